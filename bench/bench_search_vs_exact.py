"""The search against the proved optimum: how far the schedule `search` finds is from the fastest
one a CP-SAT solver proves on the same cost model (one stage per rank, buffered links).

120 cases: p = 4..8 ranks, m = 4, 8, 12, 16 microbatches, and six cost models (F = I = W, I twice F,
W half F; each with no latency and with a latency of a tenth of F). For each: the search's step
(its local improvement run until no move helps), the solver's (started from the search's best,
`exact_seconds` at most), whether the solver proved it optimal, and the gap.

Run: python bench/bench_search_vs_exact.py [--out bench/results/search_vs_exact.json] [--exact-seconds 30]
Needs OR-Tools (pip install 'pplab[solver]').
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pplab.planning.search import search
from pplab.planning.simulator import Costs

COST_MODELS = {
    "F=I=W": dict(forward=1.0, input_grad=1.0, weight_grad=1.0),
    "I=2F": dict(forward=1.0, input_grad=2.0, weight_grad=1.0),
    "W=F/2": dict(forward=1.0, input_grad=1.0, weight_grad=0.5),
}
LATENCIES = (0.0, 0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/search_vs_exact.json")
    parser.add_argument("--exact-seconds", type=float, default=30.0)
    args = parser.parse_args()
    cases = []
    started = time.perf_counter()
    for name, model in COST_MODELS.items():
        for latency in LATENCIES:
            costs = Costs(**model, latency=latency)
            for p in range(4, 9):
                for m in (4, 8, 12, 16):
                    searched = search(p, m, costs, show=False, improve_seconds=60)
                    found = search(p, m, costs, show=False, improve_seconds=60, exact=True,
                                   exact_seconds=args.exact_seconds)
                    gap = searched.step_time / found.step_time - 1
                    cases.append({"costs": name, "latency": latency, "p": p, "m": m,
                                  "search": searched.step_time, "search_schedule": searched.schedule.name,
                                  "exact": found.step_time, "proved_optimal": found.proved_optimal,
                                  "bound": found.proof.bound, "solver_s": round(found.proof.seconds, 2),
                                  "gap": gap})
                    mark = "" if gap < 1e-9 else f"  <- search {gap:.1%} above"
                    print(f"{name:6} latency {latency:g} p={p} m={m:2}: search {searched.step_time:.4g}, "
                          f"exact {found.step_time:.4g} "
                          f"({'proved' if found.proved_optimal else 'not proved'}){mark}",
                          flush=True)
    at_optimum = sum(1 for c in cases if c["gap"] < 1e-9 and c["proved_optimal"])
    proved = sum(1 for c in cases if c["proved_optimal"])
    summary = {"cases": len(cases), "proved_optimal": proved, "search_at_proved_optimum": at_optimum,
               "worst_gap": max(c["gap"] for c in cases), "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(summary))
    Path(args.out).write_text(json.dumps({"summary": summary, "cases": cases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
