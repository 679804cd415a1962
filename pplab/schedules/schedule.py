"""The `Schedule` type: one ordered, immutable list of actions per rank, and where each stage lives.

Stage placement has its one home here: `Schedule.stage_to_rank` and `Schedule.stages_of`
answer for any schedule; `loop_placement` and `v_placement` spell out the two classic layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pplab.schedules.actions import Action


class ScheduleError(ValueError):
    """A schedule that is malformed, violates a dependency or can deadlock."""


class DeadlockError(ScheduleError):
    """The schedule stops with ranks waiting for data that never comes (from `validate` and `simulate`)."""


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for a pipeline of ``n_stages`` stages.

    Stage ``s`` lives on rank ``s % n_ranks`` (the loop placement of GPipe,
    1F1B and interleaved 1F1B) unless ``placement[s]`` says otherwise, as in
    the V-shape of ZBVZeroBubble and DualPipeV (stages 0..p-1 on ranks 0..p-1,
    then stages p..2p-1 back on ranks p-1..0).

    A schedule never changes once made: ``actions`` is a tuple of tuples, and
    every transformation (``compute_only``, ``add_communication``) returns a
    new schedule.

    ``stage_actions`` holds, per rank, torch's actions of a whole stage that a lowered schedule
    carries (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``: FSDP's gather and free, the gradients'
    reduction), each as (its position among the rank's actions, its text): pplab keeps them to
    write the file back, and takes them as free; a schedule made from other lists
    (``with_actions``) has none.
    """

    actions: tuple[tuple[Action, ...], ...]
    n_ranks: int
    n_microbatches: int
    n_stages: int
    n_virtual: int = 1
    name: str = "custom"
    placement: tuple[int, ...] | None = None
    stage_actions: tuple[tuple[tuple[int, str], ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
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
            object.__setattr__(self, "placement", tuple(self.placement))
            _check_placement(self.placement, self.n_ranks, self.n_virtual)
        if self.stage_actions is not None:
            stage_actions = tuple(tuple((int(at), str(text)) for at, text in of) for of in self.stage_actions)
            object.__setattr__(self, "stage_actions", stage_actions)
            if len(self.stage_actions) != self.n_ranks:
                raise ScheduleError(f"schedule {self.name!r} has stage actions for {len(self.stage_actions)} "
                                    f"ranks, not {self.n_ranks}")
            for rank, (actions, extra) in enumerate(zip(self.actions, stage_actions)):
                outside = [text for at, text in extra if not 0 <= at <= len(actions)]
                if outside:
                    raise ScheduleError(f"schedule {self.name!r}: rank {rank}'s stage actions {outside} "
                                        f"stand outside its {len(actions)} actions")

    def __getstate__(self) -> dict:
        # The integer form validate/simulate keep with a schedule is a cache: it does not travel.
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def stage_to_rank(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} is not in 0..{self.n_stages - 1}")
        if self.placement is None:
            return stage % self.n_ranks  # `loop_placement`, without making the tuple
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages that ``rank`` runs, in increasing order."""
        return [s for s in range(self.n_stages) if self.stage_to_rank(s) == rank]

    def same_rank(self, stage: int, other: int) -> bool:
        """True when ``stage`` and ``other`` live on one rank (they hand tensors over in memory)."""
        return self.stage_to_rank(stage) == self.stage_to_rank(other)

    def peer_rank(self, action: Action) -> int:
        """The rank at the other end of a send or receive."""
        return self.stage_to_rank(action.peer_stage)

    @property
    def has_communication(self) -> bool:
        """True when the lists hold sends and receives (else data is taken to move by itself)."""
        return any(a.is_comm for acts in self.actions for a in acts)

    def compute_only(self) -> Schedule:
        """The same schedule without its communication actions."""
        return self.with_actions([[a for a in acts if a.is_compute] for acts in self.actions])

    def with_actions(self, actions: Sequence[Sequence[Action]]) -> Schedule:
        """A schedule of the same sizes, name and placement with other action lists."""
        return Schedule(actions, self.n_ranks, self.n_microbatches, self.n_stages,
                        self.n_virtual, self.name, self.placement)

    def to_torch_csv(self, path, format: str = "compute_only") -> Path:
        """Write this schedule as torch's CSV, which torch's `_PipelineScheduleRuntime` and
        torchtitan (`pipeline_parallel_schedule_csv`) run: "compute_only" (torch adds the sends and
        receives) or "compute_comms" (this schedule's own order of them); the path written (see
        `pplab.schedules.torch_csv`)."""
        from pplab.schedules import write_torch_csv  # the package's, loaded after this module

        return write_torch_csv(self, path, format)

    @classmethod
    def from_torch_csv(cls, path, name: str | None = None, format: str = "compute_only") -> Schedule:
        """Read torch's CSV back as a schedule (`name`: the file's stem unless given): a
        "compute_only" file with pplab's sends and receives added, a "compute_comms" one with its
        own, where the file puts them."""
        from pplab.schedules import read_torch_csv  # the package's, loaded after this module

        return read_torch_csv(path, name, format)

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


def loop_placement(n_ranks: int, n_virtual: int = 1) -> tuple[int, ...]:
    """Each stage's rank when the stages loop over the ranks, s on rank s %
    n_ranks (GPipe, 1F1B, interleaved)."""
    return tuple(stage % n_ranks for stage in range(n_ranks * n_virtual))


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """Each stage's rank in a V: 0..p-1 on ranks 0..p-1, then p..2p-1 back on
    p-1..0 (ZBVZeroBubble, DualPipeV)."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


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


def from_lists(
    actions: Sequence[Sequence[Action]],
    n_microbatches: int | None = None,
    placement: tuple[int, ...] | None = None,
    name: str = "custom",
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
    loop = loop_placement(n_ranks, n_stages // n_ranks)
    return Schedule(
        actions,
        n_ranks,
        n_microbatches,
        n_stages,
        n_stages // n_ranks,
        name,
        None if tuple(placement) == loop else tuple(placement),
    )


def _placement_from_lists(actions: Sequence[Sequence[Action]], n_stages: int) -> tuple[int, ...]:
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
