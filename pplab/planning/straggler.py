"""Which rank computes too long: a verdict that a busy machine does not flip.

A rank's compute time on a shared machine is its own work plus whatever the other processes took
from its core meanwhile. The load only ever adds, and it adds unevenly: one action runs alone,
the next one shares its core. So the evidence here is per action, never a rank's total:

* each action (stage, kind) has run several times, once per microbatch and once per step given;
  its *best* time (the fastest run) is the closest to its cost, and never under it;
* how far the best may still be over its cost is read from the runs next to it. Near its
  smallest values the load's excess is spread about evenly, so the fastest run's excess is
  like one of the gaps between the next runs: it is over `k` times the gap up to the `j`-th
  next run with probability (1 + k)^-j. With `k` set for `CONFIDENCE` (shared among the few
  gaps tried, the tightest kept), an action's cost lies between its best less `k` such gaps
  and its best. When the next runs came within a hair of the best, that range is a point;
  when they took much longer, the best was probably loaded too, and the range says by how much;
* a rank's compute is the sum over its actions, at either end of that range;
* the candidate is the rank whose compute at best is largest. Against the other ranks (their
  median) it computes at least its lowest over their best, and at most its best over their
  lowest: a point on a quiet machine, an interval that widens as the load blurs the best;
* it is the straggler when even the lower end is over `STRAGGLER_RATIO` and every kind of its
  actions (F, B, ...) is slower at best than the other ranks' at best; there is none when even
  the upper end is under the ratio; otherwise the verdict is undecided, saying by how much the
  load varied an action's time (typical, the median run, over best). More steps narrow it.

A load that stretches every run of one rank alike (a core it never has to itself) is not told
apart from more work: that rank does compute longer, on this machine.

Pure Python on a Timeline: it runs on pplab's own recordings and on imported profiler traces.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from pplab.trace.timeline import Timeline

__all__ = ["STRAGGLER_RATIO", "StragglerVerdict", "straggler_verdict"]

STRAGGLER_RATIO = 1.25  # a rank computing this much more than the other ranks is the straggler
CONFIDENCE = 0.9  # of each end of an action's cost range (see the module's docstring)


@dataclass(frozen=True)
class StragglerVerdict:
    """The straggler named (or none, or undecided), with the evidence's bounds."""

    rank: int | None  # the straggler; None when there is none or the evidence cannot tell
    decided: bool
    candidate: int  # the rank that computes most at best
    low: float  # the candidate's compute over the other ranks', at least (with CONFIDENCE)
    high: float  # ... and at most
    # how much longer an action typically ran than at best (the largest rank's, a fraction)
    load_spread: float
    runs_per_action: int  # the fewest times any action ran: the evidence's depth

    def text(self) -> str:
        """One line for a report."""
        if math.isinf(self.high):  # the other ranks computed nothing at their slowest
            bounds = f"at least {self.low:.2f}x (no upper bound; {CONFIDENCE:.0%} bounds)"
        elif abs(self.high - self.low) < 0.005:
            bounds = f"{self.low:.2f}x"
        else:
            bounds = f"{self.low:.2f}-{self.high:.2f}x ({CONFIDENCE:.0%} bounds)"
        evidence = (f"each action's fastest runs against the other ranks' "
                    f"({self.runs_per_action} run{'s' if self.runs_per_action != 1 else ''} of each action)")
        if self.rank is not None:
            return (f"straggler: rank {self.rank}, computing {bounds} the other ranks' compute; "
                    f"from {evidence}")
        if self.decided:
            return (f"no straggler: rank {self.candidate}, the busiest, computes {bounds} the other ranks' "
                    f"compute (under {STRAGGLER_RATIO}x); from {evidence}")
        return (f"straggler: undecided: rank {self.candidate} computes {bounds} the other ranks' "
                f"compute, and the machine's load varied an action's time by {self.load_spread:.0%} "
                f"(typical over best): too little to tell it from the {STRAGGLER_RATIO}x line. Measure "
                "more steps, or on a quieter machine")


def cost_range(durations: Sequence[float]) -> tuple[float, float]:
    """An action's cost from its runs: (lowest, best), `CONFIDENCE` that it is not under lowest."""
    ordered = sorted(durations)
    best = ordered[0]
    gaps = range(1, min(len(ordered) - 1, max(2, len(ordered) // 4)) + 1)  # up to a quarter of the runs along
    miss = (1 - CONFIDENCE) / len(gaps) if gaps else 0.0  # the chance of missing, shared by the gaps tried
    lowest = [best - (miss ** (-1 / j) - 1) * (ordered[j] - best) for j in gaps]  # (1 + k)^-j = miss
    return max(0.0, max(lowest, default=best)), best


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
    ranges = {key: cost_range(durations) for key, durations in runs.items()}
    LOWEST, BEST = 0, 1

    def compute(rank: int, end: int, kind: str | None = None) -> float:
        """The rank's compute in one step, each action's cost at one `end` of its range."""
        return sum(count * ranges[key][end] for key, count in count_in_step.items()
                   if key[0] == rank and kind in (None, key[2]))

    def over_others(candidate: int, mine: int, theirs: int, kind: str | None = None) -> float:
        others = statistics.median(compute(rank, theirs, kind) for rank in range(n_ranks)
                                   if rank != candidate)
        return compute(candidate, mine, kind) / others if others > 0 else float("inf")

    best = [compute(rank, BEST) for rank in range(n_ranks)]
    candidate = max(range(n_ranks), key=lambda rank: best[rank])
    low, high = over_others(candidate, LOWEST, BEST), over_others(candidate, BEST, LOWEST)
    every_kind_slower = all(over_others(candidate, BEST, BEST, kind) > 1 for kind in kinds)
    typical = [sum(count * statistics.median(runs[key]) for key, count in count_in_step.items()
                   if key[0] == rank)
               for rank in range(n_ranks)]
    spread = max((typical[rank] / best[rank] - 1 for rank in range(n_ranks) if best[rank] > 0), default=0.0)
    straggles = low > STRAGGLER_RATIO and every_kind_slower
    decided = straggles or high < STRAGGLER_RATIO
    return StragglerVerdict(candidate if straggles else None, decided, candidate, low, high, spread,
                            min((len(durations) for durations in runs.values()), default=0))
