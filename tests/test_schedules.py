"""Tests for pplab.schedules: actions, building, validation, theory and torch's plans."""

import pytest

from pplab.schedules import (
    ALL_SCHEDULE_NAMES,
    COMM_KINDS,
    SCHEDULE_NAMES,
    TORCH_SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    add_communication,
    build,
    from_text,
    from_torch,
    loop_placement,
    peak_inflight_at,
    releases_activations,
    schedule_name,
    theory,
    v_placement,
    validate,
)

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W


def sizes(name, max_ranks=6, max_microbatches=12):
    """(p, m, v) triples for `name`, with the virtual stages it takes."""
    virtuals = (2, 3) if name == "interleaved-1f1b" else (1,)
    for p in range(1, max_ranks + 1):
        for m in range(1, max_microbatches + 1):
            for v in virtuals:
                yield p, m, v


def interleaved_accepts(p, m):
    """torch's rule: m // max(1, m // p) microbatches per round, in whole rounds."""
    return m % max(1, m // p) == 0


# ---------------------------------------------------------------- actions and text


@pytest.mark.parametrize("text", ["2F0", "1SEND_F3", "2RECV_B0", "0I1", "0W1", "3B12", "10RECV_F7",
                                  "0SEND_B1"])
def test_action_text_round_trip(text):
    assert str(Action.parse(text)) == text


def test_action_fields_and_properties():
    send = Action.parse("1SEND_F3")
    assert (send.stage, send.kind, send.microbatch) == (1, Kind.SEND_F, 3)
    assert send.is_comm and not send.is_compute
    assert Action.parse("0W1").is_compute and not Action.parse("0W1").is_comm
    peers = {"2SEND_F0": 3, "2RECV_F0": 1, "2SEND_B0": 1, "2RECV_B0": 3, "2F0": None}
    assert {text: Action.parse(text).peer_stage for text in peers} == peers


def test_where_a_message_goes_has_one_rule_that_a_send_and_its_receive_share():
    for kind in COMM_KINDS:
        for stage in range(1, 4):
            message, partner = Action(stage, kind, 0), Action(stage, kind, 0).partner()
            sender, receiver = message.sender_stage, message.receiver_stage
            assert (partner.sender_stage, partner.receiver_stage) == (sender, receiver)
            assert partner.boundary == message.boundary
            # activations go to the next stage, gradients to the previous one
            assert receiver - sender == (1 if kind in (Kind.SEND_F, Kind.RECV_F) else -1), message
            assert {message.stage, message.peer_stage} == {sender, receiver}
            assert message.stage == (sender if message.is_send else receiver)
            assert message.boundary == min(sender, receiver)  # the boundary after the lower stage
    compute = Action(2, Kind.F, 0)
    assert (compute.peer_stage, compute.sender_stage, compute.receiver_stage, compute.boundary) == (None,) * 4


def test_the_release_rule_b_or_w_frees_a_forward():
    assert {kind for kind in Kind if releases_activations(kind)} == {Kind.B, Kind.W}
    assert releases_activations("B") and releases_activations("W")  # an event's kind, as text
    assert not any(releases_activations(text) for text in ("F", "I", "SEND_B", "OPT", "ALL_GATHER"))


def test_theory_the_timeline_and_the_search_count_activations_by_the_one_release_rule():
    from pplab.planning.search import _peaks
    from pplab.planning.simulator import Costs, simulate

    costs = Costs(forward=1.0, input_grad=1.0, weight_grad=0.5, latency=0.25)
    for schedule in (build("1f1b", 4, 8), build("zb-h1", 4, 8), build("interleaved-1f1b", 2, 4, 2),
                     from_torch("ZBVZeroBubble", 2, 4, 2)):
        timeline = simulate(schedule, costs)
        by_order = [peak for peak, _ in peak_inflight_at(schedule)]
        assert timeline.peak_inflight_per_rank() == by_order, schedule.name
        assert list(_peaks(schedule, [1.0] * schedule.n_stages)) == by_order, schedule.name


@pytest.mark.parametrize("text", ["F0", "2X0", "2F", "2 F0", "-1F0", "2SEND0", "2f0", ""])
def test_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot read action"):
        Action.parse(text)


def test_schedule_text_round_trip():
    schedule = build("zb-h1", 3, 5)
    text = [" ".join(str(a) for a in acts) for acts in schedule.actions]
    assert from_text(text, name="zb-h1") == schedule


def test_from_text_infers_sizes_and_adds_communication():
    schedule = from_text(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches, schedule.n_virtual) == (2, 2, 2, 1)
    assert [str(a) for a in schedule.actions[1]] == [
        "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
    ]
    assert [str(a) for a in schedule.compute_only().actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    validate(schedule)


def test_from_text_reads_a_v_shaped_placement():
    schedule = from_text(["0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"])
    assert schedule.placement == (0, 1, 1, 0)
    assert [schedule.stage_to_rank(s) for s in range(4)] == [0, 1, 1, 0]
    assert schedule.stages_of(0) == [0, 3]
    # Stages 1 and 2 share rank 1: no message between them.
    assert "1SEND_F0" not in [str(a) for a in schedule.actions[1]]
    validate(schedule)


def test_from_text_rejects_a_stage_on_two_ranks():
    with pytest.raises(ScheduleError, match="stage 0 appears on rank 0 and on rank 1"):
        from_text(["0F0 0B0", "0F1 0B1"])


def test_loop_placement_by_default():
    schedule = build("interleaved-1f1b", 2, 4, 2)
    assert schedule.placement is None
    assert [schedule.stage_to_rank(s) for s in range(4)] == [0, 1, 0, 1]
    assert schedule.stages_of(1) == [1, 3]


def test_stage_placement_looped_and_v_shaped():
    """Which stages a rank holds: the schedule says, for the loop and the V alike."""
    assert loop_placement(4) == (0, 1, 2, 3)
    assert loop_placement(4, 3) == (0, 1, 2, 3) * 3
    looped = build("interleaved-1f1b", 4, 8, 3)
    assert tuple(looped.stage_to_rank(s) for s in range(12)) == loop_placement(4, 3)
    assert [looped.stages_of(r) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    v_shaped = Schedule([[] for _ in range(3)], 3, 1, 6, 2, placement=v_placement(3))
    assert [v_shaped.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]  # rank r: r and 2p-1-r
    assert v_shaped.peer_rank(Action(3, Kind.SEND_F, 0)) == 1 and v_shaped.same_rank(2, 3)
    torch_v = from_torch("DualPipeV", 3, 6, 2)
    assert torch_v.placement == v_placement(3) and torch_v.stages_of(0) == [0, 5]
    with pytest.raises(ValueError, match=r"stage 6 is not in 0..5"):
        v_shaped.stage_to_rank(6)
    with pytest.raises(ScheduleError, match="every rank must hold n_virtual=2 stages"):
        Schedule([[] for _ in range(3)], 3, 1, 6, 2, placement=(0, 0, 0, 0, 1, 2))


def test_add_communication_puts_sends_after_producers_and_receives_before_consumers():
    schedule = build("zb-h1", 2, 2)
    rank1 = [str(a) for a in schedule.actions[1]]
    assert rank1 == ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1RECV_F1", "1F1", "1I1", "1SEND_B1", "1W0", "1W1"]
    rank0 = [str(a) for a in schedule.actions[0]]
    assert rank0[:4] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]
    assert rank0[rank0.index("0I0") - 1] == "0RECV_B0"


def test_add_communication_is_idempotent_and_takes_plain_lists():
    schedule = build("interleaved-1f1b", 2, 4, 2)
    assert add_communication(schedule) == schedule
    from_lists = add_communication(schedule.compute_only().actions)
    assert from_lists.actions == schedule.actions


def test_no_communication_when_all_stages_share_a_rank():
    schedule = build("interleaved-1f1b", 1, 3, 2)
    assert all(a.is_compute for a in schedule.actions[0])
    validate(schedule)


def test_str_is_a_table_with_one_column_per_rank():
    lines = str(build("gpipe", 2, 2)).splitlines()
    assert lines[0] == "gpipe: 2 ranks, 2 stages, 2 microbatches"
    assert lines[1].split() == ["|", "rank", "0", "rank", "1"]
    assert lines[2].split() == ["0", "|", "0F0", "1RECV_F0"]


# ---------------------------------------------------------------- building


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_built_schedule_validates(name):
    built = 0
    for p, m, v in sizes(name):
        if name == "interleaved-1f1b" and not interleaved_accepts(p, m):
            with pytest.raises(ValueError, match="must be a multiple of"):
                build(name, p, m, v)
            continue
        schedule = build(name, p, m, v)
        assert (schedule.n_ranks, schedule.n_microbatches, schedule.n_stages) == (p, m, p * v)
        validate(schedule)
        built += 1
    assert built >= 60


# ---------------------------------------------------------------- names


def test_every_spelling_of_a_schedule_names_its_canonical_name():
    typed = {"ScheduleInterleaved1F1B": "interleaved-1f1b", "Interleaved1F1B": "interleaved-1f1b",
             "interleaved_1f1b": "interleaved-1f1b", "ZBVZeroBubble": "zbv-zero-bubble",
             "zbv_zero_bubble": "zbv-zero-bubble", "GPipe": "gpipe", "Schedule1F1B": "1f1b",
             "DualPipeV": "dualpipev", "ZB_H1": "zb-h1", "zbh1": "zb-h1", "Looped-BFS": "looped-bfs",
             "schedule_interleaved_zero_bubble": "interleaved-zero-bubble"}
    for name in ALL_SCHEDULE_NAMES:
        squashed = name.replace("-", "")
        for spelling in (name, name.upper(), name.replace("-", "_"), squashed, f"Schedule{squashed}"):
            typed[spelling] = name
    for entry in TORCH_SCHEDULES.values():  # torch's class names, with and without its prefix
        typed[entry.torch_name] = typed[f"Schedule{entry.torch_name}"] = entry.name
    for spelling, name in typed.items():
        assert schedule_name(spelling) == name, spelling
    assert set(ALL_SCHEDULE_NAMES) == set(SCHEDULE_NAMES) | set(TORCH_SCHEDULES)
    from pplab.schedules.builders import _BUILDERS

    assert tuple(_BUILDERS) == SCHEDULE_NAMES  # the names pplab says it builds are the ones it builds
    assert all(schedule_name(name) == name for name in ALL_SCHEDULE_NAMES)  # canonical names are fixed points


def test_a_built_or_imported_schedule_carries_the_canonical_name_whatever_was_typed():
    assert build("ScheduleInterleaved1F1B", 2, 4, 2).name == "interleaved-1f1b"
    assert build("ZB_H1", 2, 4).name == "zb-h1"
    assert from_torch("ScheduleZBVZeroBubble", 2, 4, 2).name == "zbv-zero-bubble"
    assert from_torch("interleaved_1f1b", 2, 4, 2).name == "interleaved-1f1b"
    assert from_torch("DualPipeV", 2, 4, 2).name == "dualpipev"


@pytest.mark.parametrize("bad", ["pipedream", "zb-h2", "1f1b-interleaved", "", None])
def test_an_unknown_name_is_named_with_every_canonical_one(bad):
    with pytest.raises(ValueError) as error:
        schedule_name(bad)
    assert str(error.value).startswith(f"unknown schedule {bad!r}: known schedules are "
                                       f"{', '.join(ALL_SCHEDULE_NAMES)}")


@pytest.mark.parametrize(
    "args, message",
    [
        (("pipedream", 2, 4), "unknown schedule 'pipedream': known schedules are gpipe, 1f1b, "
                              "interleaved-1f1b, zb-h1, looped-bfs, interleaved-zero-bubble, "
                              "zbv-zero-bubble, dualpipev"),
        (("ZBVZeroBubble", 2, 4, 2), "pplab does not build zbv-zero-bubble: it builds gpipe, 1f1b, "
                                     "interleaved-1f1b, zb-h1; torch runs zbv-zero-bubble (impl='torch')"),
        (("1f1b", 2, 0), "n_microbatches=0 must be at least 1"),
        (("1f1b", 0, 4), "n_ranks=0 must be at least 1"),
        (("1f1b", 2.0, 4), "n_ranks=2.0 must be a whole number"),
        (("1f1b", 2, "4"), "n_microbatches='4' must be a whole number"),
        (("1f1b", True, 4), "n_ranks=True must be a whole number"),
        (("interleaved-1f1b", 2, 4, 1), "interleaved-1f1b needs n_virtual >= 2 stages per "
                                        "rank, got n_virtual=1"),
        (("gpipe", 2, 4, 2), "gpipe runs one stage per rank, got n_virtual=2; use n_virtual=1"),
        (("interleaved-1f1b", 4, 9, 2), "n_microbatches must be a multiple of 2; nearby values that work"),
    ],
)
def test_build_rejects_bad_input(args, message):
    with pytest.raises(ValueError) as error:
        build(*args)
    assert message in str(error.value)


def test_1f1b_order():
    compute = build("1f1b", 3, 4).compute_only().actions
    assert [" ".join(str(a) for a in acts) for acts in compute] == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


# ---------------------------------------------------------------- validation


def rejection(schedule, blocking_sends=False):
    with pytest.raises(ScheduleError) as error:
        validate(schedule, blocking_sends=blocking_sends)
    return str(error.value)


@pytest.mark.parametrize(
    "per_rank, message",
    [
        (  # backward before forward
            ["0B0 0F0"],
            "rank 0 action 0B0 at position 0: backward of microbatch 0 on stage 0 comes before "
            "its forward 0F0, which comes later, at position 1",
        ),
        (  # forward through the stages out of order (both stages on one rank)
            ["1F0 0F0 1B0 0B0"],
            "rank 0 action 1F0 at position 0: forward of microbatch 0 on stage 1 comes before "
            "the forward of the previous stage 0F0, which comes later, at position 1",
        ),
        (  # backward through the stages out of order
            ["0F0 1F0 0B0 1B0"],
            "rank 0 action 0B0 at position 2: backward of microbatch 0 on stage 0 comes before "
            "the backward of the next stage 1B0, which comes later, at position 3",
        ),
        (  # W before its I
            ["0F0 0W0 0I0"],
            "rank 0 action 0W0 at position 1: weight-gradient pass of microbatch 0 on stage 0 comes "
            "before its input-gradient pass 0I0, which comes later, at position 2",
        ),
        (  # duplicate
            ["0F0 0B0 0F0"],
            "rank 0 action 0F0 at position 2: duplicate: the same action is already at position 0",
        ),
        (  # a backward both whole and split
            ["0F0 0I0 0B0 0W0"],
            "rank 0 action 0B0 at position 2: the backward of microbatch 0 on stage 0 already ran "
            "as 0I0 at position 1: use either B or the pair I and W",
        ),
        (  # I without its W
            ["0F0 0I0"],
            "rank 0 never runs 0W0: every microbatch needs, on every stage, a forward F and a "
            "backward (B, or the pair I and W)",
        ),
        (  # missing receive: the text has communication, so none is added
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"],
            "rank 1 action 1F0 at position 0: forward of microbatch 0 on stage 1 comes before "
            "the receive of its input 1RECV_F0, which is not in the schedule",
        ),
        (  # a receive whose send is missing
            ["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 1 action 1RECV_F0 at position 0: no matching send 0SEND_F0 on rank 0",
        ),
        (  # a send between stages that share a rank
            ["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"],
            "rank 0 action 0SEND_F0 at position 1: stages 0 and 1 are both on rank 0: "
            "they share memory, so nothing is sent between them",
        ),
        (  # a send from the last stage
            ["0F0 0SEND_F0 0B0"],
            "rank 0 action 0SEND_F0 at position 1: stage 0 has no neighbour stage 1 to send to",
        ),
    ],
)
def test_invalid_schedules_name_the_first_offence(per_rank, message):
    assert rejection(from_text(per_rank)) == message


def test_microbatch_out_of_range():
    schedule = from_text(["0F0 0B0 0F1 0B1"], n_microbatches=1)
    assert rejection(schedule) == (
        "rank 0 action 0F1 at position 2: microbatch 1 does not exist (microbatches are 0..0)"
    )


def test_missing_forward():
    schedule = from_text(["0F0 0B0 0B1"], n_microbatches=2)
    assert ("rank 0 action 0B1 at position 2: backward of microbatch 1 on stage 0 comes before its "
            "forward 0F1" in rejection(schedule))
    assert rejection(from_text(["0F0 0B0"], n_microbatches=2)).startswith("rank 0 never runs 0F1:")


def test_action_on_the_wrong_rank():
    schedule = Schedule([[Action(1, F, 0)], [Action(0, F, 0)]], n_ranks=2, n_microbatches=1, n_stages=2)
    assert rejection(schedule) == "rank 0 action 1F0 at position 0: stage 1 lives on rank 1, not on rank 0"


def test_ranks_that_each_receive_first_deadlock():
    schedule = from_text(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    assert rejection(schedule) == (
        "deadlock with buffered sends (isend), no rank can go on: "
        "rank 0 at position 0 on 0RECV_B0 waits for 1SEND_B0 on rank 1 "
        "(rank 1 is stuck at position 0 on 1RECV_F0); "
        "rank 1 at position 0 on 1RECV_F0 waits for 0SEND_F0 on rank 0 "
        "(rank 0 is stuck at position 0 on 0RECV_B0)"
    )


def test_compute_only_schedule_deadlocks_on_data_dependencies():
    # Rank 0 wants the gradient of microbatch 0 before sending microbatch 1;
    # rank 1 wants microbatch 1 before it will do microbatch 0.
    lists = [
        [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        [Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)],
    ]
    compute_only = Schedule(lists, n_ranks=2, n_microbatches=2, n_stages=2)
    assert rejection(compute_only) == (
        "deadlock with buffered sends (isend), no rank can go on: "
        "rank 0 at position 1 on 0B0 waits for 1B0 on rank 1 (rank 1 is stuck at position 0 on 1F1); "
        "rank 1 at position 0 on 1F1 waits for 0F1 on rank 0 (rank 0 is stuck at position 1 on 0B0)"
    )
    assert rejection(add_communication(compute_only)).startswith("deadlock with buffered sends")


def test_1f1b_deadlocks_only_with_blocking_sends():
    # Why Megatron fuses "send forward, receive backward" into one exchange.
    schedule = build("1f1b", 2, 2)
    validate(schedule)
    assert rejection(schedule, blocking_sends=True) == (
        "deadlock with blocking sends, no rank can go on: "
        "rank 0 at position 3 on 0SEND_F1 waits for 1RECV_F1 on rank 1 "
        "(rank 1 is stuck at position 3 on 1SEND_B0); "
        "rank 1 at position 3 on 1SEND_B0 waits for 0RECV_B0 on rank 0 "
        "(rank 0 is stuck at position 3 on 0SEND_F1)"
    )


def test_gpipe_runs_with_blocking_sends():
    validate(build("gpipe", 4, 6), blocking_sends=True)


# ---------------------------------------------------------------- theory


class UniformCosts:
    """The protocol theory() reads (pplab.Costs has it): a cost per kind, the same on every stage."""

    def __init__(self, forward=1.0, input_grad=1.0, weight_grad=1.0, transfer=0.0, stage_scale=None):
        self.times = {F: forward, B: input_grad + weight_grad, I: input_grad, W: weight_grad}
        self.transfer = transfer
        self.stage_scale = stage_scale or {}

    def compute_time(self, kind, stage):
        return self.times[kind] * self.stage_scale.get(stage, 1.0)

    def transfer_time(self, stage):
        return self.transfer


def simulated_bubble(schedule, costs):
    """Idle over step time on all ranks: each rank runs its compute in order as soon as inputs exist."""
    compute = schedule.compute_only().actions
    present = {a for acts in compute for a in acts}
    last = schedule.n_stages - 1

    def gradient(stage, mb):
        split = Action(stage, I, mb)
        return split if split in present else Action(stage, B, mb)

    def inputs(a):
        s, mb = a.stage, a.microbatch
        if a.kind == F:
            return [Action(s - 1, F, mb)] if s > 0 else []
        if a.kind in (B, I):
            return [Action(s, F, mb)] + ([gradient(s + 1, mb)] if s < last else [])
        return [Action(s, I, mb)]

    finished, free, busy, next_index = {}, [0.0] * len(compute), [0.0] * len(compute), [0] * len(compute)
    moved = True
    while moved:
        moved = False
        for rank, acts in enumerate(compute):
            while next_index[rank] < len(acts) and all(x in finished for x in inputs(acts[next_index[rank]])):
                action = acts[next_index[rank]]
                start = max([free[rank]] + [finished[x] for x in inputs(action)])
                duration = costs.compute_time(action.kind, action.stage)
                finished[action] = free[rank] = start + duration
                busy[rank] += duration
                next_index[rank] += 1
                moved = True
    assert next_index == [len(acts) for acts in compute]
    step = max(free)
    return sum(step - b for b in busy) / (step * len(compute))


def test_theory_known_numbers():
    gpipe = theory(build("gpipe", 4, 8))
    assert gpipe.bubble_fraction == pytest.approx(3 / 11)
    assert gpipe.bubble_formula == "(p-1)/(m+p-1) = 3/11"
    assert gpipe.peak_inflight == (8, 8, 8, 8)
    one_f_one_b = theory(build("1f1b", 4, 8))
    assert one_f_one_b.bubble_fraction == pytest.approx(3 / 11)
    assert one_f_one_b.peak_inflight == (4, 3, 2, 1)
    assert theory(build("1f1b", 4, 2)).peak_inflight == (2, 2, 2, 1)
    assert theory(build("interleaved-1f1b", 4, 8, 2)).bubble_fraction == pytest.approx(3 / 19)
    # Default costs F=1, I=W=1: (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)) = 3/27.
    assert theory(build("zb-h1", 4, 8)).bubble_fraction == pytest.approx(3 / 27)
    assert theory(build("zb-h1", 4, 8)).peak_inflight == (4, 4, 4, 4)


def test_theory_peak_inflight_formulas():
    expected = {
        "gpipe": lambda p, m, v, r: m,
        "1f1b": lambda p, m, v, r: min(p - r, m),
        "interleaved-1f1b": lambda p, m, v,
        r: min(v * m, (v - 1) * (m // max(1, m // p)) + 2 * (p - 1 - r) + 1),
        "zb-h1": lambda p, m, v, r: min(p, m),
    }
    for name, formula in expected.items():
        for p, m, v in sizes(name, max_ranks=5, max_microbatches=10):
            if name == "interleaved-1f1b" and not interleaved_accepts(p, m):
                continue
            got = theory(build(name, p, m, v)).peak_inflight
            assert got == tuple(formula(p, m, v, r) for r in range(p)), (name, p, m, v)


@pytest.mark.parametrize("forward, backward", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_theory_bubble_equals_simulation(forward, backward):
    costs = UniformCosts(forward, backward / 2, backward / 2)
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        for p, m, v in sizes(name, max_ranks=5, max_microbatches=10):
            if name == "interleaved-1f1b" and m % p:
                continue
            expected = theory(build(name, p, m, v), costs).bubble_fraction
            assert simulated_bubble(build(name, p, m, v), costs) == pytest.approx(expected), (name, p, m, v)


@pytest.mark.parametrize("forward, input_grad, weight_grad",
                         [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (3, 2, 2)])
def test_zb_h1_bubble_equals_simulation_under_its_conditions(forward, input_grad, weight_grad):
    costs = UniformCosts(forward, input_grad, weight_grad)
    for p in range(1, 6):
        for m in range(p, 11):
            schedule = build("zb-h1", p, m)
            result = theory(schedule, costs)
            assert result.bubble_fraction is not None
            assert simulated_bubble(schedule, costs) == pytest.approx(result.bubble_fraction), (p, m)
            if p > 1:
                assert result.bubble_fraction < theory(build("1f1b", p, m), costs).bubble_fraction


@pytest.mark.parametrize(
    "costs, p, m, condition",
    [
        (UniformCosts(1, 1, 2), 4, 8, "the formula needs W <= F and W <= I, here F=1, I=1, W=2"),
        (UniformCosts(1, 2, 1.5), 4, 8, "the formula needs W <= F and W <= I, here F=1, I=2, W=1.5"),
        (UniformCosts(), 4, 3, "the formula needs n_microbatches >= n_ranks, here m=3 < p=4"),
    ],
)
def test_zb_h1_gives_no_number_outside_its_conditions(costs, p, m, condition):
    schedule = build("zb-h1", p, m)
    result = theory(schedule, costs)
    assert result.bubble_fraction is None
    assert result.conditions == condition
    # The formula would indeed be wrong there.
    f, i, w = (costs.compute_time(k, 0) for k in (F, I, W))
    formula = (p - 1) * (f + i - w) / (m * (f + i + w) + (p - 1) * (f + i - w))
    assert simulated_bubble(schedule, costs) != pytest.approx(formula)


def test_theory_gives_no_number_without_a_closed_form():
    interleaved = theory(build("interleaved-1f1b", 4, 10, 2))
    assert interleaved.bubble_fraction is None
    assert "needs n_microbatches a multiple of n_ranks, here m=10, p=4" in interleaved.conditions
    uneven = theory(build("1f1b", 4, 8), UniformCosts(stage_scale={3: 2.0}))
    assert uneven.bubble_fraction is None
    assert "the cost of F, B differs between stages" in uneven.conditions
    with_latency = theory(build("gpipe", 4, 8), UniformCosts(transfer=0.1))
    assert with_latency.bubble_fraction is None
    assert "transfer time" in with_latency.conditions


def test_theory_recognises_schedules_by_order_not_name():
    # 1F1B's compute order, hand-edited: the first rank runs GPipe-style.
    text = [" ".join(str(a) for a in acts) for acts in build("1f1b", 2, 3).compute_only().actions]
    text[0] = "0F0 0F1 0F2 0B0 0B1 0B2"
    edited = from_text(text, name="1f1b")
    result = theory(edited)
    assert result.bubble_fraction is None
    assert result.conditions.startswith("no closed form")
    assert result.peak_inflight == (3, 1)
    renamed = from_text([" ".join(str(a) for a in acts) for acts in build("gpipe", 3, 4).actions],
                        name="mine")
    assert theory(renamed).bubble_fraction == pytest.approx(2 / 6)


def test_theory_rejects_an_invalid_schedule():
    with pytest.raises(ScheduleError):
        theory(from_text(["0B0 0F0"]))


# ---------------------------------------------------------------- torch's plans


def forwards_renumbered(actions, shift):
    return [Action(a.stage, a.kind, a.microbatch + shift) if a.kind == F else a for a in actions]


@pytest.mark.parametrize(
    "ours, theirs, virtual",
    [("gpipe", "GPipe", 1), ("interleaved-1f1b", "Interleaved1F1B", 2),
     ("interleaved-1f1b", "Interleaved1F1B", 3)],
)
def test_compute_order_matches_torch(ours, theirs, virtual):
    compared = 0
    for p in range(1, 5):
        for m in range(1, 13):
            if ours == "interleaved-1f1b" and not interleaved_accepts(p, m):
                # Both refuse the same sizes.
                with pytest.raises(ValueError, match="torch cannot plan"):
                    from_torch(theirs, p, m, virtual)
                with pytest.raises(ValueError):
                    build(ours, p, m, virtual)
                continue
            torch_plan = from_torch(theirs, p, m, virtual)
            validate(torch_plan)
            ours_built = build(ours, p, m, virtual).compute_only()
            assert torch_plan.compute_only().actions == ours_built.actions, (p, m)
            compared += 1
    assert compared >= 35


def test_torch_1f1b_plan_has_a_known_defect_on_its_last_rank():
    """torch 2.13 numbers the last rank's forwards 1..m; everything else matches ours.

    This fails when torch fixes its plan (then compare it like the others).
    """
    for p in range(2, 5):
        for m in range(p, 13):
            ours = build("1f1b", p, m).compute_only().actions
            torch_plan = from_torch("1F1B", p, m)
            theirs = torch_plan.compute_only().actions
            assert theirs[:-1] == ours[:-1], (p, m)
            assert list(theirs[-1]) == forwards_renumbered(ours[-1], +1), (p, m)
            last = p - 1
            assert rejection(torch_plan) == (
                f"rank {last} action {last}B0 at position 1 (counting compute actions only): "
                f"backward of microbatch 0 on stage "
                f"{last} comes before its forward {last}F0, which is not in the schedule"
            )


def test_torch_1f1b_refuses_fewer_microbatches_than_ranks_but_the_schedule_exists():
    with pytest.raises(ValueError, match="must be greater than or equal to the number of stages"):
        from_torch("1F1B", 4, 3)
    validate(build("1f1b", 4, 3))


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_torch_v_shape_schedules_validate(name):
    for p in range(1, 5):
        for m in range(2 * p, 2 * p + 4):
            schedule = from_torch(name, p, m, 2)
            assert tuple(schedule.stage_to_rank(s) for s in range(2 * p)) == v_placement(p)
            kinds = {a.kind for acts in schedule.actions for a in acts}
            assert {I, W} <= kinds
            assert p == 1 or {Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B} <= kinds
            validate(schedule)
            validate(schedule, blocking_sends=True)


@pytest.mark.parametrize("name, virtual",
                         [("InterleavedZeroBubble", 2), ("InterleavedZeroBubble", 3), ("LoopedBFS", 2)])
def test_other_torch_schedules_validate(name, virtual):
    for p, m in [(1, 3), (2, 4), (3, 6), (4, 8), (4, 5)]:
        validate(from_torch(name, p, m, virtual), blocking_sends=True)


def test_the_table_of_torch_schedules_agrees_with_torch():
    from torch.distributed.pipelining import schedules as torch_schedules

    assert list(TORCH_SCHEDULES)[:3] == ["gpipe", "1f1b", "interleaved-1f1b"]
    for name, entry in TORCH_SCHEDULES.items():
        torch_class = torch_schedules.get_schedule_class(entry.torch_name)
        assert entry.name == name and schedule_name(torch_class.__name__) == name
        assert entry.multi_stage == issubclass(torch_class, torch_schedules.PipelineScheduleMulti), name
        # torch's class name works too
        plan = from_torch(entry.torch_name, 2, 4, entry.fewest_stages_per_rank)
        assert plan.name == name
        assert (plan.placement == v_placement(2)) == entry.v_shaped, name
        assert plan.n_virtual == entry.fewest_stages_per_rank


@pytest.mark.parametrize(
    "args, message",
    [
        (("Nope", 2, 4), "unknown schedule 'Nope': known schedules are gpipe, 1f1b, interleaved-1f1b, "
                         "zb-h1, looped-bfs, interleaved-zero-bubble, zbv-zero-bubble, dualpipev"),
        (("Interleaved1F1B", 2, 4, 1), "torch's interleaved-1f1b runs several stages per rank: "
                                       "use n_virtual=2 or more"),
        (("GPipe", 2, 4, 2), "torch's gpipe runs one stage per rank: use n_virtual=1"),
        (("DualPipeV", 4, 4, 2), "torch cannot plan dualpipev for n_ranks=4, n_microbatches=4, n_virtual=2"),
        (("ZBVZeroBubble", 2, 4, 3), "torch's zbv-zero-bubble places exactly 2 stages per rank (a V): use "
                                     "n_virtual=2, got n_virtual=3"),
        (("zb-h1", 2, 4), "torch has no zb-h1 schedule: torch runs gpipe, 1f1b, "
                          "interleaved-1f1b, looped-bfs"),
        (("PipelineScheduleMulti", 2, 4, 2), "unknown schedule 'PipelineScheduleMulti'"),
        (("GPipe", 2, 0), "n_microbatches=0 must be at least 1"),
    ],
)
def test_from_torch_rejects_bad_input(args, message):
    with pytest.raises(ValueError) as error:
        from_torch(*args)
    assert message in str(error.value)


def test_theory_gives_no_textbook_number_when_messages_are_moved():
    from pplab.planning.simulator import simulate

    # GPipe's compute order, but rank 0 sends both activations only after both forwards.
    late_sends = from_text(["0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                                     "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"])
    validate(late_sends)
    assert simulate(late_sends).bubble_fraction() == pytest.approx(0.4)   # not 1/3
    assert theory(late_sends).bubble_fraction is None
    assert "messages are not those of" in theory(late_sends).conditions


def test_positions_in_errors_are_those_of_the_hand_written_compute_order():
    with pytest.raises(ScheduleError, match=r"rank 1 action 1B0 at position 0 \(counting compute actions "
                                            r"only\): backward of microbatch 0 on stage 1 comes before its "
                                            r"forward 1F0, which comes later, at position 1"):
        validate(from_text(["0F0 0B0", "1B0 1F0"]))
    with pytest.raises(ScheduleError, match="already ran as 0B0 at position 1: use "
                                            "either B or the pair I and W"):
        validate(from_text(["0F0 0B0 0I0 0W0", "1F0 1B0"]))


def test_measured_costs_within_one_percent_count_as_the_same():
    from pplab.planning.simulator import Costs

    schedule = build("1f1b", 2, 4)
    noisy = theory(schedule, Costs(forward=[0.0501, 0.0500], backward=[0.1, 0.1002]))
    assert noisy.bubble_fraction == pytest.approx(1 / 5, rel=1e-3)
    uneven = theory(schedule, Costs(forward=[0.0525, 0.0500], backward=0.1))
    assert uneven.bubble_fraction is None and "differs between stages (by more than 1%)" in uneven.conditions
    assert "needs every stage to have the same costs" in uneven.conditions
