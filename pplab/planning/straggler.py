"""Which rank computes too long: a verdict that a busy machine does not flip.

A rank's compute time on a shared machine is its own work plus whatever the other processes took
from its core meanwhile. The load only ever adds, and it adds unevenly: one action runs alone,
the next one shares its core. So the evidence here is per action, never a rank's total:

* each action (stage, kind) has run several times, once per microbatch and once per step given;
  its *best* time (the fastest run) is the closest to its cost, its *typical* time (the median)
  is what the load made of it;
* a rank's compute at best is the sum over its actions of their best times, and likewise at
  typical;
* the candidate is the rank whose compute at best is largest. Against the other ranks (their
  median) it computes at least its best over their typical, and at most its typical over their
  best: an interval that is narrow on a quiet machine and widens with the load;
* it is the straggler when even the lower end is over `STRAGGLER_RATIO` and every kind of its
  actions (F, B, ...) at best is slower than the other ranks' typical: an action whose every run
  was loaded has a slow best, two kinds loaded every time are far rarer, and a rank with more
  work is slower at all of them. There is none when even the upper end is under the ratio;
  otherwise the verdict is undecided, saying by how much the load varied an action's time.

Pure Python on a Timeline: it runs on pplab's own recordings and on imported profiler traces.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from pplab.trace.timeline import Timeline

__all__ = ["STRAGGLER_RATIO", "StragglerVerdict", "straggler_verdict"]

STRAGGLER_RATIO = 1.25  # a rank computing this much more than the other ranks is the straggler


@dataclass(frozen=True)
class StragglerVerdict:
    """The straggler named (or none, or undecided), with the evidence's bounds."""

    rank: int | None  # the straggler; None when there is none or the evidence cannot tell
    decided: bool
    candidate: int  # the rank that computes most at best
    low: float  # the candidate's compute over the other ranks', at least (its best against their typical)
    high: float  # ... and at most (its typical against their best)
    load_spread: float  # how much longer an action typically ran than at best (the largest rank's, a fraction)
    runs_per_action: int  # the fewest times any action ran: the evidence's depth

    def text(self) -> str:
        """One line for a report."""
        bounds = (f"{self.low:.2f}x" if abs(self.high - self.low) < 0.005
                  else f"{self.low:.2f}-{self.high:.2f}x")
        evidence = (f"its actions' best and typical times against the other ranks' "
                    f"({self.runs_per_action} run{'s' if self.runs_per_action != 1 else ''} of each action)")
        if self.rank is not None:
            return f"straggler: rank {self.rank}, computing {bounds} the other ranks' compute; from {evidence}"
        if self.decided:
            return (f"no straggler: rank {self.candidate}, the busiest, computes {bounds} the other ranks' "
                    f"compute (under {STRAGGLER_RATIO}x); from {evidence}")
        return (f"straggler: undecided: rank {self.candidate} computes {bounds} the other ranks' compute, and "
                f"the machine's load varied an action's time by {self.load_spread:.0%} (typical over best): too "
                f"little to tell it from the {STRAGGLER_RATIO}x line. Measure more steps, or on a quieter machine")


def straggler_verdict(timelines: Sequence[Timeline], n_ranks: int) -> StragglerVerdict | None:
    """The verdict from one or more measured steps of one pipeline (None for a single rank)."""
    if n_ranks < 2:
        return None
    runs: dict[tuple, list[float]] = defaultdict(list)  # (rank, stage, kind) -> every duration seen
    count_in_step: dict[tuple, int] = defaultdict(int)  # how often the action runs in one step
    for index, timeline in enumerate(timelines):
        for event in timeline.compute_events():
            key = (event.rank, event.stage, event.kind)
            runs[key].append(event.duration)
            if index == 0:
                count_in_step[key] += 1
    kinds = sorted({kind for _, _, kind in count_in_step})

    def compute(rank: int, estimate, kind: str | None = None) -> float:
        """The rank's compute in one step, each action at its `estimate` (min: best, median: typical)."""
        return sum(count * estimate(runs[key]) for key, count in count_in_step.items()
                   if key[0] == rank and kind in (None, key[2]))

    def over_others(candidate: int, mine, theirs, kind: str | None = None) -> float:
        others = statistics.median(compute(rank, theirs, kind) for rank in range(n_ranks) if rank != candidate)
        return compute(candidate, mine, kind) / others if others > 0 else float("inf")

    best = [compute(rank, min) for rank in range(n_ranks)]
    typical = [compute(rank, statistics.median) for rank in range(n_ranks)]
    candidate = max(range(n_ranks), key=lambda rank: best[rank])
    low, high = over_others(candidate, min, statistics.median), over_others(candidate, statistics.median, min)
    every_kind_slower = all(over_others(candidate, min, statistics.median, kind) > 1 for kind in kinds)
    spread = max((typical[rank] / best[rank] - 1 for rank in range(n_ranks) if best[rank] > 0), default=0.0)
    straggles = low > STRAGGLER_RATIO and every_kind_slower
    decided = straggles or high < STRAGGLER_RATIO
    return StragglerVerdict(candidate if straggles else None, decided, candidate, low, high, spread,
                            min((len(durations) for durations in runs.values()), default=0))
