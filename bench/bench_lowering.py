"""torch's lowering simulated, then run: the early-receive stall predicted and measured.

For each case (a schedule, its ranks and microbatches), three orders of the same compute run on
pplab's hand-written runtime, which executes a schedule's sends and receives where the schedule
puts them (a receive holds its rank until its message has arrived), in timing mode (each compute
action padded to its cost: F 20 ms, B 40 ms, or I and W 20 ms each):

* pplab's own order (each receive right before the compute that needs it): it calibrates the one
  cost the simulator is not told, a message's latency between these ranks (bisected so that the
  simulated step equals this order's measured one);
* torch's lowering (`pplab.schedules.lowered_by_torch`), receives posted as early as they can be;
* the same with `defer_pp_recv=True`.

Each is simulated with the calibrated latency and measured (median of the steps after the first),
and checked exact against one device. The error is measured / simulated - 1.

Then torch's own runtime (`impl="torch"`) runs torch's early and deferred orders on the same ranks,
over gloo, beside the doctor's model of that transport (`pplab.planning.streams`, messages in no
order: `transport="gloo"`) with the same calibrated latency.

Run: python bench/bench_lowering.py [--steps 5] [--out FILE]. Writes bench/results/lowering.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

import pplab
from measuring import load
from pplab.planning.doctor import TRANSPORTS
from pplab.planning.streams import simulate_streams
from pplab.schedules import build, from_torch, lowered_by_torch

HERE = Path(__file__).resolve().parent
RESULT_PATH = HERE / "results" / "lowering.json"
WHOLE = pplab.Costs(forward=0.02, backward=0.04)
SPLIT = pplab.Costs(forward=0.02, input_grad=0.02, weight_grad=0.02)
# (label, schedule, the costs its compute runs at)
CASES = [
    ("interleaved-1f1b, 2 ranks x 2 stages, m=4", lambda: build("interleaved-1f1b", 2, 4, 2), WHOLE),
    ("interleaved-1f1b, 4 ranks x 2 stages, m=8", lambda: build("interleaved-1f1b", 4, 8, 2), WHOLE),
    ("zb-h1, 4 ranks, m=8", lambda: build("zb-h1", 4, 8), SPLIT),
    ("interleaved-zero-bubble, 2 ranks x 2 stages, m=4",
     lambda: from_torch("interleaved-zero-bubble", 2, 4, 2), SPLIT),
    ("interleaved-zero-bubble, 4 ranks x 2 stages, m=8",
     lambda: from_torch("interleaved-zero-bubble", 4, 8, 2), SPLIT),
]


def measured_step(pool, schedule, costs, steps: int, impl: str = "pplab") -> tuple[float, bool]:
    """The median step after the first on `pool` in timing mode, and whether it was exact."""
    pipe = pool.pipeline(pplab.LlamaConfig.tiny(), schedule=schedule, timing=costs, impl=impl)
    try:
        times = [pipe.step().timeline.step_time() for _ in range(steps)]
        return statistics.median(times[1:]), pipe.check_parity().passed
    finally:
        pipe.close()


def calibrated_latency(schedule, costs, measured: float) -> float:
    """The message latency at which the simulated step of `schedule` equals `measured`."""
    low, high = 0.0, 0.05
    for _ in range(40):
        middle = (low + high) / 2
        step = pplab.simulate(schedule, replace(costs, latency=middle)).step_time()
        low, high = (middle, high) if step < measured else (low, middle)
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    args = parser.parse_args()
    rows, pools, on_gloo = [], {}, []
    try:
        for label, make, costs in CASES:
            schedule = make()
            pool = pools.get(schedule.n_ranks) or pools.setdefault(schedule.n_ranks,
                                                                    pplab.RankPool(schedule.n_ranks))
            own, own_exact = measured_step(pool, schedule, costs, args.steps)
            latency = calibrated_latency(schedule, costs, own)
            with_latency = replace(costs, latency=latency)
            row = dict(case=label, calibrated_latency_s=latency, orders=[])
            for order, lowered in (("pplab's own (calibrates the latency)", schedule),
                                   ("torch, early receives", lowered_by_torch(schedule)),
                                   ("torch, deferred receives", lowered_by_torch(schedule, True))):
                measured, exact = (own, own_exact) if lowered is schedule else \
                    measured_step(pool, lowered, costs, args.steps)
                simulated = pplab.simulate(lowered, with_latency).step_time()
                row["orders"].append(dict(order=order, simulated_s=simulated, measured_s=measured,
                                          error=measured / simulated - 1, exact=exact))
                print(f"{label:48s} {order:38s} simulated {simulated:.3f} s  measured {measured:.3f} s  "
                      f"({measured / simulated - 1:+.1%}){'' if exact else '  NOT EXACT'}", flush=True)
            rows.append(row)
        # torch's own runtime: its early receives against its deferred ones, and the doctor's model of gloo
        gloo = TRANSPORTS["gloo"]
        for (label, make, costs), row in zip(CASES[:2], rows):
            schedule = make()
            pool = pools[schedule.n_ranks]
            with_latency = replace(costs, latency=row["calibrated_latency_s"])
            case = dict(case=label)
            for order, defer in (("early", False), ("deferred", True)):
                lowered = lowered_by_torch(schedule, defer)
                measured, exact = measured_step(pool, lowered, costs, args.steps, impl="torch")
                run = simulate_streams(lowered, with_latency, gloo.streams, gloo.buffered_bytes)
                simulated = run.step_time()
                case[order] = dict(measured_s=measured, simulated_s=simulated,
                                   error=measured / simulated - 1, exact=exact)
                print(f"{label:48s} torch's runtime on gloo, {order:8s} simulated {simulated:.3f} s  "
                      f"measured {measured:.3f} s  ({measured / simulated - 1:+.1%})", flush=True)
            case["ratio"] = case["early"]["measured_s"] / case["deferred"]["measured_s"]
            on_gloo.append(case)
    finally:
        for pool in pools.values():
            pool.stop()
    args.out.write_text(json.dumps(dict(
        bench="bench_lowering", machine=platform.node(), cpus=os.cpu_count(), load=load(),
        steps=args.steps, timing=dict(whole=_fields(WHOLE), split=_fields(SPLIT)), cases=rows,
        torchs_runtime_on_gloo=on_gloo,
        largest_error=max(abs(order["error"]) for row in rows for order in row["orders"][1:]),
    ), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _fields(costs) -> dict:
    return {field.name: getattr(costs, field.name) for field in fields(costs)}


if __name__ == "__main__":
    sys.exit(main())
