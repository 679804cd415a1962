"""Schedules as torch's CSV: the file torch's own runtime, and torchtitan, run.

torch 2.13 runs any schedule written down as a CSV: `_PipelineScheduleRuntime._load_csv(path)`
(format "compute_only"), and torchtitan's `pipeline_parallel_schedule_csv` option loads the same
file. One row per rank holds its compute actions in order, each in torch's text form (`0F0`,
`1I0`, `1W0`, `0B1`, which is pplab's too); an empty cell is an idle slot. torch derives the
sends and receives itself, so a pplab schedule's own are not written, and reading a file back
adds pplab's (the same rule: each receive right before the compute that needs it, each send
right after the compute that makes it).

`check_torch_runs` asks torch whether its runtime can run a schedule, on stand-in stages (no
process group): the same validation and lowering `_load_csv` does on the ranks, before any rank
starts. Pure Python otherwise: torch is imported only there.
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

__all__ = ["write_torch_csv", "read_torch_csv", "check_torch_runs"]


def write_torch_csv(schedule: Schedule, path) -> Path:
    """Write `schedule`'s compute actions as torch's compute-only CSV at `path`; the path.

    The schedule is validated first (a ScheduleError names what is wrong); the sends and
    receives are left to torch, which derives them from the compute order."""
    validate(schedule)
    path = Path(path)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        for actions in schedule.compute_only().actions:
            writer.writerow([str(action) for action in actions])
    return path


_TORCH_ONLY = re.compile(r"\d*(UNSHARD|RESHARD|REDUCE_GRAD|OVERLAP_F_B)\d*|\(.*\).*")


def read_torch_csv(path, name: str | None = None) -> Schedule:
    """The pplab Schedule of a torch compute-only CSV (`name`: the file's stem by default).

    Stage placement and the number of microbatches are read off the actions; pplab's sends and
    receives are added, so the schedule runs, simulates and validates as any other. Raises a
    ScheduleError naming the row and cell of anything that is not a compute action."""
    path = Path(path)
    rows = []
    with open(path, newline="") as file:
        for rank, row in enumerate(csv.reader(file)):
            rows.append([_compute_action(cell, path, rank, column) for column, cell in enumerate(row)
                         if cell.strip()])
    if not rows:
        raise ScheduleError(f"{path}: the file is empty; torch's CSV has one row of actions per rank")
    try:
        schedule = from_lists(rows, name=name or path.stem)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: {error}") from error
    return add_communication(schedule)


def _compute_action(cell: str, path: Path, rank: int, column: int) -> Action:
    """One cell of a compute-only CSV as a pplab action, or a ScheduleError saying where and why."""
    where = f"{path}, row {rank + 1} (rank {rank}), cell {column + 1}"
    if _TORCH_ONLY.fullmatch(cell.strip()):
        raise ScheduleError(f"{where}: {cell.strip()!r} is one of torch's own actions (FSDP's unshard or "
                            "reshard, gradient reduction, an overlapped F and B), which pplab does not "
                            "model: write a compute-only schedule (F, B, I, W)")
    try:
        action = Action.parse(cell)
    except ValueError as error:
        raise ScheduleError(f"{where}: {error}") from error
    if not action.is_compute:
        raise ScheduleError(f"{where}: {cell.strip()!r} is a send or receive; torch's compute-only CSV holds "
                            f"F, B, I and W only (torch adds the messages itself)")
    return action


def check_torch_runs(schedule: Schedule) -> None:
    """Raise a ValueError, naming the action and why, unless torch's `_PipelineScheduleRuntime`
    can run `schedule`: torch validates the CSV and derives its sends and receives from it, here
    on stand-in stages, as it will on the ranks."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    validate(schedule)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, schedule.n_ranks, None
    stage.num_stages = schedule.n_stages
    runtime = _PipelineScheduleRuntime([stage] * schedule.n_virtual, schedule.n_microbatches)
    with tempfile.TemporaryDirectory() as folder:
        path = write_torch_csv(schedule, Path(folder) / "schedule.csv")
        try:
            runtime._load_csv(str(path))
        except Exception as error:  # torch says why with AssertionError or RuntimeError
            said = str(error).split("\n\n")[0]
            raise ValueError(f"torch's runtime cannot run schedule {schedule.name!r}: {said}"
                             f"{_named_action(said, schedule)}") from error


def _named_action(said: str, schedule: Schedule) -> str:
    """torch says 'Rank r, step s': the action that is, in pplab's words."""
    match = re.search(r"Rank (\d+), step (\d+)", said)
    if not match:
        return ""
    rank, step = int(match.group(1)), int(match.group(2))
    actions = schedule.compute_only().actions[rank] if rank < schedule.n_ranks else ()
    return (f" (rank {rank}'s action {actions[step]}: the {actions[step].describe()})" if step < len(actions)
            else "")
