"""torch.distributed.pipelining's schedules: `TORCH_SCHEDULES`, the one table of their names and
stages per rank, and `from_torch`, their plans imported as pplab schedules.

torch is imported inside `from_torch` only, so that `pplab.schedules` stays pure Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pplab.base.arguments import check_positive_int
from pplab.schedules.actions import Action, Kind
from pplab.schedules.communication import add_communication
from pplab.schedules.names import SCHEDULE_NAMES, schedule_name
from pplab.schedules.schedule import Schedule, from_lists


@dataclass(frozen=True)
class TorchPlan:
    """One of torch's schedules: its canonical name, torch's class name, and how many stages a rank runs."""

    name: str  # canonical (pplab.schedules.names), as every listing shows it
    torch_name: str  # what torch's get_schedule_class takes
    multi_stage: bool  # several stages per rank (n_virtual >= 2), else exactly one
    v_shaped: bool = False  # exactly 2 stages per rank, rank r holding stages r and 2p-1-r (`v_placement`)

    @property
    def built_by_pplab(self) -> bool:
        """pplab's builders make this very schedule, under the same name."""
        return self.name in SCHEDULE_NAMES

    @property
    def fewest_stages_per_rank(self) -> int:
        """The smallest n_virtual torch runs it with."""
        return 2 if self.multi_stage else 1

    def check_n_virtual(self, n_virtual: int) -> None:
        """Raise a ValueError unless torch runs it with ``n_virtual`` stages per rank."""
        if self.multi_stage and n_virtual < 2:
            raise ValueError(f"torch's {self.name} runs several stages per rank: use n_virtual=2 or more")
        if self.v_shaped and n_virtual != 2:
            raise ValueError(f"torch's {self.name} places exactly 2 stages per rank (a V): use n_virtual=2, "
                             f"got n_virtual={n_virtual}")
        if not self.multi_stage and n_virtual != 1:
            raise ValueError(f"torch's {self.name} runs one stage per rank: use n_virtual=1, got "
                             f"n_virtual={n_virtual}")


# canonical name -> torch's schedule, in the order pictures and searches list them.
TORCH_SCHEDULES = {plan.name: plan for plan in (
    TorchPlan("gpipe", "GPipe", multi_stage=False),
    TorchPlan("1f1b", "1F1B", multi_stage=False),
    TorchPlan("interleaved-1f1b", "Interleaved1F1B", multi_stage=True),
    TorchPlan("looped-bfs", "LoopedBFS", multi_stage=True),
    TorchPlan("interleaved-zero-bubble", "InterleavedZeroBubble", multi_stage=True),
    TorchPlan("zbv-zero-bubble", "ZBVZeroBubble", multi_stage=True, v_shaped=True),
    TorchPlan("dualpipev", "DualPipeV", multi_stage=True, v_shaped=True),
)}


def torch_plan(name: str) -> TorchPlan:
    """The table's entry for any spelling of a schedule torch runs; a ValueError naming the others if none."""
    canonical = schedule_name(name)
    if canonical not in TORCH_SCHEDULES:
        raise ValueError(f"torch has no {canonical} schedule: torch runs {', '.join(TORCH_SCHEDULES)}")
    return TORCH_SCHEDULES[canonical]


# torch actions that move no pipeline data: FSDP parameter sharding and the
# final gradient reduction. They have no place in a pplab schedule.
_TORCH_BOOKKEEPING = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})


def from_torch(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """Import the plan torch.distributed.pipelining makes for schedule ``name``.

    ``name`` is any spelling of one of `TORCH_SCHEDULES` (torch's class name
    "ZBVZeroBubble" as well as "zbv-zero-bubble"), and the schedule takes its
    canonical name; ``n_virtual`` is torch's stages per rank (1 for gpipe and
    1f1b, 2 for the V-shaped ones, 2 or more for the others). No process group
    is needed. Torch's sends and receives are kept where its planner makes them
    (multi-stage schedules); otherwise :func:`add_communication` adds ours. Overlapped
    F+B actions (DualPipeV) are split into their F and B, in order. The plan
    is imported as torch makes it, defects included: run :func:`validate`.
    """
    check_positive_int("n_ranks", n_ranks)
    check_positive_int("n_microbatches", n_microbatches)
    check_positive_int("n_virtual", n_virtual, example=2)
    entry = torch_plan(name)
    entry.check_n_virtual(n_virtual)
    try:
        actions = _planned_actions(entry.torch_name, n_ranks, n_microbatches, n_virtual, entry.multi_stage)
    except Exception as error:  # torch reports bad sizes with several exception types
        raise ValueError(
            f"torch cannot plan {entry.name} for n_ranks={n_ranks}, n_microbatches={n_microbatches}, "
            f"n_virtual={n_virtual}: {error}"
        ) from error
    schedule = from_lists(actions, n_microbatches, None, entry.name)
    return schedule if entry.multi_stage else add_communication(schedule)


@functools.lru_cache(maxsize=256)
def _planned_actions(torch_name: str, n_ranks: int, n_microbatches: int, n_virtual: int,
                     with_comms: bool) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in torch's plan. Kept: torch plans on mock stages (about 50 ms a plan), and a
    search asks for the same few plans again and again."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(torch_name, n_ranks, n_microbatches, n_virtual, with_comms=with_comms)
    return tuple(tuple(a for step in rank_ops for a in _from_torch_action(step)) for rank_ops in ops)


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
