"""Floor 1, a hung job read from torch's flight recorder.

torch's flight recorder keeps, on each rank, its last operations on the process group (set
`TORCH_FR_BUFFER_SIZE`, e.g. 2000): each with its name (`gloo:all_reduce`, `nccl:send 0->1`), its
number among its process group's collectives or among the sends and receives, and whether it
completed. NCCL's watchdog writes its own dump on a timeout (a pickle, which torch's `fr_trace`
tool reads); on any backend, `dump_on_hang(folder, after=...)` on every rank writes `rank<r>.json`
there if the rank is still running `after` seconds later (a thread does it while the rank waits in
torch, which lets go of Python's lock there): gloo has no watchdog of its own.

`read_flight_recorder(folder)` reads those files and says where each rank stands: the collective
a rank waits in that a peer never entered (a rank that stopped, or took another path), and the
sends and receives that never completed, with their peers. gloo in torch 2.13 records collectives
only: a hang in sends and receives (a schedule whose order deadlocks, too few microbatches) leaves
no pending entry there; the report says so and points at what can find it before a run
(`pplab doctor`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["read_flight_recorder", "dump_on_hang", "FlightRecord"]


def dump_on_hang(folder, after: float) -> threading.Thread:
    """On this rank (after `init_process_group`, with `TORCH_FR_BUFFER_SIZE` set before it): write the
    flight recorder to `folder/rank<r>.json` if the process is still running `after` seconds from
    now. The thread is a daemon: a job that ends sooner writes nothing."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json

    path = Path(folder) / f"rank{dist.get_rank()}.json"

    def dump() -> None:
        time.sleep(after)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_dump_fr_trace_json(True, False))  # collectives too; completed ones as well

    thread = threading.Thread(target=dump, name="pplab-flight-recorder", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class Operation:
    """One entry of a rank's flight recorder."""

    name: str  # torch's: "gloo:all_reduce", "nccl:send 0->1", "nccl:recv 0<-1"
    group: str  # its process group (collectives are numbered per group)
    collective: int  # its number among the group's collectives (0 for a send or receive)
    p2p: int  # its number among the sends and receives (0 for a collective)
    is_p2p: bool
    completed: bool

    @property
    def said(self) -> str:
        number = f"send/receive #{self.p2p}" if self.is_p2p else f"collective #{self.collective}"
        return f"{self.name} ({number}{'' if self.group == '0' else f' of group {self.group}'})"


@dataclass
class FlightRecord:
    """Every rank's recorded operations, in order, and what they say about a hang."""

    folder: Path
    operations: dict[int, list[Operation]]  # rank -> its operations, oldest first
    backend: str  # "gloo" or "nccl", from the operations' names
    groups: dict[str, tuple[int, ...]]  # a process group's id -> its ranks, where the dumps say

    def pending(self, rank: int) -> list[Operation]:
        """The rank's operations that never completed."""
        return [op for op in self.operations[rank] if not op.completed]

    def last_collective(self, rank: int, group: str = "0") -> int:
        """The number of the last collective of `group` the rank entered (0 for none)."""
        return max((op.collective for op in self.operations[rank] if not op.is_p2p and op.group == group),
                   default=0)

    def members(self, group: str) -> list[int]:
        """The ranks that recorded anything in `group`, or that its configuration lists."""
        listed = self.groups.get(group, ())
        return sorted(rank for rank, ops in self.operations.items()
                      if rank in listed or any(op.group == group for op in ops))

    def findings(self) -> list[str]:
        """What the records say, a line each: who waits in what, and who never came."""
        lines = []
        for rank in sorted(self.operations):
            for op in self.pending(rank):
                if op.is_p2p:
                    lines.append(f"rank {rank} waits in {op.said}: its peer never matched it")
                    continue
                absent = [other for other in self.members(op.group)
                          if self.last_collective(other, op.group) < op.collective]
                behind = "".join(f"; rank {other} never entered it (its last: collective "
                                 f"#{self.last_collective(other, op.group)})" for other in absent)
                lines.append(f"rank {rank} waits in {op.said}{behind}")
        if not lines:
            lines.append("no rank has an operation pending in the recorder")
        if self.backend == "gloo" and not any(op.is_p2p for ops in self.operations.values() for op in ops):
            lines.append("gloo records collectives only (torch 2.13): a hang in sends and receives leaves no "
                         "entry here; `pplab doctor SCHEDULE` finds an order that deadlocks, and too few "
                         "microbatches, before a run")
        return lines

    def text(self) -> str:
        """The report: each rank's last operations, then the findings."""
        lines = [f"flight recorder of {len(self.operations)} ranks ({self.backend}), from {self.folder}:"]
        for rank in sorted(self.operations):
            last = self.operations[rank][-3:]
            lines.append(f"  rank {rank}: " + (", ".join(
                f"{op.said} {'done' if op.completed else 'PENDING'}" for op in last) or "nothing recorded"))
        return "\n".join([*lines, *(f"  {line}" for line in self.findings())])


def read_flight_recorder(folder) -> FlightRecord:
    """The flight recorder's files of a job's ranks (`rank<r>.json`, as `dump_on_hang` writes them, or
    JSON dumps named with the rank last), read; a ValueError naming a file that is not one."""
    folder = Path(folder)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"{folder}: no flight recorder files (*.json) there; on each rank, "
                         f"pplab.trace.flight_recorder.dump_on_hang({str(folder)!r}, after=...) writes them")
    operations, names, groups = {}, set(), {}
    for path in files:
        match = re.search(r"(\d+)\.json$", path.name)
        try:
            record = json.loads(path.read_text())
            entries = record["entries"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}: not a flight recorder dump (torch's JSON with its 'entries')") \
                from None
        if match is None:
            raise ValueError(f"{path}: its name does not end with the rank (rank0.json)")
        for config in record.get("pg_config", {}).values():
            ranks = re.findall(r"\d+", str(config.get("ranks", "")))
            groups.setdefault(str(config.get("name", "") or "0"), tuple(int(rank) for rank in ranks))
        operations[int(match.group(1))] = [
            Operation(entry["profiling_name"], _group(entry), int(entry.get("collective_seq_id", 0)),
                      int(entry.get("p2p_seq_id", 0)), bool(entry.get("is_p2p")),
                      entry.get("retired", False) or entry.get("state") == "completed")
            for entry in entries]
        names |= {entry["profiling_name"].split(":")[0] for entry in entries}
    backend = "nccl" if "nccl" in names else "gloo" if "gloo" in names else "/".join(sorted(names)) or "?"
    return FlightRecord(folder, operations, backend, groups)


def _group(entry: dict) -> str:
    """An entry's process group, by its id ("0" is the default group)."""
    if "pg_id" in entry:
        return str(entry["pg_id"])
    group = entry.get("process_group")
    return str(group[0]) if isinstance(group, list) and group else "0"
