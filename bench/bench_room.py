"""Room capacity: how many attendees' 2-rank labs this machine runs at once with every verdict right.

Each seat is `pplab.course.drill`'s: a process with a 2-rank CPU lab that checks gpipe, 1F1B and
ZB-H1 against one device with their gradient flow, explains three timing-mode steps whose stage 1
is four times slower (the straggler must be rank 1), and trains 10 steps. The bench runs 1 seat
alone, then 2, 3, 4, ... at once, and stops after the first count with a wrong verdict or whose
median seat took more than --max-slowdown times one seat alone. Per count: every verdict right,
each phase's median seconds, and the slowdown against one seat, measured in this one run.

Run: python bench/bench_room.py [--seats 1 2 3 4 6 8] [--max-slowdown 6] [--out FILE]
Writes bench/results/room.json (bench/results/room_16_cores.json: the GPU host's 16 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

from measuring import load

RESULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "room.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seats", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--max-slowdown", type=float, default=6.0,
                        help="stop when a seat takes this many times one seat alone (default 6)")
    parser.add_argument("--out", default=RESULT_PATH, help=f"where the JSON goes (default {RESULT_PATH})")
    args = parser.parse_args()
    from pplab.base.machine import measure_load
    from pplab.course.drill import drill, drill_table

    machine = measure_load()
    print(f"the machine: {machine.describe()}")
    results, alone = [], None
    for seats in sorted(set([1, *args.seats])):
        print(f"{seats} seat(s) at once:", flush=True)
        result = drill(seats)
        results.append(result)
        median = statistics.median(result.seat_seconds) if result.seat_seconds else float("inf")
        alone = alone or median
        print(drill_table(results).splitlines()[-1 - len(result.wrong[:5])], flush=True)
        if not result.all_right or median > args.max_slowdown * alone:
            break
    capacity = max((r.seats for r in results if r.all_right and
                    statistics.median(r.seat_seconds) <= args.max_slowdown * alone), default=0)
    print(drill_table(results))
    print(f"capacity: {capacity} seats with every verdict right and a seat at most "
          f"{args.max_slowdown:g}x slower than alone")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump({"benchmark": "room capacity (pplab.course.drill)", "machine": platform.platform(),
                   "cores": machine.cores, "load_before": load(), "machine_load": machine.describe(),
                   "max_slowdown": args.max_slowdown, "capacity": capacity,
                   "drills": [{**r.to_json(), "slowdown": (statistics.median(r.seat_seconds) / alone
                                                          if r.seat_seconds else None)} for r in results]},
                  file, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
