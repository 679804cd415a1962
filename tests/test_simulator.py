"""The simulator: exact agreement with the theory, communication costs, deadlocks, Costs checks."""

import dataclasses
import math

import pytest

from pplab import Event, Timeline
from pplab.planning.simulator import Costs, DeadlockError, simulate
from pplab.schedules import Schedule, ScheduleError, build, from_text, theory

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

# ---------------------------------------------------------------- agreement with the theory


def test_gpipe_and_1f1b_bubble_and_peaks_equal_the_theory_for_1_to_8_ranks_and_1_to_32_microbatches():
    for name in ("gpipe", "1f1b"):
        for p in range(1, 9):
            for m in range(1, 33):
                schedule = build(name, p, m)
                expected = theory(schedule)
                timeline = simulate(schedule)
                assert expected.bubble_fraction == (p - 1) / (m + p - 1)
                assert abs(timeline.bubble_fraction() - expected.bubble_fraction) < 1e-12, (name, p, m)
                assert timeline.peak_inflight_per_rank() == list(expected.peak_inflight), (name, p, m)


def test_interleaved_bubble_equals_the_theory_when_microbatches_are_a_multiple_of_ranks():
    checked = 0
    for p in range(1, 9):
        for m in range(p, 33, p):
            for v in (2, 3):
                schedule = build("interleaved-1f1b", p, m, v)
                expected = theory(schedule)
                timeline = simulate(schedule)
                assert expected.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-15)
                assert abs(timeline.bubble_fraction() - expected.bubble_fraction) < 1e-12, (p, m, v)
                assert timeline.peak_inflight_per_rank() == list(expected.peak_inflight), (p, m, v)
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("costs", [None, Costs(forward=1.0, input_grad=1.5, weight_grad=0.5),
                                   Costs(forward=2.0, backward=3.0)])
def test_zb_h1_beats_1f1b_and_matches_the_zero_bubble_formula(costs):
    for p in range(2, 9):
        for m in (1, 2, 4, 7, 8, 16, 32):
            zero_bubble = simulate(build("zb-h1", p, m), costs).bubble_fraction()
            one_f_one_b = simulate(build("1f1b", p, m), costs).bubble_fraction()
            assert zero_bubble < one_f_one_b, (p, m)
            expected = theory(build("zb-h1", p, m), costs)
            if m >= p:
                assert abs(zero_bubble - expected.bubble_fraction) < 1e-12, (p, m)
            else:
                # No closed form for a partial warm-up: theory says so instead of giving a number.
                assert expected.bubble_fraction is None and f"m={m} < p={p}" in expected.conditions


def test_zb_h1_formula_by_hand_for_4_ranks_8_microbatches():
    # (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)) with F=I=W=1: 3 / 27
    assert simulate(build("zb-h1", 4, 8)).bubble_fraction() == pytest.approx(3 / 27, abs=1e-15)


def test_theory_declines_a_wide_w_and_the_simulator_still_runs_it():
    costs = Costs(forward=1.0, input_grad=1.0, weight_grad=2.0)
    assert theory(build("zb-h1", 4, 8), costs).bubble_fraction is None
    zero_bubble, one_f_one_b = (simulate(build(name, 4, 8), costs) for name in ("zb-h1", "1f1b"))
    assert zero_bubble.bubble_fraction() < one_f_one_b.bubble_fraction()


# ---------------------------------------------------------------- the cost model


def test_result_is_a_simulated_timeline_of_compute_and_comm_events():
    timeline = simulate(build("1f1b", 3, 4))
    assert isinstance(timeline, Timeline)
    assert timeline.label == "simulated" and timeline.n_ranks == 3
    kinds = {e.kind for e in timeline.events}
    assert kinds == {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    assert all(e.duration == 0 for e in timeline.comm_events())


def test_latency_and_bandwidth_delay_every_hop():
    # Two ranks, one microbatch: F, hop, F, B, hop, B.
    latency, size, bandwidth = 0.25, 1000, 4000.0
    costs = Costs(latency=latency, bandwidth=bandwidth, activation_bytes=size)
    timeline = simulate(build("gpipe", 2, 1), costs)
    hop = latency + size / bandwidth
    assert timeline.step_time() == pytest.approx(1 + hop + 1 + 2 + hop + 2)
    send = next(e for e in timeline.events if e.kind == "SEND_F")
    receive = next(e for e in timeline.events if e.kind == "RECV_F")
    assert (send.start, send.end, send.bytes) == (1.0, 1.0 + hop, size)
    # Rank 1 posted its receive at 0 but the message only left at 1: it waits on the wire from then on.
    assert (receive.start, receive.end) == (1.0, 1.0 + hop)
    assert timeline.busy_time(1) == 3.0  # waiting on a receive is not busy


def test_per_stage_costs():
    costs = Costs(forward=[1.0, 3.0], backward=[2.0, 4.0])
    timeline = simulate(build("gpipe", 2, 2), costs)
    # Rank 1 starts at 1 and computes 3+3+4+4 back to back; rank 0's last
    # backward (2) can only follow rank 1's last one.
    assert timeline.step_time() == 1 + 14 + 2
    assert timeline.busy_time(1) == 14.0


def test_split_backward_defaults_to_half_and_half():
    timeline = simulate(build("zb-h1", 2, 2), Costs(backward=4.0))
    assert {e.duration for e in timeline.events if e.kind in ("I", "W")} == {2.0}
    timeline = simulate(build("zb-h1", 2, 2), Costs(backward=4.0, weight_grad=1.0))
    assert {e.kind: e.duration for e in timeline.events if e.kind in ("I", "W")} == {"I": 3.0, "W": 1.0}


def test_compute_only_schedule_moves_data_implicitly():
    schedule = build("interleaved-1f1b", 4, 8, 2)
    full, compute_only = simulate(schedule), simulate(schedule.compute_only())
    assert compute_only.compute_events() == full.compute_events()
    assert compute_only.comm_events() == []


def test_v_shaped_placement_hands_over_on_the_same_rank_without_messages():
    # Stages 1 and 2 share rank 1; stages 0 and 3 share rank 0: one long chain.
    schedule = from_text(["0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"])
    timeline = simulate(schedule)
    assert timeline.step_time() == 4 * 1.0 + 4 * 2.0
    assert timeline.bubble_fraction() == 0.5


# ---------------------------------------------------------------- broken schedules


def test_a_deadlocking_schedule_raises_naming_the_stuck_ranks():
    # Rank 0 waits for the gradient of microbatch 0 before sending microbatch 1;
    # rank 1 waits for microbatch 1 before doing microbatch 0.
    schedule = from_text(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"])
    with pytest.raises(DeadlockError, match=r"rank 0 at action 0RECV_B0.*waits for the send 1SEND_B0.*"
                                            r"rank 1 at action 1RECV_F1.*waits for the send 0SEND_F1"):
        simulate(schedule)


def test_a_backward_before_its_forward_is_a_deadlock_not_a_hang():
    with pytest.raises(DeadlockError, match="1B0.*its forward 1F0"):
        simulate(from_text(["0F0 0B0", "1B0 1F0"]))


def test_a_repeated_action_is_an_error():
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        simulate(from_text(["0F0 0F0 0B0"]))


# ---------------------------------------------------------------- Costs checks


@pytest.mark.parametrize("kwargs, message", [
    ({"forward": -1.0}, "forward=-1.0"),
    ({"backward": math.nan}, "backward=nan"),
    ({"forward": "fast"}, "forward='fast' must be a number"),
    ({"latency": math.inf}, "latency=inf"),
    ({"forward": []}, "forward is an empty sequence"),
    ({"bandwidth": 0.0, "activation_bytes": 10}, "bandwidth=0"),
    ({"bandwidth": 1e9}, "needs message sizes"),
    ({"weight_grad": [1.0, -0.5]}, "weight_grad=-0.5"),
])
def test_bad_costs_are_rejected_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Costs(**kwargs)


def test_per_stage_costs_must_match_the_number_of_stages():
    with pytest.raises(ValueError, match="forward has 3 values but the schedule has 4 stages"):
        simulate(build("1f1b", 4, 4), Costs(forward=[1.0, 1.0, 1.0]))


def test_half_of_the_backward_cannot_exceed_the_backward():
    with pytest.raises(ValueError, match="input_grad=3.0 on stage 0 exceeds backward=2.0"):
        simulate(build("zb-h1", 2, 2), Costs(input_grad=3.0))


def test_backward_is_input_grad_plus_weight_grad():
    assert Costs(input_grad=1.0, weight_grad=2.0).backward == 3.0
    assert Costs(input_grad=[1.0, 2.0], weight_grad=1.0).backward == (2.0, 3.0)
    with pytest.raises(ValueError, match=r"input_grad \+ weight_grad = 3 on stage 0 but backward=2: .* "
                                         r"give backward=3 or leave backward out"):
        simulate(build("zb-h1", 2, 2), Costs(backward=2.0, input_grad=1.0, weight_grad=2.0))


def test_a_simulated_timeline_makes_its_events_when_read_and_pickles_with_them():
    import pickle

    timeline = simulate(build("1f1b", 3, 5), Costs(latency=0.1))
    assert timeline._events is None and len(timeline) == sum(map(len, build("1f1b", 3, 5).actions))
    step = timeline.step_time()  # from the rows' bounds, no events made
    assert timeline._events is None
    copy = pickle.loads(pickle.dumps(timeline))
    assert copy == timeline and copy.step_time() == step
    assert timeline.events[0] == Event(0, "F", 0, 0, 0.0, 1.0)


@pytest.mark.parametrize("lists", [
    ["0RECV_F0 0F0 0B0"],                               # a receive from no stage
    ["0F0 0B0 0SEND_B0"],                               # a send to no stage
    ["0F0 0I0 1B0 0W0", "1F0 1I0 1W0"],                 # 1B0 on the wrong rank
])
def test_schedules_without_an_integer_form_take_the_readable_path(lists):
    """Faults the integer form cannot hold are simulated (or refused) as the readable path does."""
    from pplab.planning.simulator import _Simulation
    from pplab.schedules import Action
    from pplab.schedules.compiled import compile_schedule

    actions = [[Action.parse(word) for word in line.split()] for line in lists]
    n_stages = max(a.stage for acts in actions for a in acts) + 1
    schedule = Schedule(actions, len(actions), 1, n_stages, n_stages // len(actions))
    assert compile_schedule(schedule) is None

    def outcome(run):
        try:
            timeline = run()
        except ScheduleError as error:
            return str(error)
        return [(e.rank, e.kind, e.stage, e.start, e.end) for e in timeline.events]

    costs = Costs(latency=0.5)
    assert outcome(lambda: simulate(schedule, costs)) == outcome(lambda: _Simulation(schedule, costs).run())


def test_with_link_contention_a_message_waits_for_the_one_before_it():
    # GPipe, 2 ranks: rank 0 sends 3 activations 1 s apart; each holds the link 2 s (4 bytes at
    # 2 B/s) and arrives 0.5 s (latency) after it leaves the link.
    costs = Costs(forward=1.0, backward=1.0, latency=0.5, bandwidth=2.0, activation_bytes=4,
                  link_contention=True)
    timeline = simulate(build("gpipe", 2, 3), costs)
    sends = [e for e in timeline.events if e.kind == "SEND_F"]
    assert [(e.start, e.end) for e in sends] == [(1.0, 3.5), (2.0, 5.5), (3.0, 7.5)]
    free = simulate(build("gpipe", 2, 3), dataclasses.replace(costs, link_contention=False))
    assert [e.end for e in free.events if e.kind == "SEND_F"] == [3.5, 4.5, 5.5]
    with pytest.raises(ValueError, match="has none: add them first"):
        simulate(build("gpipe", 2, 3).compute_only(), costs)


@pytest.mark.quick
def test_a_rendezvous_link_holds_a_message_until_its_receive_is_posted():
    """GPipe on 2 ranks, a hop of 2: rank 1 posts its receive of microbatch 1 when its wait for
    microbatch 0 ends (t=3, as the runtime posts one compute ahead), after rank 0 sent it (t=2):
    the message leaves at 3 and arrives at 5, not at 4; each later one waits the same way."""
    schedule = build("gpipe", 2, 4)
    buffered = simulate(schedule, Costs(forward=1, backward=2, latency=2))
    rendezvous = simulate(schedule, Costs(forward=1, backward=2, latency=2, link="rendezvous"))

    def event(timeline, rank, kind, microbatch):
        return next(e for e in timeline.events if (e.rank, e.kind, e.microbatch) == (rank, kind, microbatch))

    assert event(buffered, 1, "RECV_F", 1).end == 4 and event(rendezvous, 1, "RECV_F", 1).end == 5
    assert event(rendezvous, 0, "SEND_F", 1).end == 5  # a send completes when its message has crossed
    assert (buffered.step_time(), rendezvous.step_time()) == (19, 22)


@pytest.mark.quick
@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_a_rendezvous_costs_nothing_when_the_compute_between_covers_the_hop(name, v):
    """Receives posted one compute ahead are posted before their sends whenever a hop is
    shorter than a compute: the rendezvous then changes no time."""
    schedule = build(name, 4, 8, v)
    costs = Costs(forward=1, input_grad=1, weight_grad=1, latency=0.1)
    assert simulate(schedule, costs).step_time() == \
        simulate(schedule, dataclasses.replace(costs, link="rendezvous")).step_time()


@pytest.mark.quick
def test_a_rendezvous_needs_receives_and_a_link_needs_a_known_name():
    with pytest.raises(ValueError, match=r"no receives: add them first"):
        simulate(build("1f1b", 2, 4).compute_only(), Costs(link="rendezvous"))
    with pytest.raises(ValueError, match=r"link='pigeon': choose one of 'buffered', 'rendezvous'"):
        Costs(link="pigeon")
    with pytest.raises(ValueError, match=r"link_contention=True\): a queue on a link .* choose one"):
        simulate(build("1f1b", 2, 4), Costs(link="rendezvous", link_contention=True, latency=1))
