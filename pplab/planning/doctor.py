"""Floor 2, the schedule doctor: what torch's runtime will run for a schedule, and what it costs.

torch's runtime does not run the compute order it is given: it lowers it, posting each receive as
early as it can (or later, with `defer_pp_recv=True`), and a receive that waits holds up the work
queued behind it on its rank. `doctor(schedule)` asks torch's own lowering what it will run
(`pplab.schedules.lowered_by_torch`) and reports, before any rank starts:

* a job torch cannot run (its reason, in pplab's words) or one whose order deadlocks (the ranks
  and the actions they wait at);
* the step the lowering takes against the step the compute order allows (`bound`: messages that
  cost their time but never block), and the stalls that make the difference: each receive a rank
  waited at while its next compute did not need that message;
* the activations each rank holds at its peak;
* a better order of the sends and receives, where one removes stalls without a deadlock (torch's
  deferred receives, or each receive right before the compute that needs it), simulated and
  validated, to write as torch's compute+comms CSV (`Diagnosis.write_fix`).

The times are the simulator's, in the costs given (seconds, or cost units), with pplab's model
of a message: a receive holds its rank until the message has arrived, as a receive posted on
NCCL's stream holds the operations behind it. torch's runtime on gloo posts receives that do not
block: there an order this model calls a deadlock may run, and its stalls are smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pplab.base.formatting import ShownAsText, text_table
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import TORCH_SCHEDULES, DeadlockError, Schedule, ScheduleError, validate
from pplab.schedules.communication import add_communication
from pplab.schedules.torch_csv import lowered_by_torch
from pplab.trace.timeline import Timeline

__all__ = ["doctor", "Diagnosis", "Stall"]

NOTICED = 0.01  # a fix counts when it saves at least 1 % of the step
# How a posted receive behaves: on NCCL's stream it holds what is queued behind it; gloo's does not
# block (torch's runtime on gloo ran torch's early and deferred orders alike: bench_lowering.py).
TRANSPORTS = ("nccl", "gloo")


@dataclass(frozen=True)
class Stall:
    """A receive a rank waited at while its next compute did not need that message."""

    rank: int
    receive: str  # the action, e.g. "2RECV_F1"
    blocked: str  # the compute queued behind it, which did not need it
    seconds: float


@dataclass(repr=False)
class Diagnosis(ShownAsText):
    """What torch will run for a schedule, what it costs, and a better order where there is one."""

    schedule: Schedule
    costs: Costs
    transport: str = "nccl"
    refused: str | None = None  # why torch's runtime cannot run the schedule
    deadlock: str | None = None  # the lowered order's deadlock, named
    lowered: Schedule | None = None
    bound: float | None = None  # the compute order's step, messages never blocking a rank
    step: float | None = None  # torch's lowering, simulated
    stalls: list[Stall] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)  # activations each rank holds at its peak
    fix: Schedule | None = None
    fix_step: float | None = None
    timelines: dict[str, Timeline] = field(default_factory=dict)  # "torch's order", "the fix"

    @property
    def runs(self) -> bool:
        """torch's runtime runs it, and its order does not deadlock."""
        return self.refused is None and self.deadlock is None

    def write_fix(self, path) -> Path:
        """The better order as torch's compute+comms CSV, which its runtime runs as written."""
        if self.fix is None:
            raise ValueError(f"{self.schedule.name}: no order of its messages the doctor tried is faster "
                             f"than torch's; there is no fix to write")
        return self.fix.to_torch_csv(path, format="compute_comms")

    def __str__(self) -> str:
        s = self.schedule
        lines = [f"doctor: {s.name} on {s.n_ranks} ranks, {s.n_stages} stages, {s.n_microbatches} "
                 f"microbatches"]
        if self.refused is not None:
            return "\n".join([*lines, f"  torch's runtime cannot run it: {self.refused}"])
        if self.deadlock is not None:
            said = (f"  torch's order deadlocks where a receive holds what is queued behind it (NCCL's "
                    f"stream order; gloo's receives do not block, and it may run there): {self.deadlock}")
            return "\n".join([*lines, said])
        cost = self.step / self.bound - 1 if self.bound else 0.0
        lines.append(f"  torch's order: step {self.step:.4g}, the compute order's bound {self.bound:.4g} "
                     f"({cost:+.1%}); peak activations per rank {self.peak}")
        if self.transport == "gloo":
            lines.append("  on gloo torch's receives do not block: its order runs at the compute order's "
                         "pace, no stall (measured: bench/bench_lowering.py); give transport='nccl' for the "
                         "stalls a GPU job meets")
        elif self.stalls:
            lines.append(f"  {len(self.stalls)} stall(s), a receive waited at while the next compute did not "
                         f"need it (the largest first):")
            rows = [(stall.rank, stall.receive, stall.blocked, f"{stall.seconds:.3g}")
                    for stall in self.stalls[:8]]
            lines += ["    " + line for line in text_table(["rank", "waits at", "holding up", "for"], rows,
                                                           right=(0, 3)).splitlines()]
        else:
            lines.append("  no stalls: each receive torch posts waits only for what the next compute needs")
        plan = TORCH_SCHEDULES.get(s.name)
        if plan is not None and not plan.multi_stage:
            lines.append(f"  (torch's own {plan.torch_name} class runs its own loop, not this order: this is "
                         f"what the runtime runs for the same order as a CSV, as torchtitan's does)")
        if self.fix is not None:
            lines.append(f"  a better order: {self.fix.name}, step {self.fix_step:.4g} "
                         f"({(self.fix_step / self.step - 1) if self.step else 0.0:+.1%}), deadlock-free; "
                         f"write it with "
                         f".write_fix(path) (torch's compute+comms CSV)")
        return "\n".join(lines)


def doctor(schedule: Schedule, costs: Costs | None = None, transport: str = "nccl") -> Diagnosis:
    """Diagnose what torch's runtime will run for `schedule` in `costs` (by default the simulator's: a
    forward 1, a backward 2, messages free): its compute order as torch lowers it, or, for a schedule
    read with its messages (a compute+comms CSV), that order as written. `transport`: "nccl" (a
    posted receive holds what is queued behind it) or "gloo" (it does not: no stalls, no fix)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: give one of {', '.join(map(repr, TRANSPORTS))}")
    costs = costs or Costs()
    compute = schedule.compute_only()
    diagnosis = Diagnosis(schedule, costs, transport)
    try:  # a file with its messages (compute_comms) runs as written; a compute order, as torch lowers it
        lowered = schedule if schedule.stage_actions is not None else lowered_by_torch(compute)
    except (ValueError, ScheduleError) as error:
        diagnosis.refused = str(error)
        return diagnosis
    try:
        validate(lowered if transport == "nccl" else compute)  # gloo: only the compute order can deadlock
    except DeadlockError as error:
        diagnosis.deadlock = str(error)
        return diagnosis
    if transport == "gloo":  # receives that do not block: the compute order's pace
        diagnosis.lowered, timeline = lowered, simulate(compute, costs)
        diagnosis.step = diagnosis.bound = timeline.step_time()
        diagnosis.peak = timeline.peak_inflight_per_rank()
        diagnosis.timelines["torch's order"] = timeline
        return diagnosis
    timeline = simulate(lowered, costs)
    diagnosis.lowered, diagnosis.step = lowered, timeline.step_time()
    diagnosis.bound = simulate(compute, costs).step_time()
    diagnosis.stalls = stalls(lowered, timeline)
    diagnosis.peak = timeline.peak_inflight_per_rank()
    diagnosis.timelines["torch's order"] = timeline
    for candidate in _better_orders(compute):
        try:
            validate(candidate)
        except ScheduleError:
            continue  # an order that deadlocks is never offered
        tried = simulate(candidate, costs)
        best = diagnosis.fix_step if diagnosis.fix is not None else diagnosis.step * (1 - NOTICED)
        if tried.step_time() < best:
            diagnosis.fix, diagnosis.fix_step = candidate, tried.step_time()
            diagnosis.timelines["the fix"] = tried
    return diagnosis


def stalls(lowered: Schedule, timeline: Timeline) -> list[Stall]:
    """Each receive in `lowered`'s simulated `timeline` that a rank waited at while the next compute in
    its order did not need that message, the largest first.

    A rank is free again when its last compute or receive ends (a send costs it nothing: its event
    is the message's flight); a receive's wait is from then to its message's arrival."""
    found = []
    for rank, actions in enumerate(lowered.actions):
        events = {(event.kind, event.stage, event.microbatch): event for event in timeline.of_rank(rank)}
        free = 0.0
        for position, action in enumerate(actions):
            event = events[(action.kind.value, action.stage, action.microbatch)]
            if action.is_send:
                continue
            waited, free = (event.end - free if action.is_comm else 0.0), event.end
            if waited <= 1e-9:
                continue
            after = next((later for later in actions[position + 1:] if later.is_compute), None)
            if after is not None and not _needs(after, action):
                found.append(Stall(rank, str(action), str(after), waited))
    return sorted(found, key=lambda stall: -stall.seconds)


def _needs(compute, receive) -> bool:
    """Does `compute` take what `receive` brings? (A forward its activation, a backward its gradient.)"""
    wanted = {"RECV_F": ("F",), "RECV_B": ("B", "I")}[receive.kind.value]
    return compute.stage == receive.stage and compute.microbatch == receive.microbatch and \
        compute.kind.value in wanted


def _better_orders(compute: Schedule):
    """Orders of the sends and receives to try: torch's deferred receives, and pplab's own (each
    receive right before the compute that needs it)."""
    yield lowered_by_torch(compute, defer_pp_recv=True)
    own = add_communication(compute)
    yield Schedule(own.actions, own.n_ranks, own.n_microbatches, own.n_stages, own.n_virtual,
                   f"{compute.name}, each receive right before its compute", own.placement)
