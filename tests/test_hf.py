"""Hugging Face decoders as pipeline stages, against the same `transformers` model on one device.

Tiny random configs are built here (and saved with save_pretrained where a directory is
needed); nothing is downloaded. Every run is on real gloo ranks.
"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pplab.data import batches  # noqa: E402
from pplab.models.hf import HFModel, Layout  # noqa: E402
from pplab.models.llama import loss_fn  # noqa: E402
from pplab.rank.checkpoint import step_directory  # noqa: E402
from pplab.rank.rank_pipeline import PipelineSpec  # noqa: E402
from pplab.rank.reference import reference_step  # noqa: E402
from ranks import pool  # noqa: E402

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SIZES),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=8, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=None),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0),
}
# (schedule, runtime, stages per rank) on 2 ranks; on 3 the ones that fit 4 blocks in 3 stages.
# Every schedule and runtime on one family (the schedules do not depend on it); on the others the
# paths a family changes (tied weights, learned positions, RoPE on a middle stage) on both runtimes.
ON_TWO = [("gpipe", "pplab", 1), ("1f1b", "pplab", 1), ("interleaved-1f1b", "pplab", 2),
          ("zb-h1", "pplab", 1),
          ("gpipe", "torch", 1), ("1f1b", "torch", 1)]
ON_THREE = [("1f1b", "pplab", 1), ("zb-h1", "pplab", 1), ("1f1b", "torch", 1)]
ON_TWO_SHORT, ON_THREE_SHORT = [("zb-h1", "pplab", 1), ("1f1b", "torch", 1)], [("1f1b", "pplab", 1)]


def parity_failures(config, n_ranks: int, runs, batch) -> list[str]:
    """Each run's parity and gradient flow against transformers on one device; what failed, in words."""
    failures = []
    for schedule, impl, n_virtual in runs:
        with pool(n_ranks).pipeline(config, schedule=schedule, n_microbatches=4, n_virtual=n_virtual,
                                    impl=impl) as pipe:
            parity, flow = pipe.check_parity(batch), pipe.check_gradient_flow()
            shapes = pipe.boundary_shapes().boundaries
            where = f"{schedule} on {impl}'s runtime, {n_ranks} ranks"
            if not parity.passed:
                failures.append(f"{where}: {parity}")
            if not flow.passed:
                failures.append(f"{where}: {flow}")
            stages = pipe.schedule.n_stages
            if sorted((b.source, b.microbatch) for b in shapes) != \
                    [(s, mb) for s in range(stages - 1) for mb in range(4)]:
                failures.append(f"{where}: boundary shapes {[(b.source, b.microbatch) for b in shapes]}")
            elif {tuple(b.shape) for b in shapes} != {(2, 16, 32)}:
                failures.append(f"{where}: boundary shapes {sorted({tuple(b.shape) for b in shapes})}")
    return failures


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_transformers_on_one_device(family):
    batch = next(batches(8, 16, 0))
    config = FAMILIES[family]()
    every = family == "llama"
    failures = (parity_failures(config, 2, ON_TWO if every else ON_TWO_SHORT, batch)
                + parity_failures(config, 3, ON_THREE if every else ON_THREE_SHORT, batch))
    assert not failures, "\n".join(failures)


def test_weights_are_read_per_stage_from_safetensors(tmp_path):
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3"]()).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        in_file = set(handle.keys())
    with pool(3).pipeline(str(tmp_path), schedule="1f1b", n_microbatches=3) as pipe:
        read = pipe.lab.run(_tensors_read, pipe.pipeline_id)
        parity = pipe.check_parity(next(batches(6, 16, 0)))
    per_rank = [names for by_stage in read for names in by_stage.values()]
    assert per_rank[0][0] == "model.embed_tokens.weight"
    assert "model.layers.0.mlp.up_proj.weight" in per_rank[0]
    assert all(name.startswith("model.layers.2.") for name in per_rank[1])  # the middle: its block only
    # The tied head reads the embedding (save_pretrained writes a tied weight once).
    assert "model.embed_tokens.weight" in per_rank[2] and "model.norm.weight" in per_rank[2]
    assert not any(name.startswith(("model.layers.0.", "model.layers.1."))
                   for name in per_rank[1] + per_rank[2])
    assert set().union(*per_rank) == in_file  # together, exactly the file's tensors
    assert parity.passed, parity  # and they are the file's values: the reference reads the file too


def _tensors_read(pipeline_id):
    from pplab.session.on_rank import built_pipeline

    return {index: stage.loaded for index, stage in built_pipeline(pipeline_id).stages.items()}


def test_tied_embeddings_need_their_gradients_summed():
    config = HFModel.of(FAMILIES["qwen3"]())
    assert config.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    batch = next(batches(8, 16, 0))
    with pool(2).pipeline(dataclasses.replace(config, sum_tied_gradients=False), schedule="1f1b",
                          n_microbatches=4) as pipe:
        unsummed = pipe.check_parity(batch)
    assert not unsummed.passed
    assert unsummed.failing == ["lm_head.weight", "model.embed_tokens.weight"]
    with pool(2).pipeline(config, schedule="1f1b", n_microbatches=4) as pipe:
        result = pipe.step(batch)
        live = pipe.start_step(batch, live_interval=0.05).result()  # its events come on the stream only
    assert sorted(e.rank for e in live.timeline.events if e.kind == "ALL_REDUCE") == [0, 1]
    summing = [e for e in result.timeline.events if e.kind == "ALL_REDUCE"]
    assert sorted(e.rank for e in summing) == [0, 1]  # at the end of the step, on both ends
    assert all(e.bytes == 128 * 32 * 4 for e in summing)
    assert all(e.start >= max(x.end for x in result.timeline.events if x.rank == e.rank and x.kind in "BW")
               for e in summing)


def test_a_model_that_drops_draws_the_masks_one_device_draws():
    # GPT-2's published dropout (0.1 after the embeddings, in attention and after each block): each
    # block draws from its own stream, keyed by (seed, step, microbatch, block).
    dropping = HFModel.of(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=4, n_head=4,
                                                  n_positions=64,
                                                  bos_token_id=0, eos_token_id=0))
    assert dropping.hf_config.attn_pdrop == dropping.hf_config.resid_pdrop == 0.1
    batch = next(batches(8, 16, 0))
    reference = reference_step(dropping, batch, 4)
    assert reference_step(dropping, batch, 4).loss == reference.loss  # one device draws them again
    not_dropping = HFModel.of(FAMILIES["gpt2"]())
    assert abs(reference_step(not_dropping, batch, 4).loss - reference.loss) > 1e-4  # the masks act
    for schedule, impl in (("zb-h1", "pplab"), ("1f1b", "torch")):
        with pool(2).pipeline(dropping, schedule=schedule, n_microbatches=4, impl=impl) as pipe:
            parity = pipe.check_parity(batch, reference=reference)
        assert parity.passed and parity.loss_rel_diff == 0.0, (schedule, impl, parity)


def test_training_resumes_bitwise_and_exports_to_transformers(tmp_path):
    config = FAMILIES["qwen3"]()  # tied embeddings, so the sum and the clipping are both on the path
    options = dict(batch_size=8, seq_len=32, warmup=5, eval_every=0, clip=1.0, lr=3e-3,
                   checkpoint_dir=str(tmp_path / "run"), checkpoint_every=25)
    with pool(2).pipeline(config, schedule="1f1b", n_microbatches=4) as pipe:
        whole = pipe.train(50, show=False, **options)
    # The global norm counts the tied weight once, as one device does.
    first = next(batches(8, 32, 0, split="train"))
    reference = reference_step(HFModel.of(config), first, 4)
    one_device_norm = torch.linalg.vector_norm(torch.stack(
        [g.norm() for name, g in reference.grads.items() if name != "lm_head.weight"]))
    assert whole.records[0].grad_norm == pytest.approx(float(one_device_norm), rel=1e-5)
    assert whole.losses[-1] < whole.losses[0] - 1.0
    with pool(2).pipeline(config, schedule="gpipe", n_microbatches=4) as pipe:
        resumed = pipe.train(50, show=False, **options, resume=str(step_directory(tmp_path / "run", 25)))
        held_out = next(batches(4, 32, 1))
        pipeline_loss = pipe.step(held_out).loss
    assert resumed.losses == whole.losses[25:]  # bitwise, on another schedule

    from pplab.rank.checkpoint import export_pretrained

    exported = transformers.AutoModelForCausalLM.from_pretrained(
        export_pretrained(step_directory(tmp_path / "run", 50), tmp_path / "exported"))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    with torch.no_grad():
        losses = [loss_fn(exported(ids.unsqueeze(0)).logits, targets.unsqueeze(0)).item()
                  for ids, targets in zip(*held_out)]
    assert sum(losses) / len(losses) == pytest.approx(pipeline_loss, rel=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("model, options, message", [
    (lambda: transformers.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                    num_attention_heads=4), {},
     "model_type='opt' has no known layout"),
    (FAMILIES["llama"], {"schedule": "interleaved-1f1b", "n_virtual": 3}, "more than n_layers=4"),
    (lambda: HFModel.of(FAMILIES["llama"](), layout=Layout(embed="model.embed", blocks="model.layers",
                                                          norm="model.norm", head="lm_head")), {},
     "layout embed='model.embed'"),
    (lambda: "/nonexistent/model", {}, "holds no config.json"),
    (lambda: torch.nn.Linear(2, 2), {}, "cannot pipeline a Linear"),
    (FAMILIES["gpt2"], {"mesh": {"pp": 2}}, "know pplab's own model only"),
])
def test_bad_models_are_refused_on_the_client(model, options, message):
    arguments = {"schedule": "1f1b", "n_microbatches": 2, **options}
    with pytest.raises((ValueError, TypeError), match=message) as raised:
        model = model()
        PipelineSpec.create(model, arguments.pop("schedule"), 2, **arguments)
    if "opt" in message:  # what pplab found, and how to describe it
        assert "model.decoder" in str(raised.value) and "Layout(" in str(raised.value)
