"""Schedules as torch's CSV: the files torch's own runtime, and torchtitan, run.

torch 2.13 runs any schedule written down as a CSV, one row per rank of actions in torch's text
form (`0F0`, `1I0`, `1W0`, `0B1`, which is pplab's too; an empty cell is an idle slot), in one of
two formats (`_PipelineScheduleRuntime._load_csv(path, format=...)`; torchtitan's
`pipeline_parallel_schedule_csv` loads the first):

* "compute_only": the compute actions alone. torch lowers them to what it runs: it adds its sends
  and receives (`_add_send_recv`: each receive as early as it can be posted; with
  `defer_pp_recv=True`, later, in an order that alternates by rank), FSDP's unshard and reshard
  and the gradients' reduction. Reading such a file back adds pplab's sends and receives instead
  (each receive right before the compute that needs it, each send right after the compute that
  makes it).
* "compute_comms": what a rank runs, sends and receives included (`1SEND_F0`, `2RECV_B3`) and
  torch's actions of a whole stage (`0UNSHARD`, `0RESHARD`, `0REDUCE_GRAD`). torch runs it as
  written. pplab reads the sends and receives where the file puts them, and keeps the stage
  actions beside them (`Schedule.stage_actions`): free in pplab's model, written back in place.

`lowered_by_torch` asks torch's own lowering what its runtime will execute for a schedule, and
`check_torch_runs` whether it can run it at all, both on stand-in stages (no process group): the
same validation and lowering `_load_csv` does on the ranks, before any rank starts. Pure Python
otherwise: torch is imported only there.
"""

from __future__ import annotations

import csv
import re
import tempfile
from pathlib import Path

from pplab.schedules.actions import Action
from pplab.schedules.communication import add_communication
from pplab.schedules.schedule import Schedule, ScheduleError, from_lists
from pplab.schedules.validation import validate

__all__ = ["write_torch_csv", "read_torch_csv", "read_either_csv", "check_torch_runs", "lowered_by_torch",
           "FORMATS"]

FORMATS = ("compute_only", "compute_comms")

# torch's actions of a whole stage, in a lowered schedule: FSDP's gather and free of the stage's
# parameters, and the reduction of its gradients (each a no-op where there is nothing to do).
STAGE_ACTION = re.compile(r"(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)")
_TORCH_ONLY = re.compile(r"\d*(UNSHARD|RESHARD|REDUCE_GRAD|OVERLAP_F_B)\d*|\(.*\).*")


def write_torch_csv(schedule: Schedule, path, format: str = "compute_only") -> Path:
    """Write `schedule` as torch's CSV at `path` in `format` (see the module docstring); the path.

    The schedule is validated first (a ScheduleError names what is wrong). "compute_only" writes
    its compute actions and leaves the sends and receives to torch; "compute_comms" writes its own
    (pplab's, where it has none: `add_communication`) and its stage actions, or torch's where it
    has none (each stage unsharded before the rank's first action, its gradients reduced and
    resharded after its last)."""
    _check_format(format)
    validate(schedule)
    path = Path(path)
    if format == "compute_only":
        rows = [[str(action) for action in actions] for actions in schedule.compute_only().actions]
    else:
        rows = _rows_with_comms(schedule if schedule.has_communication else add_communication(schedule))
    with open(path, "w", newline="") as file:
        csv.writer(file).writerows(rows)
    return path


def _rows_with_comms(schedule: Schedule) -> list[list[str]]:
    """Each rank's actions as text, its stage actions back at their positions."""
    stage_actions = schedule.stage_actions or tuple(
        tuple([*((0, f"{stage}UNSHARD") for stage in schedule.stages_of(rank)),
               *((len(actions), f"{stage}{what}") for stage in schedule.stages_of(rank)
                 for what in ("REDUCE_GRAD", "RESHARD"))])
        for rank, actions in enumerate(schedule.actions))
    rows = []
    for actions, extra in zip(schedule.actions, stage_actions):
        row = []
        for at in range(len(actions) + 1):  # the stage actions before each action, in their order
            row += [text for where, text in extra if where == at]
            row += [str(actions[at])] if at < len(actions) else []
        rows.append(row)
    return rows


def read_torch_csv(path, name: str | None = None, format: str = "compute_only") -> Schedule:
    """The pplab Schedule of a torch CSV in `format` (`name`: the file's stem by default).

    Stage placement and the number of microbatches are read off the actions. A "compute_only"
    file gets pplab's sends and receives; a "compute_comms" file keeps its own where it puts them,
    and its stage actions (`Schedule.stage_actions`). Either runs, simulates and validates as any
    schedule. Raises a ScheduleError naming the row and cell of anything the format does not hold."""
    _check_format(format)
    path = Path(path)
    rows, stage_actions = [], []
    with open(path, newline="") as file:
        for rank, row in enumerate(csv.reader(file)):
            actions, extra = [], []
            for column, cell in enumerate(row):
                if not cell.strip():
                    continue
                if format == "compute_comms" and STAGE_ACTION.fullmatch(cell.strip()):
                    extra.append((len(actions), cell.strip()))
                else:
                    actions.append(_action(cell, path, rank, column, format))
            rows.append(actions)
            stage_actions.append(tuple(extra))
    if not rows:
        raise ScheduleError(f"{path}: the file is empty; torch's CSV has one row of actions per rank")
    try:
        schedule = from_lists(rows, name=name or path.stem)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: {error}") from error
    if format == "compute_only":
        return add_communication(schedule)
    return Schedule(schedule.actions, schedule.n_ranks, schedule.n_microbatches, schedule.n_stages,
                    schedule.n_virtual, schedule.name, schedule.placement, tuple(stage_actions))


def read_either_csv(path, name: str | None = None) -> Schedule:
    """A torch CSV in either format, told apart by its cells: with a send, a receive or a stage
    action it is read as "compute_comms" (its order kept, as torch runs it), else "compute_only"."""
    if not Path(path).is_file():
        raise ScheduleError(f"schedule {str(path)!r}: no such file (a schedule ending in .csv is read as "
                            "torch's CSV)")
    with open(path, newline="") as file:
        cells = [cell.strip() for row in csv.reader(file) for cell in row if cell.strip()]
    with_comms = any(STAGE_ACTION.fullmatch(cell) or re.fullmatch(r"\d+(SEND|RECV)_[FB]\d+", cell)
                     for cell in cells)
    return read_torch_csv(path, name, "compute_comms" if with_comms else "compute_only")


def _action(cell: str, path: Path, rank: int, column: int, format: str) -> Action:
    """One cell of a torch CSV as a pplab action, or a ScheduleError saying where and why."""
    where = f"{path}, row {rank + 1} (rank {rank}), cell {column + 1}"
    if _TORCH_ONLY.fullmatch(cell.strip()):
        if format == "compute_comms" or not STAGE_ACTION.fullmatch(cell.strip()):
            raise ScheduleError(f"{where}: {cell.strip()!r} is one of torch's actions pplab does not model "
                                "(an overlapped F and B, or a batch of actions): write them one by one")
        raise ScheduleError(f"{where}: {cell.strip()!r} is one of torch's own actions (FSDP's unshard or "
                            "reshard, gradient reduction), which a compute-only file does not hold: write F, "
                            "B, I and W, or read the file with format='compute_comms'")
    try:
        action = Action.parse(cell)
    except ValueError as error:
        raise ScheduleError(f"{where}: {error}") from error
    if format == "compute_only" and not action.is_compute:
        raise ScheduleError(f"{where}: {cell.strip()!r} is a send or receive; torch's compute-only CSV holds "
                            f"F, B, I and W only (torch adds the messages itself): read it with "
                            f"format='compute_comms'")
    return action


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: give one of {', '.join(map(repr, FORMATS))}, torch's two CSV "
                         f"formats")


def _stand_in_runtime(schedule: Schedule, defer_pp_recv: bool = False):
    """torch's `_PipelineScheduleRuntime` for `schedule`'s sizes on stand-in stages (no process group,
    no model): enough for torch to validate and lower a schedule as it will on the ranks."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, schedule.n_ranks, None
    stage.num_stages = schedule.n_stages
    return _PipelineScheduleRuntime([stage] * schedule.n_virtual, schedule.n_microbatches,
                                    defer_pp_recv=defer_pp_recv)


def check_torch_runs(schedule: Schedule) -> None:
    """Raise a ValueError, naming the action and why, unless torch's `_PipelineScheduleRuntime`
    can run `schedule`: torch validates the CSV and derives its sends and receives from it, here
    on stand-in stages, as it will on the ranks."""
    validate(schedule)
    runtime = _stand_in_runtime(schedule)
    with tempfile.TemporaryDirectory() as folder:
        path = write_torch_csv(schedule, Path(folder) / "schedule.csv")
        try:
            runtime._load_csv(str(path))
        except Exception as error:  # torch says why with AssertionError or RuntimeError
            said = str(error).split("\n\n")[0]
            raise ValueError(f"torch's runtime cannot run schedule {schedule.name!r}: {said}"
                             f"{_named_action(said, schedule)}") from error


def lowered_by_torch(schedule: Schedule, defer_pp_recv: bool = False) -> Schedule:
    """What torch's runtime will execute for `schedule`'s compute order: its own lowering (sends and
    receives where torch posts them, with `defer_pp_recv` as the runtime's flag; the stage actions),
    asked on stand-in stages and read back as a schedule that prints, draws, validates and simulates
    like any other. Raises a ValueError where torch cannot run the schedule."""
    check_torch_runs(schedule)
    runtime = _stand_in_runtime(schedule, defer_pp_recv)
    with tempfile.TemporaryDirectory() as folder:
        runtime._load_csv(str(write_torch_csv(schedule, Path(folder) / "compute_only.csv")))
        lowered = Path(folder) / "compute_comms.csv"
        runtime._dump_csv(str(lowered), format="compute_comms")
        said = "deferred receives" if defer_pp_recv else "receives posted early"
        return read_torch_csv(lowered, f"{schedule.name}, as torch lowers it ({said})", "compute_comms")


def _named_action(said: str, schedule: Schedule) -> str:
    """torch says 'Rank r, step s': the action that is, in pplab's words."""
    match = re.search(r"Rank (\d+), step (\d+)", said)
    if not match:
        return ""
    rank, step = int(match.group(1)), int(match.group(2))
    actions = schedule.compute_only().actions[rank] if rank < schedule.n_ranks else ()
    return (f" (rank {rank}'s action {actions[step]}: the {actions[step].describe()})" if step < len(actions)
            else "")
