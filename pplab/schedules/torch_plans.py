"""`from_torch`: the plans torch.distributed.pipelining makes, imported as pplab schedules.

torch is imported inside the function only, so that `pplab.schedules` stays pure Python.
"""

from __future__ import annotations

from pplab.arguments import check_positive_int
from pplab.schedules.actions import Action, Kind
from pplab.schedules.communication import add_communication
from pplab.schedules.schedule import Schedule, from_lists


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

    check_positive_int("n_ranks", n_ranks)
    check_positive_int("n_microbatches", n_microbatches)
    check_positive_int("n_virtual", n_virtual, example=2)
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
    schedule = from_lists(actions, n_microbatches, None, f"torch {name}")
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
