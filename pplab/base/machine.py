"""How busy this machine is: the reading that waits, messages and predictions scale with.

A workshop server with twenty labs on it, or a CI box shared with other jobs, runs every rank
slower than a quiet laptop does, and by a factor no constant can know. Three readings tell it,
taken together over a short window (0.2 s):

* the share of a core a thread gets: this thread spins for the window and compares the CPU time
  it was given with the time that passed. 1.0 on a quiet machine; about 0.5 when every core
  already runs one other busy thread;
* how many threads were ready to run meanwhile (Linux's `procs_running`, sampled): a thread
  added to R of them on C cores gets C / R of a core. The share alone can flatter a busy
  machine: a process that slept is let run first for a moment;
* how many cores' worth of CPU the other processes used (Linux's /proc/stat, less this
  process's own), so that a prediction can say when ranks outnumber the free cores.

The slowdown every CPU-bound wait suffers is the larger of the two views of a thread's share.
`LoadWatch` samples the ready threads through a longer piece of work (a test's, a step's), at
no cost to it.

Pure Python: the drivers scale their waits with it, the predictions state it, the tests take
their margins from it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["measure_load", "LoadWatch"]

WINDOW_SECONDS = 0.2  # long enough for /proc/stat's 10 ms ticks to count a core's use to 5 %


@dataclass(frozen=True)
class MachineLoad:
    """One reading of the machine: its cores, the other processes' use of them, a thread's share."""

    cores: int  # the cores this process may run on
    busy_cores: float | None  # cores' worth of CPU other processes used (None: not Linux)
    share: float  # the share of a core a busy thread of this process got (0-1]
    ready: float | None = None  # threads ready to run, this one included (mean; None: not Linux)

    @property
    def slowdown(self) -> float:
        """How much longer CPU-bound work takes than on a quiet machine (1.0: quiet)."""
        crowd = 1.0 if self.ready is None else self.ready / self.cores
        return max(1.0, 1.0 / max(self.share, 0.05), crowd)

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
        return seconds * self.slowdown  # at least 1

    def describe(self) -> str:
        """One line: e.g. '2 cores, 1.9 kept busy by other processes, 4 threads ready to run: a
        thread gets about 50% of a core'."""
        said = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        if self.busy_cores is not None:
            said += f", {self.busy_cores:.1f} kept busy by other processes"
        if self.ready is not None:
            said += f", {self.ready:.0f} thread{'s' if round(self.ready) != 1 else ''} ready to run"
        return f"{said}: a thread gets about {1 / self.slowdown:.0%} of a core"


def measure_load(window: float = WINDOW_SECONDS) -> MachineLoad:
    """Read the machine's load now (takes `window` seconds of one core)."""
    cores = _cores()
    machine_before, own_before = _machine_busy_seconds(), time.process_time()
    wall_before, thread_before = time.perf_counter(), time.thread_time()
    ready, next_look = [], wall_before
    while (now := time.perf_counter()) - wall_before < window:
        if now >= next_look:  # every 5 ms: reading the count costs some 20 us
            ready.append(ready_threads())
            next_look = now + 0.005
    wall = time.perf_counter() - wall_before
    share = min(1.0, (time.thread_time() - thread_before) / wall)
    machine_after, own = _machine_busy_seconds(), time.process_time() - own_before
    others = None if machine_before is None or machine_after is None else \
        max(0.0, (machine_after - machine_before - own) / wall)
    counted = [count for count in ready if count is not None]
    return MachineLoad(cores, others, share, sum(counted) / len(counted) if counted else None)


_LAST: list[tuple[float, MachineLoad]] = []  # (when, reading): recent_load's memory


def recent_load(max_age: float = 10.0) -> MachineLoad:
    """A reading at most `max_age` seconds old, measured now if there is none (for callers that
    ask often, such as a what-if panel's predictions)."""
    if not _LAST or time.monotonic() - _LAST[0][0] > max_age:
        _LAST[:] = [(time.monotonic(), measure_load())]
    return _LAST[0][1]


class LoadWatch:
    """The machine's slowdown through a piece of work: the threads ready to run, sampled from a
    thread that sleeps between looks (so it adds no load), as `with LoadWatch() as watch: ...`."""

    def __init__(self, every: float = 0.05):
        import threading

        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._look, daemon=True, name="pplab-load-watch")

    def __enter__(self) -> "LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *failure) -> None:
        self._stop.set()
        self._thread.join()

    def _look(self) -> None:
        while True:
            count = ready_threads()
            if count is not None:
                self.samples.append(count)  # this thread is one of them: the work's own share
            if self._stop.wait(self.every):
                return

    @property
    def slowdown(self) -> float:
        """The mean over the samples of ready threads per core, at least 1 (1.0: no samples)."""
        if not self.samples:
            return 1.0
        cores = _cores()
        return sum(max(1.0, count / cores) for count in self.samples) / len(self.samples)


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def ready_threads() -> int | None:
    """Threads of the whole machine ready to run now, the caller included (None: no /proc/stat)."""
    try:
        with open("/proc/stat") as file:
            for line in file:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


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


def crowding_note(n_ranks: int, load: MachineLoad) -> str:
    """A sentence when ranks will share cores or a busy machine slows them ('' when neither)."""
    said = []
    if n_ranks > load.free_cores:
        said.append(f"{n_ranks} ranks on {load.free_cores:.1f} free core(s): they take turns")
    if load.busy:
        said.append(f"the machine is busy ({load.describe()})")
    if not said:
        return ""
    return ("; ".join(said) + ": times are longer than a quiet machine's, and a prediction assumes a core "
            "per rank")

