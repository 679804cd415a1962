"""Schedules as integers: the form `validate` and `simulate` loop over, a million actions a second.

Action ``(stage, kind, microbatch)`` becomes the index ``(kind * n_stages + stage) * m +
microbatch``, so a table over ``kind * n_stages + stage`` answers for every microbatch.
What an action needs still comes from the one rule (`Dependencies.needs`): it is asked once
per (kind, stage), for microbatch 0, and the answer is shifted to every microbatch (every
need of an action is of its own microbatch). That holds when each stage splits its backward
into I and W for all microbatches or for none. A schedule that mixes them, or has an action
outside its stages or microbatches, on another rank than its stage's, or a message with no
neighbour stage to go to, has no integer form (`compile_schedule` returns None) and takes
the readable path, which also explains every error.

Where a message goes comes from the one rule too (`message_peer`, `message_boundary` in
`actions`), asked once per (kind, stage) into the tables `peer_stages` and `boundaries`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
from dataclasses import dataclass

from pplab.schedules.actions import COMM_KINDS, Action, Kind, message_boundary, message_peer
from pplab.schedules.dependencies import Dependencies
from pplab.schedules.schedule import Schedule

KINDS = tuple(Kind)  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
CODE = {kind: code for code, kind in enumerate(KINDS)}
F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B = range(len(KINDS))
NO_NEED = -1


@dataclass(frozen=True)
class Compiled:
    """A schedule's integer form.

    ``steps[rank]`` lists the rank's actions in order as (index, key, microbatch, kind,
    stage). For ``key = kind * n_stages + stage``: ``needs[key]`` is a tuple of (base, transfer,
    lives_on_rank) per need, the need's index being ``base + microbatch``; ``transfer`` is
    the boundary whose message time comes on top (or -1); ``lives_on_rank`` says whether the
    needed action belongs on the same rank (rule 1 of `validate`). ``None`` stands where
    the rule names a stage that does not exist.
    """

    schedule: Schedule
    needs: tuple
    rank_of_stage: tuple[int, ...]
    steps: tuple[list[tuple[int, int, int, int, int]], ...]
    # per key: (base, transfer) of the first need and of the second, -1s where there is none
    first_two_needs: list[tuple[int, int, int, int]]

    @property
    def m(self) -> int:
        return self.schedule.n_microbatches

    def action(self, index: int) -> Action:
        """The Action an index stands for."""
        key, microbatch = divmod(index, self.m)
        kind, stage = divmod(key, self.schedule.n_stages)
        return Action(stage, KINDS[kind], microbatch)


@functools.lru_cache(maxsize=256)
def peer_stages(n_stages: int) -> tuple[int | None, ...]:
    """Per key: the stage a send or receive talks to; None for compute, or where that stage does not exist."""
    def existing(stage: int) -> int | None:
        return stage if 0 <= stage < n_stages else None

    return tuple(existing(message_peer(kind, stage)) if kind in COMM_KINDS else None
                 for kind in KINDS for stage in range(n_stages))


@functools.lru_cache(maxsize=256)
def boundaries(n_stages: int) -> tuple[int, ...]:
    """Per key: the boundary a send's or receive's message crosses; -1 for compute (and before stage 0)."""
    return tuple(message_boundary(kind, stage) if kind in COMM_KINDS else NO_NEED
                 for kind in KINDS for stage in range(n_stages))


@contextlib.contextmanager
def no_cyclic_gc():
    """Pause the cyclic garbage collector while the integer form is made and used: it makes a
    tuple per action, and the collector would scan them over and over (10 % of the time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_schedule(schedule: Schedule) -> Compiled | None:
    """The integer form, made once per schedule and kept with it; None where there is none."""
    cached = schedule.__dict__.get("_compiled", False)
    if cached is not False:
        return cached
    compiled = _compile(schedule)
    object.__setattr__(schedule, "_compiled", compiled)  # a Schedule never changes
    return compiled


def _compile(schedule: Schedule) -> Compiled | None:
    n_stages, m = schedule.n_stages, schedule.n_microbatches
    steps, input_grads, used = [], bytearray(n_stages * m), []
    for actions in schedule.actions:
        used.append(bytearray(len(KINDS) * n_stages))  # the keys this rank's actions have
        rank_steps = _steps(actions, n_stages, m, input_grads, used[-1])
        if rank_steps is None:
            return None
        steps.append(rank_steps)
    split = _split_stages(input_grads, n_stages, m)
    if split is None:
        return None
    talks = any(step[3] >= SEND_F for rank_steps in steps for step in rank_steps)  # has_communication
    shape = (schedule.n_ranks, n_stages, m, schedule.placement, frozenset(split), talks)
    if shape not in _NEEDS:
        if len(_NEEDS) > 256:
            _NEEDS.clear()
        _NEEDS[shape] = _needs(schedule, split, talks)
    needs, rank_of_stage, first_two, placeable = _NEEDS[shape]
    for rank, rank_used in enumerate(used):  # each action on its stage's rank, each with a form
        for key in itertools.compress(range(len(rank_used)), rank_used):
            if not placeable[key] or rank_of_stage[key % n_stages] != rank:
                return None
    return Compiled(schedule, needs, rank_of_stage, tuple(steps), first_two)


# What every (kind, stage) needs depends only on the schedule's shape: (ranks, stages,
# microbatches, placement, split stages, messages or not), the same for thousands of
# candidates in a search, so it is worked out once per shape.
_NEEDS: dict[tuple, tuple] = {}


def _needs(schedule: Schedule, split: set[int], talks: bool) -> tuple:
    """(needs per key, rank of each stage, the first two needs per key, whether each key has
    an integer form), from the rule asked for microbatch 0."""
    n_stages, m = schedule.n_stages, schedule.n_microbatches
    rank_of_stage = tuple(schedule.stage_to_rank(s) for s in range(n_stages))
    representatives = {Action(s, Kind.I, 0) for s in split}
    rule = Dependencies(schedule, with_communication=talks, present=representatives)
    needs = tuple(_template(rule, Action(stage, kind, 0), rank_of_stage, n_stages, m)
                  for kind in KINDS for stage in range(n_stages))
    # An action needs at most two others (its forward and its output's gradient).
    first_two = [(*(t[0][:2] if t else (-1, -1)), *(t[1][:2] if t and len(t) > 1 else (-1, -1)))
                 for t in needs]
    # A key has an integer form when its needs are all in the pipeline and, for a message,
    # its neighbour is (a send from stage 0 backwards, say, has no boundary to cross).
    peers, first_message = peer_stages(n_stages), SEND_F * n_stages
    placeable = [template is not None and (key < first_message or peers[key] is not None)
                 for key, template in enumerate(needs)]
    return needs, rank_of_stage, first_two, placeable


def _steps(actions, n_stages: int, m: int, input_grads: bytearray, used: bytearray) -> list[tuple] | None:
    """(index, key, microbatch, kind, stage) of each action; None if one is outside the pipeline.
    Marks ``used[key]`` for each action and ``input_grads[stage * m + microbatch]`` for each I."""
    steps = []
    append, code, first_i = steps.append, CODE, I * n_stages * m
    for action in actions:
        kind, stage, microbatch = code[action.kind], action.stage, action.microbatch
        if stage >= n_stages or microbatch >= m or stage < 0 or microbatch < 0:
            return None
        key = kind * n_stages + stage
        index = key * m + microbatch
        used[key] = 1
        append((index, key, microbatch, kind, stage))
        if kind == I:
            input_grads[index - first_i] = 1
    return steps


def _split_stages(input_grads: bytearray, n_stages: int, m: int) -> set[int] | None:
    """Stages that run I for every microbatch; None when a stage runs I for only some."""
    counts = [input_grads.count(1, s * m, (s + 1) * m) for s in range(n_stages)]
    if any(0 < c < m for c in counts):
        return None
    return {s for s, c in enumerate(counts) if c == m}


def _template(rule: Dependencies, action: Action, rank_of_stage, n_stages: int, m: int):
    """(base, transfer, lives on the action's rank) for each need of ``action``; None if a
    need names a stage that does not exist."""
    try:
        needs = rule.needs(action)
    except ValueError:  # the rule asked where a stage outside the pipeline lives
        return None
    template = []
    for need in needs:
        stage = need.action.stage
        if not 0 <= stage < n_stages:
            return None
        base = (CODE[need.action.kind] * n_stages + stage) * m
        transfer = NO_NEED if need.transfer is None else need.transfer
        template.append((base, transfer, rank_of_stage[stage] == rank_of_stage[action.stage]))
    return tuple(template)
