"""Training on a mesh (PP x FSDP2 x TP) against the same training on one device, on real gloo ranks.

Tolerance: on a mesh the gradients come out of FSDP's reduce-scatter (an average over the dp
replicas) and TP's all-reduces, summed in another order than one device sums them, so a
loss agrees to fp32 rounding (relative 1e-6 here) rather than to the last bit; a resume on
the same mesh repeats the same reductions and is bitwise.
"""

import pytest
import torch

from one_device import single_device_training
from pplab.data import batches, split_microbatches
from pplab.models.llama import LlamaConfig, build_model, loss_fn
from pplab.rank.checkpoint import load_model, step_directory
from pplab.rank.train import TrainOptions
from ranks import pool

CONFIG = LlamaConfig.tiny()
# clip=0.5 is below every step's global norm (2 to 18): clipping acts on every step.
OPTIONS = dict(steps=4, batch_size=16, seq_len=32, warmup=2, eval_every=2, clip=0.5, lr=3e-3)
# mesh, microbatches per pipeline (8 in all). On 8 ranks FSDP shards TP's shards again (a strided
# shard, not a torch Shard): a norm that took it for a copy counted half of those weights.
MESHES = {"pp2 x dp2": ({"pp": 2, "dp": 2}, 4), "pp2 x tp2": ({"pp": 2, "tp": 2}, 8),
          "pp2 x dp2 x tp2": ({"pp": 2, "dp": 2, "tp": 2}, 4)}


@pytest.fixture(scope="module")
def one_device():
    return single_device_training(TrainOptions(**OPTIONS), 8)  # 8 microbatches in all, as on every mesh


def replicated_under_tp() -> list[str]:
    """The parameters TP leaves whole on every tp rank: the embedding, the norms, the head."""
    return [name for name, p in build_model(CONFIG).named_parameters()
            if not name.endswith(("proj.weight",))]


@pytest.mark.parametrize("name", MESHES)
def test_training_on_a_mesh_clips_by_the_one_device_norm(one_device, name):
    mesh, n_microbatches = MESHES[name]
    n_ranks = mesh["pp"] * mesh.get("dp", 1) * mesh.get("tp", 1)
    with pool(n_ranks).pipeline(CONFIG, "1f1b", n_microbatches, impl="torch", mesh=mesh) as pipe:
        history = pipe.train(show=False, **OPTIONS)
    losses, norms = one_device
    assert history.losses == pytest.approx(losses, rel=1e-6)
    assert [r.grad_norm for r in history.records] == pytest.approx(norms, rel=1e-5)
    if "tp" in mesh:  # a norm that counted TP's whole copies once per tp rank would be another number
        model = build_model(CONFIG)
        model.zero_grad()
        batch = next(batches(16, 32, 0, split="train"))
        for input_ids, target_ids in split_microbatches(batch, 8):
            (loss_fn(model(input_ids), target_ids) / 8).backward()
        whole = dict(model.named_parameters())
        copies = sum(float(whole[n].grad.norm()) ** 2 for n in replicated_under_tp())
        double_counted = (norms[0] ** 2 + copies) ** 0.5
        assert abs(double_counted / norms[0] - 1) > 100 * 1e-5  # the test could tell them apart
        assert history.records[0].grad_norm == pytest.approx(norms[0], rel=1e-5)


def test_a_mesh_checkpoint_resumes_bitwise_and_reshards_to_any_layout(tmp_path, one_device):
    options = {**OPTIONS, "checkpoint_dir": str(tmp_path), "checkpoint_every": 2}
    at_2 = str(step_directory(tmp_path, 2))
    with pool(4).pipeline(CONFIG, "1f1b", 4, impl="torch", mesh={"pp": 2, "dp": 2}) as pipe:
        whole = pipe.train(show=False, **options)
        resumed = pipe.train(show=False, **{**options, "resume": at_2})
    assert resumed.losses == whole.losses[2:]  # the same mesh repeats the same reductions
    step_3 = {**options, "checkpoint_dir": None, "checkpoint_every": 0, "resume": at_2}
    with pool(4).pipeline(CONFIG, "1f1b", 8) as pipe:  # pp4 on pplab's runtime
        pp4 = pipe.train(until=3, show=False, **step_3)
    with pool(4).pipeline(CONFIG, "1f1b", 8, impl="torch", mesh={"pp": 2, "tp": 2}) as pipe:
        pp2_tp2 = pipe.train(until=3, show=False, **step_3)
    model = load_model(at_2)  # one device
    batch = next(batches(16, 32, 0, split="train", start=2))
    with torch.no_grad():
        one = sum(loss_fn(model(ids), targets).item() for ids, targets in split_microbatches(batch, 8)) / 8
    for loss in (pp4.losses[0], pp2_tp2.losses[0], one):
        assert loss == pytest.approx(whole.losses[2], rel=1e-6)


@pytest.mark.quick
def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
    with pytest.raises(ValueError, match=r"batch_size=12 does not split into dp=2 pipelines x 4 "
                                         r"microbatches; use a multiple of 8"):
        TrainOptions(batch_size=12).check(4, replicas=2)
