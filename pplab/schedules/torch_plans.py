"""torch.distributed.pipelining's schedules: `TORCH_SCHEDULES`, the one table of their names and
stages per rank, and `from_torch`, their plans imported as pplab schedules.

torch is imported inside `from_torch` only, so that `pplab.schedules` stays pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from pplab.arguments import check_positive_int
from pplab.schedules.actions import Action, Kind
from pplab.schedules.communication import add_communication
from pplab.schedules.schedule import Schedule, from_lists


@dataclass(frozen=True)
class TorchPlan:
    """One of torch's schedules: the name pplab gives it, torch's name, and how many stages a rank runs."""

    name: str  # pplab's own where pplab builds the same schedule, else torch's class name without "Schedule"
    torch_name: str  # what torch's get_schedule_class takes
    multi_stage: bool  # several stages per rank (n_virtual >= 2), else exactly one
    v_shaped: bool = False  # exactly 2 stages per rank, rank r holding stages r and 2p-1-r (`v_placement`)
    built_by_pplab: bool = False  # pplab's builders make this very schedule, under `name`

    @property
    def fewest_stages_per_rank(self) -> int:
        """The smallest n_virtual torch runs it with."""
        return 2 if self.multi_stage else 1

    def check_n_virtual(self, n_virtual: int, called: str | None = None) -> None:
        """Raise a ValueError unless torch runs it with ``n_virtual`` stages per rank (``called``: the name given)."""
        called = self.name if called is None else called
        if self.multi_stage and n_virtual < 2:
            raise ValueError(f"torch's {called} runs several stages per rank: use n_virtual=2 or more")
        if self.v_shaped and n_virtual != 2:
            raise ValueError(f"torch's {called} places exactly 2 stages per rank (a V): use n_virtual=2, "
                             f"got n_virtual={n_virtual}")
        if not self.multi_stage and n_virtual != 1:
            raise ValueError(f"torch's {called} runs one stage per rank: use n_virtual=1, got n_virtual={n_virtual}")


# pplab's name -> torch's schedule, in the order pictures and searches list them.
TORCH_SCHEDULES = {plan.name: plan for plan in (
    TorchPlan("gpipe", "GPipe", multi_stage=False, built_by_pplab=True),
    TorchPlan("1f1b", "1F1B", multi_stage=False, built_by_pplab=True),
    TorchPlan("interleaved-1f1b", "Interleaved1F1B", multi_stage=True, built_by_pplab=True),
    TorchPlan("LoopedBFS", "LoopedBFS", multi_stage=True),
    TorchPlan("InterleavedZeroBubble", "InterleavedZeroBubble", multi_stage=True),
    TorchPlan("ZBVZeroBubble", "ZBVZeroBubble", multi_stage=True, v_shaped=True),
    TorchPlan("DualPipeV", "DualPipeV", multi_stage=True, v_shaped=True),
)}


def torch_plan(torch_name: str) -> TorchPlan | None:
    """The table's entry for a name torch's get_schedule_class takes (any case, as torch reads it); None if none."""
    return next((plan for plan in TORCH_SCHEDULES.values() if plan.torch_name.lower() == torch_name.lower()), None)


# torch actions that move no pipeline data: FSDP parameter sharding and the
# final gradient reduction. They have no place in a pplab schedule.
_TORCH_BOOKKEEPING = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})


def from_torch(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """Import the plan torch.distributed.pipelining makes for schedule ``name``.

    ``name`` is what torch's ``get_schedule_class`` takes ("GPipe", "1F1B",
    "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV": the ``torch_name``s of `TORCH_SCHEDULES`); ``n_virtual`` is
    torch's stages per rank (1 for GPipe and 1F1B, 2 for the V-shaped ones,
    2 or more for the others). No process group is needed. Torch's
    sends and receives are kept where its planner makes them (multi-stage
    schedules); otherwise :func:`add_communication` adds ours. Overlapped
    F+B actions (DualPipeV) are split into their F and B, in order. The plan
    is imported as torch makes it, defects included: run :func:`validate`.
    """
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    check_positive_int("n_ranks", n_ranks)
    check_positive_int("n_microbatches", n_microbatches)
    check_positive_int("n_virtual", n_virtual, example=2)
    torch_schedules.get_schedule_class(name)  # torch's own words for a name it does not know
    entry = torch_plan(name)
    if entry is None:
        raise ValueError(f"torch's {name} is not a schedule pplab imports: use one of "
                         f"{', '.join(plan.torch_name for plan in TORCH_SCHEDULES.values())}")
    entry.check_n_virtual(n_virtual, called=name)
    try:
        ops = get_schedule_ops(name, n_ranks, n_microbatches, n_virtual, with_comms=entry.multi_stage)
    except Exception as error:  # torch reports bad sizes with several exception types
        raise ValueError(
            f"torch cannot plan {name} for n_ranks={n_ranks}, n_microbatches={n_microbatches}, "
            f"n_virtual={n_virtual}: {error}"
        ) from error
    actions = [[a for step in rank_ops for a in _from_torch_action(step)] for rank_ops in ops]
    schedule = from_lists(actions, n_microbatches, None, f"torch {name}")
    return schedule if entry.multi_stage else add_communication(schedule)


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
