"""Pipeline schedules as plain data: actions, schedules, a validator and the theory.

A schedule says, for every rank, the ordered list of actions that rank runs:
compute actions (forward ``F``, full backward ``B``, or the zero-bubble split
of ``B`` into the input-gradient backward ``I`` and the weight-gradient ``W``)
and the communication actions that move activations forward (``SEND_F`` /
``RECV_F``) and gradients backward (``SEND_B`` / ``RECV_B``).

Every action has a compact text form, the same as torch's ``_Action``:
``2F0`` is stage 2 running the forward of microbatch 0, ``1SEND_F3`` is stage 1
sending the activation of microbatch 3 to stage 2.

Pure Python: this module imports torch only inside :func:`from_torch`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that is malformed, violates a dependency or can deadlock."""


# --------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------


class Kind(str, enum.Enum):
    """What an action does; the values are torch's text forms."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble paper's name for the input-gradient pass
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})

# Which neighbour a communication action talks to: activations flow to the
# next stage, gradients to the previous one.
_PEER_OFFSET = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}

# Longest names first so that "SEND_F" is not read as "S..." and "F".
_ACTION_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of ``stage`` for ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form, e.g. ``"2F0"`` or ``"1SEND_F3"``."""
        match = _ACTION_PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: write <stage><kind><microbatch>, "
                f"e.g. '2F0' or '1SEND_F3', with kind one of "
                f"{', '.join(k.value for k in Kind)}"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for sends and receives."""
        return self.kind in COMM_KINDS

    @property
    def peer_stage(self) -> int | None:
        """The stage a send goes to or a receive comes from; None for compute."""
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset


# --------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------


@dataclass
class Schedule:
    """Per-rank ordered action lists for a pipeline of ``n_stages`` stages.

    Stage ``s`` lives on rank ``s % n_ranks`` (the loop placement of GPipe,
    1F1B and interleaved 1F1B) unless ``placement[s]`` says otherwise, as in
    the V-shape of ZBVZeroBubble and DualPipeV (stages 0..p-1 on ranks 0..p-1,
    then stages p..2p-1 back on ranks p-1..0).
    """

    actions: list[list[Action]]
    n_ranks: int
    n_microbatches: int
    n_stages: int
    n_virtual: int = 1
    name: str = "custom"
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.actions) != self.n_ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.actions)} action lists "
                f"for n_ranks={self.n_ranks}: give one list per rank"
            )
        if self.n_stages != self.n_ranks * self.n_virtual:
            raise ScheduleError(
                f"schedule {self.name!r}: n_stages={self.n_stages} must equal "
                f"n_ranks * n_virtual = {self.n_ranks} * {self.n_virtual}"
            )
        if self.placement is not None:
            self.placement = tuple(self.placement)
            _check_placement(self.placement, self.n_ranks, self.n_virtual)

    def stage_to_rank(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} is not in 0..{self.n_stages - 1}")
        if self.placement is None:
            return stage % self.n_ranks
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages that ``rank`` runs, in increasing order."""
        return [s for s in range(self.n_stages) if self.stage_to_rank(s) == rank]

    @classmethod
    def from_text(
        cls,
        per_rank: list[str],
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
        schedule = _schedule_from_lists(actions, n_microbatches, placement, name)
        if any(a.is_comm for rank_actions in actions for a in rank_actions):
            return schedule
        return add_communication(schedule)

    def compute_only(self) -> Schedule:
        """The same schedule without its communication actions."""
        return self._with_actions([[a for a in acts if a.is_compute] for acts in self.actions])

    def _with_actions(self, actions: list[list[Action]]) -> Schedule:
        return Schedule(
            actions,
            self.n_ranks,
            self.n_microbatches,
            self.n_stages,
            self.n_virtual,
            self.name,
            self.placement,
        )

    def __str__(self) -> str:
        # One column per rank, like torch's printout: p columns stay readable
        # however long the schedule is. Rows are positions, not time steps.
        header = (
            f"{self.name}: {self.n_ranks} ranks, {self.n_stages} stages, "
            f"{self.n_microbatches} microbatches"
        )
        columns = [[str(a) for a in acts] for acts in self.actions]
        width = max([len(t) for col in columns for t in col] + [len(f"rank {self.n_ranks - 1}")])
        depth = max(len(col) for col in columns)
        label_width = len(str(max(depth - 1, 0)))
        ranks_row = " ".join(f"rank {r}".ljust(width) for r in range(self.n_ranks)).rstrip()
        lines = [header, " " * label_width + " | " + ranks_row]
        for row in range(depth):
            cells = [col[row] if row < len(col) else "" for col in columns]
            lines.append(f"{row:>{label_width}} | " + " ".join(c.ljust(width) for c in cells).rstrip())
        return "\n".join(lines)


def _check_placement(placement: tuple[int, ...], n_ranks: int, n_virtual: int) -> None:
    for rank in range(n_ranks):
        held = [s for s, r in enumerate(placement) if r == rank]
        if len(held) != n_virtual:
            raise ScheduleError(
                f"placement {placement} puts stages {held} on rank {rank}: "
                f"every rank must hold n_virtual={n_virtual} stages"
            )
    strays = [r for r in placement if not 0 <= r < n_ranks]
    if strays:
        raise ScheduleError(f"placement {placement} names ranks {strays} outside 0..{n_ranks - 1}")


def _schedule_from_lists(
    actions: list[list[Action]],
    n_microbatches: int | None,
    placement: tuple[int, ...] | None,
    name: str,
) -> Schedule:
    """A Schedule whose sizes (and, if not given, placement) are read off ``actions``."""
    n_ranks = len(actions)
    if n_ranks == 0:
        raise ScheduleError("a schedule needs at least one rank (one action list)")
    every_action = [a for acts in actions for a in acts]
    if not every_action:
        raise ScheduleError("a schedule needs at least one action")
    n_stages = max(a.stage for a in every_action) + 1
    if n_microbatches is None:
        n_microbatches = max(a.microbatch for a in every_action) + 1
    if placement is None:
        placement = _placement_from_lists(actions, n_stages)
    if n_stages % n_ranks:
        raise ScheduleError(
            f"{n_stages} stages cannot be spread evenly over {n_ranks} ranks: "
            f"use a multiple of {n_ranks} stages"
        )
    loop = tuple(s % n_ranks for s in range(n_stages))
    return Schedule(
        actions,
        n_ranks,
        n_microbatches,
        n_stages,
        n_stages // n_ranks,
        name,
        None if tuple(placement) == loop else tuple(placement),
    )


def _placement_from_lists(actions: list[list[Action]], n_stages: int) -> tuple[int, ...]:
    """Each stage's rank: the one whose list mentions it (exactly one must)."""
    owner: dict[int, int] = {}
    for rank, acts in enumerate(actions):
        for a in acts:
            if owner.setdefault(a.stage, rank) != rank:
                raise ScheduleError(
                    f"stage {a.stage} appears on rank {owner[a.stage]} and on rank "
                    f"{rank} (action {a}): a stage lives on one rank; pass "
                    f"placement=... if you meant another layout"
                )
    missing = [s for s in range(n_stages) if s not in owner]
    if missing:
        raise ScheduleError(
            f"stages {missing} have no actions, so their rank is unknown: "
            f"give them actions or pass placement=..."
        )
    return tuple(owner[s] for s in range(n_stages))


# --------------------------------------------------------------------------
# Communication derived from computation
# --------------------------------------------------------------------------


def add_communication(
    schedule: Schedule | list[list[Action]],
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
    as in :meth:`Schedule.from_text`).
    """
    if not isinstance(schedule, Schedule):
        schedule = _schedule_from_lists(schedule, None, placement, "custom")
    return schedule._with_actions(
        [_with_communication(acts, schedule) for acts in schedule.actions]
    )


def _with_communication(rank_actions: list[Action], schedule: Schedule) -> list[Action]:
    result = []
    for action in rank_actions:
        if action.is_comm:
            continue
        result += _receives_before(action, schedule)
        result.append(action)
        result += _sends_after(action, schedule)
    return result


def _receives_before(action: Action, schedule: Schedule) -> list[Action]:
    stage, mb = action.stage, action.microbatch
    if action.kind == Kind.F and stage > 0:
        crossing = _crosses_ranks(schedule, stage, stage - 1)
        return [Action(stage, Kind.RECV_F, mb)] if crossing else []
    if action.kind in (Kind.B, Kind.I) and stage < schedule.n_stages - 1:
        crossing = _crosses_ranks(schedule, stage, stage + 1)
        return [Action(stage, Kind.RECV_B, mb)] if crossing else []
    return []


def _sends_after(action: Action, schedule: Schedule) -> list[Action]:
    stage, mb = action.stage, action.microbatch
    if action.kind == Kind.F and stage < schedule.n_stages - 1:
        crossing = _crosses_ranks(schedule, stage, stage + 1)
        return [Action(stage, Kind.SEND_F, mb)] if crossing else []
    # The input gradient is what travels upstream, so it leaves after I, not W.
    if action.kind in (Kind.B, Kind.I) and stage > 0:
        crossing = _crosses_ranks(schedule, stage, stage - 1)
        return [Action(stage, Kind.SEND_B, mb)] if crossing else []
    return []


def _crosses_ranks(schedule: Schedule, stage: int, neighbour: int) -> bool:
    return schedule.stage_to_rank(stage) != schedule.stage_to_rank(neighbour)


# --------------------------------------------------------------------------
# The classic schedules
# --------------------------------------------------------------------------
# Each builder returns the compute order of every rank; build() adds the
# communication. p ranks, m microbatches, v stages per rank (loop placement:
# stage s on rank s % p).


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [
        [Action(r, Kind.F, mb) for mb in range(m)] + [Action(r, Kind.B, mb) for mb in range(m)]
        for r in range(p)
    ]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """Warm up with p-1-r forwards, then alternate one forward and one backward (PipeDream-Flush).

    torch's Schedule1F1B refuses m < p; the schedule is still well defined
    there (the warm-up is cut short at m forwards), so this one accepts it.
    """
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, Kind.F, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            order += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, k)]
        order += [Action(r, Kind.B, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return orders


def _microbatches_per_round(p: int, m: int) -> int:
    """How many microbatches go through a chunk before the next chunk, as torch counts them.

    Megatron's interleaved schedule needs m to be a multiple of p; torch
    relaxes that to rounds of m // rounds microbatches with rounds =
    max(1, m // p), which needs m to be a multiple of the number of rounds.
    """
    rounds = max(1, m // p)
    if m % rounds:
        fits = [k for k in range(max(1, m - p), m + p + 1) if k % max(1, k // p) == 0]
        raise ValueError(
            f"interleaved-1f1b with n_ranks={p} cannot use n_microbatches={m}: "
            f"it runs in {rounds} rounds of equal size, so n_microbatches must be a "
            f"multiple of {rounds}; nearby values that work: {fits}"
        )
    return m // rounds


def _interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021), with torch's round sizes."""
    per_round = _microbatches_per_round(p, m)
    orders = []
    for r in range(p):
        # Every extra chunk needs a round of forwards before the first
        # backward, and each hop away from the last rank two more.
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), v * m)
        forward_stages = [r + p * ((op // per_round) % v) for op in range(v * m)]
        backward_stages = [r + p * (v - 1 - (op // per_round) % v) for op in range(v * m)]
        next_mb = {Kind.F: [0] * (v * p), Kind.B: [0] * (v * p)}

        def take(kind: Kind, stage: int) -> Action:
            mb = next_mb[kind][stage]
            next_mb[kind][stage] += 1
            return Action(stage, kind, mb)

        order = [take(Kind.F, forward_stages[op]) for op in range(warmup)]
        for op in range(warmup, v * m):
            order.append(take(Kind.F, forward_stages[op]))
            order.append(take(Kind.B, backward_stages[op - warmup]))
        order += [take(Kind.B, backward_stages[op]) for op in range(v * m - warmup, v * m)]
        orders.append(order)
    return orders


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with B split into I and W.

    Rank r holds back its first r weight-gradient passes W and runs them at
    the end, where 1F1B would leave rank r idle; the last rank, which would
    idle longest, holds back the most.
    """
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, Kind.F, mb) for mb in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                order.append(Action(r, Kind.F, warmup + k))
            order.append(Action(r, Kind.I, k))
            if k >= r:
                order.append(Action(r, Kind.W, k - r))
        order += [Action(r, Kind.W, mb) for mb in range(max(0, m - r), m)]
        orders.append(order)
    return orders


_BUILDERS = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved_1f1b,
    "zb-h1": _zb_h1,
}
SCHEDULE_NAMES = tuple(_BUILDERS)


def build(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The named schedule for these sizes, with its communication."""
    _check_count("n_ranks", n_ranks)
    _check_count("n_microbatches", n_microbatches)
    _check_count("n_virtual", n_virtual)
    key = name.lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: known schedules are {', '.join(SCHEDULE_NAMES)}")
    if key == "interleaved-1f1b" and n_virtual < 2:
        raise ValueError(
            f"interleaved-1f1b needs n_virtual >= 2 stages per rank, got n_virtual={n_virtual}; "
            f"use n_virtual=2 or more, or '1f1b' for one stage per rank"
        )
    if key != "interleaved-1f1b" and n_virtual != 1:
        raise ValueError(
            f"{key} runs one stage per rank, got n_virtual={n_virtual}; "
            f"use n_virtual=1, or 'interleaved-1f1b' for several stages per rank"
        )
    compute = _BUILDERS[key](n_ranks, n_microbatches, n_virtual)
    schedule = Schedule(compute, n_ranks, n_microbatches, n_ranks * n_virtual, n_virtual, key)
    return add_communication(schedule)


def _check_count(what: str, value: int) -> None:
    # bool is an int in Python, but build("1f1b", True, 4) is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be a whole number, got {value!r}; pass e.g. {what}=4")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def validate(schedule: Schedule, blocking_sends: bool = False) -> None:
    """Raise ScheduleError at the first broken rule; return None for a sound schedule.

    The rules, checked in this order:

    1. each action, rank by rank and position by position: its stage and
       microbatch exist, its stage lives on this rank, it is no duplicate,
       and what it needs from its own rank came earlier (a forward after the
       forward of the previous stage when both are here, a backward after its
       forward and after the gradient of the next stage, ``W`` after its
       ``I``, a send after the compute that produces it, and, in a schedule
       with communication, each compute after the receive of its input);
    2. each send and receive goes between neighbour stages on different
       ranks and has its partner on the peer's rank;
    3. every (stage, microbatch) has one forward and one backward, either
       ``B`` or the pair ``I`` and ``W``;
    4. no deadlock: every rank runs its list in order, a receive waits for
       its send, and a send waits for nothing (buffered, like ``isend``) or,
       with ``blocking_sends=True``, for its receive. A schedule without any
       communication action is run as if data moved instantly.
    """
    if _has_comm(schedule):
        # First the compute order alone, with positions as a hand-written compute order
        # reads (from_text inserts the messages), then with its messages.
        _check_each_action(schedule.compute_only(), " (counting compute actions only)")
    _check_each_action(schedule)
    _check_sends_meet_receives(schedule)
    _check_every_pass_present(schedule)
    _check_runs_to_the_end(schedule, blocking_sends)


def _first_positions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Where each action first appears, as (rank, position)."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for position, action in enumerate(acts):
            where.setdefault(action, (rank, position))
    return where


def _has_comm(schedule: Schedule) -> bool:
    return any(a.is_comm for acts in schedule.actions for a in acts)


def _check_each_action(schedule: Schedule, counting: str = "") -> None:
    everywhere = _first_positions(schedule)
    with_comm = _has_comm(schedule)
    for rank, acts in enumerate(schedule.actions):
        earlier: dict[Action, int] = {}
        for position, action in enumerate(acts):
            why = _what_is_wrong(schedule, rank, action, earlier, everywhere, with_comm)
            if why:
                raise ScheduleError(f"rank {rank} action {action} at position {position}{counting}: {why}")
            earlier[action] = position


def _what_is_wrong(
    schedule: Schedule,
    rank: int,
    action: Action,
    earlier: dict[Action, int],
    everywhere: dict[Action, tuple[int, int]],
    with_comm: bool,
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
    for needed, label in _local_needs(schedule, action, everywhere, with_comm):
        if needed not in earlier:
            whereabouts = _whereabouts(needed, rank, everywhere)
            return f"{_describe(action)} comes before {label} {needed}, {whereabouts}"
    return None


def _whereabouts(action: Action, rank: int, everywhere: dict[Action, tuple[int, int]]) -> str:
    if action not in everywhere:
        return "which is not in the schedule"
    its_rank, position = everywhere[action]
    if its_rank != rank:
        return f"which is on rank {its_rank}"
    return f"which comes later, at position {position}"


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
    direction = "send to" if action.kind in (Kind.SEND_F, Kind.SEND_B) else "receive from"
    if not 0 <= peer < schedule.n_stages:
        return f"stage {action.stage} has no neighbour stage {peer} to {direction}"
    peer_rank = schedule.stage_to_rank(peer)
    if peer_rank == rank:
        return (
            f"stages {action.stage} and {peer} are both on rank {rank}: they share "
            f"memory, so nothing is sent between them"
        )
    partner = _partner(action)
    if partner not in everywhere:
        role = "receive" if direction == "send to" else "send"
        return f"no matching {role} {partner} on rank {peer_rank}"
    return None


def _partner(action: Action) -> Action:
    """The receive that matches a send, or the send that matches a receive."""
    kind = {
        Kind.SEND_F: Kind.RECV_F,
        Kind.RECV_F: Kind.SEND_F,
        Kind.SEND_B: Kind.RECV_B,
        Kind.RECV_B: Kind.SEND_B,
    }[action.kind]
    return Action(action.peer_stage, kind, action.microbatch)


def _gradient_pass(stage: int, mb: int, everywhere: dict[Action, tuple[int, int]]) -> Action:
    """The action that produces the input gradient of ``stage``: its I if it has one, else its B."""
    split = Action(stage, Kind.I, mb)
    return split if split in everywhere else Action(stage, Kind.B, mb)


def _local_needs(
    schedule: Schedule,
    action: Action,
    everywhere: dict[Action, tuple[int, int]],
    with_comm: bool,
) -> list[tuple[Action, str]]:
    """What ``action`` needs earlier on its own rank, each with a label for messages."""
    stage, kind, mb = action.stage, action.kind, action.microbatch
    last = schedule.n_stages - 1
    needs = []
    if kind == Kind.F and stage > 0:
        if not _crosses_ranks(schedule, stage, stage - 1):
            needs.append((Action(stage - 1, Kind.F, mb), "the forward of the previous stage"))
        elif with_comm:
            needs.append((Action(stage, Kind.RECV_F, mb), "the receive of its input"))
    elif kind in (Kind.B, Kind.I):
        needs.append((Action(stage, Kind.F, mb), "its forward"))
        if stage < last and not _crosses_ranks(schedule, stage, stage + 1):
            needs.append((_gradient_pass(stage + 1, mb, everywhere), "the backward of the next stage"))
        elif stage < last and with_comm:
            needs.append((Action(stage, Kind.RECV_B, mb), "the receive of its output gradient"))
    elif kind == Kind.W:
        needs.append((Action(stage, Kind.I, mb), "its input-gradient pass"))
    elif kind == Kind.SEND_F:
        needs.append((Action(stage, Kind.F, mb), "its forward"))
    elif kind == Kind.SEND_B:
        needs.append((_gradient_pass(stage, mb, everywhere), "its backward"))
    return needs


_DESCRIPTIONS = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.I: "input-gradient pass",
    Kind.W: "weight-gradient pass",
    Kind.SEND_F: "send of the activation",
    Kind.RECV_F: "receive of the activation",
    Kind.SEND_B: "send of the gradient",
    Kind.RECV_B: "receive of the gradient",
}


def _describe(action: Action) -> str:
    return f"{_DESCRIPTIONS[action.kind]} of microbatch {action.microbatch} on stage {action.stage}"


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


def _check_runs_to_the_end(schedule: Schedule, blocking_sends: bool) -> None:
    next_index = _run_until_stuck(schedule, blocking_sends)
    stuck = [r for r, acts in enumerate(schedule.actions) if next_index[r] < len(acts)]
    if stuck:
        mode = "blocking sends" if blocking_sends else "buffered sends (isend)"
        waits = "; ".join(_describe_wait(schedule, r, next_index, blocking_sends) for r in stuck)
        raise ScheduleError(f"deadlock with {mode}, no rank can go on: {waits}")


def _run_until_stuck(schedule: Schedule, blocking_sends: bool) -> list[int]:
    """Run every rank's list in order; return where each rank stops (its length if it finished)."""
    next_index = [0] * schedule.n_ranks
    done: set[Action] = set()
    everywhere = _first_positions(schedule)
    with_comm = _has_comm(schedule)
    moved = True
    while moved:
        moved = False
        for rank, acts in enumerate(schedule.actions):
            while next_index[rank] < len(acts):
                action = acts[next_index[rank]]
                awaited = _awaited(schedule, action, everywhere, with_comm, blocking_sends)
                if blocking_sends and action.is_comm:
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


def _awaited(
    schedule: Schedule,
    action: Action,
    everywhere: dict[Action, tuple[int, int]],
    with_comm: bool,
    blocking_sends: bool,
) -> Action | None:
    """The action on another rank that ``action`` waits for, or None.

    Everything it needs from its own rank came earlier (checked before).
    """
    if action.is_comm:
        is_send = action.kind in (Kind.SEND_F, Kind.SEND_B)
        return None if is_send and not blocking_sends else _partner(action)
    if with_comm:
        return None
    # Without communication actions, a compute waits directly for its producer.
    stage, mb = action.stage, action.microbatch
    if action.kind == Kind.F and stage > 0 and _crosses_ranks(schedule, stage, stage - 1):
        return Action(stage - 1, Kind.F, mb)
    if (
        action.kind in (Kind.B, Kind.I)
        and stage < schedule.n_stages - 1
        and _crosses_ranks(schedule, stage, stage + 1)
    ):
        return _gradient_pass(stage + 1, mb, everywhere)
    return None


def _head_is(schedule: Schedule, next_index: list[int], action: Action) -> bool:
    rank = schedule.stage_to_rank(action.stage)
    acts = schedule.actions[rank]
    return next_index[rank] < len(acts) and acts[next_index[rank]] == action


def _describe_wait(schedule: Schedule, rank: int, next_index: list[int], blocking_sends: bool) -> str:
    action = schedule.actions[rank][next_index[rank]]
    awaited = _awaited(schedule, action, _first_positions(schedule), _has_comm(schedule), blocking_sends)
    other = schedule.stage_to_rank(awaited.stage)
    if next_index[other] < len(schedule.actions[other]):
        state = f"stuck at position {next_index[other]} on {schedule.actions[other][next_index[other]]}"
    else:
        state = "finished"
    return (
        f"rank {rank} at position {next_index[rank]} on {action} waits for "
        f"{awaited} on rank {other} (rank {other} is {state})"
    )


# --------------------------------------------------------------------------
# Theory
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Theory:
    """The textbook numbers of a schedule.

    ``bubble_fraction`` is idle time over total step time, summed over all
    ranks (``sum idle_r / (p * step)``); it is None when no closed form holds
    for this schedule and these costs, and ``conditions`` says why.
    ``peak_inflight[r]`` is the most activation sets (one stage, one
    microbatch) rank r holds at once: a forward holds its activations until
    its backward ``B`` ends or, when the backward is split, until its ``W``
    ends (W still reads the saved layer inputs).
    """

    bubble_fraction: float | None
    bubble_formula: str
    conditions: str
    peak_inflight: tuple[int, ...]
    peak_inflight_formula: str


_DEFAULT_COSTS = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
_UNIFORM = "every stage has the same costs and communication takes no time"

_PEAK_FORMULAS = {
    "gpipe": "m on every rank",
    "1f1b": "min(p - r, m) on rank r",
    "interleaved-1f1b": (
        "min(v*m, (v-1)*k + 2*(p-1-r) + 1) on rank r, with k microbatches per round "
        "(k = p when p divides m: Megatron's (v-1)*p + 2*(p-1-r) warm-up forwards, plus one)"
    ),
    "zb-h1": (
        "min(p, m) on every rank: as 1F1B until the input-gradient pass I, "
        "but rank r defers r weight passes W, which keep their activations"
    ),
}


def theory(schedule: Schedule, costs=None) -> Theory:
    """Bubble fraction and peak in-flight activations, from the textbook formulas.

    ``costs`` is a ``pplab.Costs`` (anything with ``compute_time(kind, stage)``
    and ``transfer_time(stage)``); None means F=1, B=2, I=W=1, no
    communication time. The schedule is recognised by its compute order, not
    its name, so an edited "1f1b" gets no 1F1B number. The peak in-flight
    counts are exact for any valid schedule: they follow from the order alone.
    """
    validate(schedule)
    recognised = _recognise(schedule)
    bubble, formula, conditions = _bubble(schedule, recognised, costs)
    return Theory(
        bubble_fraction=bubble,
        bubble_formula=formula,
        conditions=conditions,
        peak_inflight=_peak_inflight(schedule),
        peak_inflight_formula=_PEAK_FORMULAS.get(recognised, "counted from the schedule's order"),
    )


def _recognise(schedule: Schedule) -> str | None:
    """The name of the classic schedule with this compute order and its messages, if any.

    Moving a send later (or a receive earlier) than `add_communication` puts it can make
    ranks wait longer, so such a schedule gets no textbook number.
    """
    if schedule.placement is not None:
        return None
    if _has_comm(schedule) and add_communication(schedule).actions != schedule.actions:
        return None
    mine = schedule.compute_only().actions
    for name in SCHEDULE_NAMES:
        try:
            candidate = build(name, schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual)
        except ValueError:
            continue
        if candidate.compute_only().actions == mine:
            return name
    return None


def _peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for action in acts:
            if action.kind == Kind.F:
                held += 1
                peak = max(peak, held)
            elif action.kind in (Kind.B, Kind.W):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def _bubble(schedule: Schedule, recognised: str | None, costs) -> tuple[float | None, str, str]:
    """(bubble fraction or None, formula as text, conditions) for a recognised schedule."""
    p, m, v = schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual
    if recognised is None:
        return None, "none", (
            "no closed form: the compute order and messages are not those of "
            f"{', '.join(SCHEDULE_NAMES)} for these sizes; simulate it (pplab.simulate)"
        )
    cost, why_not = _uniform_costs(schedule, costs)
    if recognised in ("gpipe", "1f1b"):
        formula = f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
        if why_not:
            return None, formula, f"the formula needs {_UNIFORM}, but {why_not}"
        return (p - 1) / (m + p - 1), formula, f"{_UNIFORM}; any ratio of F to B"
    if recognised == "interleaved-1f1b":
        formula = f"(p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1}"
        if m % p:
            return None, formula, (
                f"Megatron's formula needs n_microbatches a multiple of n_ranks, "
                f"here m={m}, p={p}; simulate it (pplab.simulate)"
            )
        if why_not:
            return None, formula, f"the formula needs {_UNIFORM}, but {why_not}"
        return (p - 1) / (v * m + p - 1), formula, f"{_UNIFORM}; m a multiple of p; F and B per stage"
    return _zb_h1_bubble(p, m, cost, why_not)


def _zb_h1_bubble(
    p: int, m: int, cost: dict[Kind, float], why_not: str | None
) -> tuple[float | None, str, str]:
    """ZB-H1's bubble from Qi et al. 2023: (p-1)(F+I-W) idle on every rank.

    The backward reaches rank 0 after (p-1) input-gradient passes I instead of
    (p-1) full backwards, and the deferred W passes fill the tail, so each
    rank idles (p-1)(F+I-W) instead of 1F1B's (p-1)(F+I+W). That holds when
    every deferred W fits in the gap it fills (W <= F and W <= I) and the
    warm-up is full (m >= p); checked against an event simulation in the tests.
    """
    formula = "(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))"
    if why_not:
        return None, formula, f"the formula needs {_UNIFORM}, but {why_not}"
    f, i, w = cost[Kind.F], cost[Kind.I], cost[Kind.W]
    if m < p:
        return None, formula, f"the formula needs n_microbatches >= n_ranks, here m={m} < p={p}"
    here = f"F={f:g}, I={i:g}, W={w:g}"
    if w > f or w > i:
        return None, formula, f"the formula needs W <= F and W <= I, here {here}"
    idle = (p - 1) * (f + i - w)
    conditions = f"m >= p, W <= F and W <= I (here {here}); {_UNIFORM}"
    return idle / (m * (f + i + w) + idle), formula, conditions


def _uniform_costs(schedule: Schedule, costs) -> tuple[dict[Kind, float], str | None]:
    """The per-kind cost shared by all stages, or a reason why there is none."""
    if costs is None:
        return _DEFAULT_COSTS, None
    stages = range(schedule.n_stages)
    used = {a.kind for acts in schedule.actions for a in acts if a.is_compute}
    per_kind = {k: {costs.compute_time(k, s) for s in stages} for k in _DEFAULT_COSTS if k in used}
    varying = [k.value for k, values in per_kind.items() if len(values) > 1]
    if varying:
        return {}, f"the cost of {', '.join(varying)} differs between stages"
    if any(costs.transfer_time(s) > 0 for s in stages):
        return {}, "the costs give messages a transfer time"
    return {k: values.pop() for k, values in per_kind.items()}, None


# --------------------------------------------------------------------------
# torch's plans
# --------------------------------------------------------------------------

# torch actions that move no pipeline data: FSDP parameter sharding and the
# final gradient reduction. They have no place in a pplab schedule.
_TORCH_BOOKKEEPING = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})


def from_torch(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """Import the plan torch.distributed.pipelining makes for schedule ``name``.

    ``name`` is what torch's ``get_schedule_class`` takes ("GPipe", "1F1B",
    "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV"); ``n_virtual`` is torch's stages per rank (1 for GPipe and
    1F1B, 2 or more for the others). No process group is needed. Torch's
    sends and receives are kept where its planner makes them (multi-stage
    schedules); otherwise :func:`add_communication` adds ours. Overlapped
    F+B actions (DualPipeV) are split into their F and B, in order. The plan
    is imported as torch makes it, defects included: run :func:`validate`.
    """
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    _check_count("n_ranks", n_ranks)
    _check_count("n_microbatches", n_microbatches)
    _check_count("n_virtual", n_virtual)
    schedule_class = torch_schedules.get_schedule_class(name)
    multi_stage = issubclass(schedule_class, torch_schedules.PipelineScheduleMulti)
    if multi_stage and n_virtual < 2:
        raise ValueError(f"torch's {name} runs several stages per rank: use n_virtual=2 or more")
    if not multi_stage and n_virtual != 1:
        raise ValueError(f"torch's {name} runs one stage per rank: use n_virtual=1")
    try:
        plan = get_schedule_ops(name, n_ranks, n_microbatches, n_virtual, with_comms=multi_stage)
    except Exception as error:  # torch reports bad sizes with several exception types
        raise ValueError(
            f"torch cannot plan {name} for n_ranks={n_ranks}, n_microbatches={n_microbatches}, "
            f"n_virtual={n_virtual}: {error}"
        ) from error
    actions = [[a for step in rank_plan for a in _from_torch_action(step)] for rank_plan in plan]
    schedule = _schedule_from_lists(actions, n_microbatches, None, f"torch {name}")
    return schedule if multi_stage else add_communication(schedule)


def _from_torch_action(torch_action) -> list[Action]:
    """The pplab actions for one torch ``_Action`` (none for idle slots and bookkeeping)."""
    if torch_action is None:
        return []
    kind = torch_action.computation_type.value
    if kind == "OVERLAP_F_B":
        return [a for sub in torch_action.sub_actions for a in _from_torch_action(sub)]
    if kind in _TORCH_BOOKKEEPING:
        return []
    return [Action(torch_action.stage_index, Kind(kind), torch_action.microbatch_index)]
