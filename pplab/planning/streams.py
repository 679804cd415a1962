"""Floor 2, messages as the transports run them: each rank's streams, in the order it issues.

`simulate` models pplab's own runtime, where a rank that reaches a receive waits there. torch's
runtime on GPUs runs otherwise, and the stalls its users meet come from how:

* a rank's host issues its actions in the schedule's order without waiting: each compute goes on
  the compute stream, each send or receive on a communication stream;
* a message operation starts on its stream once the operations queued before it there have ended
  and the compute issued before it has ended (the stream waits for the compute stream when the
  operation is issued, as ProcessGroupNCCL does);
* a send and its receive move the message together once both have started (NCCL's rendezvous): it
  takes ``latency + bytes / bandwidth``, and both end then. Until then each holds its stream, and
  what is queued behind it there waits: an early receive holds up a send to the same peer. A
  message of at most `buffered_bytes` goes into the receiver's buffer without waiting for its
  receive (NCCL keeps a buffer per peer, `NCCL_BUFFSIZE`, 4 MiB by default; a user measured only
  1 MiB of sends completing ahead of their receives, NVIDIA/nccl issue 544), and the receive ends
  when it has arrived;
* a compute starts when the compute before it and the receives it needs have ended; it never waits
  for a send.

Which operations share a stream is the transport's (`STREAMS`):

* ``"pair"``: one stream for each pair of ranks, both directions. NCCL runs a plain isend/irecv on
  a communicator of the two ranks; torch 2.13's runtime issues every SEND and RECV action so (its
  `_batch_p2p` coalesces only a batch that mixes sends and receives);
* ``"rank"``: one stream for all the rank's messages. NCCL's coalesced batch_isend_irecv runs on the
  group's communicator: torch's runtimes that coalesced every batch, and the mixed batches of its
  single-stage schedules' own loop;
* ``"none"``: no order between messages, as gloo behaved when measured (torch's runtime on gloo ran
  early and deferred receives alike, `bench/bench_lowering.py`).

Operations that wait on each other in a cycle never end: `DeadlockError` names the cycle. UNSHARD,
RESHARD and REDUCE_GRAD are free here, as in `simulate`; compute and messages do not slow each
other down (no shared SMs or memory bandwidth).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from pplab.planning.simulator import Costs
from pplab.schedules import Action, DeadlockError, Dependencies, Schedule, validate
from pplab.trace.timeline import Event, Timeline

__all__ = ["simulate_streams", "StreamRun", "Hold", "STREAMS"]

STREAMS = {
    "pair": "one stream per pair of ranks (NCCL's isend/irecv: torch 2.13's runtime)",
    "rank": "one stream for all of a rank's messages (NCCL's coalesced batch_isend_irecv)",
    "none": "no order between messages (gloo, as measured)",
}
HELD = 1e-9  # a wait shorter than this is rounding, not a hold


@dataclass(frozen=True)
class Hold:
    """An operation that held its stream while it waited for its peer, and the one queued behind it."""

    rank: int
    peer: int | None  # the rank the stream goes to (None: the rank's one stream for all messages)
    holder: Action  # waited for its partner to start
    held: Action  # was ready, and waited behind it on the stream
    seconds: float  # how long the held operation waited while the holder waited for its partner


@dataclass
class StreamRun:
    """A schedule run on the streams: its timeline and every hold on a stream."""

    timeline: Timeline
    holds: list[Hold]
    streams: str

    def step_time(self) -> float:
        return self.timeline.step_time()


def simulate_streams(schedule: Schedule, costs: Costs | None = None, streams: str = "pair",
                     buffered_bytes: float = 0) -> StreamRun:
    """Run `schedule`'s sends and receives as a transport does (`STREAMS`) and its computes on their
    own stream; the timeline's SEND and RECV events last from the operation's start on its stream to
    the message's arrival. A send of at most `buffered_bytes` does not wait for its receive; a
    message of unknown size (no `costs.activation_bytes`) counts as larger unless it is `math.inf`."""
    if streams not in STREAMS:
        raise ValueError(f"streams={streams!r}: give one of {', '.join(map(repr, STREAMS))}")
    if not schedule.has_communication:
        raise ValueError(f"schedule {schedule.name!r} has no sends and receives to put on streams: add "
                         f"them first (pplab.schedules.add_communication, or lowered_by_torch)")
    costs = Costs() if costs is None else costs
    costs.check_stages(schedule.n_stages)
    validate(schedule, deadlock=False)  # every action in its place; the streams decide what waits
    return _Streams(schedule, costs, streams, buffered_bytes).run()


# Each action has nodes: a message its start on the stream ("start") and its end ("end"), a compute its end.
START, END = "start", "end"


class _Streams:
    """The operations as a graph of times: each node's time is the latest of the nodes it waits for
    (plus its own duration), solved in dependency order; what is left unsolved is a cycle."""

    def __init__(self, schedule: Schedule, costs: Costs, streams: str, buffered_bytes: float):
        self.schedule, self.costs, self.streams = schedule, costs, streams
        self.buffered_bytes = buffered_bytes
        self.rule = Dependencies(schedule)
        self.rank_of = {action: rank for rank, actions in enumerate(schedule.actions) for action in actions}
        self.waits: dict[tuple, list[tuple]] = {}  # node -> the nodes it waits for
        self.duration: dict[tuple, float] = {}  # node -> its time after the last of them
        self.stream_before: dict[Action, Action] = {}  # a message -> the one queued before it on its stream
        self.compute_before: dict[Action, Action] = {}  # a message -> the compute issued before it
        for rank, actions in enumerate(schedule.actions):
            self._wire(rank, actions)

    def _stream(self, rank: int, action: Action):
        if self.streams == "pair":
            return rank, self.schedule.peer_rank(action)
        return rank

    def _wire(self, rank: int, actions) -> None:
        last_compute, last_on = None, {}
        for action in actions:
            if action.is_compute:
                waits = [(END, need.action) for need in self.rule.needs(action)]
                if last_compute is not None:
                    waits.append((END, last_compute))
                self.waits[(END, action)] = waits
                self.duration[(END, action)] = self.costs.compute_time(action.kind, action.stage)
                last_compute = action
                continue
            waits = []
            if last_compute is not None:
                waits.append((END, last_compute))
                self.compute_before[action] = last_compute
            if action.is_send:  # what it sends was made by an earlier compute (checked by validate)
                waits += [(END, need.action) for need in self.rule.needs(action)]
            if self.streams != "none":
                stream = self._stream(rank, action)
                if stream in last_on:
                    waits.append((END, last_on[stream]))
                    self.stream_before[action] = last_on[stream]
                last_on[stream] = action
            self.waits[(START, action)], self.duration[(START, action)] = waits, 0.0
            self._wire_message(action)

    def _wire_message(self, action: Action) -> None:
        """When a send or receive ends: together with its partner (a rendezvous), or, for a buffered
        message, the send once its message has left and the receive once it has arrived."""
        transfer = self.costs.transfer_time(action.boundary)
        size = self.costs.message_bytes(action.boundary)
        buffered = self.buffered_bytes == math.inf or (size is not None and size <= self.buffered_bytes)
        if not buffered:
            self.waits[(END, action)] = [(START, action), (START, action.partner())]
            self.duration[(END, action)] = transfer
        elif action.is_send:
            self.waits[(END, action)], self.duration[(END, action)] = [(START, action)], transfer
        else:
            self.waits[(END, action)] = [(START, action), (END, action.partner())]
            self.duration[(END, action)] = 0.0

    def run(self) -> StreamRun:
        time = self._solve()
        events = []
        for rank, actions in enumerate(self.schedule.actions):
            for action in actions:
                end = time[(END, action)]
                if action.is_compute:
                    start = end - self.duration[(END, action)]
                    events.append(Event(rank, action.kind.value, action.stage, action.microbatch, start, end))
                else:
                    size = self.costs.message_bytes(action.boundary)
                    events.append(Event(rank, action.kind.value, action.stage, action.microbatch,
                                        time[(START, action)], end, size))
        timeline = Timeline(events, self.schedule.n_ranks, label=f"simulated, streams {self.streams}")
        return StreamRun(timeline, self._holds(time), self.streams)

    def _solve(self) -> dict:
        """Each node's time, in an order where every node comes after what it waits for (Kahn's)."""
        waiting_on = {node: len(waits) for node, waits in self.waits.items()}
        woken = defaultdict(list)
        for node, waits in self.waits.items():
            for awaited in waits:
                woken[awaited].append(node)
        ready = deque(node for node, count in waiting_on.items() if count == 0)
        time = {}
        while ready:
            node = ready.popleft()
            latest = max((time[awaited] for awaited in self.waits[node]), default=0.0)
            time[node] = latest + self.duration[node]
            for later in woken[node]:
                waiting_on[later] -= 1
                if waiting_on[later] == 0:
                    ready.append(later)
        if len(time) < len(self.waits):
            raise DeadlockError(self._name_cycle(time))
        return time

    def _name_cycle(self, time: dict) -> str:
        """Follow unsolved waits from an unsolved node until one repeats, and say the cycle in words."""
        node = next(node for node in self.waits if node not in time)
        path, seen = [], {}
        while node not in seen:
            seen[node] = len(path)
            path.append(node)
            node = next(awaited for awaited in self.waits[node] if awaited not in time)
        cycle = path[seen[node]:]
        said = [self._say(node, cycle[(i + 1) % len(cycle)]) for i, node in enumerate(cycle)]
        return (f"schedule {self.schedule.name!r} deadlocks on {STREAMS[self.streams]}: "
                + "; ".join(filter(None, said)))

    def _say(self, node, awaited) -> str | None:
        """One link of a cycle in words: why `node` waits for `awaited`."""
        (part, action), (_, other) = node, awaited
        rank, other_rank = self.rank_of[action], self.rank_of.get(other)
        if part == END and action.is_comm and other == action:
            return None  # a message ends after it starts: said by its start's link
        if part == END and action.is_comm:
            return f"rank {rank}'s {action} waits for rank {other_rank} to reach {other}"
        if action.is_comm and other == self.stream_before.get(action):
            return f"rank {rank}'s {action} is queued behind {other} on its stream"
        return f"rank {rank}'s {action} waits for {other}"

    def _holds(self, time: dict) -> list[Hold]:
        """Each message queued behind one that waited for its partner, and for how long that wait held
        it: the overlap of [when it was ready, when it started] with the holder's wait."""
        holds = []
        for held, holder in self.stream_before.items():
            ready = max((time[node] for node in self.waits[(START, held)] if node != (END, holder)),
                        default=0.0)
            # The holder waited for its partner from its start until its message began to move.
            waited_from = time[(START, holder)]
            waited_to = time[(END, holder)] - self.duration[(END, holder)]
            seconds = min(time[(START, held)], waited_to) - max(ready, waited_from)
            if seconds > HELD:
                rank = self.rank_of[held]
                peer = self.schedule.peer_rank(held) if self.streams == "pair" else None
                holds.append(Hold(rank, peer, holder, held, seconds))
        return sorted(holds, key=lambda hold: -hold.seconds)
