"""Where a measured step's bubble went, and what would shrink it.

A rank of a pipeline is idle for four reasons, and `explain` tells them apart on any
measured Timeline (pplab's own, or one imported from torch.profiler traces):

* the schedule: warm-up and cool-down idle that the schedule implies even on a perfect
  machine, from pplab's simulation of the same schedule with the costs measured in the step;
* waiting for a message: an action that could not start when its rank became free because
  its input (a forward's activation, a backward's gradient) had not arrived; the wait is
  attributed to the microbatch, to the rank that sent it, and to the rank at the root of the
  chain (a rank that waited itself before sending passes the blame upstream);
* a straggler: a rank whose compute took longer than its peers' (the median rank's). With
  stages of unequal work this is the rank with more to do, which a rebalance would help. Who it
  is, is decided action by action from every step given (`pplab.planning.straggler`), so that a busy
  machine makes the verdict undecided rather than wrong;
* outside the pipeline: the part of the profiled step (ProfilerStep) before its first action
  and after its last (the optimizer, data loading), where the traces say how long the step was.

Then the simulator predicts the step with one change at a time (twice the microbatches, stages
rebalanced, another schedule: `pplab.planning.whatif`, on a model of the run that includes its
messages and the runtime's own time per action), so that the report can say which single change
would help most. Those are predictions on the measured costs, and are stated as such.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from pplab.base.formatting import wrapped
from pplab.planning.prediction import Profile
from pplab.planning.simulator import costs_from_timeline, simulate
from pplab.planning.straggler import StragglerVerdict, straggler_verdict
from pplab.planning.whatif import RunModel, Suggestion, named_schedule, ranked, step_spread, suggestions
from pplab.schedules import Schedule, theory
from pplab.trace.timeline import Event, Timeline

__all__ = ["explain", "named_schedule"]

LOADED_SPREAD = 0.2  # an action typically this much over its best: the run's machine was busy
_FEEDS = {"F": ("F", -1), "B": ("B", +1), "I": ("I", +1)}  # an action's input: (producer kind, stage step)


@dataclass(frozen=True)
class Wait:
    """A compute action that started late because its input had not arrived."""

    rank: int
    action: str  # e.g. "1F3"
    microbatch: int
    seconds: float
    peer: int  # the rank that sent the input
    cause: int  # the rank at the root of the chain of waits


@dataclass(frozen=True)
class RankBubble:
    """One rank's step: how long, how busy, and its idle time by reason (seconds)."""

    rank: int
    step_time: float
    busy: float
    idle: float
    bubble_fraction: float
    schedule_idle: float  # what the simulation of the same schedule and costs leaves idle
    waiting: float  # for messages (sum of this rank's waits)
    straggler: float  # compute beyond the median rank's
    outside: float | None  # profiled step time outside the pipeline's actions (None: not recorded)


@dataclass
class BubbleReport:
    """`explain`'s answer: per rank, overall, the waits, the straggler and the predictions."""

    schedule: Schedule
    measured: Timeline
    simulated: Timeline
    theory_bubble: float | None
    ranks: list[RankBubble]
    waits: list[Wait]
    verdict: StragglerVerdict | None  # who straggles, with the evidence's bounds (None: one rank)
    suggestions: list[Suggestion] = field(default_factory=list)
    message_latency: float = 0.0  # seconds: the median time a message that was waited for took
    overhead_per_action: float = 0.0  # seconds: the runtime's own time between computes (see explain)
    predicted_as_is: float | None = None  # seconds: the run as it is, on the model the suggestions use
    notes: list[str] = field(default_factory=list)

    @property
    def straggler(self) -> int | None:
        """The rank named the straggler (None: none, or the evidence cannot tell)."""
        return self.verdict.rank if self.verdict else None

    @property
    def best(self) -> Suggestion | None:
        """The change predicted to help most (None if none helps): a measured change before an assumed
        one, and an assumed one only where it helps across the assumption's whole range."""
        helping = [s for s in ranked(self.suggestions)
                   if s.gain > 0.01 and (not s.assumed or s.gain - s.uncertainty > 0.01)]
        return helping[0] if helping else None

    def waits_caused_by(self, rank: int) -> float:
        """Seconds other ranks waited, at the root, for `rank`."""
        return sum(w.seconds for w in self.waits if w.cause == rank and w.rank != rank)

    def text(self) -> str:
        """The report in a few lines, for a terminal or a notebook."""
        m, s = self.measured, self.simulated
        theory = "n/a" if self.theory_bubble is None else f"{self.theory_bubble:.1%}"
        lines = [f"{self.schedule.name}: {self.schedule.n_ranks} ranks, {self.schedule.n_microbatches} "
                 "microbatches" + (f", {self.schedule.n_virtual} stages per "
                                   "rank" if self.schedule.n_virtual > 1
                                    else ""),
                 f"step {m.step_time() * 1e3:.2f} ms measured, {s.step_time() * 1e3:.2f} ms simulated on the "
                 f"measured costs (messages free); bubble {m.bubble_fraction():.1%} measured, "
                 f"{s.bubble_fraction():.1%} simulated, {theory} in theory",
                 "idle per rank (ms): the schedule's own (simulated, messages free), waits for messages "
                 "(measured, the schedule's included), compute beyond the median rank's, profiled step "
                 "outside the pipeline",
                 "rank  bubble  schedule  waiting  straggler  outside"]
        for r in self.ranks:
            outside = "   n/a" if r.outside is None else f"{r.outside * 1e3:6.2f}"
            lines.append(f"{r.rank:4d}  {r.bubble_fraction:6.1%}  {r.schedule_idle * 1e3:8.2f}  "
                         f"{r.waiting * 1e3:7.2f}  {r.straggler * 1e3:9.2f}  {outside}")
        if self.verdict is not None:
            lines.append(self.verdict.text())
        if self.straggler is not None:
            lines.append(f"rank {self.straggler} computed {self.ranks[self.straggler].straggler * 1e3:.2f} "
                         "ms more than the median rank; the other ranks waited "
                         f"{self.waits_caused_by(self.straggler) * 1e3:.2f} ms for it")
        longest = sorted(self.waits, key=lambda w: -w.seconds)[:3]
        for wait in longest:
            lines.append(f"rank {wait.rank} waited {wait.seconds * 1e3:.2f} ms before {wait.action} for "
                         f"microbatch {wait.microbatch} from rank {wait.peer}"
                         + (f" (which waited on rank {wait.cause})" if wait.cause != wait.peer else ""))
        if self.suggestions:
            lines.append("predicted by the simulator on the measured costs, messages taking "
                         f"{self.message_latency * 1e3:.2f} ms (the median of those waited for) and each "
                         f"compute {self.overhead_per_action * 1e3:.2f} ms of the runtime's own; the run as "
                         f"it is predicts {self.predicted_as_is * 1e3:.2f} ms there, and each change is "
                         "given against that (± how much the run's own steps varied, and for an assumed "
                         "cost how much it can be off by); measured changes first:")
            for suggestion in ranked(self.suggestions):
                either_way = f" ± {suggestion.uncertainty:.0%}" if suggestion.uncertainty >= 0.005 else ""
                assumed = f", assumed: {suggestion.assumed}" if suggestion.assumed else ""
                lines.append(f"  {suggestion.change}: {suggestion.predicted_step_time * 1e3:.2f} ms "
                             f"({-suggestion.gain:+.0%}{either_way}{assumed})")
            best = self.best
            lines.append(f"most helpful single change: {best.change}" if best else
                         "no single change is predicted to help by more than 1 %")
        lines += self.notes
        return wrapped("\n".join(lines))

    def to_json(self) -> dict:
        """The report as plain data."""
        return {"schedule": self.schedule.name, "n_ranks": self.schedule.n_ranks,
                "n_microbatches": self.schedule.n_microbatches, "n_virtual": self.schedule.n_virtual,
                "step_time": {"measured": self.measured.step_time(), "simulated": self.simulated.step_time()},
                "bubble": {"measured": self.measured.bubble_fraction(),
                           "simulated": self.simulated.bubble_fraction(),
                           "theory": self.theory_bubble},
                "ranks": [dataclasses.asdict(r) for r in self.ranks],
                "waits": [dataclasses.asdict(w) for w in self.waits],
                "straggler": self.straggler,
                "straggler_verdict": dataclasses.asdict(self.verdict) if self.verdict else None,
                "message_latency": self.message_latency, "overhead_per_action": self.overhead_per_action,
                "predicted_as_is": self.predicted_as_is,
                "suggestions": [dataclasses.asdict(s) for s in self.suggestions],
                "best": self.best.change if self.best else None, "notes": self.notes}


def explain(measured: Timeline, schedule: Schedule, outside: list[float | None] | None = None, *,
            steps: Sequence[Timeline] = (), profile: Profile | Sequence[Profile] = ()) -> BubbleReport:
    """Split each rank's idle time into the schedule's, waits, straggling and time outside; predict
    the step after one change at a time (pplab.planning.whatif).

    `measured` must hold the compute actions `schedule` has, rank by rank (raises ValueError
    naming the first that differs); `outside`, per rank, the profiled step's time outside them;
    `steps`, other steps of the same run, which the straggler's verdict weighs too; `profile`,
    one-device profiles of the same stages (`pplab.profile`) at the run's microbatch size and at
    half of it, for what a split backward and half a microbatch cost (see pplab.planning.whatif)."""
    for timeline in (measured, *steps):
        _check_actions(timeline, schedule)
    costs = costs_from_timeline(measured, schedule.n_stages)  # messages free: the schedule's own idle
    simulated = simulate(schedule, costs)
    simulated.label = "simulated on the measured costs"  # in seconds, not the simulator's cost units
    latency = message_latency(measured, schedule)
    waits = _waits(measured, schedule)
    busy = [measured.busy_time(rank) for rank in range(schedule.n_ranks)]
    median_busy = statistics.median(busy)
    step = measured.step_time()
    ranks = [RankBubble(rank, step, busy[rank], measured.idle_time(rank), measured.bubble_fraction(rank),
                        simulated.idle_time(rank), sum(w.seconds for w in waits if w.rank == rank),
                        max(0.0, busy[rank] - median_busy), outside[rank] if outside else None)
             for rank in range(schedule.n_ranks)]
    report = BubbleReport(schedule, measured, simulated, theory(schedule, costs).bubble_fraction,
                          ranks, waits,
                          straggler_verdict([measured, *steps], schedule.n_ranks))
    profiles = [profile] if isinstance(profile, Profile) else list(profile)
    model = RunModel.of(schedule, costs, latency, overhead_per_action(measured, schedule), profiles)
    report.predicted_as_is = model.step_time()
    report.suggestions = suggestions(model, step_spread([measured, *steps]))
    report.message_latency, report.overhead_per_action = latency, model.overhead
    if model.split_from == "assumed" and any(s.change == "schedule zb-h1" for s in report.suggestions):
        report.notes.append("schedule zb-h1's prediction takes a backward split into I and W to cost what "
                            "the whole one does; on a CPU it costs more: give explain a profile of the same "
                            "stages (pplab.profile) to take the split's cost from it")
    if model.halved_from == "assumed":
        report.notes.append("twice the microbatches at half the size are taken to cost half as much each; a "
                            "layer has costs that do not shrink with the batch: give explain profiles at the "
                            "run's microbatch size and at half of it to take them from those")
    if report.verdict is not None and report.verdict.load_spread > LOADED_SPREAD:
        report.notes.append(f"the machine's load varied an action's time by {report.verdict.load_spread:.0%} "
                            f"(typical over best) in this run: the predictions above carry that much "
                            f"uncertainty; measure on a quieter machine to trust a smaller gain")
    return report


def message_latency(measured: Timeline, schedule: Schedule) -> float:
    """What a message took in this run: the median time from the end of a compute on one rank to
    the start of the compute on another that consumed its result, over those that waited for it."""
    spans = [max(0.0, event.start - producer.end) for event, producer, _ in _late_inputs(measured, schedule)]
    return statistics.median(spans) if spans else 0.0


def overhead_per_action(measured: Timeline, schedule: Schedule) -> float:
    """The runtime's own time between two computes of a rank (posting messages, recording): the
    median gap before a compute whose input was already there when its rank became free. A change
    that adds actions (more microbatches, split backwards, more stages) adds that much per action."""
    late = {(event.stage, event.kind, event.microbatch) for event, _, _ in _late_inputs(measured, schedule)}
    gaps = []
    for rank in range(schedule.n_ranks):
        events = sorted(measured.compute_events(rank), key=lambda e: e.start)
        gaps += [max(0.0, after.start - before.end) for before, after in zip(events, events[1:])
                 if (after.stage, after.kind, after.microbatch) not in late]
    return statistics.median(gaps) if gaps else 0.0


def _late_inputs(measured: Timeline, schedule: Schedule):
    """(compute, its producer on another rank, when its rank became free) for every compute whose
    input was not there yet when its rank became free."""
    compute = {(e.stage, e.kind, e.microbatch): e for e in measured.events if e.is_compute}
    for rank in range(schedule.n_ranks):
        free = measured.start
        for event in sorted(measured.compute_events(rank), key=lambda e: e.start):
            producer = _producer(event, compute, schedule)
            if producer is not None and producer.rank != rank and producer.end > free:
                yield event, producer, free
            free = max(free, event.end)


def _check_actions(measured: Timeline, schedule: Schedule) -> None:
    """Every rank ran exactly its scheduled compute actions (in any order)."""
    for rank in range(schedule.n_ranks):
        planned = sorted(str(a) for a in schedule.actions[rank] if a.kind.value in ("F", "B", "I", "W"))
        ran = sorted(f"{e.stage}{e.kind}{e.microbatch}" for e in measured.compute_events(rank))
        if planned != ran:
            extra, missing = sorted(set(ran) - set(planned)), sorted(set(planned) - set(ran))
            raise ValueError(
                f"rank {rank} ran {len(ran)} compute actions, and {schedule.name} with {schedule.n_ranks} "
                f"ranks, {schedule.n_microbatches} microbatches and {schedule.n_virtual} stage(s) per rank "
                f"plans {len(planned)}" + (f"; not planned: {' '.join(extra[:6])}" if extra else "")
                + (f"; not run: {' '.join(missing[:6])}" if missing else "")
                + ": give the schedule, microbatches and stages per rank the run used")


def _waits(measured: Timeline, schedule: Schedule) -> list[Wait]:
    """Each compute action that began late because its input was not there when its rank was free."""
    compute = {(e.stage, e.kind, e.microbatch): e for e in measured.events if e.is_compute}
    waits: dict[tuple, Wait] = {}
    for event, producer, free in _late_inputs(measured, schedule):
        if event.start > free:
            waits[(event.stage, event.kind, event.microbatch)] = Wait(
                event.rank, f"{event.stage}{event.kind}{event.microbatch}", event.microbatch,
                event.start - free, producer.rank, producer.rank)
    # The root of a chain: a producer that itself started late waited on someone else.
    def root(key, seen=()) -> int:
        wait = waits[key]
        producer = _producer(compute[key], compute, schedule)
        upstream = (producer.stage, producer.kind, producer.microbatch)
        if upstream in waits and upstream not in seen:
            return root(upstream, (*seen, key))
        return wait.peer
    return [dataclasses.replace(wait, cause=root(key)) for key, wait in waits.items()]


def _producer(event: Event, compute: dict, schedule: Schedule) -> Event | None:
    """The compute whose result `event` consumes from another stage (None for the pipeline's ends)."""
    if event.kind not in _FEEDS:
        return None
    kind, step = _FEEDS[event.kind]
    stage = event.stage + step
    if not 0 <= stage < schedule.n_stages:
        return None
    return compute.get((stage, kind, event.microbatch)) or compute.get((stage, "B", event.microbatch))
