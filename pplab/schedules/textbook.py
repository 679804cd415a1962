"""`theory`: the textbook numbers of a schedule (bubble fraction, peak in-flight activations)."""

from __future__ import annotations

from dataclasses import dataclass

from pplab.schedules.actions import Action, Kind, releases_activations
from pplab.schedules.builders import build_compute_order
from pplab.schedules.communication import add_communication
from pplab.schedules.names import SCHEDULE_NAMES
from pplab.schedules.schedule import Schedule
from pplab.schedules.validation import validate


@dataclass(frozen=True)
class Theory:
    """The textbook numbers of a schedule.

    ``bubble_fraction`` is idle time over total step time, summed over all
    ranks (``sum idle_r / (p * step)``); it is None when no closed form holds
    for this schedule and these costs, and ``conditions`` says why.
    ``peak_inflight[r]`` is the most activation sets (one stage, one
    microbatch) rank r holds at once: a forward holds its activations until
    its backward ``B`` ends or, when the backward is split, until its ``W``
    ends (W still reads the saved layer inputs).
    """

    bubble_fraction: float | None
    bubble_formula: str
    conditions: str
    peak_inflight: tuple[int, ...]
    peak_inflight_formula: str


_DEFAULT_COSTS = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
# Costs measured on real ranks differ by noise: within this relative spread they count as the same.
SAME_COST_TOLERANCE = 0.01
_UNIFORM = "every stage has the same costs (within 1%) and communication takes no time"
_NEEDS_UNIFORM = "every stage to have the same costs (within 1%) and communication to take no time"

_PEAK_FORMULAS = {
    "gpipe": "m on every rank",
    "1f1b": "min(p - r, m) on rank r",
    "interleaved-1f1b": (
        "min(v*m, (v-1)*k + 2*(p-1-r) + 1) on rank r, with k microbatches per round "
        "(k = p when p divides m: Megatron's (v-1)*p + 2*(p-1-r) warm-up forwards, plus one)"
    ),
    "zb-h1": (
        "min(p, m) on every rank: as 1F1B until the input-gradient pass I, "
        "but rank r defers r weight passes W, which keep their activations"
    ),
}


def theory(schedule: Schedule, costs=None) -> Theory:
    """Bubble fraction and peak in-flight activations, from the textbook formulas.

    ``costs`` is a ``pplab.Costs`` (anything with ``compute_time(kind, stage)``
    and ``transfer_time(stage)``); None means F=1, B=2, I=W=1, no
    communication time. The schedule is recognised by its compute order, not
    its name, so an edited "1f1b" gets no 1F1B number. The peak in-flight
    counts are exact for any valid schedule: they follow from the order alone.
    """
    validate(schedule)
    recognised = _recognise(schedule)
    bubble, formula, conditions = _bubble(schedule, recognised, costs)
    return Theory(
        bubble_fraction=bubble,
        bubble_formula=formula,
        conditions=conditions,
        peak_inflight=_peak_inflight(schedule),
        peak_inflight_formula=_PEAK_FORMULAS.get(recognised, "counted from the schedule's order"),
    )


def _recognise(schedule: Schedule) -> str | None:
    """The name of the classic schedule with this compute order and its messages, if any.

    Moving a send later (or a receive earlier) than `add_communication` puts it can make
    ranks wait longer, so such a schedule gets no textbook number.
    """
    if schedule.placement is not None:
        return None
    if schedule.has_communication and add_communication(schedule).actions != schedule.actions:
        return None
    mine = schedule.compute_only().actions
    for name in SCHEDULE_NAMES:
        try:
            candidate = build_compute_order(name, schedule.n_ranks, schedule.n_microbatches,
                                            schedule.n_virtual)
        except ValueError:
            continue
        if candidate.actions == mine:
            return name
    return None


def peak_inflight_at(schedule: Schedule) -> list[tuple[int, Action | None]]:
    """Per rank: the most microbatches whose activations it holds at once (from a forward until
    the B or W that frees them), and the forward that reaches that peak (None if none)."""
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        at = None
        for action in acts:
            if action.kind == Kind.F:
                held += 1
                if held > peak:
                    peak, at = held, action
            elif releases_activations(action.kind):
                held -= 1
        peaks.append((peak, at))
    return peaks


def _peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    return tuple(peak for peak, _ in peak_inflight_at(schedule))


def _bubble(schedule: Schedule, recognised: str | None, costs) -> tuple[float | None, str, str]:
    """(bubble fraction or None, formula as text, conditions) for a recognised schedule."""
    p, m, v = schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual
    if recognised is None:
        return None, "none", (
            "no closed form: the compute order and messages are not those of "
            f"{', '.join(SCHEDULE_NAMES)} for these sizes; simulate it (pplab.simulate)"
        )
    cost, why_not = _uniform_costs(schedule, costs)
    if recognised in ("gpipe", "1f1b"):
        formula = f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
        if why_not:
            return None, formula, f"the formula needs {_NEEDS_UNIFORM}, but {why_not}"
        return (p - 1) / (m + p - 1), formula, f"{_UNIFORM}; any ratio of F to B"
    if recognised == "interleaved-1f1b":
        formula = f"(p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1}"
        if m % p:
            return None, formula, (
                f"Megatron's formula needs n_microbatches a multiple of n_ranks, "
                f"here m={m}, p={p}; simulate it (pplab.simulate)"
            )
        if why_not:
            return None, formula, f"the formula needs {_NEEDS_UNIFORM}, but {why_not}"
        return (p - 1) / (v * m + p - 1), formula, f"{_UNIFORM}; m a multiple of p; F and B per stage"
    return _zb_h1_bubble(p, m, cost, why_not)


def _zb_h1_bubble(
    p: int, m: int, cost: dict[Kind, float], why_not: str | None
) -> tuple[float | None, str, str]:
    """ZB-H1's bubble from Qi et al. 2023: (p-1)(F+I-W) idle on every rank.

    The backward reaches rank 0 after (p-1) input-gradient passes I instead of
    (p-1) full backwards, and the deferred W passes fill the tail, so each
    rank idles (p-1)(F+I-W) instead of 1F1B's (p-1)(F+I+W). That holds when
    every deferred W fits in the gap it fills (W <= F and W <= I) and the
    warm-up is full (m >= p); checked against an event simulation in the tests.
    """
    formula = "(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))"
    if why_not:
        return None, formula, f"the formula needs {_NEEDS_UNIFORM}, but {why_not}"
    f, i, w = cost[Kind.F], cost[Kind.I], cost[Kind.W]
    if m < p:
        return None, formula, f"the formula needs n_microbatches >= n_ranks, here m={m} < p={p}"
    here = f"F={f:g}, I={i:g}, W={w:g}"
    if w > f or w > i:
        return None, formula, f"the formula needs W <= F and W <= I, here {here}"
    idle = (p - 1) * (f + i - w)
    conditions = f"m >= p, W <= F and W <= I (here {here}); {_UNIFORM}"
    return idle / (m * (f + i + w) + idle), formula, conditions


def _uniform_costs(schedule: Schedule, costs) -> tuple[dict[Kind, float], str | None]:
    """The per-kind cost shared by all stages, or a reason why there is none."""
    if costs is None:
        return _DEFAULT_COSTS, None
    stages = range(schedule.n_stages)
    used = {a.kind for acts in schedule.actions for a in acts if a.is_compute}
    per_kind = {k: [costs.compute_time(k, s) for s in stages] for k in _DEFAULT_COSTS if k in used}
    varying = [k.value for k, values in per_kind.items()
               if max(values) - min(values) > SAME_COST_TOLERANCE * max(values)]
    if varying:
        return {}, (f"the cost of {', '.join(varying)} differs between stages "
                    f"(by more than {SAME_COST_TOLERANCE:.0%})")
    if any(costs.transfer_time(s) > 0 for s in stages):
        return {}, "the costs give messages a transfer time"
    return {k: sum(values) / len(values) for k, values in per_kind.items()}, None

