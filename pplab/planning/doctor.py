"""Floor 2, the schedule doctor: what torch's runtime will run for a schedule, and what it costs.

torch's runtime does not run the compute order it is given: it lowers it, posting each receive as
early as it can (or later, with `defer_pp_recv=True`). What a posted receive holds up is the
transport's: on NCCL it holds the sends queued behind it on its stream. `doctor(schedule)` asks
torch's own lowering what it will run (`pplab.schedules.lowered_by_torch`) and reports, before any
rank starts:

* a job torch cannot run (its reason, in pplab's words) or one whose order deadlocks (the cycle of
  ranks and operations that wait on each other);
* the step the lowering takes against the step the compute order allows (`bound`: messages that
  cost their time but never hold anything up), and the stalls that make the difference;
* the activations each rank holds at its peak;
* a better order of the sends and receives, where one removes stalls without a deadlock (torch's
  deferred receives, each receive right before the compute that needs it, or the doctor's own
  search from torch's order), simulated and deadlock-free, to write as torch's compute+comms CSV
  (`Diagnosis.write_fix`).

The transports (`TRANSPORTS`) are modelled by `pplab.planning.streams`, and pplab's own runtime
(a rank waits at each receive) by `pplab.simulate`. The times are the simulator's, in the costs
given (seconds, or cost units).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from pplab.base.formatting import ShownAsText, text_table
from pplab.planning.simulator import Costs, simulate
from pplab.planning.streams import StreamRun, simulate_streams
from pplab.schedules import (
    TORCH_SCHEDULES,
    Action,
    DeadlockError,
    Dependencies,
    Kind,
    Schedule,
    ScheduleError,
)
from pplab.schedules.communication import add_communication
from pplab.schedules.torch_csv import lowered_by_torch
from pplab.trace.timeline import Timeline

__all__ = ["doctor", "Diagnosis", "Stall", "TRANSPORTS"]

NOTICED = 0.01  # a fix counts when it saves at least 1 % of the step
# NCCL sends a message into its peer's buffer without waiting for the receive while it fits; a user
# measured 1 MiB (two 512 KiB sends) with the default NCCL_BUFFSIZE of 4 MiB (NVIDIA/nccl issue 544).
NCCL_BUFFERED_BYTES = 1 << 20


@dataclass(frozen=True)
class Transport:
    """How a runtime and its transport run the messages: on which streams (`pplab.planning.streams`;
    None: pplab's runtime, where a rank waits at each receive) and the largest message sent without
    waiting for its receive."""

    streams: str | None
    buffered_bytes: float
    said: str


WAITS = "a message over 1 MiB (or of unknown size) waits for its receive"
TRANSPORTS = {
    "nccl": Transport("pair", NCCL_BUFFERED_BYTES,
                      f"torch 2.13's runtime on NCCL: each send and receive a plain isend/irecv, on one "
                      f"stream per pair of ranks; {WAITS}"),
    "nccl-coalesced": Transport("rank", NCCL_BUFFERED_BYTES,
                                f"NCCL with every batch coalesced (batch_isend_irecv): all of a rank's "
                                f"messages on one stream; {WAITS}"),
    "gloo": Transport("none", math.inf, "torch's runtime on gloo: messages in no order, buffered (as "
                                        "measured: bench/bench_lowering.py)"),
    "pplab": Transport(None, math.inf, "pplab's runtime: a rank waits at each receive until its message "
                                       "arrives (as measured: bench/bench_lowering.py)"),
}
"""The transports the doctor knows, by name."""


@dataclass(frozen=True)
class Stall:
    """An operation that waited for its peer while something ready waited behind it."""

    rank: int
    waits_at: str  # the operation that waited, e.g. "2RECV_F1"
    blocked: str  # what waited behind it: a message on its stream, or (pplab's runtime) the next compute
    seconds: float
    peer: int | None = None  # the stream's other rank, on a stream per pair of ranks


@dataclass(repr=False)
class Diagnosis(ShownAsText):
    """What torch will run for a schedule, what it costs, and a better order where there is one."""

    schedule: Schedule
    costs: Costs
    transport: str = "nccl"
    refused: str | None = None  # why torch's runtime cannot run the schedule
    deadlock: str | None = None  # the lowered order's deadlock, named
    lowered: Schedule | None = None
    bound: float | None = None  # the compute order's step, messages never holding anything up
    step: float | None = None  # torch's lowering, simulated
    stalls: list[Stall] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)  # activations each rank holds at its peak
    fix: Schedule | None = None
    fix_step: float | None = None
    tried: dict[str, float | None] = field(default_factory=dict)  # each order tried: its step, None: deadlock
    timelines: dict[str, Timeline] = field(default_factory=dict)  # "torch's order", "the fix"

    @property
    def runs(self) -> bool:
        """torch's runtime runs it, and its order does not deadlock."""
        return self.refused is None and self.deadlock is None

    def write_fix(self, path) -> Path:
        """The better order as torch's compute+comms CSV, which its runtime runs as written."""
        if self.fix is None:
            raise ValueError(f"{self.schedule.name}: no order of its messages the doctor tried is faster "
                             f"than torch's on {self.transport}; there is no fix to write")
        return self.fix.to_torch_csv(path, format="compute_comms")

    def __str__(self) -> str:
        s = self.schedule
        lines = [f"doctor: {s.name} on {s.n_ranks} ranks, {s.n_stages} stages, {s.n_microbatches} "
                 f"microbatches; transport {self.transport} ({TRANSPORTS[self.transport].said})"]
        if self.refused is not None:
            return "\n".join([*lines, f"  torch's runtime cannot run it: {self.refused}"])
        if self.deadlock is not None:
            return "\n".join([*lines, f"  torch's order deadlocks: {self.deadlock}"])
        cost = self.step / self.bound - 1 if self.bound else 0.0
        lines.append(f"  torch's order: step {self.step:.4g}, the compute order's bound {self.bound:.4g} "
                     f"({cost:+.1%}); peak activations per rank {self.peak}")
        if self.stalls and self.step <= self.bound * (1 + NOTICED):
            lines.append(f"  {len(self.stalls)} stall(s), an operation that waited for its peer while "
                         f"something ready waited behind it; together they lengthen the step by less than "
                         f"{NOTICED:.0%}")
        elif self.stalls:
            lines.append(f"  {len(self.stalls)} stall(s), an operation that waited for its peer while "
                         f"something ready waited behind it (the largest first):")
            rows = [(stall.rank, "" if stall.peer is None else stall.peer, stall.waits_at, stall.blocked,
                     f"{stall.seconds:.3g}") for stall in self.stalls[:8]]
            table = text_table(["rank", "stream to", "waits at", "holding up", "for"], rows, right=(0, 1, 4))
            lines += ["    " + line for line in table.splitlines()]
        else:
            lines.append("  no stalls: nothing waits behind an operation that waits for its peer")
        plan = TORCH_SCHEDULES.get(s.name)
        if plan is not None and not plan.multi_stage:
            lines.append(f"  (torch's own {plan.torch_name} class runs its own loop, not this order: this is "
                         f"what the runtime runs for the same order as a CSV, as torchtitan's does)")
        if self.fix is not None:
            lines.append(f"  a better order: {self.fix.name}, step {self.fix_step:.4g} "
                         f"({(self.fix_step / self.step - 1) if self.step else 0.0:+.1%}), deadlock-free on "
                         f"{self.transport}; write it with .write_fix(path) (torch's compute+comms CSV)")
        elif self.stalls and self.step > self.bound * (1 + NOTICED):
            dead = [name for name, step in self.tried.items() if step is None]
            lines.append("  no order the doctor tried is faster" + (f" ({', '.join(dead)} deadlock here)"
                                                                    if dead else ""))
        return "\n".join(lines)


def doctor(schedule: Schedule, costs: Costs | None = None, transport: str = "nccl") -> Diagnosis:
    """Diagnose what torch's runtime will run for `schedule` in `costs` (by default the simulator's: a
    forward 1, a backward 2, messages free) on `transport` (`TRANSPORTS`): its compute order as torch
    lowers it, or, for a schedule read with its messages (a compute+comms CSV), that order as written."""
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
    run = _Runner(costs, TRANSPORTS[transport])
    try:
        timeline, stalls = run(lowered)
    except DeadlockError as error:
        diagnosis.deadlock = str(error)
        return diagnosis
    diagnosis.lowered, diagnosis.step, diagnosis.stalls = lowered, timeline.step_time(), stalls
    diagnosis.bound = simulate(compute, costs).step_time()
    diagnosis.peak = timeline.peak_inflight_per_rank()
    diagnosis.timelines["torch's order"] = timeline
    if not stalls:
        return diagnosis
    for candidate in _better_orders(compute, costs):
        try:
            tried, _ = run(candidate)
        except DeadlockError:
            diagnosis.tried[candidate.name] = None  # an order that deadlocks is never offered
            continue
        diagnosis.tried[candidate.name] = tried.step_time()
        best = diagnosis.fix_step if diagnosis.fix is not None else diagnosis.step * (1 - NOTICED)
        if tried.step_time() < best:
            diagnosis.fix, diagnosis.fix_step = candidate, tried.step_time()
            diagnosis.timelines["the fix"] = tried
    return diagnosis


class _Runner:
    """An order run on a transport: its timeline and its stalls; DeadlockError where it cannot end."""

    def __init__(self, costs: Costs, transport: Transport):
        self.costs, self.transport = costs, transport

    def __call__(self, order: Schedule) -> tuple[Timeline, list[Stall]]:
        if self.transport.streams is None:  # pplab's runtime: the simulator's own model
            timeline = simulate(order, self.costs)
            return timeline, stalls_of_waiting_ranks(order, timeline)
        transport = self.transport
        run: StreamRun = simulate_streams(order, self.costs, transport.streams, transport.buffered_bytes)
        return run.timeline, [Stall(hold.rank, str(hold.holder), str(hold.held), hold.seconds, hold.peer)
                              for hold in run.holds]


def stalls_of_waiting_ranks(lowered: Schedule, timeline: Timeline) -> list[Stall]:
    """On pplab's runtime: each receive in `lowered`'s simulated `timeline` that a rank waited at while
    the next compute in its order did not need that message, the largest first.

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


def _needs(compute: Action, receive: Action) -> bool:
    """Does `compute` take what `receive` brings? (A forward its activation, a backward its gradient.)"""
    wanted = {"RECV_F": ("F",), "RECV_B": ("B", "I")}[receive.kind.value]
    return compute.stage == receive.stage and compute.microbatch == receive.microbatch and \
        compute.kind.value in wanted


def _better_orders(compute: Schedule, costs: Costs):
    """Orders of the sends and receives to try: torch's deferred receives, pplab's own (each receive
    right before the compute that needs it), and the messages in the order the compute order's own
    timeline moves them (`in_time_order`)."""
    yield lowered_by_torch(compute, defer_pp_recv=True)
    own = add_communication(compute)
    yield replace(own, name=f"{compute.name}, each receive right before its compute")
    yield in_time_order(compute, costs)


def in_time_order(compute: Schedule, costs: Costs) -> Schedule:
    """`compute`'s order with each send and receive placed where the compute order's simulated timeline
    moves its message: a send after the compute that ends when it leaves, a receive after the last
    compute that ends before it leaves. Every rank then meets its messages in one global order (the
    time the message leaves, then its stage, microbatch and direction), so no two streams wait on each
    other in a cycle, whichever transport runs them."""
    timeline = simulate(compute, costs)
    ends = {(event.kind, event.stage, event.microbatch): event.end for event in timeline.events}
    rule = add_communication(compute)
    lists = []
    for rank, actions in enumerate(rule.actions):
        computes = [action for action in actions if action.is_compute]
        slots: list[list[tuple]] = [[] for _ in range(len(computes) + 1)]  # the messages after each compute
        finished = [ends[(action.kind.value, action.stage, action.microbatch)] for action in computes]
        for message in (action for action in actions if action.is_comm):
            leaves = ends[_produced_by(rule, message)]
            after = sum(1 for end in finished if end <= leaves)  # computes are in order: their ends rise
            if not message.is_send:  # and before the compute that takes it
                after = min(after, next(i for i, c in enumerate(computes) if _needs(c, message)))
            key = (leaves, message.boundary, message.microbatch, message.kind in (Kind.SEND_B, Kind.RECV_B))
            slots[after].append((key, message))
        order = [message for _, message in sorted(slots[0], key=lambda pair: pair[0])]
        for compute_action, slot in zip(computes, slots[1:]):
            order += [compute_action, *(message for _, message in sorted(slot, key=lambda pair: pair[0]))]
        lists.append(order)
    return replace(rule.with_actions(lists), name=f"{compute.name}, its messages in the order they move")


def _produced_by(schedule: Schedule, message: Action) -> tuple:
    """The (kind, stage, microbatch) of the compute whose result `message` carries."""
    send = message if message.is_send else message.partner()
    need = Dependencies(schedule).needs(send)[0].action
    return need.kind.value, need.stage, need.microbatch
