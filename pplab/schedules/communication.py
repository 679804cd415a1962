"""The communication pass: the sends and receives that a compute order implies."""

from __future__ import annotations

from typing import Sequence

from pplab.schedules.actions import Action, Kind
from pplab.schedules.dependencies import Dependencies
from pplab.schedules.schedule import Schedule, from_lists


def add_communication(
    schedule: Schedule | Sequence[Sequence[Action]],
    placement: tuple[int, ...] | None = None,
) -> Schedule:
    """Insert the sends and receives that the compute actions imply.

    Each receive goes right before the compute that needs it and each send
    right after the compute that produces it: the latest and the earliest
    moments that are correct, so a rank never waits on data it does not need
    yet, and a value leaves as soon as it exists. Neighbour stages on the
    same rank share memory and get no communication. Existing communication
    actions are dropped and derived afresh, so the pass is idempotent.
    A plain list of per-rank compute lists is accepted too (sizes inferred
    as in :func:`from_text`).
    """
    if not isinstance(schedule, Schedule):
        schedule = from_lists(schedule, None, placement, "custom")
    compute = schedule.compute_only()
    rule = Dependencies(compute, with_communication=True)
    return schedule.with_actions([_with_communication(acts, rule) for acts in compute.actions])


def from_text(
    per_rank: Sequence[str],
    n_microbatches: int | None = None,
    placement: tuple[int, ...] | None = None,
    name: str = "custom",
) -> Schedule:
    """Build a schedule from one line of text actions per rank.

    Sizes are inferred from the text; without ``placement`` each stage
    lives on the rank whose line mentions it. Communication actions are
    added (see :func:`add_communication`) when the text has none.
    """
    actions = [[Action.parse(word) for word in line.split()] for line in per_rank]
    schedule = from_lists(actions, n_microbatches, placement, name)
    return schedule if schedule.has_communication else add_communication(schedule)


def _with_communication(compute_actions: Sequence[Action], rule: Dependencies) -> list[Action]:
    result = []
    for action in compute_actions:
        result += [need.action for need in rule.needs(action) if need.action.is_comm]
        result.append(action)
        result += _sends_after(action, rule)
    return result


def _sends_after(action: Action, rule: Dependencies) -> list[Action]:
    """The sends whose data ``action`` produces, where that data leaves the rank."""
    schedule, stage, mb = rule.schedule, action.stage, action.microbatch
    candidates = []
    if stage < schedule.n_stages - 1:
        candidates.append(Action(stage, Kind.SEND_F, mb))
    if stage > 0:
        candidates.append(Action(stage, Kind.SEND_B, mb))
    return [send for send in candidates
            if not schedule.same_rank(stage, send.peer_stage)
            and rule.needs(send)[0].action == action]


# --- how a rank performs its list: the rule the runtime follows and the simulator models --------

def comm_batches(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """One rank's actions as the runtime performs them: each compute action alone, and each run of
    adjacent sends and receives as one batch, posted together (so no rank waits on a send that its
    peer has queued behind a receive of its own)."""
    steps: list[tuple[Action, ...]] = []
    for action in actions:
        if action.is_comm and steps and steps[-1][0].is_comm:
            steps[-1] += (action,)
        else:
            steps.append((action,))
    return steps


def receives_to_prepost(steps: Sequence[tuple[Action, ...]]) -> list[tuple[Action, ...]]:
    """For each of `comm_batches`' steps, the receives of the first batch after it: posted ahead,
    before each compute step that precedes that batch, once the batch before has ended (where the
    message's shape is known), so that a sender need not wait for its receiver to reach its turn."""
    upcoming: list[tuple[Action, ...]] = []
    receives: tuple[Action, ...] = ()
    for step in reversed(steps):
        upcoming.append(receives)
        if step[0].is_comm:
            receives = tuple(action for action in step if not action.is_send)
    return upcoming[::-1]
