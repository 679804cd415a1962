"""pplab's stages under torch.distributed.pipelining's own schedules (real processes, gloo).

Each world size starts its processes once and runs every schedule in them; every step must
match one device (loss and every gradient), and the recorded timeline must hold each compute
action of the schedule exactly once per rank.
"""

from collections import Counter

import pytest

import pplab
from pplab.data import batches
from pplab.rank.checks import check_gradient_flow, compare_with_reference
from pplab.rank.rank_pipeline import PipelineSpec, run_jobs_on_rank, split_for_ranks
from pplab.rank.torch_pp import torch_schedule
from pplab.schedules import from_torch
from pplab.session.results import merge_steps
from ranks import run_ranks

CONFIG = pplab.LlamaConfig.tiny()
FULL_NAMES = [name for name, _ in pplab.build_model(CONFIG).named_parameters()]
MICROBATCH_SIZE, SEQ_LEN = 2, 16

# (name, ranks, microbatches, stages per rank): m not a multiple of p where torch allows it.
CASES = {
    2: [("gpipe", 3, 1), ("1f1b", 3, 1), ("interleaved-1f1b", 4, 2), ("looped-bfs", 3, 2),
        ("interleaved-zero-bubble", 4, 2), ("zbv-zero-bubble", 3, 2), ("dualpipev", 4, 2)],
    4: [("gpipe", 5, 1), ("1f1b", 5, 1)],
}


@pytest.mark.parametrize("p", sorted(CASES))
def test_torch_schedules_match_one_device_and_record_every_action_once(p):
    specs, data = [], []
    for name, m, v in CASES[p]:
        spec = PipelineSpec.create(CONFIG, name, p, m, n_virtual=v, impl="torch")
        batch = next(batches(MICROBATCH_SIZE * m, SEQ_LEN, seed=m))
        specs.append((name, m, v, spec, batch))
        data.append((spec, split_for_ranks(spec, batch)))
    per_rank = run_ranks(p, run_jobs_on_rank, data, timeout=300)
    for job, (name, m, v, spec, batch) in enumerate(specs):
        label = f"torch {name} p={p} m={m} v={v}"
        result = merge_steps([per_rank[rank][job] for rank in range(p)])
        parity = compare_with_reference(result.loss, result.grads, pplab.reference_step(CONFIG, batch, m),
                                         loss_rtol=1e-6, grad_atol=1e-5)
        assert parity.passed, f"{label}: {parity}"
        assert check_gradient_flow(result.grad_stats, FULL_NAMES).passed, label
        # Every compute action torch plans, exactly once on its rank (torch splits DualPipeV's
        # overlapped F+B into both; its static 1F1B plan misnumbers the last rank, so 1F1B is
        # compared with pplab's, which torch executes).
        plan = (spec.schedule if name in ("gpipe", "1f1b", "interleaved-1f1b")
                else from_torch(name, p, m, v)).compute_only()
        for rank in range(p):
            recorded = [(e.stage, e.kind, e.microbatch) for e in result.timeline.compute_events(rank)]
            planned = [(a.stage, a.kind.value, a.microbatch) for a in plan.actions[rank]]
            assert Counter(recorded) == Counter(planned), f"{label} rank {rank}"
            if name != "dualpipev":  # in the order torch executed them
                assert recorded == planned, f"{label} rank {rank}"
            # torch's waits for its receives: each ends where the compute needing it starts.
            starts = {(e.stage, e.microbatch, e.kind): e.start for e in result.timeline.compute_events(rank)}
            for wait in result.timeline.comm_events(rank):
                split = (wait.stage, wait.microbatch, "I") in starts
                consumer = "F" if wait.kind == "RECV_F" else ("I" if split else "B")
                assert wait.end == starts[(wait.stage, wait.microbatch, consumer)], f"{label}: {wait}"
        # The last rank cannot start before the first activation arrives: a wait it shows.
        assert any(e.kind == "RECV_F" and e.microbatch == 0 and e.duration > 0
                   for e in result.timeline.comm_events(spec.schedule.stage_to_rank(1))), label


@pytest.mark.quick
@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4, 1), "unknown schedule 'pipedream': known schedules are gpipe, 1f1b"),
    (("zb-h1", 2, 4, 1), "torch has no zb-h1 schedule: torch runs gpipe, 1f1b, interleaved-1f1b, looped-bfs"),
    (("1f1b", 4, 2, 1), "Number of microbatches (2) must be greater than or equal to the "
                        "number of stages (4)"),
    (("ZBVZeroBubble", 2, 4, 3), "places exactly 2 stages per rank (a V): use n_virtual=2"),
    (("interleaved-1f1b", 2, 4, 1), "runs several stages per rank: use n_virtual=2 or more"),
    (("gpipe", 2, 4, 2), "runs one stage per rank: use n_virtual=1"),
])
def test_bad_torch_schedules_are_refused_on_the_client(args, message):
    with pytest.raises(ValueError) as error:
        torch_schedule(*args)
    assert message in str(error.value)
    name, p, m, v = args
    with pytest.raises(ValueError):  # the same through the one entry point, before any rank exists
        PipelineSpec.create(CONFIG, name, p, m, n_virtual=v, impl="torch")


@pytest.mark.quick
@pytest.mark.parametrize("spelling, canonical, n_virtual", [
    ("Schedule1F1B", "1f1b", 1), ("interleaved_1f1b", "interleaved-1f1b", 2), ("GPipe", "gpipe", 1)])
def test_a_pipeline_takes_any_spelling_of_a_schedule_under_either_implementation(spelling, canonical,
                                                                                 n_virtual):
    for impl in ("pplab", "torch"):
        spec = PipelineSpec.create(CONFIG, spelling, 2, 4, n_virtual=n_virtual, impl=impl)
        assert spec.schedule.name == canonical


@pytest.mark.quick
def test_a_schedule_only_torch_runs_is_named_canonically_by_either_implementation():
    spec = PipelineSpec.create(CONFIG, "ZBVZeroBubble", 2, 4, n_virtual=2, impl="torch")
    assert spec.schedule.name == "zbv-zero-bubble"
    with pytest.raises(ValueError, match="pplab does not build zbv-zero-bubble: it builds gpipe, 1f1b, "
                                         "interleaved-1f1b, zb-h1; torch runs zbv-zero-bubble"):
        PipelineSpec.create(CONFIG, "ZBVZeroBubble", 2, 4, n_virtual=2)


@pytest.mark.quick
def test_impl_is_checked():
    with pytest.raises(ValueError, match="impl='jax': give one of 'pplab', 'torch', e.g. impl='pplab'"):
        PipelineSpec.create(CONFIG, "1f1b", 2, 4, impl="jax")


def test_a_lab_pipeline_switches_to_torch_with_one_argument(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4, impl="torch",
                        timing=pplab.Costs(forward=0.02, backward=0.04))
    try:
        parity = pipe.check_parity()
        assert parity.passed, str(parity)
        assert pipe.check_gradient_flow().passed
        assert [row[:3] for row in pipe.boundary_shapes().rows()] == \
            [["0 -> 1", mb, (MICROBATCH_SIZE, 32, CONFIG.hidden_size)] for mb in range(4)]
        timeline = pipe.last.timeline
        # timing mode pads torch's passes
        assert all(e.duration >= 0.02 for e in timeline.events if e.kind == "F")
        assert pipe.simulate().n_ranks == 2
    finally:
        pipe.close()
