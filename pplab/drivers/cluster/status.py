"""The lab's ranks: who they are, what calls on them learned, and the status table.

A `RankGroup` is the set of ranks of one start (or restart) of a lab. Calls on the
ranks (`RankCall`) report to it what went wrong: a rank died, ranks were left
busy, the process group broke. The lab reads it to refuse calls that would queue
behind busy ranks, and to show `lab.state` and `lab.last_errors`. A restart makes
a new group, so a call on the old engines cannot mark the new ones.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields
from typing import Callable, Iterable

from pplab.base.formatting import ShownAsText, html_table, text_table
from pplab.drivers.cluster import records


@dataclass(frozen=True)
class RankInfo:
    """One rank: which engine and process it is, where it runs and what it runs on."""

    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    device: str
    backend: str
    state: str  # "idle", "busy" or "dead"


class RankGroup:
    """The ranks of one start of a lab, and whether they still work (what RankCall reports to)."""

    def __init__(self, infos: list[RankInfo], processes: dict[int, dict],
                 registered: Callable[[], Iterable[int]] | None = None,
                 exited: Callable[[int], str | None] | None = None):
        self.infos = infos
        self.processes = processes  # rank -> process entry, for the ranks on this host
        self.registered = registered  # the engine ids the controller still hears (every host)
        self.exited = exited  # pid -> how that engine ended ("killed by SIGKILL"), where it is known
        self.broken: str | None = None  # why these ranks must be replaced, if they must
        self.last_errors: dict = {}

    def needs_restart(self, reason: str) -> None:
        """Remember that ranks are busy, gone or broken, so that the next call refuses to queue."""
        self.broken = self.broken or reason  # the first reason is the cause; later ones follow

    def dead_ranks(self, ranks) -> list[int]:
        """The ranks among `ranks` whose engine has ended: on this host its process is gone (seen
        at once); on another, the controller stopped hearing its heartbeat (seen seconds later)."""
        ranks = list(ranks)
        remote = [rank for rank in ranks if rank not in self.processes]
        heard = set(self.registered()) if remote and self.registered is not None else None
        return [rank for rank in ranks
                if (records.find_process(self.processes[rank]) is None if rank in self.processes
                    else heard is not None and self.infos[rank].engine_id not in heard)]

    def how_it_ended(self, rank: int, patience: float = 1.0) -> str:
        """", killed by SIGABRT" for a dead rank whose end its fork server logged (it does on reaping
        it, within a fraction of a second: waited for up to `patience` s); "" where it is not known."""
        if self.exited is None:
            return ""
        deadline = time.monotonic() + patience
        while (said := self.exited(self.infos[rank].pid)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return f", {said}" if said else ""

    def describe(self, rank: int) -> str:
        """'rank 1 (engine 3, pid 4242 on host)': what a user needs to find the process."""
        info = self.infos[rank]
        return f"rank {rank} (engine {info.engine_id}, pid {info.pid} on {info.host})"

    def record_errors(self, errors: dict) -> None:
        """Keep the remote errors of the ranks that raised in a failed call (lab.last_errors)."""
        self.last_errors = errors


class RankTable(ShownAsText, tuple):
    """Rows of RankInfo ordered by rank; prints as a table (text or HTML)."""

    HEADER = [field.name for field in fields(RankInfo)]

    def __str__(self) -> str:
        return text_table(self.HEADER, map(astuple, self))

    def _repr_html_(self) -> str:
        return html_table(self.HEADER, map(astuple, self))
