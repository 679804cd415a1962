"""`validate`: is a schedule sound? Every dependency met in order, messages matched, no deadlock.

`check_runnable`: can ranks run it? (They move data only where it has sends and receives.)
"""

from __future__ import annotations

from pplab.schedules.actions import Action, Kind
from pplab.schedules.compiled import SEND_F, B, Compiled, F, I, W, compile_schedule, no_cyclic_gc, peer_stages
from pplab.schedules.dependencies import Dependencies, Need
from pplab.schedules.schedule import DeadlockError, Schedule, ScheduleError


def validate(schedule: Schedule, blocking_sends: bool = False, deadlock: bool = True) -> None:
    """Raise ScheduleError at the first broken rule; return None for a sound schedule.

    The rules, checked in this order:

    1. each action, rank by rank and position by position: its stage and
       microbatch exist, its stage lives on this rank, it is no duplicate,
       and what it needs from its own rank (see `pplab.schedules.dependencies`)
       came earlier: a forward after the forward of the previous stage when
       both are here, a backward after its forward and after the gradient of
       the next stage, ``W`` after its ``I``, a send after the compute that
       produces it, and, in a schedule with communication, each compute after
       the receive of its input;
    2. each send and receive goes between neighbour stages on different
       ranks and has its partner on the peer's rank;
    3. every (stage, microbatch) has one forward and one backward, either
       ``B`` or the pair ``I`` and ``W``;
    4. no deadlock (`DeadlockError`): every rank runs its list in order, a
       receive waits for its send, and a send waits for nothing (buffered,
       like ``isend``) or, with ``blocking_sends=True``, for its receive. A
       schedule without any communication action is run as if data moved
       instantly. ``deadlock=False`` leaves this rule to a model of its own
       (`pplab.planning.streams`: messages on a transport's streams).
    """
    if not blocking_sends:
        with no_cyclic_gc():
            if _sound(compile_schedule(schedule)):
                return  # nothing to explain; a fault anywhere takes the readable path below
    if schedule.has_communication:
        # First the compute order alone, with positions as a hand-written compute order
        # reads (from_text inserts the messages), then with its messages.
        _check_each_action(schedule.compute_only(), " (counting compute actions only)")
    _check_each_action(schedule)
    _check_sends_meet_receives(schedule)
    _check_every_pass_present(schedule)
    if deadlock:
        _check_runs_to_the_end(schedule, blocking_sends)


# ---------------------------------------------------------------- 0. the verdict, fast


def _sound(compiled: Compiled | None) -> bool:
    """Rules 1-4 (buffered sends) on the integer form: True exactly when the readable checks
    pass, for every schedule that has an integer form (one without says False).

    Only the verdict: where this says no, the readable checks below find and explain the fault.
    Rule 1 on the lists with messages implies it on the compute order alone (a sublist with
    the same in-rank needs), so that pass is not repeated here. Of rule 2 only the neighbour
    test is left: a missing partner breaks another rule already (a receive without its send
    never runs, rule 4; a send without its receive leaves the receiving compute without its
    input, rule 1, that compute being there by rule 3).
    """
    if compiled is None:
        return False
    schedule, rank_of_stage = compiled.schedule, compiled.rank_of_stage
    n_stages, m = schedule.n_stages, schedule.n_microbatches
    # Per key (kind * n_stages + stage): the bases of the needs on the same rank; None where
    # the key cannot stand in a sound schedule (a need outside the pipeline, a message to a
    # missing neighbour or to the same rank).
    local_needs = [None if template is None else tuple(base for base, _, local in template if local)
                   for template in compiled.needs]
    peers = peer_stages(n_stages)
    for key in range(SEND_F * n_stages, len(local_needs)):  # the sends and receives
        peer = peers[key]
        if peer is None or rank_of_stage[peer] == rank_of_stage[key % n_stages]:
            local_needs[key] = None
    seen = bytearray(8 * n_stages * m)
    # 1. each action in its place: its rank, once, what it needs from its rank earlier
    for rank, rank_steps in enumerate(compiled.steps):
        for index, key, microbatch, _, stage in rank_steps:
            bases = local_needs[key]
            if bases is None or rank_of_stage[stage] != rank or seen[index]:
                return False
            for base in bases:
                if not seen[base + microbatch]:
                    return False
            seen[index] = 1
    # 3. every pass present: F, and B or both I and W (never B and I), for every stage and microbatch
    per_kind = n_stages * m
    block = lambda kind: int.from_bytes(seen[kind * per_kind:(kind + 1) * per_kind], "big")  # noqa: E731
    every = int.from_bytes(b"\x01" * per_kind, "big")
    forwards, backwards, input_grads = block(F), block(B), block(I)
    if forwards != every or backwards | (input_grads & block(W)) != every or backwards & input_grads:
        return False
    # 4. no deadlock: run every rank in order, a rank waiting on its first remote need
    return _runs_to_the_end(compiled)


def _runs_to_the_end(compiled: Compiled) -> bool:
    needs, steps = compiled.needs, compiled.steps
    remote = [next((base for base, _, local in template or () if not local), -1) for template in needs]
    done = bytearray(8 * compiled.schedule.n_stages * compiled.schedule.n_microbatches)
    next_index = [0] * len(steps)
    waiting: dict[int, list[int]] = {}
    runnable = list(range(len(steps)))
    while runnable:
        rank = runnable.pop()
        rank_steps = steps[rank]
        position = next_index[rank]
        for position in range(position, len(rank_steps)):
            index, key, microbatch, _, _ = rank_steps[position]
            base = remote[key]
            if base >= 0 and not done[base + microbatch]:
                waiting.setdefault(base + microbatch, []).append(rank)
                break
            done[index] = 1
            if index in waiting:
                runnable += waiting.pop(index)
        else:
            position = len(rank_steps)
        next_index[rank] = position
    return all(next_index[rank] == len(rank_steps) for rank, rank_steps in enumerate(steps))


# ---------------------------------------------------------------- 1. each action in its place


def _first_positions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Where each action first appears, as (rank, position)."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for position, action in enumerate(acts):
            where.setdefault(action, (rank, position))
    return where


def _check_each_action(schedule: Schedule, counting: str = "") -> None:
    everywhere = _first_positions(schedule)
    rule = Dependencies(schedule)
    for rank, acts in enumerate(schedule.actions):
        earlier: dict[Action, int] = {}
        for position, action in enumerate(acts):
            why = _what_is_wrong(schedule, rank, action, earlier, everywhere, rule)
            if why:
                raise ScheduleError(f"rank {rank} action {action} at position {position}{counting}: {why}")
            earlier[action] = position


def _what_is_wrong(
    schedule: Schedule,
    rank: int,
    action: Action,
    earlier: dict[Action, int],
    everywhere: dict[Action, tuple[int, int]],
    rule: Dependencies,
) -> str | None:
    """Why ``action`` cannot be at this place in ``rank``'s list, or None."""
    stage, mb = action.stage, action.microbatch
    if not 0 <= stage < schedule.n_stages:
        return f"stage {stage} does not exist (stages are 0..{schedule.n_stages - 1})"
    if not 0 <= mb < schedule.n_microbatches:
        return f"microbatch {mb} does not exist (microbatches are 0..{schedule.n_microbatches - 1})"
    owner = schedule.stage_to_rank(stage)
    if owner != rank:
        return f"stage {stage} lives on rank {owner}, not on rank {rank}"
    if action in earlier:
        return f"duplicate: the same action is already at position {earlier[action]}"
    if action.kind in (Kind.B, Kind.I):
        other = Action(stage, Kind.I if action.kind == Kind.B else Kind.B, mb)
        if other in earlier:
            return (
                f"the backward of microbatch {mb} on stage {stage} already ran as {other} "
                f"at position {earlier[other]}: use either B or the pair I and W"
            )
    for need in rule.needs(action):
        if _lives_on(schedule, need, rank) and need.action not in earlier:
            whereabouts = _whereabouts(need.action, rank, everywhere)
            return f"{action.describe()} comes before {need.label} {need.action}, {whereabouts}"
    return None


def _lives_on(schedule: Schedule, need: Need, rank: int) -> bool:
    """True when the needed action belongs on ``rank`` (so it must come earlier in its list)."""
    stage = need.action.stage
    return 0 <= stage < schedule.n_stages and schedule.stage_to_rank(stage) == rank


def _whereabouts(action: Action, rank: int, everywhere: dict[Action, tuple[int, int]]) -> str:
    if action not in everywhere:
        return "which is not in the schedule"
    its_rank, position = everywhere[action]
    if its_rank != rank:
        return f"which is on rank {its_rank}"
    return f"which comes later, at position {position}"


# ---------------------------------------------------------------- 2. messages matched


def _check_sends_meet_receives(schedule: Schedule) -> None:
    # After the per-rank checks, so that a missing forward is reported as
    # such rather than as the receive its absence leaves unmatched.
    everywhere = _first_positions(schedule)
    for rank, acts in enumerate(schedule.actions):
        for position, action in enumerate(acts):
            if not action.is_comm:
                continue
            why = _comm_problem(schedule, rank, action, everywhere)
            if why:
                raise ScheduleError(f"rank {rank} action {action} at position {position}: {why}")


def _comm_problem(
    schedule: Schedule, rank: int, action: Action, everywhere: dict[Action, tuple[int, int]]
) -> str | None:
    peer = action.peer_stage
    direction = "send to" if action.is_send else "receive from"
    if not 0 <= peer < schedule.n_stages:
        return f"stage {action.stage} has no neighbour stage {peer} to {direction}"
    peer_rank = schedule.stage_to_rank(peer)
    if peer_rank == rank:
        return (
            f"stages {action.stage} and {peer} are both on rank {rank}: they share "
            f"memory, so nothing is sent between them"
        )
    partner = action.partner()
    if partner not in everywhere:
        role = "receive" if action.is_send else "send"
        return f"no matching {role} {partner} on rank {peer_rank}"
    return None


# ---------------------------------------------------------------- 3. every pass present


def _check_every_pass_present(schedule: Schedule) -> None:
    present = set(a for acts in schedule.actions for a in acts)
    for rank in range(schedule.n_ranks):
        for stage in schedule.stages_of(rank):
            for mb in range(schedule.n_microbatches):
                missing = _missing_passes(stage, mb, present)
                if missing:
                    raise ScheduleError(
                        f"rank {rank} never runs {missing}: every microbatch needs, on every "
                        f"stage, a forward F and a backward (B, or the pair I and W)"
                    )


def _missing_passes(stage: int, mb: int, present: set[Action]) -> str | None:
    forward, full = Action(stage, Kind.F, mb), Action(stage, Kind.B, mb)
    split = Action(stage, Kind.I, mb), Action(stage, Kind.W, mb)
    if forward not in present:
        return str(forward)
    if full in present:
        return None
    absent = [str(a) for a in split if a not in present]
    if len(absent) == 2:
        return f"{full} (nor {split[0]} and {split[1]})"
    return absent[0] if absent else None


# ---------------------------------------------------------------- 4. no deadlock


def _check_runs_to_the_end(schedule: Schedule, blocking_sends: bool) -> None:
    rule = Dependencies(schedule)
    next_index = _run_until_stuck(schedule, rule, blocking_sends)
    stuck = [r for r, acts in enumerate(schedule.actions) if next_index[r] < len(acts)]
    if stuck:
        mode = "blocking sends" if blocking_sends else "buffered sends (isend)"
        waits = "; ".join(_describe_wait(schedule, rule, r, next_index, blocking_sends) for r in stuck)
        raise DeadlockError(f"deadlock with {mode}, no rank can go on: {waits}")


def _run_until_stuck(schedule: Schedule, rule: Dependencies, blocking_sends: bool) -> list[int]:
    """Run every rank's list in order; return where each rank stops (its length if it finished)."""
    next_index = [0] * schedule.n_ranks
    done: set[Action] = set()
    moved = True
    while moved:
        moved = False
        for rank, acts in enumerate(schedule.actions):
            while next_index[rank] < len(acts):
                action = acts[next_index[rank]]
                awaited = _awaited(schedule, rule, rank, action, blocking_sends)
                if blocking_sends and action.is_send:
                    if not _head_is(schedule, next_index, awaited):
                        break
                    # A blocking send and its receive complete together.
                    next_index[schedule.stage_to_rank(awaited.stage)] += 1
                    done.add(awaited)
                elif awaited is not None and awaited not in done:
                    break
                done.add(action)
                next_index[rank] += 1
                moved = True
    return next_index


def _awaited(schedule: Schedule, rule: Dependencies, rank: int, action: Action,
             blocking_sends: bool) -> Action | None:
    """The action on another rank that ``action`` waits for, or None.

    What it needs from its own rank came earlier (rule 1); a blocking send
    waits for its receive, which no dependency says: it is how the send is made.
    """
    if blocking_sends and action.is_send:
        return action.partner()
    remote = [need.action for need in rule.needs(action) if not _lives_on(schedule, need, rank)]
    return remote[0] if remote else None


def _head_is(schedule: Schedule, next_index: list[int], action: Action) -> bool:
    rank = schedule.stage_to_rank(action.stage)
    acts = schedule.actions[rank]
    return next_index[rank] < len(acts) and acts[next_index[rank]] == action


def _describe_wait(schedule: Schedule, rule: Dependencies, rank: int, next_index: list[int],
                   blocking_sends: bool) -> str:
    action = schedule.actions[rank][next_index[rank]]
    awaited = _awaited(schedule, rule, rank, action, blocking_sends)
    other = schedule.stage_to_rank(awaited.stage)
    if next_index[other] < len(schedule.actions[other]):
        state = f"stuck at position {next_index[other]} on {schedule.actions[other][next_index[other]]}"
    else:
        state = "finished"
    return (
        f"rank {rank} at position {next_index[rank]} on {action} waits for "
        f"{awaited} on rank {other} (rank {other} is {state})"
    )


# ---------------------------------------------------------------- runnable on real ranks


def check_runnable(schedule: Schedule) -> None:
    """Raise a ValueError if data crosses ranks with no send and receive to carry it.

    `validate` and `simulate` read such a schedule as if data moved by itself;
    ranks cannot: they move tensors only where the schedule says so.
    """
    rule = Dependencies(schedule)
    for acts in schedule.actions:
        for action in acts:
            crossing = next((need for need in rule.needs(action) if need.transfer is not None), None)
            if crossing is not None:
                raise ValueError(
                    f"schedule {schedule.name!r} has no sends and receives, but {action} needs "
                    f"{crossing.action} from rank {schedule.stage_to_rank(crossing.action.stage)}: "
                    f"ranks move data only where the schedule says; add them with "
                    f"pplab.schedules.add_communication(schedule)")
