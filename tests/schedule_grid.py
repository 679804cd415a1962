"""The grid of schedules, costs and broken variants on which `simulate` and `validate` are
pinned to the results they gave before they were made fast (tests/data/schedule_grid.json).

Regenerate the file only for an intended change of behaviour:
    python tests/schedule_grid.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pplab.planning.simulator import Costs, simulate
from pplab.schedules import TORCH_SCHEDULES, Action, build, from_torch, validate
from pplab.schedules.schedule import Schedule

GOLDEN = Path(__file__).parent / "data" / "schedule_grid.json"
# torch's schedules at their fewest stages per rank: GPipe and 1F1B at 1, the others at 2
TORCH_PLANS = [(plan.torch_name, plan.fewest_stages_per_rank) for plan in TORCH_SCHEDULES.values()]


def schedules():
    """(name, schedule) for every built-in and torch plan on a small grid of sizes."""
    for p in range(1, 7):
        for m in (1, 2, 3, 5, 8, 12):
            for name in ("gpipe", "1f1b", "zb-h1"):
                yield f"{name} p{p} m{m}", build(name, p, m)
            for v in (2, 3):
                try:
                    yield f"interleaved-1f1b p{p} m{m} v{v}", build("interleaved-1f1b", p, m, v)
                except ValueError:
                    pass
    for p in (2, 4):
        for m in (4, 8):
            for name, v in TORCH_PLANS:
                try:
                    yield f"torch {name} p{p} m{m} v{v}", from_torch(name, p, m, v)
                except ValueError:
                    pass


def costs_for(schedule: Schedule):
    """Cost models that exercise every branch: defaults, per stage, latency, bandwidth, I/W."""
    s = schedule.n_stages
    yield "default", Costs()
    yield "per-stage+latency", Costs(forward=[1.0 + 0.25 * i for i in range(s)],
                                     backward=[2.0 + 0.5 * (i % 3) for i in range(s)], latency=0.3)
    yield "bandwidth", Costs(forward=1.3, backward=2.9, latency=0.05, bandwidth=1e6,
                             activation_bytes=[200_000 + 1000 * i for i in range(s)])
    yield "split", Costs(forward=[1.0] * (s - 1) + [1.7], input_grad=1.1, weight_grad=[0.7] * s, latency=0.1)


def timeline_digest(timeline) -> str:
    rows = [(e.rank, e.kind, e.stage, e.microbatch, repr(e.start), repr(e.end), e.bytes)
            for e in timeline.events]
    return hashlib.sha256(repr((timeline.n_ranks, timeline.label, rows)).encode()).hexdigest()


def broken_variants(schedule: Schedule):
    """Schedules one edit away from a sound one: swapped neighbours, a dropped action, a repeat."""
    for rank, actions in enumerate(schedule.actions):
        if len(actions) < 2:
            continue
        for position in sorted({0, (len(actions) - 1) // 2, len(actions) - 2}):
            swapped = list(actions)
            swapped[position], swapped[position + 1] = swapped[position + 1], swapped[position]
            yield f"r{rank} swap {position}", _with(schedule, rank, swapped)
        yield f"r{rank} drop", _with(schedule, rank, actions[:-1])
        yield f"r{rank} repeat", _with(schedule, rank, list(actions) + [actions[0]])
        yield f"r{rank} stray", _with(schedule, rank,
                                      list(actions) + [Action(schedule.n_stages, actions[0].kind, 0)])


def _with(schedule: Schedule, rank: int, actions) -> Schedule:
    lists = [list(a) for a in schedule.actions]
    lists[rank] = list(actions)
    return schedule.with_actions(lists)


def verdict(schedule: Schedule, **options) -> str:
    try:
        validate(schedule, **options)
    except ValueError as error:  # ScheduleError is one
        return f"{type(error).__name__}: {error}"
    return "valid"


def simulation_outcome(schedule: Schedule, costs: Costs) -> str:
    try:
        return timeline_digest(simulate(schedule, costs))
    except ValueError as error:  # ScheduleError is one
        return f"{type(error).__name__}: {error}"


def compute() -> dict:
    result = {"simulate": {}, "validate": {}}
    for name, schedule in schedules():
        for variant in (schedule, schedule.compute_only()):
            label = name if variant is schedule else f"{name} compute-only"
            for costs_name, costs in costs_for(variant):
                result["simulate"][f"{label} {costs_name}"] = simulation_outcome(variant, costs)
            result["validate"][label] = verdict(variant)
            result["validate"][f"{label} blocking"] = verdict(variant, blocking_sends=True)
        if schedule.n_ranks <= 4 and schedule.n_microbatches <= 5:
            for edit, broken in broken_variants(schedule):
                result["validate"][f"{name} {edit}"] = verdict(broken)
                result["simulate"][f"{name} {edit}"] = simulation_outcome(broken, Costs(latency=0.1))
    return result


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(compute(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
