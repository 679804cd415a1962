"""Floor 2, a lab's own costs: what a real lab adds to a one-device profile, read off a probe's run.

A profile (`pplab.profile`) times each stage alone in one process. On a lab the same compute runs
beside the other ranks, the client and the controller, inside a runtime that posts messages and
records events. `Lab.calibrate()` runs a small probe pipeline on the lab's own ranks at two
widths (pplab.session.calibrate), profiles the same probe on one device, and reads from its steps:

* how a compute on a rank relates to its profile: ``on_rank = scale * profiled + fixed`` (least
  squares over every compute of the probe, both widths: `fixed` is what an action pays whatever
  its size, `scale` what sharing the cores costs per second of work);
* the runtime's own time between two computes of a rank (`overhead`: posting messages, recording),
  the median gap before a compute whose input was already there;
* a message's time beyond that (`latency`): from its producer's end to its waiting consumer's start;
* how sure it is (`spread`): half the interquartile range of the computes' ratio to the fit.

`Calibration.costs(profile, schedule)` turns a profile into the costs a prediction on this lab
simulates. Floor 2: pure Python.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from pplab.base.formatting import ShownAsText
from pplab.planning.prediction import Profile
from pplab.planning.simulator import Costs
from pplab.schedules import Schedule
from pplab.trace.timeline import Timeline

__all__ = ["Calibration", "calibration_from_runs"]

_PROFILED = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}


@dataclass(frozen=True, repr=False)
class Calibration(ShownAsText):
    """What this lab adds to a one-device profile (see the module)."""

    scale: float  # a compute on a rank: scale * its profiled seconds + fixed
    fixed: float  # seconds
    overhead: float  # seconds of the runtime's own between two computes of a rank
    latency: float  # seconds a message takes beyond the overhead
    spread: float  # half the interquartile range of the computes around the fit, as a fraction
    n_ranks: int
    device: str
    probe: str  # what was run
    seconds: float = 0.0  # how long calibrating took

    def compute_time(self, profiled: float) -> float:
        """What a compute profiled at `profiled` seconds takes on a rank of this lab (0 stays 0)."""
        return self.scale * profiled + self.fixed if profiled > 0 else 0.0

    def costs(self, profile: Profile, schedule: Schedule) -> Costs:
        """The costs `schedule` runs at on this lab: each profiled compute as it runs on a rank, plus
        the runtime's overhead; each message the lab's latency (the profile's own link is left out)."""
        split = any(action.kind.value == "I" for actions in schedule.actions for action in actions)
        stages = profile.stages
        one_device = (Costs(forward=[s.forward for s in stages], input_grad=[s.input_grad for s in stages],
                            weight_grad=[s.weight_grad for s in stages]) if split else
                      Costs(forward=[s.forward for s in stages], backward=[s.backward for s in stages]))
        return self.apply(one_device)

    def apply(self, costs: Costs) -> Costs:
        """`costs` measured on one device (per stage, in seconds) as this lab runs them: what
        `pplab.search(..., lab=lab)` ranks its candidates on."""
        def on_rank(value):
            if value is None:
                return None
            if isinstance(value, (int, float)):
                return self.compute_time(value) + self.overhead
            return [self.compute_time(v) + self.overhead for v in value]

        if costs.input_grad is not None and costs.weight_grad is not None:  # B is then I + W as run
            whole = dict(backward=None, input_grad=on_rank(costs.input_grad),
                         weight_grad=on_rank(costs.weight_grad))
        else:
            whole = dict(backward=on_rank(costs.backward), input_grad=None, weight_grad=None)
        return replace(costs, forward=on_rank(costs.forward), latency=costs.latency + self.latency, **whole)

    def __str__(self) -> str:
        return (f"calibration of {self.n_ranks} ranks on {self.device} ({self.probe}; {self.seconds:.1f} s): "
                f"a compute takes {self.scale:.2f} x its one-device time + {self.fixed * 1e3:.2f} ms, the "
                f"runtime {self.overhead * 1e3:.2f} ms between computes, a message "
                f"{self.latency * 1e3:.2f} ms more; "
                f"computes vary {self.spread:.0%} around that")


def calibration_from_runs(runs: Sequence[tuple[Timeline, Profile]], schedule: Schedule, *, device: str,
                          probe: str, seconds: float = 0.0) -> Calibration:
    """A `Calibration` from a probe's measured steps, each with the one-device profile of its stages
    (the probe at several microbatch sizes gives the fit its slope and its intercept)."""
    from pplab.planning.bubble import message_latency, overhead_per_action  # the readers of a run

    pairs = []  # (profiled, on a rank)
    overheads, latencies = [], []
    for timeline, profile in runs:
        for event in timeline.compute_events():
            profiled = getattr(profile.stages[event.stage], _PROFILED[event.kind])
            if profiled > 0:
                pairs.append((profiled, event.duration))
        overhead = overhead_per_action(timeline, schedule)
        overheads.append(overhead)
        latencies.append(max(0.0, message_latency(timeline, schedule) - overhead))
    if len({round(profiled, 6) for profiled, _ in pairs}) < 2:
        raise ValueError("calibrating needs computes of at least two sizes: run the probe at two "
                         "microbatch sizes")
    scale, fixed = _fit(pairs)
    ratios = [measured / (scale * profiled + fixed) for profiled, measured in pairs]
    low, _, high = statistics.quantiles(ratios, n=4)
    return Calibration(scale, fixed, statistics.median(overheads), statistics.median(latencies),
                       (high - low) / 2, schedule.n_ranks, device, probe, seconds)


def _fit(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = scale * x + fixed, with fixed kept at 0 or above (a compute never takes
    less than nothing)."""
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    scale = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread_x
    fixed = mean_y - scale * mean_x
    if fixed < 0:  # through the origin instead
        return sum(x * y for x, y in pairs) / sum(x * x for x in xs), 0.0
    return scale, fixed
