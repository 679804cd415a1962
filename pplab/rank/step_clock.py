"""The clock of a step: one time zero on every rank, the device's own times, and timing mode's padding.

Both runtimes (pplab's `RankRuntime` and the one over torch's schedules) time their
events from `StepClock.origin`, so the ranks' events land on one timeline. On a GPU the
host only queues the work: `DeviceClock` turns each reading into when the device got there.
In timing mode `pad_to_cost` stretches each compute action to its cost. Floor 3.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from pplab.planning.simulator import Costs
from pplab.rank.comm import monotonic_clock
from pplab.schedules import Action
from pplab.trace.timeline import Event


class StepClock:
    """Time zero of each step, the same instant on every rank.

    Ranks on one machine read one monotonic clock: they agree on the earliest of
    their post-barrier readings, so their timelines line up exactly, however busy
    the CPUs. Across machines the clocks differ: each rank's zero is its own exit
    from the barrier, off by the barrier's skew (well under a millisecond on a LAN).
    """

    def __init__(self, group=None, device=torch.device("cpu")):
        self.group, self.device = group, torch.device(device)
        self._shared: bool | None = None  # do all ranks read one clock? (asked once)

    def origin(self) -> float:
        """A barrier, then this step's time zero (seconds of `monotonic_clock`)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return monotonic_clock()
        dist.barrier(group=self.group)
        origin = monotonic_clock()
        if self._shared is None:
            self._shared = _ranks_share_a_clock(self.group)
        if self._shared:
            on = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
            earliest = torch.tensor([origin], dtype=torch.float64, device=on)
            dist.all_reduce(earliest, op=dist.ReduceOp.MIN, group=self.group)
            origin = earliest.item()
        return origin


def step_clock(origin: float, device: torch.device, timing: Costs | None) -> Callable[[], float]:
    """The clock a step's events are read on: seconds since `origin`; a `DeviceClock` on a GPU in
    real mode (timing mode's pads are host time: there the host's clock is the truth)."""
    host_clock = lambda: monotonic_clock() - origin  # noqa: E731 - one clock for the whole step
    if torch.device(device).type == "cuda" and timing is None:
        return DeviceClock(torch.device(device), host_clock)
    return host_clock


class DeviceClock:
    """The step's clock as the GPU sees it: each reading is also a CUDA event on the current stream.

    A compute action returns to the host once its kernels are queued, so host readings time the
    launch, not the work. Each reading here records an event where the host is in the stream;
    when the step has ended, `on_device` replaces every reading in the events by the moment the
    device reached it. A zero event recorded on an idle device ties the two clocks: the device
    reaches it as the host records it. A message through host memory is timed alike, from the
    device reaching its copy to the host, to its copy back having landed.
    """

    def __init__(self, device: torch.device, host_clock: Callable[[], float]):
        self.device, self.host_clock = device, host_clock
        torch.cuda.synchronize(device)  # idle: the zero event runs the moment it is recorded
        self._zero, self._zero_at = self._record(), host_clock()
        self._marks: dict[float, torch.cuda.Event] = {}

    def __call__(self) -> float:
        reading = self.host_clock()
        self._marks[reading] = self._record()
        return reading

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def on_device(self, events: Iterable[Event]) -> list[Event]:
        """`events` with each time read on this clock moved to when the device reached it (waits
        for the device to finish the step)."""
        torch.cuda.synchronize(self.device)
        reached = {reading: self._zero_at + self._zero.elapsed_time(mark) / 1e3
                   for reading, mark in self._marks.items()}
        moved = []
        for event in events:
            start = reached.get(event.start, event.start)
            moved.append(dataclasses.replace(event, start=start,
                                             end=max(start, reached.get(event.end, event.end))))
        return moved


def on_device(clock: Callable[[], float], events: list[Event]) -> list[Event]:
    """The step's events in the device's times where `clock` is a `DeviceClock`, else as they are."""
    return clock.on_device(events) if isinstance(clock, DeviceClock) else events


def timed_on(clock: Callable[[], float]) -> str:
    """"device" where `clock` is a `DeviceClock`, else "host"."""
    return "device" if isinstance(clock, DeviceClock) else "host"


def _ranks_share_a_clock(group) -> bool:
    """True when every rank of `group` runs on this machine's boot (one monotonic clock)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:  # not Linux: no way to tell, so assume separate clocks
        boot = None
    boots = [None] * dist.get_world_size(group)
    dist.all_gather_object(boots, boot, group=group)
    return boot is not None and len(set(boots)) == 1


def pad_to_cost(timing: Costs | None, action: Action, started: float, clock) -> None:
    """Timing mode: stretch a compute action to its cost, so the schedule's shape shows
    even when ranks share fewer cores than there are ranks."""
    if timing is not None:
        until = started + timing.compute_time(action.kind, action.stage)
        if until > clock():
            with record_function("pplab: timing pad"):  # a profiler trace shows it as the action's work
                # Sleep most of it and spin the end: a sleep wakes 0.1-0.3 ms late here, which
                # timing mode would add to every action and a prediction would miss.
                left = until - clock()  # read once: a second read could come after `until`
                if left > SPIN_SECONDS:
                    time.sleep(left - SPIN_SECONDS)
                while clock() < until:
                    pass


SPIN_SECONDS = 0.0005  # the end of a timing pad spun rather than slept (about twice a sleep's lateness)
