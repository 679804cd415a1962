"""A proved-optimal schedule on the simulator's cost model, found by a CP-SAT solver.

The search (`pplab.planning.search`) builds schedules and improves them; this module states the
problem for a solver, which finds the fastest step and proves that none is faster:

* one stage per rank; each microbatch runs F on every stage in turn, then its backward, B or I
  then W, from the last stage back;
* each action is an interval of its cost on its rank's line, and no two of a rank's overlap;
* the activation (or gradient) crossing the boundary after stage s arrives `costs.transfer_time(s)`
  after its sender ended (buffered links: a send costs its rank nothing, links never queue);
* a forward holds its stage's activations from its start until its B, or its W, ends: what a rank
  holds at once stays under `memory_limit` (the search's count, in its unit).

The solver minimises the last end. Its answer, each rank's actions in the order the solver timed
them, is a pplab `Schedule`, which the simulator runs to the same step. The solver works on whole
numbers: the costs are put on a grid (exact where they have few decimals, else `GRID` steps of
the longest action), and its proof is about the costs on that grid (`Proof.grid`).

OR-Tools is an optional dependency (`pip install pplab[solver]`), imported only here. Floor 2.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from pplab.base.formatting import ShownAsText
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import Action, Kind, Schedule, add_communication, validate

__all__ = ["Proof", "exact_schedule", "SolverMissingError"]

GRID = 10_000  # grid steps in the longest action, where the costs are not few-decimal numbers
LARGEST_SCALE = 10 ** 6  # costs with more decimals than this are put on the grid instead


class SolverMissingError(ImportError):
    """OR-Tools, which the exact search needs, is not installed."""


@dataclass(frozen=True)
class Proof(ShownAsText):
    """What the solver proved about the schedule it returned."""

    optimal: bool  # True: no schedule of these costs (on the grid) has a shorter step
    bound: float  # no step can be shorter than this (in the costs' unit)
    step_time: float  # the returned schedule's step, simulated with the costs as given
    seconds: float  # the solver's time
    grid: float  # the time step the costs were put on (in the costs' unit)

    def __str__(self) -> str:
        if self.optimal:
            return (f"proved optimal: step {self.step_time:.6g} (CP-SAT in {self.seconds:.1f} s, "
                    f"costs on a grid of {self.grid:g})")
        if self.bound <= 0:
            return (f"not proved: step {self.step_time:.6g} (the solver stopped at its time limit after "
                    f"{self.seconds:.1f} s with no bound proved)")
        gap = self.step_time / self.bound - 1
        return (f"not proved: step {self.step_time:.6g}, and none can be shorter than {self.bound:.6g} "
                f"({gap:.1%} apart; the solver stopped at its time limit after {self.seconds:.1f} s)")


def exact_schedule(n_ranks: int, n_microbatches: int, costs: Costs, memory_limit: float | None = None,
                   weights: Sequence[float] | None = None, split_backward: bool = True,
                   time_limit: float = 60.0, hint: Schedule | None = None) -> tuple[Schedule, Proof]:
    """The fastest schedule of one stage per rank on these costs, and its proof (see the module).

    `weights`: what one microbatch's activations of each stage count against `memory_limit`
    (default 1 each: the limit is in microbatches). `time_limit`: seconds the solver may take;
    when it stops there, the best schedule found comes with the best bound proved. `hint`: a
    schedule of these sizes to start from (the search's best: the solver then begins where the
    search ended, and large sizes get its schedule or a better one within the limit, also where
    the limit ran out before the solver found one of its own).
    """
    cp_model = _solver()
    _check(costs, n_ranks, time_limit)
    p, m = n_ranks, n_microbatches
    weights = [1.0] * p if weights is None else list(weights)
    backward_kinds = (Kind.I, Kind.W) if split_backward else (Kind.B,)
    kinds = (Kind.F, *backward_kinds)
    scale = _scale([costs.compute_time(kind, stage) for kind in kinds for stage in range(p)]
                   + [costs.transfer_time(stage) for stage in range(p - 1)])

    def ticks(seconds: float) -> int:
        return round(seconds * scale)

    transfer = [ticks(costs.transfer_time(stage)) for stage in range(p - 1)]
    horizon = m * sum(ticks(costs.compute_time(kind, stage)) for kind in kinds for stage in range(p)) \
        + 2 * m * sum(transfer)
    model = cp_model.CpModel()
    starts, ends, intervals = {}, {}, {}
    for stage in range(p):
        for microbatch in range(m):
            for kind in kinds:
                key = (stage, kind, microbatch)
                length = ticks(costs.compute_time(kind, stage))
                starts[key] = model.NewIntVar(0, horizon, f"start {stage}{kind.value}{microbatch}")
                ends[key] = model.NewIntVar(0, horizon, f"end {stage}{kind.value}{microbatch}")
                intervals[key] = model.NewIntervalVar(starts[key], length, ends[key],
                                                      f"{stage}{kind.value}{microbatch}")
    backward = backward_kinds[0]  # B, or I: the pass whose gradient goes upstream
    release = backward_kinds[-1]  # B, or W: the pass whose end frees the activations
    for microbatch in range(m):
        for stage in range(p):
            forward = (stage, Kind.F, microbatch)
            if stage > 0:  # its input comes from the stage before
                model.Add(starts[forward] >= ends[(stage - 1, Kind.F, microbatch)] + transfer[stage - 1])
            grad = (stage, backward, microbatch)
            model.Add(starts[grad] >= ends[forward])
            if stage < p - 1:  # its gradient comes from the stage after
                model.Add(starts[grad] >= ends[(stage + 1, backward, microbatch)] + transfer[stage])
            if split_backward:
                model.Add(starts[(stage, Kind.W, microbatch)] >= ends[grad])
    for stage in range(p):  # a rank runs one action at a time
        model.AddNoOverlap([interval for key, interval in intervals.items() if key[0] == stage])
    if memory_limit is not None:
        _limit_memory(model, p, m, starts, ends, release, weights, memory_limit, horizon)
    for microbatch in range(m - 1):  # the microbatches are alike: number them in stage 0's order
        model.Add(starts[(0, Kind.F, microbatch)] <= starts[(0, Kind.F, microbatch + 1)])
    step = model.NewIntVar(0, horizon, "step")
    model.AddMaxEquality(step, list(ends.values()))
    model.Minimize(step)
    hinted = hint is not None and _hint(model, hint, costs, starts, ends, ticks)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = 1  # one core: the same answer every run, and the ranks' cores left alone
    began = time.perf_counter()
    status = solver.Solve(model)
    seconds = time.perf_counter() - began
    if status == cp_model.INFEASIBLE:
        raise ValueError(f"no schedule fits memory_limit={memory_limit:g} per rank: give a larger limit")
    if status != cp_model.OPTIMAL and status != cp_model.FEASIBLE:
        if hinted:  # stopped before it had a schedule of its own (a busy machine): the one it was given
            step_time = simulate(hint, costs).step_time()
            return hint, Proof(False, _proved_bound(solver, scale, step_time), step_time, seconds, 1 / scale)
        raise TimeoutError(f"the solver found no schedule within time_limit={time_limit:g} s "
                           f"(p={p}, m={m}): give it longer, or use the search without exact=True")
    order = [sorted((key for key in starts if key[0] == stage),
                    key=lambda key: (solver.Value(starts[key]), solver.Value(ends[key]), kinds.index(key[1])))
             for stage in range(p)]
    schedule = add_communication(Schedule([[Action(*key) for key in keys] for keys in order], p, m, p,
                                          name="exact (CP-SAT)"))
    validate(schedule)
    step_time = simulate(schedule, costs).step_time()
    return schedule, Proof(status == cp_model.OPTIMAL, _proved_bound(solver, scale, step_time), step_time,
                           seconds, 1 / scale)


def _proved_bound(solver, scale: float, step_time: float) -> float:
    """The solver's lower bound on the step, in the costs' unit (0 where it proved none)."""
    bound = solver.BestObjectiveBound() / scale
    return min(bound, step_time) if math.isfinite(bound) and bound > 0 else 0.0


def _hint(model, hint: Schedule, costs: Costs, starts, ends, ticks) -> bool:
    """Start the solver from `hint`'s simulated times, where its actions are the model's (True)."""
    timeline = simulate(hint, costs)
    timed = {(e.stage, Kind(e.kind), e.microbatch): e for e in timeline.compute_events()}
    if set(timed) != set(starts):  # another split of the backward, or other sizes: no use
        return False
    for key, event in timed.items():
        model.AddHint(starts[key], ticks(event.start - timeline.start))
        model.AddHint(ends[key], ticks(event.end - timeline.start))
    return True


def _limit_memory(model, p, m, starts, ends, release, weights, memory_limit, horizon) -> None:
    """A rank's activations, each held from its forward's start to its release's end, stay under the limit."""
    unit = _scale(list(weights) + [memory_limit])
    capacity = int(memory_limit * unit + 1e-9)
    for stage in range(p):
        holds = []
        for microbatch in range(m):
            start, end = starts[(stage, Kind.F, microbatch)], ends[(stage, release, microbatch)]
            length = model.NewIntVar(0, horizon, f"held {stage} {microbatch}")
            holds.append(model.NewIntervalVar(start, length, end, f"holds {stage} {microbatch}"))
        model.AddCumulative(holds, [round(weights[stage] * unit)] * m, capacity)


def _scale(values: Sequence[float]) -> float:
    """Ticks per unit of time: the smallest power of ten that makes every value whole (costs of
    few decimals are then exact), else `GRID` ticks in the largest value."""
    largest = max((abs(v) for v in values), default=1.0) or 1.0
    scale = 1
    while scale <= LARGEST_SCALE:
        if all(abs(v * scale - round(v * scale)) < 1e-9 * max(1.0, abs(v * scale)) for v in values):
            return float(scale)
        scale *= 10
    return GRID / largest


def _check(costs: Costs, n_ranks: int, time_limit: float) -> None:
    """What the exact model states: refuse, naming the value, what it does not."""
    if costs.link_contention:
        raise ValueError("exact=True models links that never queue: give Costs(link_contention=False), "
                         "or search without exact=True")
    if not isinstance(time_limit, (int, float)) or isinstance(time_limit, bool) or time_limit <= 0:
        raise ValueError(f"time_limit={time_limit!r}: give the solver's seconds, a number > 0")
    costs.check_stages(n_ranks)


def _solver():
    """OR-Tools' CP-SAT, or a clear error naming the extra that installs it."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise SolverMissingError("the exact search needs OR-Tools: pip install 'pplab[solver]' "
                                 "(or pip install ortools)") from error
    return cp_model
