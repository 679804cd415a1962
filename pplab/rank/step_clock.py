"""The clock of a step: one time zero on every rank, and timing mode's padding.

Both runtimes (pplab's `RankRuntime` and the one over torch's schedules) time their
events from `StepClock.origin`, so the ranks' events land on one timeline. In timing
mode `pad_to_cost` stretches each compute action to its cost. Floor 3.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from pplab.rank.comm import monotonic_clock
from pplab.schedules import Action
from pplab.planning.simulator import Costs


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
