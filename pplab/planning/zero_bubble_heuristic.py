"""The zero-bubble paper's scheduling heuristic, written from its description.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 3.1, describe how their
scheduler builds a schedule for given F, B (= I), W times, a message time and a memory limit:

* warm-up: each stage runs as many forwards as the memory limit allows before its first
  backward; one more forward that would delay that backward is a yes/no hyperparameter;
* then forwards and backwards alternate (1F1B); a W fills a gap longer than itself, or a gap that
  would make this stage's idle time the largest of all stages so far, and a W runs when the
  memory limit stops the next forward (it frees that memory);
* a stage is always at least one forward ahead of the next; when it is more than one ahead, a
  second yes/no hyperparameter lets it skip a forward for a backward;
* when a stage runs out of forwards and backwards, its remaining Ws run one by one;
* the best of the hyperparameters' combinations (a grid search) is the schedule.

Where the text leaves a choice, this takes the simplest reading. It is not the paper's code
(none was read). `pplab.search` tries its four schedules as candidates (one stage per rank), so
the search is never slower than it; bench/bench_search_vs_zero_bubble.py counts where the search's
other candidates and its local improvement do better.

Memory is counted as the search counts it: a forward holds its stage's weight (1 for one
microbatch, or its bytes) until its W ends, and the limit is on what a rank holds.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from pplab.planning.list_scheduling import empty_pipeline, inputs_of_passes, outputs_reach
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import Action, Kind, Schedule, ScheduleError, add_communication, validate

HYPERPARAMETERS = tuple(itertools.product((False, True), repeat=2))  # (extra_warmup, skip_forward)


def heuristic_schedule(p: int, m: int, costs: Costs, memory_limit: float, extra_warmup: bool,
                       skip_forward: bool, weights: Sequence[float] | None = None) -> Schedule | None:
    """One combination of the two hyperparameters: a compute order per rank (stage s on rank s),
    or None when the limit leaves a rank unable to go on. `weights` are what one microbatch of
    each stage counts against `memory_limit` (default 1: the limit is in microbatches)."""
    costs.check_stages(p)
    weights = [1.0] * p if weights is None else list(weights)
    if len(weights) != p:
        raise ValueError(f"weights has {len(weights)} values for {p} stages: give one per stage")
    pipeline = empty_pipeline(p, m, 1)
    inputs = inputs_of_passes(pipeline, Kind.I, costs)
    ended = {key: [None] * m for key in inputs}
    f_cost = [costs.compute_time(Kind.F, s) for s in range(p)]
    i_cost = [costs.compute_time(Kind.I, s) for s in range(p)]
    w_cost = [costs.compute_time(Kind.W, s) for s in range(p)]
    next_f, next_i, done_w = [0] * p, [0] * p, [0] * p
    held, busy_until, idle, last_kind = [0.0] * p, [0.0] * p, [0.0] * p, [None] * p
    free_since = [0.0] * p
    orders = [[] for _ in range(p)]
    wakes = [(0.0, s) for s in range(p)]
    reaches = outputs_reach(inputs, pipeline)  # stage s is on rank s

    def arrival(kind, stage, mb):
        """When the inputs of (kind, stage, mb) are there; None while a producer has not started."""
        at = 0.0
        for producer, delay in inputs[kind, stage]:
            done = ended[producer][mb]
            if done is None:
                return None
            at = max(at, done + delay)
        return at

    def run(stage, kind, mb, cost, now):
        orders[stage].append(Action(stage, kind, mb))
        end = busy_until[stage] = now + cost
        idle[stage] += now - free_since[stage]
        free_since[stage] = end
        if (kind, stage) in ended:
            ended[kind, stage][mb] = end
        heapq.heappush(wakes, (end, stage))
        for consumer, delay in reaches.get((kind, stage), ()):
            heapq.heappush(wakes, (end + delay, consumer))
        last_kind[stage] = kind

    total = 3 * p * m
    steps = 0
    while sum(len(order) for order in orders) < total:
        if not wakes:
            return None
        now, stage = heapq.heappop(wakes)
        steps += 1
        if steps > 50 * total or busy_until[stage] > now:
            if steps > 50 * total:
                return None
            continue
        f_mb, i_mb = next_f[stage], next_i[stage]
        f_at = arrival(Kind.F, stage, f_mb) if f_mb < m else None
        i_at = arrival(Kind.I, stage, i_mb) if i_mb < f_mb else None
        fits = held[stage] + weights[stage] <= memory_limit * (1 + 1e-9)
        can_f = f_at is not None and f_at <= now and fits
        can_i = i_at is not None and i_at <= now
        can_w = done_w[stage] < next_i[stage]
        ahead = stage + 1 < p and next_f[stage] - next_f[stage + 1] > 1
        warm = next_i[stage] == 0
        choice = None
        if warm:
            if can_i:
                choice = Kind.I
            elif can_f and (extra_warmup or i_at is None or now + f_cost[stage] <= i_at):
                choice = Kind.F
        else:
            prefer_f = last_kind[stage] != Kind.F and not (skip_forward and ahead and can_i)
            if can_f and (prefer_f or not can_i):
                choice = Kind.F
            elif can_i:
                choice = Kind.I
            elif can_w:
                coming = [t for t in (f_at if f_at is not None and fits else None, i_at)
                          if t is not None and t > now]
                gap = min(coming) - now if coming else float("inf")
                memory_full = f_mb < m and not fits
                largest = idle[stage] + gap > max(idle)
                if gap >= w_cost[stage] or memory_full or largest:
                    choice = Kind.W
        if choice is None and next_f[stage] == m and next_i[stage] == m and can_w:
            choice = Kind.W
        if choice is Kind.F:
            run(stage, Kind.F, f_mb, f_cost[stage], now)
            next_f[stage] += 1
            held[stage] += weights[stage]
        elif choice is Kind.I:
            run(stage, Kind.I, i_mb, i_cost[stage], now)
            next_i[stage] += 1
        elif choice is Kind.W:
            run(stage, Kind.W, done_w[stage], w_cost[stage], now)
            done_w[stage] += 1
            held[stage] -= weights[stage]
    return Schedule(orders, p, m, p, 1, heuristic_name(extra_warmup, skip_forward))


def heuristic_name(extra_warmup: bool, skip_forward: bool) -> str:
    """How the search's table names one combination of the hyperparameters."""
    return f"zero-bubble heuristic warm-up+{int(extra_warmup)} skip-F {int(skip_forward)}"


def best_heuristic(p: int, m: int, costs: Costs, memory_limit: float) -> tuple[float, Schedule] | None:
    """The grid search over both hyperparameters: the fastest valid schedule, with its step time."""
    best = None
    for extra_warmup, skip_forward in HYPERPARAMETERS:
        schedule = heuristic_schedule(p, m, costs, memory_limit, extra_warmup, skip_forward)
        if schedule is None:
            continue
        try:
            validate(add_communication(schedule))
        except ScheduleError:
            continue
        step = simulate(schedule, costs).step_time()
        if best is None or step < best[0]:
            best = (step, schedule)
    return best
