"""The model: config validation, deterministic init, shapes, loss."""

import pytest
import torch

import pplab
from pplab.models.llama import IGNORE_INDEX, LlamaModel, RotaryEmbedding, apply_rotary, loss_fn

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(vocab_size=-3), "vocab_size=-3"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers=2.5"),
    (dict(hidden_size=64, num_attention_heads=5), "num_attention_heads=5 does not divide hidden_size=64"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
    (dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=1), "head_dim=3"),
    (dict(rope_theta=0.0), "rope_theta=0.0"),
])
def test_config_rejects_bad_values_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        pplab.LlamaConfig.tiny(**overrides)


def test_presets():
    tiny, small = pplab.LlamaConfig.tiny(), pplab.LlamaConfig.small()
    assert tiny.num_hidden_layers == 8
    assert (small.num_hidden_layers, small.hidden_size) == (12, 768)
    with torch.device("meta"):
        n_small = sum(p.numel() for p in LlamaModel(small).parameters())
    assert 100e6 < n_small < 150e6
    # GQA in both: fewer KV heads than query heads.
    assert tiny.num_key_value_heads < tiny.num_attention_heads
    assert small.num_key_value_heads < small.num_attention_heads


def test_weights_are_a_function_of_seed_and_name_only():
    config = pplab.LlamaConfig.tiny()
    a, b, c = (pplab.build_model(config, seed=seed) for seed in (0, 0, 1))
    direct = LlamaModel(config, seed=0)  # built without the meta device: same weights
    for (name, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                      direct.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pd), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # Two parameters of the same shape get different values.
    assert not torch.equal(a.layers["0"].mlp.up_proj.weight, a.layers["0"].mlp.gate_proj.weight)


def test_forward_shapes_and_causality():
    config = pplab.LlamaConfig.tiny()
    model = pplab.build_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, config.vocab_size)
    # Changing a later token must not change earlier logits (causal mask).
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % config.vocab_size
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:], atol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
    config = pplab.LlamaConfig.tiny()
    rotary = RotaryEmbedding(config)
    cos, sin = rotary(32)
    q, k = torch.randn(config.head_dim), torch.randn(config.head_dim)

    def score(m, n):  # the attention score of a query at position m and a key at position n
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    assert torch.allclose(score(3, 1), score(20, 18), atol=1e-5)
    assert torch.allclose(score(7, 7), q @ k, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)


def test_bad_inputs_are_named():
    config = pplab.LlamaConfig.tiny()
    model = pplab.build_model(config)
    with pytest.raises(TypeError, match=r"expects token ids as an int64 or int32 tensor \[batch, seq\], "
                                        r"got torch.float32 of shape \(2, 4, 64\)"):
        model(torch.randn(2, 4, config.hidden_size))
    with pytest.raises(TypeError, match="int64 or int32 tensor.*got torch.int16"):
        model(torch.zeros(1, 4, dtype=torch.int16))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=256"):
        model(torch.zeros(1, 300, dtype=torch.int64))
    middle = pplab.build_stage(config, 1, 2)
    with pytest.raises(TypeError, match="expects hidden states"):
        middle(torch.zeros(1, 4, dtype=torch.int64))


def test_loss_ignores_padding():
    logits = torch.randn(1, 6, 10)
    targets = torch.tensor([[1, 2, 3, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    assert torch.allclose(loss_fn(logits, targets), loss_fn(logits[:, :3], targets[:, :3]))


def test_token_ids_may_be_int64_or_int32_as_the_message_says():
    model = pplab.build_model(pplab.LlamaConfig.tiny())
    ids = torch.randint(0, 128, (2, 8))
    assert torch.equal(model(ids.to(torch.int32)), model(ids))
