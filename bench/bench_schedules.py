"""The schedule machinery's speed, and what the search finds.

1. Actions per second of `validate` and `simulate` for 1F1B with its messages at
   p=8/m=32, p=32/m=128 and p=128/m=512, each on a freshly built schedule (so the integer
   form is made inside the timed call), the median of several repeats. Beside them, in the
   same run, the readable paths they replaced (still in the code: they explain faults), and
   `simulate` again on the same schedule with other costs (what-if sliders), and reading the
   simulated timeline's events (what a picture pays). Goal: >= 1,000,000 actions/s each.

Run: python bench/bench_schedules.py   (about a minute)
Writes bench/results/schedules.json.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

from pplab.schedules import build, validate
from pplab.schedules.compiled import no_cyclic_gc
from pplab.schedules.validation import (_check_each_action, _check_every_pass_present, _check_runs_to_the_end,
                                        _check_sends_meet_receives)
from pplab.simulator import Costs, _Simulation, simulate

RESULTS = Path(__file__).parent / "results" / "schedules.json"
SIZES = [(8, 32, 25), (32, 128, 7), (128, 512, 3)]  # p, m, repeats
GOAL = 1_000_000


def readable_validate(schedule) -> None:
    """`validate`'s readable path alone: the four rules as they explain a fault."""
    _check_each_action(schedule.compute_only(), " (counting compute actions only)")
    _check_each_action(schedule)
    _check_sends_meet_receives(schedule)
    _check_every_pass_present(schedule)
    _check_runs_to_the_end(schedule, False)


def seconds(function, repeats: int, fresh: bool, p: int, m: int) -> float:
    """Median seconds of `function(schedule)`, on a new schedule each repeat when `fresh`."""
    times, schedule = [], build("1f1b", p, m)
    for _ in range(repeats):
        if fresh:
            schedule = build("1f1b", p, m)
        started = time.perf_counter()
        function(schedule)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machinery() -> dict:
    rows = {}
    costs, other_costs = Costs(latency=0.1), Costs(forward=1.2, backward=2.1, latency=0.2)
    for p, m, repeats in SIZES:
        actions = sum(len(a) for a in build("1f1b", p, m).actions)
        with_readable = repeats if p < 128 else 1
        timed = {
            "validate": seconds(validate, repeats, True, p, m),
            "simulate": seconds(lambda s: simulate(s, costs), repeats, True, p, m),
            "simulate_same_schedule_other_costs": seconds(
                lambda s: (simulate(s, costs), simulate(s, other_costs)), repeats, False, p, m) / 2,
            "validate_readable_path": seconds(readable_validate, with_readable, True, p, m),
            "simulate_readable_path": seconds(lambda s: _Simulation(s, costs).run(), with_readable, True, p, m),
        }
        schedule = build("1f1b", p, m)
        timeline = simulate(schedule, costs)
        started = time.perf_counter()
        with no_cyclic_gc():
            timeline.events
        timed["reading_the_events"] = time.perf_counter() - started
        rows[f"p{p}_m{m}"] = dict(actions=actions, seconds=timed,
                                  actions_per_second={k: actions / v for k, v in timed.items()})
        speed = rows[f"p{p}_m{m}"]["actions_per_second"]
        print(f"p={p:3d} m={m:3d} ({actions:,} actions): validate {speed['validate']:,.0f}/s "
              f"(readable {speed['validate_readable_path']:,.0f}/s), simulate {speed['simulate']:,.0f}/s "
              f"(readable {speed['simulate_readable_path']:,.0f}/s, same schedule "
              f"{speed['simulate_same_schedule_other_costs']:,.0f}/s, events {speed['reading_the_events']:,.0f}/s)")
    met = all(row["actions_per_second"][k] >= GOAL for row in rows.values() for k in ("validate", "simulate"))
    return dict(rows=rows, goal=f"validate and simulate >= {GOAL:,} actions/s on a fresh schedule", met=met)


def main() -> None:
    started = time.perf_counter()
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "python": platform.python_version()}
    report["machinery"] = machinery()
    report["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
