"""Training on real ranks (gloo, CPU) against a single-device training loop (tests/one_device.py)."""

import pytest

from one_device import single_device_training
from pplab.data import CharTokenizer, batches
from pplab.models.llama import LlamaConfig, generate
from pplab.rank.rank_pipeline import PipelineSpec
from pplab.rank.train import TrainOptions, build_and_train_on_rank, lr_factor
from ranks import pool, run_ranks

CONFIG = LlamaConfig.tiny()
OPTIONS = TrainOptions(steps=6, batch_size=8, seq_len=32, warmup=2, eval_every=3, clip=0.5)


@pytest.fixture(scope="module")
def reference_losses():
    return single_device_training(OPTIONS, 4)[0]


@pytest.mark.parametrize("schedule, impl, n_virtual", [("1f1b", "pplab", 1), ("zb-h1", "pplab", 1),
                                                       ("interleaved-1f1b", "pplab", 2),
                                                       ("1f1b", "torch", 1)])
def test_pipeline_training_equals_one_device_to_the_last_bit(reference_losses, schedule, impl, n_virtual):
    spec = PipelineSpec.create(CONFIG, schedule, 2, 4, n_virtual, impl=impl)
    histories = run_ranks(2, build_and_train_on_rank, spec, OPTIONS, None, False, timeout=180)
    assert histories[0].losses == reference_losses
    assert histories[1].losses == histories[0].losses  # the loss is known on every rank
    assert any(r.grad_norm > OPTIONS.clip for r in histories[0].records)  # clipping did act
    evaluations = histories[0].eval_losses
    assert [step for step, _ in evaluations] == [3, 6] and evaluations[1][1] < evaluations[0][1]


@pytest.mark.quick
def test_per_stage_clipping_is_not_the_single_device_update(reference_losses):
    # Two stages, each clipped by its own norm, as a per-rank clip_grad_norm_ does.
    per_stage = single_device_training(OPTIONS, 4, per_stage=2)[0]
    assert per_stage[0] == reference_losses[0]  # the first loss precedes any update
    assert max(abs(a - b) for a, b in zip(per_stage[1:], reference_losses[1:])) > 1e-4


@pytest.mark.quick
def test_learning_rate_warms_up_then_decays_to_min_lr():
    options = TrainOptions(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    lrs = [options.lr * lr_factor(options, i) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


@pytest.mark.quick
@pytest.mark.parametrize("options, message", [
    (dict(batch_size=6), "batch_size=6 does not split into 4"),
    (dict(resume="latest"), "need checkpoint_dir"),
    (dict(min_lr=1.0, lr=0.1), "min_lr <= lr"),
    (dict(clip=0.0), "clip=0.0"),
    (dict(steps=0), "steps"),
    (dict(resume="/nonexistent/run"), "does not exist"),
])
def test_bad_options_are_refused_before_any_rank_starts(options, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(**options).check(4)


@pytest.mark.slow
def test_the_embedded_corpus_trains_visibly_and_generates_corpus_like_text(tmp_path):
    options = TrainOptions(steps=100, batch_size=8, seq_len=64, eval_every=50,
                           checkpoint_dir=str(tmp_path))
    spec = PipelineSpec.create(CONFIG, "1f1b", 2, 4)
    history = run_ranks(2, build_and_train_on_rank, spec, options, None, False, timeout=400)[0]
    (_, first), *_, (_, last) = history.eval_losses
    assert last < 0.5 * history.records[0].loss and last < first
    from pplab.rank.checkpoint import load_model

    tokenizer = CharTokenizer()
    text = tokenizer.decode(generate(load_model(tmp_path), tokenizer.encode("the "), 40))
    words = set(text.replace(".", " ").split())
    assert words & {"the", "sat", "on", "ran", "to", "mat", "barn", "cat", "dog", "red", "blue"}, text


def test_bf16_stages_train_and_stay_close_to_fp32():
    """Plain bf16 stages (a pipeline alone): weights, activations and gradients in bf16, the loss
    in fp32. Tolerance against fp32 on one device: loss 1e-4 relative, gradients 1e-2 absolute."""
    batch = next(batches(8, 32, 0))
    with pool(2).pipeline(CONFIG, "1f1b", 4, param_dtype="bfloat16") as pipe:
        parity = pipe.check_parity(batch, loss_rtol=1e-4, grad_atol=1e-2)
        dtypes = {b.dtype for b in pipe.boundary_shapes().boundaries}
        history = pipe.train(20, show=False, batch_size=8, seq_len=32, eval_every=0)
    assert parity.passed and parity.max_abs_diff > 0, parity  # close, and not fp32 in disguise
    assert dtypes == {"bfloat16"}
    assert history.losses[-1] < history.losses[0] - 1.0


@pytest.mark.quick
def test_bf16_stages_on_a_mesh_are_refused_for_fsdps_mixed_precision():
    with pytest.raises(ValueError, match="on a mesh use FSDP's mixed precision instead"):
        PipelineSpec.create(CONFIG, "1f1b", 4, 4, impl="torch", mesh={"pp": 2, "dp": 2},
                            param_dtype="bfloat16")
