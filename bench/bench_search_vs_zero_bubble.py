"""pplab.search against the zero-bubble paper's scheduling heuristic, and how long a search takes.

1. On a grid of cost models the paper's scheduler accepts (F, I = B's input half, W per stage;
   a message time; a memory limit in microbatches held): p in {3, 4}, m in {2p, 3p}; uniform
   stages, a heavy first stage (x1.5) or a heavy last one (x2); latencies 0, 0.1, 0.5, 1 and 2
   forwards; limits p, 1.5p and 2p. For each, the step time of `pplab.search` against the best
   of the built-in schedules that fit and of `pplab.planning.zero_bubble_heuristic.best_heuristic`
   (written from the paper's description). The search tries the heuristic's schedules among its
   candidates, so "never slower" holds by construction; what the grid measures is where its
   other candidates and its local improvement are strictly faster, and by how much.
2. Two stages per rank (p=4, m=8, uniform; latencies 0 to 2; limits 4, 6, 8 microbatches of a
   rank's share): the search's step against the best looped candidate and the best V-shaped one.
3. Search time on one core for p=8, m=24 (goal <= 1 s) and p=32, m=128 (goal <= 10 s).

Run: python bench/bench_search_vs_zero_bubble.py   (about two minutes)
Writes bench/results/search_vs_zero_bubble.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

from measuring import load
from pplab.planning.search import search
from pplab.planning.simulator import Costs
from pplab.planning.zero_bubble_heuristic import best_heuristic

RESULTS = Path(__file__).parent / "results" / "search_vs_zero_bubble.json"


def grid():
    """(p, m, shape, latency, limit, costs) of every case."""
    for p, m in ((3, 6), (4, 8), (4, 12), (3, 9)):
        for shape in ("uniform", "heavy first", "heavy last"):
            forward = [1.0] * p
            if shape == "heavy first":
                forward[0] = 1.5
            if shape == "heavy last":
                forward[-1] = 2.0
            for latency in (0.0, 0.1, 0.5, 1.0, 2.0):
                costs = Costs(forward=tuple(forward), input_grad=tuple(forward),
                              weight_grad=tuple(0.8 * f for f in forward), latency=latency)
                for limit in sorted({p, (3 * p) // 2, 2 * p}):
                    yield p, m, shape, latency, limit, costs


def main() -> None:
    cases, counts = [], {"faster": 0, "equal": 0, "slower": 0}
    for p, m, shape, latency, limit, costs in grid():
        found = search(p, m, costs, memory_limit=limit, show=False)
        paper = best_heuristic(p, m, costs, limit)
        builtin = found.best_builtin.step_time if found.best_builtin else None
        reference = min(t for t in (paper and paper[0], builtin) if t is not None)
        verdict = ("equal" if abs(found.step_time - reference) <= 1e-9 * reference else
                   "faster" if found.step_time < reference else "slower")
        counts[verdict] += 1
        cases.append(dict(p=p, m=m, stages=shape, latency=latency, limit=limit, search=found.step_time,
                          found=found.schedule.name, paper_heuristic=paper and paper[0],
                          best_builtin=builtin, verdict=verdict,
                          gain_over_reference=round(1 - found.step_time / reference, 4)))
        if verdict != "equal":
            print(f"p={p} m={m} {shape:11s} latency {latency:3.1f} limit {limit}: search "
                  f"{found.step_time:6.2f}, paper's heuristic {paper[0] if paper else float('nan'):6.2f}, "
                  f"built-ins {builtin:6.2f}: {verdict}")
    gains = sorted(c["gain_over_reference"] for c in cases if c["verdict"] == "faster")
    print(counts, f"faster by {gains[0]:.1%} to {gains[-1]:.1%}" if gains else "")
    v_shaped = _two_stages_per_rank()
    timings = {}
    warm = Costs(forward=1.0, input_grad=1.0, weight_grad=1.0, latency=0.1)
    search(2, 2, warm, show=False)  # torch's planner imported once
    for p, m, goal in ((8, 24, 1.0), (32, 128, 10.0)):
        started = time.perf_counter()
        found = search(p, m, warm, memory_limit=p, show=False)
        seconds = time.perf_counter() - started
        timings[f"p={p}, m={m}"] = dict(seconds=seconds, goal_seconds=goal, met=seconds <= goal,
                                        candidates=len(found.tried), found=found.schedule.name)
        print(f"search p={p} m={m}: {seconds:.2f} s ({len(found.tried)} candidates; goal {goal:g} s)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(dict(
        benchmark="bench_search_vs_zero_bubble", when=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), load=load()),
        grid=dict(counts=counts, goal="never slower than the best of the built-ins and the paper's heuristic",
                  met=counts["slower"] == 0,
                  faster_by=dict(least=gains[0], most=gains[-1]) if gains else None,
                  cases=cases),
        two_stages_per_rank=v_shaped,
        search_time=timings), indent=2) + "\n")
    print(f"wrote {RESULTS}")


def _two_stages_per_rank() -> list[dict]:
    """The search with two stages per rank: which placement wins, looped or V-shaped."""
    rows = []
    for latency in (0.0, 0.5, 1.0, 2.0):
        costs = Costs(forward=1.0, input_grad=1.0, weight_grad=1.0, latency=latency)
        for limit in (4, 6, 8):
            found = search(4, 8, costs, memory_limit=limit, n_virtual=2, show=False)
            fitting = [c for c in found.tried if c.fits and c.schedule is not None]
            looped = min(c.step_time for c in fitting if c.schedule.placement is None)
            v_shaped = min((c.step_time for c in fitting if c.schedule.placement is not None), default=None)
            rows.append(dict(latency=latency, limit=limit, search=found.step_time, found=found.schedule.name,
                             best_looped=looped, best_v_shaped=v_shaped,
                             placement="V" if found.schedule.placement is not None else "looped"))
            print(f"v=2 latency {latency:3.1f} limit {limit}: {found.schedule.name} {found.step_time:6.2f} "
                  f"(looped {looped:6.2f}, V {v_shaped if v_shaped is None else round(v_shaped, 2)})")
    return rows


if __name__ == "__main__":
    main()
