"""How busy this machine is: the reading that waits, messages and predictions scale with.

A workshop server with twenty labs on it, or a CI box shared with other jobs, runs every rank
slower than a quiet laptop does, and by a factor no constant can know. Two readings tell it,
taken together over a short window (0.2 s):

* the share of a core a thread gets: this thread spins for the window and compares the CPU time
  it was given with the time that passed. 1.0 on a quiet machine; about 0.5 when every core
  already runs one other busy thread. Its inverse is the slowdown every CPU-bound wait suffers;
* how many cores' worth of CPU the other processes used meanwhile (Linux's /proc/stat, less
  this process's own), so that a prediction can say when ranks outnumber the free cores.

Pure Python: the drivers scale their waits with it, the predictions state it, the tests take
their margins from it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["MachineLoad", "measure_load"]

WINDOW_SECONDS = 0.2  # long enough for /proc/stat's 10 ms ticks to count a core's use to 5 %


@dataclass(frozen=True)
class MachineLoad:
    """One reading of the machine: its cores, the other processes' use of them, a thread's share."""

    cores: int  # the cores this process may run on
    busy_cores: float | None  # cores' worth of CPU other processes used (None: not Linux)
    share: float  # the share of a core a busy thread of this process got (0-1]

    @property
    def slowdown(self) -> float:
        """How much longer CPU-bound work takes than on a quiet machine (1.0: quiet)."""
        return 1.0 / max(self.share, 0.05)

    @property
    def free_cores(self) -> float:
        """The cores no other process was using."""
        return float(self.cores) if self.busy_cores is None else max(0.0, self.cores - self.busy_cores)

    @property
    def busy(self) -> bool:
        """True when other processes slowed a thread here by more than a fifth."""
        return self.slowdown > 1.2

    def scale(self, seconds: float) -> float:
        """`seconds` of a quiet machine's waiting, stretched to this machine's pace."""
        return seconds * max(1.0, self.slowdown)

    def describe(self) -> str:
        """One line: e.g. '2 cores, 1.9 kept busy by other processes: a thread got 52 % of a core'."""
        others = "" if self.busy_cores is None else f", {self.busy_cores:.1f} kept busy by other processes"
        return f"{self.cores} core{'s' if self.cores != 1 else ''}{others}: a thread got {self.share:.0%} of a core"


def measure_load(window: float = WINDOW_SECONDS) -> MachineLoad:
    """Read the machine's load now (takes `window` seconds of one core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    machine_before, own_before = _machine_busy_seconds(), time.process_time()
    wall_before, thread_before = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall_before < window:
        pass
    wall = time.perf_counter() - wall_before
    share = min(1.0, (time.thread_time() - thread_before) / wall)
    machine_after, own = _machine_busy_seconds(), time.process_time() - own_before
    others = None if machine_before is None or machine_after is None else \
        max(0.0, (machine_after - machine_before - own) / wall)
    return MachineLoad(cores, others, share)


def _machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent not idle since boot (None: no /proc/stat)."""
    try:
        with open("/proc/stat") as file:
            fields = file.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: idle and iowait are not busy
    ticks = [int(value) for value in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def busy_note(load: MachineLoad | None = None) -> str:
    """A sentence for a timeout's message when a busy machine is part of the cause ('' when quiet).

    Measures now when no reading is given: a wait that gave up is the moment to look."""
    load = load if load is not None else measure_load()
    if not load.busy:
        return ""
    return (f" The machine is busy ({load.describe()}): everything here runs about {load.slowdown:.1f}x "
            f"slower than on a quiet one, so give it more time or fewer processes.")
