"""Run a schedule on a cost model and predict its timeline.

The model is the one the textbook bubble formulas assume, plus optional
communication costs:

* each rank runs its action list in order, one action at a time;
* a compute action (F, B, I, W) starts when its rank is free and its inputs
  are there, and takes its cost from `Costs`;
* sends are buffered and non-blocking (like ``isend``): a send costs its rank
  no time; the message travels for ``latency + bytes / bandwidth`` seconds
  and shows as a SEND event on the sender's communication track;
* a receive blocks its rank until the message has arrived; its RECV event
  covers the part of the transfer the receiver actually waited for (zero
  length when the data was already there);
* messages do not compete for links, unless ``Costs(link_contention=True)``: then
  each direction of a boundary carries one message at a time, a message waiting
  for the ones sent before it to be transmitted (``bytes / bandwidth`` each; the
  latency overlaps), which is what a slow link does to a pipeline;
* with ``Costs(link="rendezvous")`` a message leaves only once its receive is posted, as
  gloo and NCCL move data: it arrives ``transfer time`` after the later of its send and
  the posting of its receive, and its SEND event ends then. A receive is posted as pplab's
  runtime posts it on gloo when its shape is known (every gradient; activations of fixed
  shapes): ahead of its turn, as soon as its rank has finished the communication before it
  (so a message waits only for a receiver that is itself stuck in an earlier wait, or whose
  compute in between is shorter than the transfer). Where the runtime posts a receive only
  at its turn (NCCL, activations of varying shapes) this prediction is optimistic;
* a schedule without sends and receives (``schedule.compute_only()``) moves
  data between ranks by itself, after the same transfer time;
* a schedule that cannot finish raises `DeadlockError`, naming what every
  stuck rank waits for.

The result is a `Timeline` labelled "simulated", the same type a measured run
produces, so predictions and measurements can be compared directly. Times are
in the unit of the costs: give them in seconds to compare with a measurement.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Sequence, Union

from pplab.base.config import NUMBER_OR_ZERO, PER_STAGE, PER_STAGE_BYTES, POSITIVE, choice, option
from pplab.schedules import (
    COMPUTE_KINDS,
    SEND_KINDS,
    Action,
    DeadlockError,
    Dependencies,
    Kind,
    Schedule,
    ScheduleError,
)
from pplab.schedules.communication import comm_batches
from pplab.schedules.compiled import (
    KINDS,
    SEND_B,
    SEND_F,
    Compiled,
    boundaries,
    compile_schedule,
    no_cyclic_gc,
)
from pplab.trace.timeline import Event, Timeline

__all__ = ["Costs", "simulate", "costs_from_timeline"]

LINKS = ("buffered", "rendezvous")
"""How a message moves: when its send is posted, or once its receive is posted too."""

PerStage = Union[float, Sequence[float]]
"""A value for every stage: one number for all, or one number per stage."""


# ---------------------------------------------------------------- costs


@dataclass(frozen=True)
class Costs:
    """Durations of F, B, I, W per stage, and the cost of a message.

    Each duration is one number for every stage or a sequence, one per stage.
    When a schedule splits the backward into I (input gradient) and W (weight
    gradient), B is I and W together: with neither given, I = W = backward / 2;
    with one, the other is backward minus it; with both, backward defaults to
    I + W (and must equal it if given), so schedules with B and with I/W
    compare on the same work. A message across the boundary after stage s (its
    activation, or the gradient coming back) takes ``latency +
    activation_bytes[s] / bandwidth``; without a bandwidth, just the latency.
    """

    forward: PerStage = option(1.0, "the forward F of one stage (an interleaved chunk is a stage)", "costs",
                               PER_STAGE, "T")
    backward: PerStage | None = option(None, "the whole backward B (default: input_grad + weight_grad when "
                                             "both are given, else 2)", "costs", PER_STAGE, "T")
    input_grad: PerStage | None = option(None, "zero-bubble schedules: the input-gradient pass I, part of "
                                               "the backward (default: the backward less W, else half)",
                                         "costs", PER_STAGE, "T")
    weight_grad: PerStage | None = option(None, "zero-bubble schedules: the weight-gradient pass W, part of "
                                                "the backward (default: the backward less I, else half)",
                                          "costs", PER_STAGE, "T")
    latency: float = option(0.0, "the time a message between ranks takes", "costs", NUMBER_OR_ZERO)
    bandwidth: float | None = option(None, "bytes a link carries per unit of time (needs activation_bytes; "
                                           "default: a message costs its latency alone)", "costs", POSITIVE,
                                     optional=True)
    activation_bytes: int | Sequence[int] | None = option(
        None, "bytes of an activation (or its gradient) crossing a stage boundary", "costs", PER_STAGE_BYTES,
        "BYTES")
    link_contention: bool = option(False, "a link carries one message at a time (see pplab.planning."
                                          "simulator)", "costs")
    link: str = option("buffered", "how a message moves: buffered (at its send) or rendezvous (once its "
                                   "receive is posted too)", "costs", choice(*LINKS))

    def __post_init__(self):
        if self.backward is None:
            halves = (self.input_grad, self.weight_grad)
            object.__setattr__(self, "backward", 2.0 if None in halves else _sum(*halves))
        for name in ("forward", "backward", "input_grad", "weight_grad", "activation_bytes"):
            _check_per_stage(name, getattr(self, name))
            if _is_sequence(getattr(self, name)):
                # A tuple keeps Costs immutable and hashable, and is quick to index.
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_number("latency", self.latency)
        if self.link not in LINKS:
            raise ValueError(f"Costs: link={self.link!r}: choose one of {', '.join(map(repr, LINKS))}")
        if self.bandwidth is not None:
            _check_number("bandwidth", self.bandwidth)
            if self.bandwidth == 0:
                raise ValueError("Costs: bandwidth=0 would make every message take forever; "
                                 "give bytes per second > 0, or None for no bandwidth cost")
        if self.bandwidth is not None and self.activation_bytes is None:
            raise ValueError(f"Costs: bandwidth={self.bandwidth} needs message sizes: "
                             "give activation_bytes (one number, or one per stage)")

    def check_stages(self, n_stages: int) -> None:
        """Raise ValueError if a per-stage sequence does not have one value per stage."""
        for name in ("forward", "backward", "input_grad", "weight_grad", "activation_bytes"):
            value = getattr(self, name)
            if _is_sequence(value) and len(value) != n_stages:
                raise ValueError(f"Costs: {name} has {len(value)} values but the schedule has "
                                 f"{n_stages} stages; give one value per stage or a single number")
        for stage in range(n_stages):
            self._split_backward(stage)  # raises when a given half exceeds the backward

    def compute_time(self, kind: Kind, stage: int) -> float:
        """How long a compute action of `kind` takes on `stage`."""
        if kind == Kind.F:
            return _at(self.forward, stage)
        if kind == Kind.B:
            return _at(self.backward, stage)
        input_grad, weight_grad = self._split_backward(stage)
        if kind == Kind.I:
            return input_grad
        if kind == Kind.W:
            return weight_grad
        raise ValueError(f"{kind} is not a compute action")

    def message_bytes(self, stage: int) -> int | None:
        """Size of the activation leaving `stage`; its gradient, going back, is the same size."""
        return None if self.activation_bytes is None else int(_at(self.activation_bytes, stage))

    def transmission_time(self, stage: int) -> float:
        """Seconds the message across the boundary after `stage` occupies the link (bytes / bandwidth)."""
        return 0.0 if self.bandwidth is None else self.message_bytes(stage) / self.bandwidth

    def transfer_time(self, stage: int) -> float:
        """Seconds the activation leaving `stage`, or its gradient coming back, spends in flight."""
        if self.bandwidth is None:
            return self.latency
        return self.latency + self.message_bytes(stage) / self.bandwidth

    def _split_backward(self, stage: int) -> tuple[float, float]:
        backward = _at(self.backward, stage)
        input_grad = None if self.input_grad is None else _at(self.input_grad, stage)
        weight_grad = None if self.weight_grad is None else _at(self.weight_grad, stage)
        if input_grad is None and weight_grad is None:
            return backward / 2, backward / 2
        if input_grad is not None and weight_grad is not None:
            if not math.isclose(input_grad + weight_grad, backward, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(f"Costs: input_grad + weight_grad = {input_grad + weight_grad:g} on "
                                 f"stage {stage} but backward={backward:g}: B is I and W together; give "
                                 f"backward={input_grad + weight_grad:g} or leave backward out")
            return input_grad, weight_grad
        for name, half in (("input_grad", input_grad), ("weight_grad", weight_grad)):
            if half is not None and half > backward and (input_grad is None or weight_grad is None):
                raise ValueError(f"Costs: {name}={half} on stage {stage} exceeds backward={backward}, "
                                 f"so the other half would be negative; give both input_grad and weight_grad")
        if input_grad is None:
            input_grad = backward - weight_grad
        if weight_grad is None:
            weight_grad = backward - input_grad
        return input_grad, weight_grad


def _sum(a: PerStage, b: PerStage) -> PerStage:
    """a + b, stage by stage when either is a sequence."""
    if not _is_sequence(a) and not _is_sequence(b):
        return a + b
    n_stages = len(a) if _is_sequence(a) else len(b)
    return [_at(tuple(a) if _is_sequence(a) else a, s) + _at(tuple(b) if _is_sequence(b) else b, s)
            for s in range(n_stages)]


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _at(value: PerStage, stage: int) -> float:
    return value[stage] if type(value) is tuple else value  # sequences became tuples in __post_init__


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Costs: {name}={value!r} must be a number")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Costs: {name}={value!r} must be a finite number >= 0")


def _check_per_stage(name: str, value) -> None:
    if value is None:
        return
    values = list(value) if _is_sequence(value) else [value]
    if not values:
        raise ValueError(f"Costs: {name} is an empty sequence; give a number or one value per stage")
    for v in values:
        _check_number(name, v)


# ---------------------------------------------------------------- simulation


def costs_from_timeline(timeline: Timeline, n_stages: int | None = None) -> Costs:
    """The per-stage costs a measured run shows: median F, B (or I and W) durations per stage.

    Message costs are not read off a run (a receive's length includes the wait for its
    sender), so latency and bandwidth stay 0 and None: set them to study a slow link.
    A stage with no event of a kind gets the median of that kind over all stages.
    """
    compute = [e for e in timeline.events if e.is_compute and e.stage is not None]
    if not compute:
        raise ValueError(f"timeline {timeline.label!r} has no compute events to measure costs from")
    n_stages = n_stages if n_stages is not None else max(e.stage for e in compute) + 1

    def medians(kind: str) -> tuple[float, ...] | None:
        durations = [e.duration for e in compute if e.kind == kind]
        if not durations:
            return None
        overall = statistics.median(durations)
        return tuple(statistics.median([e.duration for e in compute
                                        if e.kind == kind and e.stage == s] or [overall])
                     for s in range(n_stages))

    forward, backward = medians("F"), medians("B")
    input_grad, weight_grad = medians("I"), medians("W")
    if forward is None:
        raise ValueError(f"timeline {timeline.label!r} has no forward (F) events")
    if backward is None and (input_grad is None or weight_grad is None):
        raise ValueError(f"timeline {timeline.label!r} has no backward events (B, or I and W)")
    if input_grad is not None and weight_grad is not None:
        return Costs(forward=forward, input_grad=input_grad, weight_grad=weight_grad)
    return Costs(forward=forward, backward=backward)


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Execute `schedule` on the cost model and return the predicted timeline."""
    costs = Costs() if costs is None else costs
    costs.check_stages(schedule.n_stages)
    if costs.link_contention and not schedule.has_communication:
        raise ValueError(f"Costs(link_contention=True) queues messages on their links, and schedule "
                         f"{schedule.name!r} has none: add them first (pplab.schedules.add_communication)")
    if costs.link == "rendezvous" and costs.link_contention:
        raise ValueError("Costs(link='rendezvous', link_contention=True): a queue on a link that holds "
                         "messages until their receives are posted is not modelled; choose one of the two")
    if costs.link == "rendezvous" and not schedule.has_communication:
        raise ValueError("Costs(link='rendezvous') holds a message until its receive is posted, and "
                         f"schedule {schedule.name!r} has no receives: add them first "
                         "(pplab.schedules.add_communication)")
    with no_cyclic_gc():
        if costs.link == "rendezvous":  # the readable path only: a prediction, not a search's thousands
            return _Simulation(schedule, costs).run()
        compiled = compile_schedule(schedule)
        if compiled is None:  # no integer form: mixed B and I/W on a stage, or stray actions
            return _Simulation(schedule, costs).run()
        return _simulate_compiled(compiled, costs)


def _simulate_compiled(compiled: Compiled, costs: Costs) -> Timeline:
    """`_Simulation` on the integer form: the same rule, the same arithmetic in the same order
    (so the same floats), about ten times faster. Read `_Simulation` first: it is the spec."""
    schedule = compiled.schedule
    n_stages, m, n_ranks = schedule.n_stages, schedule.n_microbatches, schedule.n_ranks
    duration, transfer, hop = _cost_tables(costs, n_stages)
    contention = costs.link_contention
    # A send's key names its link (one direction of one boundary): when it is free, how long a message holds
    # it.
    link_free = [0.0] * len(hop)
    occupy = [costs.transmission_time(boundary)
              if contention and KINDS[key // n_stages] in SEND_KINDS and boundary >= 0 else 0.0
              for key, boundary in enumerate(boundaries(n_stages))]
    steps = compiled.steps
    needs = compiled.first_two_needs
    ready: list[float | None] = [None] * (len(KINDS) * n_stages * m)  # when what each action made is there
    starts = [math.inf] * len(ready)  # when each action started (inf: it did not run)
    waiting: dict[int, list[int]] = {}
    next_index, free_at = [0] * n_ranks, [0.0] * n_ranks
    runnable = list(range(n_ranks))
    send_f, send_b = SEND_F, SEND_B
    while runnable:
        rank = runnable.pop()
        rank_steps, free = steps[rank], free_at[rank]
        position = next_index[rank]
        for position in range(position, len(rank_steps)):
            index, key, microbatch, kind, stage = rank_steps[position]
            base, boundary, second_base, second_boundary = needs[key]
            if base < 0:
                inputs_at = 0.0
            else:
                at = ready[base + microbatch]
                if at is None:
                    waiting.setdefault(base + microbatch, []).append(rank)
                    break  # woken when what it waits for is recorded
                # Data that crosses ranks with no send/receive in the lists still takes its time.
                at += transfer[boundary]
                inputs_at = at if at > 0.0 else 0.0  # max(0.0, at), ties as max() breaks them
                if second_base >= 0:
                    at = ready[second_base + microbatch]
                    if at is None:
                        waiting.setdefault(second_base + microbatch, []).append(rank)
                        break
                    at += transfer[second_boundary]
                    inputs_at = at if at > inputs_at else inputs_at
            start = inputs_at if inputs_at > free else free
            if kind < send_f:
                end = free = start + duration[key]
            elif kind == send_f or kind == send_b:  # non-blocking: the rank goes on at once
                if contention:  # after the messages before it on this link are transmitted
                    sending = link_free[key] if link_free[key] > start else start
                    link_free[key] = sending + occupy[key]
                    end = sending + hop[key]
                else:
                    end = start + hop[key]
            else:  # blocking: the event shows only the waiting that overlapped the transfer
                sent_at, posted = inputs_at - hop[key], free
                end = free = start
                start = sent_at if sent_at > posted else posted
                start = end if end < start else start  # min(), ties as min() breaks them
            starts[index], ready[index] = start, end
            if index in waiting:
                runnable += waiting.pop(index)
        else:
            position = len(rank_steps)  # the rank ran to its end
        next_index[rank], free_at[rank] = position, free
    stuck = any(next_index[rank] < len(steps[rank]) for rank in range(n_ranks))
    count = sum(next_index)
    repeated = len(ready) - ready.count(None) != count  # an action recorded twice
    if stuck or repeated:
        _Simulation(schedule, costs).run()  # it names the repeated action, or what each stuck rank waits for
        raise AssertionError(f"the readable simulation of {schedule.name!r} finished "
                             "where the fast one did not")
    end = max(filter(None, ready), default=0.0)  # filter drops the actions that did not run (and 0.0s)
    return Timeline.deferred(lambda: _events(compiled, costs, starts, ready), count, min(starts, default=0.0),
                             end, n_ranks, label="simulated")


def _cost_tables(costs: Costs, n_stages: int) -> tuple[list[float], list[float], list[float]]:
    """Per key (kind * n_stages + stage): compute durations and message times; per boundary
    (and -1 for none): transfer times. Kept on the Costs, which a search reuses thousands of times."""
    tables = costs.__dict__.setdefault("_tables", {})
    if n_stages not in tables:
        transfer = [costs.transfer_time(b) for b in range(n_stages)] + [0.0]  # [-1]: no transfer
        duration = [costs.compute_time(kind, stage) if kind in COMPUTE_KINDS else 0.0
                    for kind in KINDS for stage in range(n_stages)]
        hop = [transfer[boundary] for boundary in boundaries(n_stages)]  # compute keys: boundary -1, 0.0
        tables[n_stages] = (duration, transfer, hop)
    return tables[n_stages]


def _events(compiled: Compiled, costs: Costs, starts: list[float], ends: list[float]) -> list[Event]:
    """The events of `_simulate_compiled`: one per action that ran (its start is not inf)."""
    n_stages, m = compiled.schedule.n_stages, compiled.schedule.n_microbatches
    rank_of_stage, boundary_of, events = compiled.rank_of_stage, boundaries(n_stages), []
    for index, start in enumerate(starts):
        if start == math.inf:
            continue
        key, microbatch = divmod(index, m)
        kind, stage = divmod(key, n_stages)
        name = KINDS[kind].value
        if kind < SEND_F:
            events.append(Event(rank_of_stage[stage], name, stage, microbatch, start, ends[index]))
        else:
            events.append(Event(rank_of_stage[stage], name, stage, microbatch, start, ends[index],
                                costs.message_bytes(boundary_of[key])))
    return events


class _Simulation:
    """Dataflow over the schedule: every action is placed once, so it runs in O(actions).

    What an action waits for comes from the schedules' one dependency rule
    (`Dependencies.needs`); `ready_at[action]` is when what it made is there:
    the end of a compute or a receive, the arrival of a send's message.
    """

    def __init__(self, schedule: Schedule, costs: Costs):
        self.schedule = schedule
        self.costs = costs
        self.rule = Dependencies(schedule)
        self.ready_at: dict[Action, float] = {}
        self.waiting: dict[Action, list[int]] = defaultdict(list)
        self.next_index = [0] * schedule.n_ranks
        self.free_at = [0.0] * schedule.n_ranks
        self.events: list[Event] = []
        self.link_free: dict[tuple[Kind, int], float] = {}  # with link contention: when each link is free
        # With a rendezvous link: when each rank posts the receives of its next communication
        # (the end of its last one), and each send's start and event, to end it when it leaves.
        self.receives_posted_at = [0.0] * schedule.n_ranks
        # the runtime's rule
        self.batch_ends = [{step[-1] for step in comm_batches(actions) if step[0].is_comm}
                           for actions in schedule.actions]
        self.sent: dict[Action, tuple[float, int]] = {}

    def run(self) -> Timeline:
        runnable = list(range(self.schedule.n_ranks))
        while runnable:
            runnable += self._advance(runnable.pop())
        self._check_finished()
        return Timeline(self.events, self.schedule.n_ranks, label="simulated")

    def _advance(self, rank: int) -> list[int]:
        """Run `rank` until it ends or blocks; return the ranks this woke up."""
        actions = self.schedule.actions[rank]
        woken = []
        while self.next_index[rank] < len(actions):
            action = actions[self.next_index[rank]]
            inputs_at = 0.0
            for need in self.rule.needs(action):
                if need.action not in self.ready_at:
                    self.waiting[need.action].append(rank)  # woken when it is recorded
                    return woken
                # Data that crosses ranks with no send/receive in the lists still takes its time.
                delay = 0.0 if need.transfer is None else self.costs.transfer_time(need.transfer)
                inputs_at = max(inputs_at, self.ready_at[need.action] + delay)
            self._execute(rank, action, inputs_at)
            woken += self.waiting.pop(action, [])
            self.next_index[rank] += 1
            if action in self.batch_ends[rank]:
                self.receives_posted_at[rank] = self.free_at[rank]  # the runtime posts the next ones now
        return woken

    def _execute(self, rank: int, action: Action, inputs_at: float) -> None:
        """Place the action on the clock and record when what it makes is ready."""
        if action.is_send:
            return self._send(rank, action, max(self.free_at[rank], inputs_at))
        if action.is_comm:
            return self._receive(rank, action, arrival=inputs_at)
        start = max(self.free_at[rank], inputs_at)
        end = start + self.costs.compute_time(action.kind, action.stage)
        self.free_at[rank] = end
        self.events.append(Event(rank, action.kind.value, action.stage, action.microbatch, start, end))
        self._record(action, end)

    def _send(self, rank: int, action: Action, start: float) -> None:
        # Non-blocking: the rank goes on at once while the message is in flight.
        sending = start
        if self.costs.link_contention:  # after the messages before it on this link are transmitted
            link = (action.kind, action.boundary)
            sending = max(start, self.link_free.get(link, 0.0))
            self.link_free[link] = sending + self.costs.transmission_time(action.boundary)
        arrival = sending + self.costs.transfer_time(action.boundary)
        if self.costs.link == "rendezvous":  # to end its event when it has left
            self.sent[action] = (sending, len(self.events))
        self.events.append(Event(rank, action.kind.value, action.stage, action.microbatch, start, arrival,
                                 bytes=self.costs.message_bytes(action.boundary)))
        self._record(action, arrival)

    def _receive(self, rank: int, action: Action, arrival: float) -> None:
        # Blocking: the rank waits until the message is there. The event shows
        # only the waiting that overlapped the transfer; waiting for the
        # sender to send at all is idle time, like any other bubble.
        sent_at = arrival - self.costs.transfer_time(action.boundary)
        if self.costs.link == "rendezvous":
            arrival = self._rendezvous(rank, action, arrival)
        posted = self.free_at[rank]
        end = max(posted, arrival)
        self.free_at[rank] = end
        self.events.append(Event(rank, action.kind.value, action.stage, action.microbatch,
                                 min(max(posted, sent_at), end), end,
                                 bytes=self.costs.message_bytes(action.boundary)))
        self._record(action, end)

    def _rendezvous(self, rank: int, action: Action, arrival: float) -> float:
        """When the message of receive `action` arrives on a rendezvous link: it left at the later
        of its send and the posting of this receive; its SEND event ends when it arrived."""
        send = action.partner()
        sending, index = self.sent[send]
        leaves = max(sending, self.receives_posted_at[rank])
        if leaves > sending:
            arrival = max(arrival, leaves + self.costs.transfer_time(action.boundary))
            self.events[index] = replace(self.events[index], end=arrival)
        return arrival

    def _record(self, action: Action, time: float) -> None:
        if action in self.ready_at:
            raise ScheduleError(f"action {action} appears twice in schedule {self.schedule.name!r}")
        self.ready_at[action] = time

    def _check_finished(self) -> None:
        """Raise DeadlockError naming what every stuck rank waits for."""
        stuck = []
        for rank, actions in enumerate(self.schedule.actions):
            if self.next_index[rank] < len(actions):
                action = actions[self.next_index[rank]]
                missing = next(need for need in self.rule.needs(action) if need.action not in self.ready_at)
                stuck.append(f"rank {rank} at action {action} (position {self.next_index[rank]}) "
                             f"waits for {missing.label} {missing.action}")
        if stuck:
            raise DeadlockError(f"schedule {self.schedule.name!r} deadlocks: " + "; ".join(stuck))
