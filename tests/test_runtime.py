"""The hand-written runtime on real processes (gloo): exact parity, gradient flow, memory, failures.

Each world size starts its processes once and runs every (schedule, microbatches)
case in them; the client compares each step with the single-device reference.
"""

import pytest
import torch

import pplab
from pplab.data import batches
from pplab.rank.checks import check_gradient_flow, compare_with_reference
from pplab.rank.comm import PipelineTimeoutError
from pplab.rank.rank_pipeline import PipelineSpec, run_jobs_on_rank, split_for_ranks
from pplab.schedules import Action, Schedule, build, from_text
from pplab.session import RankFailedError
from pplab.session.results import merge_steps
from ranks import run_ranks

CONFIG = pplab.LlamaConfig.tiny()
FULL_NAMES = [name for name, _ in pplab.build_model(CONFIG).named_parameters()]
MICROBATCH_SIZE, SEQ_LEN = 2, 16


def cases(p):
    """(schedule, n_virtual, microbatches) for p ranks: m in {1, p, 2p+1} where the schedule allows."""
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        # interleaved runs in rounds of equal size, so 2p+1 is not allowed: 2p covers two rounds.
        counts = (1, p, 2 * p) if name == "interleaved-1f1b" else (1, p, 2 * p + 1)
        for m in sorted(set(counts)):
            yield name, v, m


def run_cases(p, specs_and_batches, **launch):
    jobs = [(spec, split_for_ranks(spec, batch)) for spec, batch in specs_and_batches]
    per_rank = run_ranks(p, run_jobs_on_rank, jobs, **launch)
    return [merge_steps([per_rank[rank][job] for rank in range(p)]) for job in range(len(jobs))]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_matches_one_device_exactly(p):
    specs_and_batches, labels = [], []
    for name, v, m in cases(p):
        spec = PipelineSpec.create(CONFIG, name, p, m, n_virtual=v)
        batch = next(batches(MICROBATCH_SIZE * m, SEQ_LEN, seed=m))
        specs_and_batches.append((spec, batch))
        labels.append(f"{name} p={p} m={m}")
    results = run_cases(p, specs_and_batches, timeout=300)

    for label, (spec, batch), result in zip(labels, specs_and_batches, results):
        reference = pplab.reference_step(CONFIG, batch, spec.schedule.n_microbatches)
        parity = compare_with_reference(result.loss, result.grads, reference,
                                        loss_rtol=1e-6, grad_atol=1e-5)
        assert parity.passed, f"{label}: {parity}"
        assert len(parity.grad_diffs) == len(FULL_NAMES), label
        flow = check_gradient_flow(result.grad_stats, FULL_NAMES)
        assert flow.passed, f"{label}: {flow}"


def test_peak_inflight_activations_match_the_theory():
    p, m = 4, 6
    specs_and_batches = [(PipelineSpec.create(CONFIG, name, p, m),
                          next(batches(MICROBATCH_SIZE * m, SEQ_LEN)))
                         for name in ("gpipe", "1f1b")]
    gpipe, one_f_one_b = run_cases(p, specs_and_batches, timeout=300)
    assert [gpipe.timeline.peak_inflight(r) for r in range(p)] == [m] * p
    assert [one_f_one_b.timeline.peak_inflight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]
    # Bytes follow counts: rank 0 of 1F1B holds p of GPipe's m microbatches of activations.
    ratio = one_f_one_b.timeline.peak_inflight_bytes(0) / gpipe.timeline.peak_inflight_bytes(0)
    assert ratio == pytest.approx(min(p, m) / m, rel=0.05)


def test_variable_sequence_lengths_use_the_shape_handshake():
    p = 3
    microbatches = [next(batches(2, seq_len, seed=seq_len)) for seq_len in (8, 24, 16)]
    spec = PipelineSpec.create(CONFIG, "1f1b", p, len(microbatches))
    data = split_for_ranks(spec, microbatches)
    assert all(d["activation_shapes"] is None for d in data)  # shapes vary: receivers must ask
    (result,) = run_cases(p, [(spec, microbatches)], timeout=120)
    parity = compare_with_reference(result.loss, result.grads, pplab.reference_step(CONFIG, microbatches))
    assert parity.passed, str(parity)
    crossed = {(b.source, b.microbatch): b.shape for b in result.boundary_shapes}
    assert crossed[(0, 1)] == (2, 24, CONFIG.hidden_size) and crossed[(1, 2)] == (2, 16, CONFIG.hidden_size)
    received = [e for e in result.timeline.events if e.kind == "RECV_F"]
    assert {e.shape for e in received} == {(2, 8, 64), (2, 24, 64), (2, 16, 64)}


def test_pass_through_stages_keep_parity():
    config = pplab.LlamaConfig.tiny(num_hidden_layers=2)
    p, m = 4, 4
    spec = PipelineSpec.create(config, "1f1b", p, m, allow_empty=True)
    batch = next(batches(MICROBATCH_SIZE * m, SEQ_LEN))
    (result,) = run_cases(p, [(spec, batch)], timeout=120)
    parity = compare_with_reference(result.loss, result.grads, pplab.reference_step(config, batch, m))
    assert parity.passed, str(parity)


def without(schedule: Schedule, text: str) -> Schedule:
    """The schedule with one action removed from its rank's list (a deliberately broken one)."""
    target = Action.parse(text)
    return Schedule([[a for a in acts if a != target] for acts in schedule.actions], schedule.n_ranks,
                    schedule.n_microbatches, schedule.n_stages, schedule.n_virtual, "broken")


def broken_job(text):
    schedule = without(build("1f1b", 2, 2), text)
    spec = PipelineSpec(CONFIG, schedule, op_timeout=2.0)  # bypasses validate(), on purpose
    return spec, split_for_ranks(spec, next(batches(4, SEQ_LEN)))


def test_a_missing_send_ends_in_timeouts_naming_rank_peer_and_action():
    with pytest.raises(RankFailedError) as failure:
        run_ranks(2, run_jobs_on_rank, [broken_job("0SEND_F0")], timeout=60)
    message = str(failure.value)
    assert PipelineTimeoutError.__name__ in message
    # Rank 1 never gets its activation, so rank 0 never gets its gradient: both say so.
    assert "rank 1 waited 2 s for the activation of microbatch 0 from rank 0 (action 1RECV_F0)" in message
    assert "rank 0 waited 2 s for the gradient of microbatch 0 from rank 1 (action 0RECV_B0)" in message


def test_a_missing_receive_is_named_not_a_hang():
    with pytest.raises(RankFailedError, match=r"rank 1 needs the activation of microbatch 0 for stage 1 "
                                         r"but nothing received it: the schedule lacks 1RECV_F0"):
        run_ranks(2, run_jobs_on_rank, [broken_job("1RECV_F0")], timeout=60)


@pytest.mark.quick
def test_spec_rejects_bad_input_before_any_rank_starts():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        PipelineSpec.create(CONFIG, "zigzag", 2, 4)
    with pytest.raises(ValueError, match="n_stages=9 is more than n_layers=8"):
        PipelineSpec.create(CONFIG, "1f1b", 9, 4)
    with pytest.raises(ValueError, match="does not divide the batch size 6"):
        split_for_ranks(PipelineSpec.create(CONFIG, "1f1b", 2, 4), next(batches(6, SEQ_LEN)))
    bad_tokens = (torch.full((4, 8), 500), torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="token id 500 is outside the vocabulary"):
        split_for_ranks(PipelineSpec.create(CONFIG, "1f1b", 2, 2), bad_tokens)


@pytest.mark.quick
@pytest.mark.parametrize("overrides, message", [
    (dict(seq_len=300), "sequence length 300 exceeds max_position_embeddings=256"),
    (dict(first_token=-1), "a token id -1 is outside the vocabulary 0..127"),
    (dict(first_target=128), "a target id 128 is outside the vocabulary"),
    (dict(dtype=torch.int32), "must be int64 tensors"),
    (dict(short_targets=True), "must both be \\[batch, seq\\] of the same shape"),
])
def test_bad_microbatches_are_refused_on_the_client(overrides, message):
    seq_len = overrides.get("seq_len", 8)
    ids = torch.zeros(2, seq_len, dtype=overrides.get("dtype", torch.int64))
    targets = torch.zeros(2, seq_len - 1 if overrides.get("short_targets") else seq_len, dtype=torch.int64)
    ids[0, 0] = overrides.get("first_token", 0)
    targets[0, 0] = overrides.get("first_target", 0)
    spec = PipelineSpec.create(CONFIG, "1f1b", 2, 2)
    with pytest.raises(ValueError, match=message):
        split_for_ranks(spec, [(ids, targets), (ids, targets)])
    targets[0, 0] = pplab.models.llama.IGNORE_INDEX  # padding is not out of vocabulary
    if "first_target" in overrides:
        split_for_ranks(spec, [(ids, targets), (ids, targets)])


@pytest.mark.quick
def test_a_bad_microbatch_count_is_named_as_the_caller_typed_it():
    with pytest.raises(ValueError,
                       match=r"^n_microbatches=0: give a whole number >= 1, e.g. n_microbatches=4"):
        PipelineSpec.create(CONFIG, "1f1b", 2, 0)


@pytest.mark.quick
def test_a_ready_schedule_must_agree_with_the_arguments():
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="the schedule is for n_microbatches=4 but "
                                         "n_microbatches=8 was asked for"):
        PipelineSpec.create(CONFIG, schedule, 2, n_microbatches=8)
    with pytest.raises(ValueError, match="^op_timeout=0"):
        PipelineSpec.create(CONFIG, schedule, 2, op_timeout=0)
    assert PipelineSpec.create(CONFIG, schedule, 2, n_microbatches=4).schedule is schedule


@pytest.mark.quick
def test_a_step_lists_its_microbatch_losses_and_boundary_shapes_by_microbatch_as_the_reference_does():
    import typing

    from pplab.rank.reference import ReferenceResult
    from pplab.rank.runtime import Boundary, RankStep
    from pplab.session.results import StepResult

    def crossed(microbatch):
        return Boundary(0, microbatch, (2, 4, 8), "float32", 256)

    first = RankStep(0, [], {}, [crossed(1), crossed(0), crossed(2)], {})  # a rank holds only some losses
    last = RankStep(1, [], {2: 3.0, 0: 1.0, 1: 2.0}, [], {})
    result = merge_steps([first, last])
    assert result.microbatch_losses == [1.0, 2.0, 3.0] and result.loss == 2.0
    assert [b.microbatch for b in result.boundary_shapes] == [0, 1, 2]
    assert (typing.get_type_hints(StepResult)["microbatch_losses"]
            == typing.get_type_hints(ReferenceResult)["microbatch_losses"] == list[float])


def test_timing_mode_pads_every_action_and_ranks_share_one_clock():
    p, m = 2, 3
    costs = pplab.Costs(forward=0.03, backward=0.06)
    spec = PipelineSpec.create(CONFIG, "1f1b", p, m, timing=costs)
    (result,) = run_cases(p, [(spec, next(batches(MICROBATCH_SIZE * m, SEQ_LEN)))], timeout=120)
    events = result.timeline.events
    assert all(e.duration >= 0.03 for e in events if e.kind == "F")
    assert all(e.duration >= 0.06 for e in events if e.kind == "B")
    # Causality across processes on one machine (one clock, however loaded the CPUs): an
    # activation is received after its forward ended on the sender.
    forward_end = {e.microbatch: e.end for e in events if e.rank == 0 and e.kind == "F"}
    for received in (e for e in events if e.rank == 1 and e.kind == "RECV_F"):
        assert received.end >= forward_end[received.microbatch]
    assert result.timeline.step_time() >= pplab.simulate(spec.schedule, costs).step_time()


@pytest.mark.quick
def test_nccl_matching_order_is_checked_on_schedules():
    from pplab.rank.comm import in_order_mismatch

    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        assert in_order_mismatch(build(name, 4, 8, v)) is None, name
    crossed = from_text(["0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1",
                                  "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1B1 1SEND_B0 1SEND_B1"])
    said = in_order_mismatch(crossed)
    assert said == "rank 1 receives rank 0's messages in another order than rank 0 sends them"


def test_torch_v_shaped_plans_and_a_hand_written_schedule_run_exactly():
    from pplab.schedules import from_torch

    schedules = [from_torch("ZBVZeroBubble", 2, 4, 2), from_torch("DualPipeV", 2, 4, 2),
                 from_text(["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"], name="mine")]
    assert schedules[0].placement == (0, 1, 1, 0)  # stages 1 and 2 meet on rank 1: a local hand-off
    specs_and_batches = [(PipelineSpec.create(CONFIG, s, 2), next(batches(2 * s.n_microbatches, SEQ_LEN)))
                         for s in schedules]
    for (spec, batch), result in zip(specs_and_batches, run_cases(2, specs_and_batches, timeout=200)):
        reference = pplab.reference_step(CONFIG, batch, spec.schedule.n_microbatches)
        parity = compare_with_reference(result.loss, result.grads, reference)
        assert parity.passed, f"{spec.schedule.name}: {parity}"


def test_a_schedule_that_never_runs_backward_trips_the_leak_check():
    forward_only = from_text(["0F0 0SEND_F0", "1RECV_F0 1F0"], name="forward-only")
    spec = PipelineSpec(CONFIG, forward_only, op_timeout=5.0)  # bypasses validate(), on purpose
    data = split_for_ranks(spec, next(batches(2, SEQ_LEN)))
    with pytest.raises(RankFailedError,
                       match=r"still holds tensors after the step: \{'inputs': \['\(0, 0\)'\], "
                                               r"'outputs': \['\(0, 0\)'\]\}"):
        run_ranks(2, run_jobs_on_rank, [(spec, data)], timeout=60)


def _watched_step(rank, world_size, spec, data):
    from pplab.rank.rank_pipeline import RankPipeline

    told = []
    pipeline = RankPipeline(spec, rank)
    result = pipeline.runtime.step(data[rank]["inputs"], data[rank]["targets"],
                                   data[rank]["activation_shapes"], watch=told.append)
    return told, result.events, result.streamed


def test_a_watcher_is_told_each_start_and_each_event_as_the_step_goes():
    from pplab import Event
    from pplab.trace import Now

    spec = PipelineSpec.create(CONFIG, "1f1b", 2, 3)
    data = split_for_ranks(spec, next(batches(MICROBATCH_SIZE * 3, SEQ_LEN)))
    for rank, (told, events, streamed) in enumerate(run_ranks(2, _watched_step, spec, data, timeout=120)):
        told_events = [item for item in told if isinstance(item, Event)]
        # Every action's event, told once; the result repeats none of them, it says how many.
        assert sorted((e.kind, e.stage, e.microbatch) for e in told_events) == \
            sorted((a.kind.value, a.stage, a.microbatch) for a in spec.schedule.actions[rank])
        assert events == [] and streamed == len(told_events)
        starts = [item for item in told if isinstance(item, Now)]
        assert [n.doing for n in starts if " " not in n.doing and "RECV" not in n.doing
                and "SEND" not in n.doing and n.doing != "done"] == \
            [str(a) for a in spec.schedule.actions[rank] if a.is_compute]
        assert starts[-1].doing == "done" and all(n.rank == rank for n in starts)
        # Each compute action is announced before its event ends, in the order it runs.
        for item, following in zip(told, told[1:]):
            if isinstance(following, Event) and following.is_compute:
                assert isinstance(item, Now)
                assert item.doing == f"{following.stage}{following.kind}{following.microbatch}"
        receives = [n for n in starts if "RECV" in n.doing]
        peer = 1 - rank
        assert receives and all(w[0] == peer and "SEND" in w[1] for n in receives for w in n.waits_for)


def _matmuls_per_backward_action(rank, world_size, specs, data):
    """Per schedule: the matrix products each backward action (B, I, W) of this rank ran."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from pplab.rank.rank_pipeline import RankPipeline
    from pplab.rank.runtime import RankRuntime

    class Matmuls(TorchDispatchMode):
        def __init__(self, counts):
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm",
                                               "_scaled_dot_product_flash_attention_for_cpu_backward"):
                self.counts[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    counted = {}
    for name, spec in specs.items():
        counts = {kind: Counter() for kind in ("B", "I", "W")}
        pipeline = RankPipeline(spec, rank)
        runtime: RankRuntime = pipeline.runtime
        for kind, method in (("B", "_backward"), ("I", "_input_grad"), ("W", "_weight_grad")):
            original = getattr(runtime, method)

            def counting(*args, _original=original, _kind=kind):
                with Matmuls(counts[_kind]):
                    return _original(*args)
            setattr(runtime, method, counting)
        pipeline.step(data[name][rank])
        counted[name] = counts
    return counted


def test_zero_bubble_w_computes_only_weight_gradients():
    """I + W run exactly the matrix products of B: W recomputes nothing of the input-gradient chain."""
    m = 3
    specs = {name: PipelineSpec.create(CONFIG, name, 2, m) for name in ("1f1b", "zb-h1")}
    batch = next(batches(MICROBATCH_SIZE * m, SEQ_LEN))
    data = {name: split_for_ranks(spec, batch) for name, spec in specs.items()}
    per_rank = run_ranks(2, _matmuls_per_backward_action, specs, data, timeout=120)
    last = per_rank[1]  # stage 1 has an input gradient to compute (stage 0's input is token ids)
    full, split = last["1f1b"]["B"], last["zb-h1"]["I"] + last["zb-h1"]["W"]
    assert sum(full.values()) > 0 and split == full, (full, last["zb-h1"])
    # and W did weight work only: one product per linear weight and microbatch, none for inputs
    linears_per_layer, layers = 7, CONFIG.num_hidden_layers // 2
    assert last["zb-h1"]["W"]["mm"] == m * (linears_per_layer * layers + 1)  # + the LM head


@pytest.mark.quick
def test_receives_are_posted_one_compute_ahead():
    """Before each compute, the runtime posts the receives of the next comm batch (gloo moves
    a message only once its receive is posted): rank 1 of 1F1B posts microbatch 1's
    activation while it still runs microbatch 0. (The rule lives in pplab.schedules.communication,
    where the simulator's rendezvous link reads it too.)"""
    from pplab.schedules.communication import comm_batches, receives_to_prepost
    steps = comm_batches(build("1f1b", 2, 3).actions[1])
    assert [len(step) for step in steps if step[0].is_comm] == [1, 2, 2, 1]  # adjacent messages: one batch
    upcoming = {str(step[0]): [str(r) for r in receives]
                for step, receives in zip(steps, receives_to_prepost(steps)) if step[0].is_compute}
    assert upcoming == {"1F0": ["1RECV_F1"], "1B0": ["1RECV_F1"], "1F1": ["1RECV_F2"],
                        "1B1": ["1RECV_F2"], "1F2": [], "1B2": []}
