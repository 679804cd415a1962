"""The event model: what every rank did and when, on one clock.

An `Event` is one action a rank performed (a forward, a backward, a send...)
with its start and end time in seconds. A `Timeline` holds the events of all
ranks, whether predicted by the simulator or measured on real ranks, and
computes the metrics of a pipeline step from them:

* step time: last end minus first start, over all ranks;
* busy time of a rank: the time it spent computing. Communication does not
  count as busy: a rank waiting on a receive is not doing useful work, and
  the textbook bubble counts only compute;
* bubble fraction: idle / step time, where idle = step time - busy time
  (per rank, or summed over all ranks for the whole pipeline);
* in-flight activations: how many forwards a rank has run whose activations
  are still held for a backward (and how many bytes, when events carry them).

It exports to, and imports from, the Chrome trace event format, which
Perfetto (ui.perfetto.dev) and chrome://tracing open.

It is the common language of the simulator, the runtime, the widgets and the
pictures, and imports from pplab only the schedules' rule of when activations are
released (`releases_activations`), so that it counts memory as they do, and their kinds of
message (`COMM_KINDS`), from which an event's communicating kinds are derived.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from os import PathLike
from typing import Callable, Iterable, Sequence

from pplab.schedules.actions import COMM_KINDS as ACTION_COMM_KINDS
from pplab.schedules.actions import releases_activations

__all__ = ["Event", "Now", "Timeline", "COMM_EVENT_KINDS", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = frozenset({"ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE"})
"""Collectives of the other mesh dimensions: FSDP's all-gathers and reduce-scatters, TP's all-reduces."""
COMM_EVENT_KINDS = frozenset(kind.value for kind in ACTION_COMM_KINDS) | COLLECTIVE_KINDS
"""The kinds of an event that communicates: a schedule's messages (`pplab.schedules.COMM_KINDS`) and the
mesh's collectives; every other kind (F, B, I, W, OPT, ...) is compute."""

# Chrome trace tracks (thread ids) inside each rank's process. Sends, receives
# and collectives get their own tracks because they may overlap each other in time;
# overlapping ones go on further lanes (tid + _LANE_STRIDE * lane), since a
# trace viewer nests the slices of one track and cannot show partial overlaps.
_COMPUTE_TRACK, _SEND_TRACK, _RECV_TRACK, _COLLECTIVE_TRACK = 0, 1, 2, 3
_TRACK_NAMES = {_COMPUTE_TRACK: "compute", _SEND_TRACK: "send", _RECV_TRACK: "recv",
                _COLLECTIVE_TRACK: "collectives"}
_LANE_STRIDE = 10


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Event:
    """One action of one rank: kind, stage, microbatch, start and end in seconds."""

    rank: int
    kind: str
    stage: int | None
    microbatch: int | None
    start: float
    end: float
    bytes: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    def __post_init__(self):
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"event {self.label()} on rank {self.rank} has a non-finite time")
        if self.end < self.start:
            raise ValueError(
                f"event {self.label()} on rank {self.rank} ends ({self.end}) before it starts ({self.start})"
            )
        # Accept a kind enum (schedules.Kind is a str enum) but store plain text
        # so that events pickle and compare without importing schedules.
        object.__setattr__(self, "kind", str(getattr(self.kind, "value", self.kind)))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start

    @property
    def is_comm(self) -> bool:
        """True for sends, receives and collectives (FSDP's, TP's)."""
        return self.kind in COMM_EVENT_KINDS

    @property
    def is_compute(self) -> bool:
        """True for everything that is not communication (F, B, I, W, OPT, ...)."""
        return not self.is_comm

    def label(self) -> str:
        """Short human name, like 'F mb3'."""
        if self.microbatch is None:
            return self.kind
        return f"{self.kind} mb{self.microbatch}"

    def shifted(self, seconds: float) -> Event:
        """The same event moved `seconds` later on the clock."""
        return replace(self, start=self.start + seconds, end=self.end + seconds)


@dataclass(frozen=True)
class Now:
    """What a rank starts at `since` (seconds on the step's clock), for live views.

    `doing` is an action ("1F3"), a batch of messages ("1SEND_F3 1RECV_B0") or "done";
    `waits_for` names, for each receive in it, the peer rank and the send it waits on.
    """

    rank: int
    doing: str
    since: float
    waits_for: tuple[tuple[int, str], ...] = ()


def _sort_key(event: Event):
    """Events sort by rank, then time; the rest only makes the order total (-1 stands for None)."""
    stage = -1 if event.stage is None else event.stage
    microbatch = -1 if event.microbatch is None else event.microbatch
    return (event.rank, event.start, event.end, event.kind, stage, microbatch)


# ---------------------------------------------------------------- intervals


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, covered_until = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= covered_until:
            continue
        total += end - max(start, covered_until)
        covered_until = end
    return total


# ---------------------------------------------------------------- timeline


class Timeline:
    """The events of all ranks on one clock, with the metrics of a pipeline step.

    A `deferred` timeline (the simulator's) builds its `Event` objects only when they are
    first read: a search that asks thousands of simulations for their step time never pays
    for them.
    """

    def __init__(self, events: Iterable[Event] = (), n_ranks: int | None = None, label: str = ""):
        self._events: list[Event] | None = sorted(events, key=_sort_key)
        self._make_events: Callable[[], Iterable[Event]] | None = None
        self._count, self._bounds = len(self._events), None
        self.n_ranks, self.label = n_ranks, label
        highest_rank = max((e.rank for e in self._events), default=-1)
        if self.n_ranks is None:
            self.n_ranks = highest_rank + 1
        if highest_rank >= self.n_ranks:
            raise ValueError(f"an event is on rank {highest_rank} but the timeline has "
                             f"n_ranks={self.n_ranks}")
        if any(e.rank < 0 for e in self._events):
            raise ValueError("event ranks must be >= 0")

    @classmethod
    def deferred(cls, make_events: Callable[[], Iterable[Event]], count: int, start: float, end: float,
                 n_ranks: int, label: str = "") -> Timeline:
        """A timeline of `count` events from `start` to `end` that `make_events()` makes when
        they are first read. They must be valid events with ranks in 0..n_ranks-1."""
        timeline = cls((), n_ranks, label)
        timeline._events, timeline._make_events = None, make_events
        timeline._count, timeline._bounds = count, (start, end) if count else None
        return timeline

    @property
    def events(self) -> list[Event]:
        """Every event, sorted by rank, then time."""
        if self._events is None:
            self._events = sorted(self._make_events(), key=_sort_key)
            self._make_events = None
        return self._events

    def __getstate__(self) -> dict:
        self.events  # noqa: B018 - a pickle carries events, not the simulator's maker of them
        return self.__dict__

    def __eq__(self, other) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return (self.events, self.n_ranks, self.label) == (other.events, other.n_ranks, other.label)

    def __repr__(self) -> str:
        return f"Timeline({len(self)} events, n_ranks={self.n_ranks}, label={self.label!r})"

    def __len__(self) -> int:
        return self._count if self._events is None else len(self._events)

    # -- selections

    def of_rank(self, rank: int) -> list[Event]:
        """The events of one rank, in time order."""
        return [e for e in self.events if e.rank == rank]

    def compute_events(self, rank: int | None = None) -> list[Event]:
        """Compute events (F, B, I, W, ...), of one rank or of all."""
        return [e for e in self.events if e.is_compute and (rank is None or e.rank == rank)]

    def comm_events(self, rank: int | None = None) -> list[Event]:
        """Send, receive and collective events, of one rank or of all."""
        return [e for e in self.events if e.is_comm and (rank is None or e.rank == rank)]

    # -- clock

    @property
    def start(self) -> float:
        """Earliest start over all ranks (0.0 when empty)."""
        if self._bounds is not None:
            return self._bounds[0]
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        """Latest end over all ranks (0.0 when empty)."""
        if self._bounds is not None:
            return self._bounds[1]
        return max((e.end for e in self.events), default=0.0)

    def shift(self, seconds: float) -> Timeline:
        """A new timeline with every event moved `seconds` later."""
        return Timeline([e.shifted(seconds) for e in self.events], self.n_ranks, self.label)

    def normalised(self) -> Timeline:
        """A new timeline shifted so that it starts at time 0."""
        return self.shift(-self.start)

    # -- metrics

    def step_time(self) -> float:
        """Last end minus first start, over all ranks."""
        return self.end - self.start

    def busy_time(self, rank: int) -> float:
        """Time the rank spent computing (communication is not busy)."""
        return _union_length((e.start, e.end) for e in self.compute_events(rank))

    def comm_time(self, rank: int) -> float:
        """Time the rank had a send, a receive or a collective under way."""
        return _union_length((e.start, e.end) for e in self.comm_events(rank))

    def active_time(self, rank: int) -> float:
        """Time the rank had anything under way: compute, a send, a receive or a collective."""
        return _union_length((e.start, e.end) for e in self.of_rank(rank))

    def idle_time(self, rank: int) -> float:
        """Step time minus the rank's busy time."""
        return self.step_time() - self.busy_time(rank)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle over step time: of one rank, or of all ranks together when rank is None."""
        step = self.step_time()
        if step == 0.0:
            return 0.0
        if rank is not None:
            return self.idle_time(rank) / step
        busy = self._busy_time_per_rank()
        return sum(step - busy[r] for r in range(self.n_ranks)) / (step * self.n_ranks)

    def _busy_time_per_rank(self) -> list[float]:
        # One pass over the events instead of one per rank: this runs in big test grids.
        intervals: list[list[tuple[float, float]]] = [[] for _ in range(self.n_ranks)]
        for e in self.events:
            if e.is_compute:
                intervals[e.rank].append((e.start, e.end))
        return [_union_length(spans) for spans in intervals]

    def inflight(self, rank: int) -> list[tuple[float, int]]:
        """Activations held over time on a rank, as (time, count from then on) steps."""
        return [(t, count) for t, count, _ in self._inflight_steps(rank)]

    def inflight_bytes(self, rank: int) -> list[tuple[float, int]] | None:
        """Bytes of activations held over time, as steps; None when forwards carry no bytes."""
        if not self._forwards_carry_bytes(rank):
            return None
        return [(t, held) for t, _, held in self._inflight_steps(rank)]

    def peak_inflight(self, rank: int) -> int:
        """Most activations the rank held at once."""
        return max((count for _, count in self.inflight(rank)), default=0)

    def peak_inflight_bytes(self, rank: int) -> int | None:
        """Most activation bytes the rank held at once; None when forwards carry no bytes."""
        steps = self.inflight_bytes(rank)
        return None if steps is None else max((held for _, held in steps), default=0)

    def peak_inflight_per_rank(self) -> list[int]:
        """peak_inflight of every rank, comparable with schedules.theory().peak_inflight."""
        return [self.peak_inflight(r) for r in range(self.n_ranks)]

    def _forwards_carry_bytes(self, rank: int) -> bool:
        forwards = [e for e in self.of_rank(rank) if e.kind == "F"]
        return bool(forwards) and all(e.bytes is not None for e in forwards)

    def _inflight_steps(self, rank: int) -> list[tuple[float, int, int]]:
        """(time, count, bytes) after each change of the activations held by a rank.

        A forward of (stage, microbatch) holds its activations from its start
        (they are allocated as it runs) until the end of the pass that
        releases them (`releases_activations`): its full backward B or, when
        the backward is split, its weight gradient W. I alone releases nothing.
        """
        changes = []  # (time, order, d_count, d_bytes); releases sort before holds at the same time
        held_bytes = {}
        for e in self.of_rank(rank):
            key = (e.stage, e.microbatch)
            if e.kind == "F":
                held_bytes[key] = e.bytes or 0
                changes.append((e.start, 1, +1, e.bytes or 0))
            elif releases_activations(e.kind) and key in held_bytes:
                changes.append((e.end, 0, -1, -held_bytes.pop(key)))
        steps, count, held = [], 0, 0
        for time, _, d_count, d_bytes in sorted(changes):
            count, held = count + d_count, held + d_bytes
            if steps and steps[-1][0] == time:
                steps[-1] = (time, count, held)
            else:
                steps.append((time, count, held))
        return steps

    def summary(self) -> str:
        """A few lines of text: step time, bubble and peak in-flight per rank."""
        # The simulator's own label means cost units; measured (or seconds-costed) timelines are in seconds.
        def said(time: float) -> str:
            return f"{time:.4g}" if self.label == "simulated" else f"{time:.4g} s"

        unit = " (cost units)" if self.label == "simulated" else ""
        lines = [f"{self.label or 'timeline'}: {self.n_ranks} ranks, step {said(self.step_time())}{unit}, "
                 f"bubble {self.bubble_fraction():.1%}"]
        for r in range(self.n_ranks):
            lines.append(f"  rank {r}: busy {said(self.busy_time(r))}, bubble {self.bubble_fraction(r):.1%}, "
                         f"peak in-flight {self.peak_inflight(r)}")
        return "\n".join(lines)

    # -- Chrome trace

    def to_chrome_trace(self, path: str | PathLike | None = None) -> dict:
        """The timeline in the Chrome trace event format; also written to `path` when given."""
        tids = _chrome_tracks(self.events)
        trace = {
            "traceEvents": _chrome_metadata(self.n_ranks, set(zip((e.rank for e in self.events), tids)))
                           + [_chrome_event(e, tid) for e, tid in zip(self.events, tids)],
            "displayTimeUnit": "ms",
            "otherData": {"pplab": True, "label": self.label, "n_ranks": self.n_ranks},
        }
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    @classmethod
    def from_chrome_trace(cls, source: str | PathLike | dict | list) -> Timeline:
        """Read a timeline back from a Chrome trace (a path, or the loaded JSON)."""
        if isinstance(source, (str, PathLike)):
            with open(source) as f:
                source = json.load(f)
        # The format allows a bare list of events as well as an object.
        trace = {"traceEvents": source} if isinstance(source, list) else source
        other = trace.get("otherData", {})
        process_ranks = [e["pid"] for e in trace["traceEvents"]
                         if e.get("ph") == "M" and e.get("name") == "process_name"]
        events = [_event_from_chrome(e) for e in trace["traceEvents"] if e.get("ph") == "X"]
        n_ranks = other.get("n_ranks")
        if n_ranks is None:
            n_ranks = max([*process_ranks, *(e.rank for e in events), -1]) + 1
        return cls(events, n_ranks, other.get("label", ""))


def _chrome_metadata(n_ranks: int, used: set[tuple[int, int]]) -> list[dict]:
    """Process and track names, so each rank shows as 'rank r' with named tracks."""
    meta = []
    for rank in range(n_ranks):
        meta.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                     "args": {"name": f"rank {rank}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                     "args": {"sort_index": rank}})
        tids = set(_TRACK_NAMES) | {tid for r, tid in used if r == rank}
        for tid in sorted(tids):
            lane, track = divmod(tid, _LANE_STRIDE)
            name = _TRACK_NAMES[track] + (f" {lane + 1}" if lane else "")
            meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    return meta


def _chrome_tracks(events: Sequence[Event]) -> list[int]:
    """A track (thread id) per event: no two events that overlap in time share a track."""
    tids, lane_ends = [], {}  # (rank, track) -> when each of its lanes is free again
    for event in events:  # a Timeline keeps them sorted by rank, then start
        track = _track_of(event)
        ends = lane_ends.setdefault((event.rank, track), [])
        lane = next((i for i, end in enumerate(ends) if end <= event.start), len(ends))
        ends[lane:lane + 1] = [event.end]
        tids.append(track + _LANE_STRIDE * lane)
    return tids


def _track_of(event: Event) -> int:
    if event.kind.startswith("SEND"):
        return _SEND_TRACK
    if event.kind.startswith("RECV"):
        return _RECV_TRACK
    if event.kind in COLLECTIVE_KINDS:
        return _COLLECTIVE_TRACK
    return _COMPUTE_TRACK


def _chrome_event(event: Event, tid: int) -> dict:
    """One complete ('X') event; ts and dur are in microseconds, as the format wants."""
    args = {"kind": event.kind, "stage": event.stage, "microbatch": event.microbatch,
            # Exact seconds as well, so that importing back is lossless
            # (seconds -> microseconds -> seconds is not exact in floating point).
            "start_s": event.start, "end_s": event.end}
    for optional in ("bytes", "shape", "dtype"):
        value = getattr(event, optional)
        if value is not None:
            args[optional] = list(value) if optional == "shape" else value
    return {
        "ph": "X",
        "name": event.label(),
        "cat": "comm" if event.is_comm else "compute",
        "pid": event.rank,
        "tid": tid,
        "ts": event.start * 1e6,
        "dur": event.duration * 1e6,
        "args": args,
    }


def _microbatch_in_name(name: str) -> int | None:
    """The N of an 'mbN' word in an event name like 'F mb3', if any."""
    for word in name.split()[1:]:
        if word.startswith("mb") and word[2:].isdigit():
            return int(word[2:])
    return None


def _event_from_chrome(raw: dict) -> Event:
    args = raw.get("args", {})
    start = args.get("start_s", raw["ts"] / 1e6)
    end = args.get("end_s", start + raw.get("dur", 0.0) / 1e6)
    shape = args.get("shape")
    return Event(
        rank=int(raw["pid"]),
        kind=args.get("kind", raw["name"].split()[0]),
        stage=args.get("stage"),
        microbatch=args["microbatch"] if "microbatch" in args else _microbatch_in_name(raw["name"]),
        start=start,
        end=end,
        bytes=args.get("bytes"),
        shape=tuple(shape) if shape is not None else None,
        dtype=args.get("dtype"),
    )

