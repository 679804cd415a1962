"""The one dependency rule, checked against an independent oracle: where every value is made and used.

The oracle knows nothing of `Dependencies`: it lists, for each action, the values
it makes and the values it uses, each at a rank (an activation, the gradient of a
stage's input, a message on the wire), and finds each used value's maker in the
schedule. The rule must name exactly those makers, with a transfer time exactly
where a value crosses ranks without a message.
"""

import dataclasses

import pytest

from pplab.models.llama import LlamaConfig
from pplab.planning import simulator
from pplab.rank.rank_pipeline import PipelineSpec
from pplab.schedules import (
    SCHEDULE_NAMES,
    Action,
    DeadlockError,
    Dependencies,
    Kind,
    Schedule,
    ScheduleError,
    build,
    check_runnable,
    from_text,
    from_torch,
    validate,
)
from pplab.schedules.compiled import KINDS, boundaries, compile_schedule, peer_stages

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W


def made(action, rank_of):
    """(value, rank) pairs an action makes."""
    s, k, mb = action.stage, action.kind, action.microbatch
    here = rank_of(s)
    return {
        F: [(("activation", s, mb), here), (("saved", s, mb), here)],
        B: [(("input gradient", s, mb), here)],
        I: [(("input gradient", s, mb), here), (("weight gradient pending", s, mb), here)],
        W: [],
        Kind.SEND_F: [(("wire activation", s, mb), None)],
        Kind.SEND_B: [(("wire gradient", s, mb), None)],
        Kind.RECV_F: [(("activation", s - 1, mb), here)],
        Kind.RECV_B: [(("input gradient", s + 1, mb), here)],
    }[k]


def used(action, rank_of, last):
    """(value, rank) pairs an action uses."""
    s, k, mb = action.stage, action.kind, action.microbatch
    here = rank_of(s)
    if k == F:
        return [(("activation", s - 1, mb), here)] if s > 0 else []
    if k in (B, I):
        gradient = [(("input gradient", s + 1, mb), here)] if s < last else []
        return [(("saved", s, mb), here)] + gradient
    if k == W:
        return [(("weight gradient pending", s, mb), here)]
    if k == Kind.SEND_F:
        return [(("activation", s, mb), here)]
    if k == Kind.SEND_B:
        return [(("input gradient", s, mb), here)]
    return ([(("wire activation", s - 1, mb), None)] if k == Kind.RECV_F
            else [(("wire gradient", s + 1, mb), None)])


def oracle(schedule):
    """{action: {(maker, crosses ranks without a message)}} from the value flow alone."""
    rank_of, last = schedule.stage_to_rank, schedule.n_stages - 1
    makers = {}
    for acts in schedule.actions:
        for action in acts:
            for value, rank in made(action, rank_of):
                makers[(value, rank)] = action
    needs = {}
    for acts in schedule.actions:
        for action in acts:
            found = set()
            for value, rank in used(action, rank_of, last):
                if (value, rank) in makers:  # made where it is used (or on the wire)
                    found.add((makers[(value, rank)], False))
                else:  # no message in the lists: it comes from its maker's rank by itself
                    (maker,) = [a for (v, _), a in makers.items() if v == value]
                    found.add((maker, True))
            needs[action] = found
    return needs


def schedules_to_check():
    for name in SCHEDULE_NAMES:
        for p in (1, 2, 3, 4):
            for m in (1, 2, 4, 5, 8):
                try:
                    schedule = build(name, p, m, 2 if name == "interleaved-1f1b" else 1)
                except ValueError:
                    continue
                yield schedule
                yield schedule.compute_only()
    for name in ("zbv-zero-bubble", "dualpipev", "interleaved-zero-bubble"):
        schedule = from_torch(name, 2, 4, n_virtual=2)
        yield schedule
        yield schedule.compute_only()


def test_the_rule_names_exactly_what_the_value_flow_needs():
    checked = 0
    for schedule in schedules_to_check():
        rule = Dependencies(schedule)
        for action, expected in oracle(schedule).items():
            got = {(need.action, need.transfer is not None) for need in rule.needs(action)}
            assert got == expected, (schedule.name, str(action))
            checked += 1
    assert checked > 5000


def test_the_integer_form_reads_the_one_rule_of_placement_and_of_where_a_message_goes():
    """compiled.py asks the rules once per (kind, stage); its tables must say what the rules say
    action by action: each stage's rank, each message's peer stage, peer rank and boundary, and
    the message times and sizes the simulator takes from them."""
    checked = 0
    for schedule in schedules_to_check():
        compiled = compile_schedule(schedule)
        n_stages, m = schedule.n_stages, schedule.n_microbatches
        costs = simulator.Costs(latency=0.5, bandwidth=10.0,
                                activation_bytes=[3 + 4 * s for s in range(n_stages)],
                                link_contention=schedule.has_communication)
        if compiled is None:  # dualpipev runs B for some microbatches of a stage, I and W for others
            assert schedule.name == "dualpipev"
            continue
        assert compiled.rank_of_stage == tuple(schedule.stage_to_rank(s) for s in range(n_stages))
        peers, crossed = peer_stages(n_stages), boundaries(n_stages)
        _, _, hop = simulator._cost_tables(costs, n_stages)
        for key in range(len(KINDS) * n_stages):
            action = compiled.action(key * m)  # microbatch 0 of this (kind, stage)
            peer = action.peer_stage
            assert peers[key] == (peer if action.is_comm and 0 <= peer < n_stages else None), action
            assert crossed[key] == (action.boundary if action.is_comm else -1), action
            if action.is_comm and 0 <= action.boundary:
                assert hop[key] == costs.transfer_time(action.boundary), action
        for rank, steps in enumerate(compiled.steps):
            for index, key, _, _, _ in steps:
                action = compiled.action(index)
                if action.is_comm:
                    assert compiled.rank_of_stage[peers[key]] == schedule.peer_rank(action) != rank, action
                    checked += 1
        if schedule.has_communication:  # the fast events' bytes and times, against the readable simulation
            fast = simulator.simulate(schedule, costs)
            readable = simulator._Simulation(schedule, costs).run()
            assert sorted(fast.events, key=repr) == sorted(readable.events, key=repr), schedule.name
    assert checked > 2000


def test_check_runnable_refuses_data_that_crosses_ranks_without_a_message():
    check_runnable(build("gpipe", 2, 2))
    check_runnable(build("interleaved-1f1b", 1, 2, 2).compute_only())  # one rank: nothing crosses
    with pytest.raises(ValueError) as error:
        check_runnable(build("gpipe", 2, 2).compute_only())
    assert str(error.value) == (
        "schedule 'gpipe' has no sends and receives, but 0B0 needs 1B0 from rank 1: ranks move data only "
        "where the schedule says; add them with pplab.schedules.add_communication(schedule)")


def test_a_transfer_names_the_boundary_that_is_crossed():
    rule = Dependencies(build("gpipe", 3, 2).compute_only())
    assert [need.transfer for need in rule.needs(Action(2, F, 1))] == [1]
    assert [need.transfer for need in rule.needs(Action(1, B, 1))] == [None, 1]


def test_schedules_are_immutable():
    schedule = build("1f1b", 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.name = "mine"
    with pytest.raises(AttributeError):
        schedule.actions[0].append(Action(0, F, 9))
    edited = Schedule([list(acts) for acts in schedule.actions], 2, 4, 2)
    assert edited.actions == schedule.actions and isinstance(edited.actions[0], tuple)
    assert hash(schedule) == hash(build("1f1b", 2, 4))  # usable as a key, e.g. for caches


def test_one_deadlock_error_for_validate_and_simulate():
    deadlock = from_text(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(DeadlockError):
        validate(deadlock)
    with pytest.raises(DeadlockError):
        simulator.simulate(deadlock)
    assert simulator.DeadlockError is DeadlockError and issubclass(DeadlockError, ScheduleError)


def test_a_pipeline_refuses_a_schedule_without_messages_before_any_rank_runs():
    with pytest.raises(ValueError, match=r"no sends and receives, but 0B0 needs 1B0 from rank 1: .*"
                                         r"add_communication\(schedule\)"):
        PipelineSpec.create(LlamaConfig.tiny(), build("gpipe", 2, 2).compute_only(), n_ranks=2)
