"""The event model: metrics on hand-made timelines, merging, Chrome trace round trip."""

import json
import pickle

import pytest

from pplab import Event, Timeline

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)


def two_rank_pipeline() -> Timeline:
    """One microbatch through two stages, F=1, B=2, with zero-length messages.

    rank 0: F [0,1]                      B [4,6]
    rank 1:        F [1,2]  B [2,4]
    """
    return Timeline([
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "SEND_F", 0, 0, 1.0, 1.0, bytes=64),
        Event(1, "RECV_F", 1, 0, 1.0, 1.0, bytes=64),
        Event(1, "F", 1, 0, 1.0, 2.0),
        Event(1, "B", 1, 0, 2.0, 4.0),
        Event(1, "SEND_B", 1, 0, 4.0, 4.0),
        Event(0, "RECV_B", 0, 0, 4.0, 4.0),
        Event(0, "B", 0, 0, 4.0, 6.0),
    ], label="hand-made")


def test_step_busy_and_bubble_of_a_hand_made_pipeline():
    timeline = two_rank_pipeline()
    assert timeline.n_ranks == 2
    assert timeline.step_time() == 6.0
    assert timeline.busy_time(0) == 3.0
    assert timeline.busy_time(1) == 3.0
    assert timeline.bubble_fraction(0) == 0.5
    assert timeline.bubble_fraction() == 0.5  # (p-1)/(m+p-1) with p=2, m=1


def test_summary_reads_step_bubble_and_peak_per_rank():
    assert two_rank_pipeline().summary().splitlines() == [
        "hand-made: 2 ranks, step 6 s, bubble 50.0%",
        "  rank 0: busy 3 s, bubble 50.0%, peak in-flight 1",
        "  rank 1: busy 3 s, bubble 50.0%, peak in-flight 1",
    ]
    simulated = Timeline(two_rank_pipeline().events, 2, label="simulated")  # the simulator's: cost units
    assert simulated.summary().splitlines()[:2] == ["simulated: 2 ranks, step 6 (cost units), bubble 50.0%",
                                                    "  rank 0: busy 3, bubble 50.0%, peak in-flight 1"]


def test_communication_is_not_busy_time():
    timeline = Timeline([
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "RECV_B", 0, 0, 1.0, 3.0),
        Event(0, "B", 0, 0, 3.0, 4.0),
    ])
    assert timeline.busy_time(0) == 2.0
    assert timeline.comm_time(0) == 2.0
    assert timeline.bubble_fraction(0) == 0.5


def test_overlapping_compute_is_counted_once_and_free_form_kinds_are_compute():
    timeline = Timeline([
        Event(0, "F", 0, 0, 0.0, 2.0),
        Event(0, "OPT", None, None, 1.0, 3.0),
        Event(1, "F", 1, 0, 3.0, 4.0),
    ])
    assert timeline.busy_time(0) == 3.0
    assert timeline.busy_time(1) == 1.0
    assert timeline.bubble_fraction() == pytest.approx((1 + 3) / 8)


def test_a_rank_without_events_counts_as_fully_idle():
    timeline = Timeline([Event(0, "F", 0, 0, 0.0, 1.0)], n_ranks=2)
    assert timeline.bubble_fraction(1) == 1.0
    assert timeline.bubble_fraction() == 0.5


def test_inflight_steps_and_peak_for_one_f_one_b_order():
    # F0 F1 B0 F2 B1 B2: at most two microbatches are held at once.
    timeline = Timeline([
        Event(0, "F", 0, 0, 0, 1), Event(0, "F", 0, 1, 1, 2), Event(0, "B", 0, 0, 2, 4),
        Event(0, "F", 0, 2, 4, 5), Event(0, "B", 0, 1, 5, 7), Event(0, "B", 0, 2, 7, 9),
    ])
    assert timeline.inflight(0) == [(0, 1), (1, 2), (4, 2), (7, 1), (9, 0)]
    assert timeline.peak_inflight(0) == 2


def test_a_release_and_a_hold_at_the_same_instant_do_not_make_a_false_peak():
    timeline = Timeline([Event(0, "F", 0, 0, 0, 1), Event(0, "B", 0, 0, 1, 2), Event(0, "F", 0, 1, 2, 3),
                         Event(0, "B", 0, 1, 3, 4)])
    assert timeline.peak_inflight(0) == 1


def test_split_backward_holds_activations_until_w_not_until_i():
    timeline = Timeline([
        Event(0, "F", 0, 0, 0, 1, bytes=100), Event(0, "I", 0, 0, 1, 2), Event(0, "F", 0, 1, 2, 3, bytes=50),
        Event(0, "W", 0, 0, 3, 4), Event(0, "I", 0, 1, 4, 5), Event(0, "W", 0, 1, 5, 6),
    ])
    assert timeline.peak_inflight(0) == 2
    assert timeline.peak_inflight_bytes(0) == 150
    assert timeline.inflight_bytes(0) == [(0, 100), (2, 150), (4, 50), (6, 0)]


def test_bytes_are_none_when_forwards_carry_none():
    timeline = two_rank_pipeline()
    assert timeline.peak_inflight_bytes(0) is None
    assert timeline.inflight_bytes(0) is None
    assert timeline.peak_inflight_per_rank() == [1, 1]


def test_normalised_starts_at_zero_and_keeps_durations():
    timeline = two_rank_pipeline().shift(1000.0)
    assert timeline.start == 1000.0
    normal = timeline.normalised()
    assert normal.start == 0.0
    assert normal.step_time() == timeline.step_time() == 6.0


def test_events_reject_time_running_backwards_and_store_enum_kinds_as_text():
    with pytest.raises(ValueError, match="ends"):
        Event(0, "F", 0, 0, 2.0, 1.0)
    with pytest.raises(ValueError, match="rank 3.*n_ranks=2"):
        Timeline([Event(3, "F", 0, 0, 0, 1)], n_ranks=2)
    from pplab.schedules import Kind

    assert Event(0, Kind.SEND_F, 0, 0, 0, 0).kind == "SEND_F"


def rich_timeline() -> Timeline:
    """Events with every optional field, times that are not exact in microseconds."""
    return Timeline([
        Event(0, "F", 0, 3, 0.1, 0.30000000000000004, bytes=4096, shape=(2, 16, 64), dtype="float32"),
        Event(0, "SEND_F", 0, 3, 0.30000000000000004, 0.31, bytes=4096, shape=(2, 16, 64), dtype="float32"),
        Event(1, "RECV_F", 1, 3, 0.30000000000000004, 0.31, bytes=4096),
        Event(1, "F", 1, 3, 1 / 3, 2 / 3),
        Event(1, "OPT", None, None, 2 / 3, 0.7),
    ], n_ranks=3, label="measured")


def test_chrome_trace_round_trip_is_lossless(tmp_path):
    timeline = rich_timeline()
    path = tmp_path / "trace.json"
    trace = timeline.to_chrome_trace(path)
    assert json.loads(path.read_text()) == trace
    assert Timeline.from_chrome_trace(path) == timeline
    assert Timeline.from_chrome_trace(trace) == timeline
    assert pickle.loads(pickle.dumps(timeline)) == timeline


def test_chrome_trace_layout_one_process_per_rank_and_separate_tracks():
    trace = rich_timeline().to_chrome_trace()
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    forward = next(e for e in complete if e["name"] == "F mb3" and e["pid"] == 0)
    send = next(e for e in complete if e["args"]["kind"] == "SEND_F")
    assert forward["tid"] != send["tid"]
    assert forward["ts"] == pytest.approx(0.1e6) and forward["dur"] == pytest.approx(0.2e6)
    assert forward["args"]["shape"] == [2, 16, 64] and forward["args"]["bytes"] == 4096


def test_chrome_trace_without_pplab_extras_is_read_from_ts_and_dur():
    foreign = [{"ph": "X", "name": "B mb1", "pid": 1, "tid": 0, "ts": 2_000_000, "dur": 500_000},
               {"ph": "i", "name": "marker", "pid": 0, "tid": 0, "ts": 0}]
    timeline = Timeline.from_chrome_trace(foreign)
    assert timeline.n_ranks == 2
    (event,) = timeline.events
    assert (event.rank, event.kind, event.microbatch, event.start, event.end) == (1, "B", 1, 2.0, 2.5)


def test_chrome_trace_never_puts_overlapping_slices_on_one_track():
    from pplab.planning.simulator import Costs, simulate
    from pplab.schedules import build

    timeline = simulate(build("1f1b", 2, 4), Costs(latency=3.0))   # sends overlap on the wire
    trace = timeline.to_chrome_trace()
    tracks = {}
    for event in (e for e in trace["traceEvents"] if e["ph"] == "X"):
        tracks.setdefault((event["pid"], event["tid"]), []).append((event["ts"], event["ts"] + event["dur"]))
    for slices in tracks.values():
        slices.sort()
        assert all(later[0] >= earlier[1] for earlier, later in zip(slices, slices[1:]))
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert (0, "send 2") in names  # the overlapping send got a second lane
    assert Timeline.from_chrome_trace(trace).events == timeline.events
