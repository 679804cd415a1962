"""The one dependency rule, checked against an independent oracle: where every value is made and used.

The oracle knows nothing of `Dependencies`: it lists, for each action, the values
it makes and the values it uses, each at a rank (an activation, the gradient of a
stage's input, a message on the wire), and finds each used value's maker in the
schedule. The rule must name exactly those makers, with a transfer time exactly
where a value crosses ranks without a message.
"""

import dataclasses

import pytest

from pplab.rank_pipeline import PipelineSpec
from pplab.model import LlamaConfig
from pplab.schedules import (SCHEDULE_NAMES, Action, DeadlockError, Dependencies, Kind, Schedule,
                             ScheduleError, build, from_torch, validate)
from pplab import simulator

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
    return [(("wire activation", s - 1, mb), None)] if k == Kind.RECV_F else [(("wire gradient", s + 1, mb), None)]


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
    for name in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
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
    deadlock = Schedule.from_text(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(DeadlockError):
        validate(deadlock)
    with pytest.raises(DeadlockError):
        simulator.simulate(deadlock)
    assert simulator.DeadlockError is DeadlockError and issubclass(DeadlockError, ScheduleError)


def test_a_pipeline_refuses_a_schedule_without_messages_before_any_rank_runs():
    with pytest.raises(ValueError, match=r"no sends and receives, but 0B0 needs 1B0 from rank 1: .*"
                                         r"add_communication\(schedule\)"):
        PipelineSpec.create(LlamaConfig.tiny(), build("gpipe", 2, 2).compute_only(), n_ranks=2)
