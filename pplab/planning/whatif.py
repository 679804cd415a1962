"""What-ifs from one measured run: the step after one change at a time, on the run's own costs.

`pplab.planning.bubble.explain` reads a run; this module answers "and if ...?" for the changes a user can
make with the same ranks: twice the microbatches at half the size, stages rebalanced, another
schedule (gpipe, 1f1b, zb-h1), interleaved with 2 stages per rank. Each is simulated on a model
of the run (`RunModel`) built from what the run measured:

* each stage's forward and backward (medians over its microbatches);
* the time a message took (the median of those a rank waited for);
* the runtime's own time around each compute (posting messages, recording): a change that adds
  actions adds that much per action, which is why smaller microbatches gain less than the
  bubble's arithmetic says.

What a run cannot show is taken from one-device profiles of the same stages when they are given
(`pplab.profile` with the run's cut): at the run's microbatch size, what a backward costs when
split into its input and weight halves (I + W is more than B on a CPU: the split walks the graph
twice); at half that size, what half a microbatch costs (more than half: a layer has costs that
do not shrink with the batch). Without them, a split backward is taken to cost what the whole one
does and half a microbatch half a whole one's: such a change is "assumed", its uncertainty widened
by what the assumption can be off by (`ASSUMED_RANGES`), and it ranks below every measured change.
Floor 2: pure Python.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from pplab.base.config import takes_options
from pplab.planning.prediction import Profile
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import Kind, Schedule, build, from_torch, torch_plan
from pplab.trace.timeline import Timeline

__all__ = ["ASSUMED_RANGES", "RunModel", "Suggestion", "named_schedule", "step_spread", "suggestions"]

# What an assumed cost can really be, from one-device profiles of the lessons' models (tiny, 128- and
# 256-wide, 2 stages, microbatches of 4 x 64 tokens, a 2-core CPU): a split backward's I + W cost
# 1.00-1.83 x its B, and half a microbatch's F and B 0.53-0.66 x a whole one's. Without a profile,
# a change resting on one is predicted at the optimistic end and again at the far end.
ASSUMED_RANGES = {"split": (1.0, 1.8), "halved": (0.5, 0.7)}


@dataclass(frozen=True)
class Suggestion:
    """One change, and the step time the simulator predicts for it."""

    change: str
    predicted_step_time: float
    gain: float  # 1 - predicted / predicted for the run as it is
    uncertainty: float = 0.0  # the gain is this much either way: how much the run's own steps varied,
    # widened, for an assumed change, by how much the gain moves across the assumption's range
    assumed: str = ""  # what the prediction assumed rather than measured ("": nothing)


def named_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The schedule called `name`: pplab's own, or the plan of one of torch's schedules (from torch's
    planner: torch's pipelining package is imported for those)."""
    try:
        return build(name, n_ranks, n_microbatches, n_virtual)
    except ValueError as not_pplabs:
        try:
            entry = torch_plan(name)
        except ValueError:
            raise not_pplabs from None
        return from_torch(entry.name, n_ranks, n_microbatches, n_virtual)


def _is_split(schedule: Schedule) -> bool:
    return any(action.kind == Kind.I for actions in schedule.actions for action in actions)


def _per_rank(values: Sequence[float], schedule: Schedule) -> list[float]:
    """Per-stage `values` summed over each rank's stages."""
    return [sum(values[s] for s in schedule.stages_of(rank)) for rank in range(schedule.n_ranks)]


@dataclass(frozen=True)
class RunModel:
    """A measured run as the simulator sees it: costs per stage, what a split backward costs per
    rank, what half a microbatch costs per stage, the message latency and the runtime's own time
    per compute action (seconds)."""

    schedule: Schedule  # the run's
    forward: tuple[float, ...]  # per stage
    backward: tuple[float, ...]  # per stage: a whole backward (B)
    split_cost: tuple[float, ...]  # per rank: (I + W) / B
    input_share: tuple[float, ...]  # per rank: I / (I + W)
    halved: tuple[tuple[float, float], ...]  # per stage: F and B of half a microbatch, over a whole one's
    latency: float  # a message's time from the end of its producer (overhead included) to its consumer
    overhead: float
    split_from: str  # where split_cost comes from: "the profile" or "assumed" (I + W = B)
    halved_from: str  # where halved comes from: "the profiles" or "assumed" (one half)

    @classmethod
    def of(cls, schedule: Schedule, costs: Costs, latency: float, overhead: float,
           profiles: Sequence[Profile] = ()) -> "RunModel":
        """The model of a run of `schedule` whose compute `costs` were measured (see the module):
        `latency`, from a producer's end to its waiting consumer's start; `overhead`, per compute;
        `profiles`, one-device profiles of its stages: at its microbatch size (the largest given),
        and at half of it. The model's computes end `overhead` later than the run's did, so its
        messages take that much less (the runtime's time around a send is in both)."""
        for profile in profiles:
            if len(profile.stages) != schedule.n_stages:
                raise ValueError(f"profile has {len(profile.stages)} stages and schedule {schedule.name!r} "
                                 f"{schedule.n_stages}: profile the run's stages (pplab.profile with its "
                                 "n_stages and balance)")
        by_size = {profile.microbatch_size: profile for profile in profiles}
        at_size = by_size[max(by_size)] if by_size else None
        at_half = by_size.get(max(by_size) / 2) if by_size else None
        stages = range(schedule.n_stages)
        forward = tuple(costs.compute_time(Kind.F, s) for s in stages)
        input_grad = [costs.compute_time(Kind.I, s) for s in stages]
        whole = [i + costs.compute_time(Kind.W, s) for s, i in zip(stages, input_grad)]

        def ratios(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
            return [t / b for t, b in zip(_per_rank(top, schedule), _per_rank(bottom, schedule))]

        if at_size is not None:  # how I and W compare with B, on one device
            one_device_split = [p.input_grad + p.weight_grad for p in at_size.stages]
            split_cost = ratios(one_device_split, [p.backward for p in at_size.stages])
        else:
            split_cost = [1.0] * schedule.n_ranks
        if _is_split(schedule):  # the run shows I and W, and what B would be only through split_cost
            input_share = ratios(input_grad, whole)
            backward = tuple(b / split_cost[schedule.stage_to_rank(s)] for s, b in enumerate(whole))
        else:
            input_share = (ratios([p.input_grad for p in at_size.stages], one_device_split)
                           if at_size is not None else [0.5] * schedule.n_ranks)
            backward = tuple(whole)
        halved = ([(half.forward / full.forward, half.backward / full.backward)
                   for half, full in zip(at_half.stages, at_size.stages)] if at_half is not None
                  else [(0.5, 0.5)] * schedule.n_stages)
        return cls(schedule, forward, backward, tuple(split_cost), tuple(input_share), tuple(halved),
                   max(0.0, latency - overhead), overhead, "assumed" if at_size is None else "the profile",
                   "assumed" if at_half is None else "the profiles")

    def costs(self, schedule: Schedule, forward: Sequence[float], backward: Sequence[float]) -> Costs:
        """Costs of `schedule` (the same ranks) with these per-stage F and B: a split backward's
        halves by its rank's measured split, and every compute paying the runtime's overhead."""
        o = self.overhead
        f = tuple(x + o for x in forward)
        if not _is_split(schedule):
            return Costs(forward=f, backward=tuple(x + o for x in backward), latency=self.latency)
        ranks = [schedule.stage_to_rank(s) for s in range(schedule.n_stages)]
        iw = [x * self.split_cost[r] for x, r in zip(backward, ranks)]
        return Costs(forward=f, input_grad=tuple(x * self.input_share[r] + o for x, r in zip(iw, ranks)),
                     weight_grad=tuple(x * (1 - self.input_share[r]) + o for x, r in zip(iw, ranks)),
                     latency=self.latency)

    @takes_options(Costs, differs={"forward": "None: the run's"})
    def step_time(self, schedule: Schedule | None = None, forward: Sequence[float] | None = None,
                  backward: Sequence[float] | None = None) -> float:
        """The simulated step of `schedule` (default: the run's) on these costs (default: the run's)."""
        schedule = self.schedule if schedule is None else schedule
        forward = self.forward if forward is None else forward
        backward = self.backward if backward is None else backward
        return simulate(schedule, self.costs(schedule, forward, backward)).step_time()


def step_spread(steps: Sequence[Timeline]) -> float:
    """How much a run's steps varied: half their range, as a fraction of their median (0 for one)."""
    times = [step.step_time() for step in steps]
    return (max(times) - min(times)) / 2 / statistics.median(times) if len(times) > 1 else 0.0


def suggestions(model: RunModel, uncertainty: float = 0.0) -> list[Suggestion]:
    """The simulator's step time for one change at a time, against the run as it is on `model`;
    each gain `uncertainty` either way (see `step_spread`)."""
    schedule = model.schedule
    p, m, v = schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual
    now = model.step_time()
    forward, backward = model.forward, model.backward
    tried = []
    split_assumed = model.split_from == "assumed"
    worst_split = replace(model, split_cost=(ASSUMED_RANGES["split"][1],) * p)

    def attempt(change: str, name: str, microbatches: int, virtual: int,
                stage_costs: Callable[[RunModel, Schedule], tuple[Sequence[float], Sequence[float]]],
                assumed: str = "", at_far_end: RunModel | None = None) -> None:
        """`stage_costs(model, changed)`: the changed schedule's forward and backward per stage;
        `at_far_end`, for an assumed change, the model at the assumption's far end."""
        try:
            changed = named_schedule(name, p, microbatches, virtual)
            predicted = model.step_time(changed, *stage_costs(model, changed))
            far = (at_far_end.step_time(changed, *stage_costs(at_far_end, changed)) if at_far_end is not None
                   else predicted)
        except ValueError:
            return  # a schedule these sizes do not allow
        width = abs(far - predicted) / now  # how far the gain moves across the assumption's range
        tried.append(Suggestion(change, predicted, 1 - predicted / now, max(uncertainty, width), assumed))

    halved_assumed = model.halved_from == "assumed"
    low, high = ASSUMED_RANGES["halved"]
    attempt(f"{2 * m} microbatches of half the size", schedule.name, 2 * m, v,
            lambda run, _: ([x * f for x, (f, _) in zip(forward, run.halved)],
                            [x * b for x, (_, b) in zip(backward, run.halved)]),
            f"half a microbatch costs {low:g}-{high:g} of a whole one's" if halved_assumed else "",
            replace(model, halved=((high, high),) * len(forward)) if halved_assumed else None)
    mean_f, mean_b = statistics.fmean(forward), statistics.fmean(backward)
    attempt("stages rebalanced to equal work", schedule.name, m, v,
            lambda run, _: ([mean_f] * len(forward), [mean_b] * len(backward)))
    # Each rank keeps its work, split evenly among its stages in the changed schedule (which rank
    # runs which stage comes from its placement: interleaved puts stages r and r + p on rank r).
    per_rank_f, per_rank_b = _per_rank(forward, schedule), _per_rank(backward, schedule)

    def each_rank_split(run: RunModel, changed: Schedule):
        share = [len(changed.stages_of(r)) for r in range(p)]
        ranks = [changed.stage_to_rank(s) for s in range(changed.n_stages)]
        # A split run's whole backward is its I + W over the split's cost: on `run`'s, not the model's.
        redone = [model.split_cost[r] / run.split_cost[r] if _is_split(schedule) else 1.0 for r in range(p)]
        return ([per_rank_f[r] / share[r] for r in ranks],
                [per_rank_b[r] * redone[r] / share[r] for r in ranks])

    low, high = ASSUMED_RANGES["split"]
    for name in ("gpipe", "1f1b", "zb-h1"):
        if name != schedule.name:
            splits = split_assumed and _is_split(named_schedule(name, p, m)) != _is_split(schedule)
            attempt(f"schedule {name}", name, m, 1, each_rank_split,
                    f"a split backward's I + W costs {low:g}-{high:g} x its B" if splits else "",
                    worst_split if splits else None)
    if schedule.name != "interleaved-1f1b" or v != 2:
        attempt("schedule interleaved-1f1b with 2 stages per rank", "interleaved-1f1b", m, 2, each_rank_split)
    return ranked(tried)


def ranked(tried: Sequence[Suggestion]) -> list[Suggestion]:
    """Measured changes first, then assumed ones, each by its gain: a guess never outranks a measure."""
    return sorted(tried, key=lambda s: (bool(s.assumed), -s.gain))
