"""PP on a DeviceMesh with FSDP2 (dp), tensor parallelism (tp) and activation checkpointing.

Real processes on gloo: 4 ranks as pp=2 x dp=2 and pp=2 x tp=2 must compute the loss and
every gradient of one device on the whole batch; the collectives of dp and tp must be on the
timeline; FSDP must hold about half a stage per rank and gather as often as theory says.
"""

import os
from collections import Counter

import pytest

import pplab
from pplab.data import batches
from pplab.rank.checks import compare_with_reference
from pplab.rank.mesh import Mesh, all_gathers_per_unit, communicated_bytes, memory_held, optimizer_state_bytes
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline, run_jobs_on_rank, split_for_ranks
from pplab.rank.reference import reference_step
from pplab.schedules import build
from pplab.session.results import merge_steps
from ranks import run_ranks

CONFIG = pplab.LlamaConfig.tiny()
MICROBATCHES = 4
# fp32 throughout: DP and TP only change the order of some sums, so differences stay at rounding.
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-6


def gloo_threads() -> int:
    """The threads of this process's gloo process groups (one each, woken every few ms while it lives)."""
    return sum(open(f"/proc/self/task/{task}/comm").read().strip() == "gloo_tcp_loop"
               for task in os.listdir("/proc/self/task"))


def step_twice_and_measure(rank, world_size, spec, data):
    """Two steps (the first includes torch's shape inference); the second's report and memory, and
    the gloo threads once the pipeline was built and once a second one was, on the same mesh."""
    pipeline = RankPipeline(spec, rank)
    pipeline.step(data[rank])
    second = pipeline.step(data[rank], return_grads=True)
    stages = pipeline.stages.values()
    memory = {**memory_held(stages), "optimizer": optimizer_state_bytes(stages)}
    threads = [gloo_threads()]
    RankPipeline(spec, rank)
    threads.append(gloo_threads())
    return second, {**memory, "gloo_threads": threads}


def run_mesh(mesh: Mesh, schedule="1f1b", microbatch_size=2):
    spec = PipelineSpec.create(CONFIG, schedule, mesh.world_size, MICROBATCHES, impl="torch", mesh=mesh)
    batch = next(batches(microbatch_size * MICROBATCHES * mesh.dp, 32, seed=3))
    results = run_ranks(mesh.world_size, step_twice_and_measure, spec, split_for_ranks(spec, batch),
                        timeout=240)
    steps, memory = [step for step, _ in results], [m for _, m in results]
    for rank, held in enumerate(memory):  # pipelines on one mesh share its process groups
        first, second = held["gloo_threads"]
        assert second == first, (rank, held["gloo_threads"])
    reference = reference_step(CONFIG, batch, MICROBATCHES * mesh.dp)
    return spec, merge_steps(steps), memory, reference


def stage_units(spec, rank) -> int:
    """FSDP units on a rank: one per block, plus the stage root."""
    (stage,) = spec.schedule.stages_of(spec.pp_rank(rank))
    start, end = pplab.layer_ranges(CONFIG.num_hidden_layers, spec.schedule.n_stages)[stage]
    return end - start + 1


def test_pp_x_dp_matches_one_device_records_fsdp_and_halves_what_a_rank_holds():
    mesh = Mesh(pp=2, dp=2)
    spec, result, memory, reference = run_mesh(mesh)
    parity = compare_with_reference(result.loss, result.grads, reference, LOSS_RTOL, GRAD_ATOL)
    assert parity.passed, str(parity)
    assert len(result.microbatch_losses) == MICROBATCHES * mesh.dp  # each replica its own data
    assert len(parity.grad_diffs) == len(reference.grads)
    for rank in range(4):
        kinds = Counter(e.kind for e in result.timeline.of_rank(rank))
        # reshard_after_forward=False: each unit gathered once a step, reduce-scattered once.
        assert kinds["ALL_GATHER"] == kinds["REDUCE_SCATTER"] == stage_units(spec, rank), kinds
        held, unsharded = memory[rank]["parameters"], memory[rank]["unsharded_parameters"]
        assert 0.45 < held / unsharded <= 0.55, (rank, held, unsharded)
        assert 0.45 < memory[rank]["gradients"] / unsharded <= 0.55
        assert memory[rank]["optimizer"] == 2 * held  # AdamW: two moments per (sharded) parameter
    sent = communicated_bytes(result.rank_steps, spec.schedule, mesh)
    assert all(row["dp"] > 0 and row["tp"] == 0 and row["pp"] > 0 for row in sent)


def test_pp_x_tp_matches_one_device_and_records_the_all_reduces():
    mesh = Mesh(pp=2, tp=2)
    spec, result, memory, reference = run_mesh(mesh, schedule="gpipe")
    parity = compare_with_reference(result.loss, result.grads, reference, LOSS_RTOL, GRAD_ATOL)
    assert parity.passed, str(parity)
    hidden_bytes = 2 * 32 * CONFIG.hidden_size * 4
    for rank in range(4):
        all_reduces = [e for e in result.timeline.of_rank(rank) if e.kind == "ALL_REDUCE"]
        # Per block and microbatch: after attention and after the MLP in the forward, and one
        # for the input gradient of each of the five column-parallel projections in the backward.
        assert len(all_reduces) == 4 * MICROBATCHES * (2 + 5)
        assert {e.bytes for e in all_reduces} == {hidden_bytes}
        # TP splits the blocks' linear weights; the embedding, head and norms stay whole.
        assert 0.5 < memory[rank]["parameters"] / memory[rank]["unsharded_parameters"] < 0.85


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_resharding_after_forward_gathers_as_often_as_theory_says(schedule):
    mesh = Mesh(pp=2, dp=2, reshard_after_forward=True)
    spec, result, _, reference = run_mesh(mesh, schedule)
    assert compare_with_reference(result.loss, result.grads, reference, LOSS_RTOL, GRAD_ATOL).passed
    for rank in range(4):
        per_unit = all_gathers_per_unit(spec.schedule, spec.pp_rank(rank), True)
        assert per_unit == MICROBATCHES + 1  # see test_all_gather_theory
        gathers = sum(e.kind == "ALL_GATHER" for e in result.timeline.of_rank(rank))
        assert gathers == stage_units(spec, rank) * per_unit


@pytest.mark.quick
def test_all_gather_theory():
    gpipe, one_f_one_b = build("gpipe", 2, 4), build("1f1b", 4, 8)
    assert all_gathers_per_unit(gpipe, 0, False) == all_gathers_per_unit(one_f_one_b, 2, False) == 1
    assert all_gathers_per_unit(gpipe, 1, True) == 4 + 1  # F F F F, then the first B
    # 1F1B, rank 0 of 4: F0..F3 gather (each follows a forward), then B0 F4 B1 F5 .. B4:
    # each B follows a forward and gathers, each F follows a backward and does not.
    assert all_gathers_per_unit(one_f_one_b, 0, True) == 4 + 5
    # rank 3 of 4: F0 B0 F1 B1 ..: the first forward, then every backward.
    assert all_gathers_per_unit(one_f_one_b, 3, True) == 1 + 8
    assert all_gathers_per_unit(build("1f1b", 2, 4), 0, True) == MICROBATCHES + 1
    interleaved = build("interleaved-1f1b", 2, 4, 2)  # rank 0 holds stages 0 and 2: counted apart
    assert all_gathers_per_unit(interleaved, 0, False) == all_gathers_per_unit(interleaved, 2, False) == 1
    with pytest.raises(ValueError, match="'zb-h1' splits backwards into I and W"):
        all_gathers_per_unit(build("zb-h1", 2, 4), 0, True)


def test_activation_checkpointing_keeps_fewer_bytes_and_still_matches():
    plain = run_mesh(Mesh(pp=2))
    checkpointed = run_mesh(Mesh(pp=2, activation_checkpointing=True))
    for _, result, _, reference in (plain, checkpointed):
        assert compare_with_reference(result.loss, result.grads, reference, LOSS_RTOL, GRAD_ATOL).passed
    for rank in range(2):
        kept, full = (r.timeline.peak_inflight_bytes(rank) for _, r, _, _ in (checkpointed, plain))
        assert 0 < kept < full / 3, (rank, kept, full)


def test_activation_checkpointing_with_pplabs_own_runtime():
    spec = PipelineSpec.create(CONFIG, "1f1b", 2, MICROBATCHES,
                               mesh={"pp": 2, "activation_checkpointing": True})
    batch = next(batches(2 * MICROBATCHES, 32, seed=3))
    steps = run_ranks(2, run_jobs_on_rank, [(spec, split_for_ranks(spec, batch))], True, "cpu", 2,
                      timeout=120)
    result = merge_steps([rank_steps[0][1] for rank_steps in steps])  # the second step
    parity = compare_with_reference(result.loss, result.grads, reference_step(CONFIG, batch, MICROBATCHES),
                                    LOSS_RTOL, GRAD_ATOL)
    assert parity.passed, str(parity)
    # Without checkpointing a forward of 4 blocks saves ~1.4 MB; with it, each block keeps its
    # input: 2 microbatches in flight x at most 8 tensors of [2, 32, 64] fp32 (16 KiB each).
    activation = 2 * 32 * CONFIG.hidden_size * 4
    assert 0 < result.timeline.peak_inflight_bytes(0) <= 2 * 8 * activation


def test_mixed_precision_runs_in_bf16_and_stays_close():
    spec, result, memory, reference = run_mesh(Mesh(pp=2, dp=2, mixed_precision=True))
    parity = compare_with_reference(result.loss, result.grads, reference, loss_rtol=1e-3, grad_atol=5e-3)
    assert parity.passed, str(parity)
    assert {b.dtype for b in result.boundary_shapes} == {"bfloat16"}  # what crosses the stages


@pytest.mark.quick
@pytest.mark.parametrize("mesh, options, message", [
    ({"pp": 2, "dp": 3}, {}, "spans 6 ranks but the lab has 4: make the sizes multiply to 4"),
    ({"pp": 1, "tp": 4}, {}, "tp=4 does not divide num_key_value_heads=2"),
    ({"dp": 2, "tp": 2}, {}, "no 'pp' dimension"),
    ({"pp": 2, "ep": 2}, {}, r"unknown dimensions \['ep'\]"),
    ({"pp": 2, "dp": 2}, {"impl": "pplab"}, "use impl='torch'"),
    ({"pp": 4, "reshard_after_forward": True}, {}, "reshard_after_forward=True is an FSDP option"),
    ({"pp": 4, "mixed_precision": True}, {}, "mixed_precision=True is an FSDP option"),
    ({"pp": 4, "activation_checkpointing": True}, {"schedule": "zb-h1", "impl": "pplab"},
     "activation checkpointing with 'zb-h1': its backward is split into I and W"),
])
def test_bad_meshes_are_refused_before_any_rank_starts(mesh, options, message):
    options = {"impl": "torch", "schedule": "1f1b", **options}
    with pytest.raises(ValueError, match=message):
        PipelineSpec.create(CONFIG, n_ranks=4, n_microbatches=MICROBATCHES, mesh=mesh, **options)


@pytest.mark.quick
def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
    spec = PipelineSpec.create(CONFIG, "1f1b", 4, MICROBATCHES, impl="torch", mesh={"pp": 2, "dp": 2})
    with pytest.raises(ValueError, match="does not split into dp=2 pipelines x 4 microbatches"):
        split_for_ranks(spec, next(batches(12, 16)))


@pytest.mark.quick
def test_rank_layout_puts_tp_fastest_and_pp_slowest():
    mesh = Mesh(pp=2, dp=2, tp=2)
    assert [tuple(mesh.coordinates(r).values()) for r in range(8)] == \
        [(pp, dp, tp) for pp in range(2) for dp in range(2) for tp in range(2)]
    assert all(mesh.rank_of(**mesh.coordinates(r)) == r for r in range(8))
    assert mesh.label(5) == "rank 5 · pp1 dp0 tp1"
    assert "rank  pp  dp  tp" in str(mesh) and "<table>" in mesh._repr_html_()


def test_a_mesh_on_a_lab(lab_factory):
    lab = lab_factory(n_ranks=4, op_timeout=20)
    pipe = lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=MICROBATCHES, impl="torch",
                       mesh={"pp": 2, "dp": 2})
    assert "4 ranks as pp=2 x dp=2 x tp=1" in repr(pipe)
    assert [p["coordinates"] for p in pipe.placement] == [pipe.mesh.coordinates(r) for r in range(4)]
    parity = pipe.check_parity()
    assert parity.passed, str(parity)
    assert {"ALL_GATHER", "REDUCE_SCATTER"} <= {e.kind for e in pipe.last.timeline.events}
    table = pipe.memory()
    assert all(0.45 < table.held(r) / table.unsharded(r) <= 0.55 for r in range(4)), str(table)
    assert pipe.rank_labels[3] == "rank 3 · pp1 dp1"
    # The live dashboard on the mesh: a row per rank, named by its coordinates, collectives drawn.
    dash = pipe.dashboard()
    [result] = dash.run_steps(1)
    assert "rank 3 · pp1 dp1" in dash.where.html.value and dash.where.states == {r: "done" for r in range(4)}
    assert {"ALL_GATHER", "REDUCE_SCATTER"} <= {e.kind for e in result.timeline.events}
    assert dash.timeline.rank_labels == pipe.rank_labels and dash.timeline.draws >= 1
    assert dash.check_parity().passed
    # Training after a step of other shapes: torch's stages infer their shapes anew.
    history = pipe.train(steps=2, batch_size=8, seq_len=64, eval_every=0, show=False)
    assert len(history.losses) == 2 and all(loss > 0 for loss in history.losses)


def test_pp_x_dp_x_tp_on_8_ranks_matches_one_device():
    mesh = Mesh(pp=2, dp=2, tp=2)
    spec, result, _, reference = run_mesh(mesh)
    # fp32; TP and FSDP change the order of some sums (a loss difference of ~1e-8 relative).
    parity = compare_with_reference(result.loss, result.grads, reference, LOSS_RTOL, GRAD_ATOL)
    assert parity.passed, str(parity)
    kinds = {e.kind for e in result.timeline.events}
    assert {"ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE"} <= kinds


TORCHRUN_SCRIPT = '''
import functools
from pplab.rank.checks import compare_with_reference
from pplab.data import batches
from pplab.drivers.torchrun import run_as_torchrun_rank
from pplab.models.llama import LlamaConfig
from pplab.rank.rank_pipeline import PipelineSpec, run_jobs_on_rank, split_for_ranks
from pplab.session.results import merge_steps
from pplab.rank.reference import reference_step

config = LlamaConfig.tiny()
spec = PipelineSpec.create(config, "1f1b", 4, 4, impl="torch", mesh={"pp": 2, "dp": 2})
batch = next(batches(16, 32))
per_rank = run_as_torchrun_rank(run_jobs_on_rank, [(spec, split_for_ranks(spec, batch))])
if per_rank is not None:
    result = merge_steps([steps[0] for steps in per_rank])
    print(compare_with_reference(result.loss, result.grads, reference_step(config, batch, 8), 1e-6, 1e-6))
'''


def test_a_mesh_runs_under_torchrun(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "mesh_under_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4",
                           str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("parity PASSED") == 1, done.stdout  # rank 0 reports
