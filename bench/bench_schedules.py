"""The schedule machinery's speed, and what the search finds.

1. Actions per second of `validate` and `simulate` for 1F1B with its messages at
   p=8/m=32, p=32/m=128 and p=128/m=512, each on a freshly built schedule (so the integer
   form is made inside the timed call), the median of several repeats. Beside them, in the
   same run, the readable paths they replaced (still in the code: they explain faults), and
   `simulate` again on the same schedule with other costs (what-if sliders), and reading the
   simulated timeline's events (what a picture pays). Goal: >= 1,000,000 actions/s each.
2. The search on a grid: p in {2, 4, 8}, m in {2p, 4p}, memory limits of p/2, p and 2p
   microbatches, and four cost profiles (uniform; the last stage 3x heavier; the first 3x
   heavier; a slow link, latency 1.5 x F): the found schedule's simulated step time vs the
   best built-in (pplab's and torch's) that fits, and the search's seconds.
3. The found balance and schedule run for real: the tiny model with a 4096-token vocabulary
   (a heavy LM head) profiled per layer, `search_balance` on 2 ranks, 8 microbatches, a limit
   of 2 microbatches; the found (balance, schedule) and the best built-in on the even split
   run side by side on 2 ranks in timing mode (each action padded to its profiled cost x 10)
   and in real mode. Measured step time vs the prediction, and the measured gain vs the
   predicted gain.

Run: python bench/bench_schedules.py   (a few minutes)
Writes bench/results/schedules.json.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import pplab
from pplab.data import batches
from pplab.planning.balance import search_balance, stage_costs
from pplab.planning.search import search
from pplab.planning.simulator import Costs, _Simulation, simulate
from pplab.schedules import build, validate
from pplab.schedules.compiled import no_cyclic_gc
from pplab.schedules.validation import (
    _check_each_action,
    _check_every_pass_present,
    _check_runs_to_the_end,
    _check_sends_meet_receives,
)

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
            "simulate_readable_path": seconds(lambda s: _Simulation(s, costs).run(), with_readable,
                                              True, p, m),
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
        print(f"p={p:3d} m={m:3d} ({actions:,} actions): validate {speed['validate']:,.0f}/s (readable "
              f"{speed['validate_readable_path']:,.0f}/s), simulate {speed['simulate']:,.0f}/s (readable "
              f"{speed['simulate_readable_path']:,.0f}/s, same schedule "
              f"{speed['simulate_same_schedule_other_costs']:,.0f}/s, events "
              f"{speed['reading_the_events']:,.0f}/s)")
    met = all(row["actions_per_second"][k] >= GOAL for row in rows.values() for k in ("validate", "simulate"))
    return dict(rows=rows, goal=f"validate and simulate >= {GOAL:,} actions/s on a fresh schedule", met=met)


PROFILES = {
    "uniform": lambda p: Costs(forward=1.0, input_grad=1.0, weight_grad=1.0),
    "heavy last stage": lambda p: Costs(forward=[1.0] * (p - 1) + [3.0], input_grad=[1.0] * (p - 1) + [3.0],
                                        weight_grad=[1.0] * (p - 1) + [3.0]),
    "heavy first stage": lambda p: Costs(forward=[3.0] + [1.0] * (p - 1), input_grad=[3.0] + [1.0] * (p - 1),
                                         weight_grad=[3.0] + [1.0] * (p - 1)),
    "slow link": lambda p: Costs(forward=1.0, input_grad=1.0, weight_grad=1.0, latency=1.5),
}


def search_grid() -> dict:
    rows = []
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            for limit in (max(1, p // 2), p, 2 * p):
                for profile_name, make in PROFILES.items():
                    found = search(p, m, make(p), memory_limit=limit)
                    best = found.best_builtin
                    rows.append(dict(p=p, m=m, memory_limit=limit, costs=profile_name,
                                     found=found.schedule.name,
                                     found_step=found.step_time, best_builtin=best and best.name,
                                     best_builtin_step=best and best.step_time,
                                     gain=best and 1 - found.step_time / best.step_time,
                                     search_seconds=round(found.seconds, 3), candidates=len(found.tried)))
    never_slower = all(r["best_builtin_step"] is None or r["found_step"] <= r["best_builtin_step"] + 1e-9
                       for r in rows)
    beaten = sum(1 for r in rows if r["gain"] and r["gain"] > 1e-9)
    no_builtin = sum(1 for r in rows if r["best_builtin"] is None)
    slowest = max(r["search_seconds"] for r in rows if r["p"] <= 8)
    print(f"search grid: {len(rows)} cases; found beats the best fitting built-in in {beaten}, ties in "
          f"{len(rows) - beaten - no_builtin}, no built-in fits in {no_builtin}; never slower: "
          f"{never_slower}; slowest search {slowest:.2f} s")
    return dict(rows=rows, never_slower=never_slower, beaten=beaten, no_builtin_fits=no_builtin,
                slowest_search_seconds=slowest, goal="never slower than a fitting built-in; a "
                                                     "few seconds at p <= 8")


def run_found(steps: int = 5) -> dict:
    """The found balance and schedule vs the best built-in on the even split, on 2 real ranks."""
    torch.set_num_threads(1)
    config = pplab.LlamaConfig.tiny(vocab_size=4096)
    microbatch_size, seq_len, p, m, limit = 4, 64, 2, 8, 2
    layers = pplab.profile(config, microbatch_size, seq_len, config.num_hidden_layers, show=False)
    layer_costs = layers.costs(split_backward=True)
    balanced = search_balance(p, m, layer_costs, memory_limit=limit)
    best = balanced.even.best_builtin
    contenders = {"found": (balanced.found.schedule, balanced.balance),
                  "best built-in, even split": (best.schedule, balanced.even_balance)}
    batch = next(batches(microbatch_size * m, seq_len))
    report = dict(balance=list(balanced.balance), found=balanced.found.schedule.name,
                  best_builtin=best.name, even_balance=list(balanced.even_balance))
    with pplab.RankPool(p) as pool:
        for mode, scale in (("timing", 10.0), ("real", None)):
            rows = {}
            for label, (schedule, balance) in contenders.items():
                costs = stage_costs(layer_costs, balance)
                timing = None if scale is None else _scaled(costs, scale)
                predicted = simulate(schedule, costs if timing is None else timing).step_time()
                with pool.pipeline(config, schedule, balance=list(balance), timing=timing) as pipe:
                    measured = median_step(pipe, batch, steps)
                rows[label] = dict(measured_step_s=measured, predicted_step_s=predicted,
                                   error=measured / predicted - 1)
            found_row, builtin_row = rows["found"], rows["best built-in, even split"]
            gain = dict(measured=1 - found_row["measured_step_s"] / builtin_row["measured_step_s"],
                        predicted=1 - found_row["predicted_step_s"] / builtin_row["predicted_step_s"])
            report[mode] = dict(rows=rows, gain=gain, met=all(abs(r["error"]) <= 0.05 for r in rows.values()))
            print(f"{mode} mode: found {found_row['measured_step_s'] * 1e3:.1f} ms (predicted "
                  f"{found_row['predicted_step_s'] * 1e3:.1f}, {found_row['error']:+.1%}), built-in "
                  f"{builtin_row['measured_step_s'] * 1e3:.1f} ms (predicted "
                  f"{builtin_row['predicted_step_s'] * 1e3:.1f}, {builtin_row['error']:+.1%}); gain measured "
                  f"{gain['measured']:.1%}, predicted {gain['predicted']:.1%}")
    report["goal"] = "measured step within 5 % of the prediction (timing mode and real mode, 2 ranks)"
    return report


def median_step(pipe: pplab.Pipeline, batch, steps: int) -> float:
    """Median step time (from the step's events) of `steps` steps but the first, which also infers
    shapes and warms up."""
    return statistics.median([pipe.step(batch).timeline.step_time() for _ in range(steps)][1:])


def _scaled(costs: Costs, factor: float) -> Costs:
    scale = lambda values: [v * factor for v in values]  # noqa: E731
    return Costs(forward=scale(costs.forward), input_grad=scale(costs.input_grad),
                 weight_grad=scale(costs.weight_grad))


def main() -> None:
    started = time.perf_counter()
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "python": platform.python_version()}
    report["machinery"] = machinery()
    report["search_grid"] = search_grid()
    report["run_found"] = run_found()
    report["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
