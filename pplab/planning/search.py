"""Find the schedule: the fastest schedule, and stage balance, the simulator knows under a memory limit.

Textbook schedules assume equal stages; real ones are not (the first holds the embedding, the
last the LM head), and a schedule made for the measured costs can beat the hand-made ones.
`search` tries, on pplab's simulator and the given costs:

1. every built-in schedule that fits the sizes: pplab's (gpipe, 1f1b, zb-h1,
   interleaved-1f1b) and, where torch is installed, torch's plans (`TORCH_SCHEDULES`: the
   same four but zb-h1, and looped-bfs, interleaved-zero-bubble, zbv-zero-bubble, dualpipev);
2. list schedules built on the same cost model (`pplab.planning.list_scheduling`), in time order:
   whenever a rank is idle it starts a backward (B, or I) whose gradient is there, else a
   forward whose input is there and whose activations fit under a cap, else a W it held back,
   which fills what would have been a bubble. Variants: each cap from one microbatch up to the
   limit, backward-first or forward-first, B whole or split into I and W; patient: a rank waits
   for a backward's gradient instead of starting a filler that would still run when it arrives;
   alternating: after its warm-up a rank prefers a backward after a forward and a forward after
   a backward (the 1F1B steady state), running a held-back W first when memory stops the
   forward it wants. With two stages per rank, each both looped and in a V (rank r holds
   stages r and 2p-1-r, as ZBV and DualPipeV place them).
3. the zero-bubble paper's heuristic (`pplab.planning.zero_bubble_heuristic`, one stage per rank): its
   four combinations of warm-up depth and skipped forwards, so the search is never slower
   than it;
4. a local improvement of the fastest few: move one action of a rank a few places, keep what
   the simulator says is shorter and still fits (`_improve`), within `improve_seconds`;
5. with `exact=True` (one stage per rank, OR-Tools installed: `pplab[solver]`), the schedule a
   CP-SAT solver proves fastest on the same cost model (`pplab.planning.exact`); the answer
   then carries the proof (`Found.proof`).

Each candidate must pass `validate`; the fastest whose simulated peak fits the limit wins: never
slower than a built-in that fits. Memory is the activations a rank holds (a forward's, until its
B, or its W, ends), in microbatches of its share of the model (a stage of a rank with v stages
counts 1/v), or in bytes where `saved_bytes` gives each stage's bytes per microbatch.

`pplab.planning.balance.search_balance` chooses, from per-layer costs, how many layers each stage gets.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from pplab.base.config import PipelineOptions, takes_options
from pplab.base.formatting import ShownAsText, format_bytes, text_table
from pplab.planning.exact import Proof
from pplab.planning.list_scheduling import empty_pipeline, list_schedule
from pplab.planning.simulator import Costs, simulate
from pplab.planning.zero_bubble_heuristic import HYPERPARAMETERS, heuristic_name, heuristic_schedule
from pplab.schedules import (
    SCHEDULE_NAMES,
    TORCH_SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    add_communication,
    build,
    from_torch,
    releases_activations,
    v_placement,
    validate,
)


@dataclass(frozen=True)
class Candidate:
    """One schedule the search tried: its simulated step time and peak memory, or why not."""

    name: str
    step_time: float | None = None
    peak: float | None = None  # the rank holding most, in the search's memory unit
    fits: bool = False
    builtin: bool = False
    note: str = ""  # why it was not run (invalid, cannot be planned, ...)
    schedule: Schedule | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, repr=False)
class Found(ShownAsText):
    """The search's answer: the schedule, its simulated step time and memory, and what it tried."""

    schedule: Schedule
    step_time: float
    peak_memory: tuple[float, ...]  # per rank, in `unit`
    memory_limit: float | None
    unit: str  # "microbatches" or "bytes"
    tried: tuple[Candidate, ...]
    seconds: float
    proof: "Proof | None" = None  # with exact=True: what the solver proved (pplab.planning.exact)

    @property
    def proved_optimal(self) -> bool:
        """True when the solver proved that no schedule of these costs has a shorter step."""
        return (self.proof is not None and self.proof.optimal
                and self.step_time <= self.proof.step_time * (1 + 1e-9))

    @property
    def best_builtin(self) -> Candidate | None:
        """The fastest built-in schedule that fits the limit."""
        fitting = [c for c in self.tried if c.builtin and c.fits]
        return min(fitting, key=lambda c: c.step_time, default=None)

    def __str__(self) -> str:
        best = self.best_builtin
        limit = "no limit" if self.memory_limit is None else f"limit {_amount(self.memory_limit, self.unit)}"
        lines = [f"found {self.schedule.name}: step {self.step_time:.4g} (in the costs' units), peak "
                 f"{_amount(max(self.peak_memory), self.unit)} per rank ({limit})"]
        if best is not None and best.schedule is not self.schedule:
            gain = 1 - self.step_time / best.step_time
            lines.append(f"best built-in that fits: {best.name}, step {best.step_time:.4g} "
                         f"(the found one is {gain:.1%} faster)")
        elif best is not None:
            lines.append("no other schedule the search built was faster than this built-in")
        fitting = sum(c.fits for c in self.tried)
        lines.append(f"tried {len(self.tried)} schedules ({fitting} fit) in {self.seconds:.2f} s")
        if self.proof is not None:
            lines.append(str(self.proof) if self.proof.optimal or self.step_time >= self.proof.step_time else
                         f"{self.proof} (the search's own is shorter still)")
        return "\n".join(lines)

    def table(self, top: int = 10) -> str:
        """The fastest `top` candidates that fit and every built-in that ran, as text."""
        rows = sorted((c for c in self.tried if c.step_time is not None), key=lambda c: c.step_time)
        shown = [c for c in rows if c.fits][:top] + [c for c in rows if c.builtin]
        return text_table(["schedule", "step (costs' units)", "peak", "fits"],
                          ([c.name, f"{c.step_time:.4g}", _amount(c.peak, self.unit),
                            "yes" if c.fits else "no"]
                           for c in sorted(set(shown), key=lambda c: c.step_time)), right=(1, 2))


def _amount(value: float | None, unit: str) -> str:
    """A memory amount in the search's unit: bytes, or microbatches ("mb")."""
    if value is None:
        return "-"
    return format_bytes(value) if unit == "bytes" else f"{value:g} mb"


# ---------------------------------------------------------------- the search


class NothingFitsError(ValueError):
    """No schedule the search can build fits the memory limit (the message says what would)."""


@takes_options(PipelineOptions, differs={"n_virtual": "None: 1, or as many as the costs give per rank"})
def search(n_ranks: int, n_microbatches: int, costs: Costs, memory_limit: float | None = None,
           saved_bytes: Sequence[int] | None = None, n_virtual: int | None = None,
           split_backward: bool = True, include_torch: bool = True, show: bool | None = None,
           improve_seconds: float = 0.5, exact: bool = False, exact_seconds: float = 60.0,
           lab=None) -> Found:
    """The fastest schedule the search finds for these sizes and costs under `memory_limit`.

    `costs` are per stage: with sequences of n_ranks * v values the stages are those v per
    rank; with single numbers `n_virtual` (default 1) says how many stages a rank runs.
    `memory_limit` is per rank, in microbatches of the rank's share of the activations, or in
    bytes when `saved_bytes` (one value per stage) is given; None for no limit.
    `split_backward=False` keeps to whole backwards (B), for where I + W costs more than B
    (small layers, whose per-call overheads the split pays twice). A progress bar
    shows when the search is long (`show=None`), always (True) or never (False).
    The fastest candidate is then improved locally (see `_improve`) until no move helps or
    `improve_seconds` after the search began have passed (0: not at all). Candidates are
    compared on a buffered link whatever `costs.link` says (`pplab.predict` shows what a
    rendezvous does to the one found). `exact=True` also asks a solver (OR-Tools' CP-SAT, the
    `pplab[solver]` extra; one stage per rank) for the fastest schedule and a proof, within
    `exact_seconds`: `found.proof` says whether it is proved optimal, or the best bound.
    `lab`, the lab the schedule will run on: `costs` are then one device's seconds (a profile's),
    ranked as that lab runs them (`lab.calibration`, measured on first use).
    """
    started = time.perf_counter()
    _check_sizes(n_ranks, n_microbatches, memory_limit, n_virtual)
    _check_costs(costs)
    if lab is not None:
        if lab.calibration.n_ranks != n_ranks:
            raise ValueError(f"the lab has {lab.calibration.n_ranks} ranks and the search {n_ranks}: "
                             f"search for n_ranks={lab.calibration.n_ranks}, or give the lab of {n_ranks}")
        costs = lab.calibration.apply(costs)
    # Candidates are compared on buffered links: a rendezvous needs every send and receive
    # simulated, at several times the cost; `pplab.predict` shows its effect on the one found.
    costs = replace(costs, link="buffered")
    v = _virtual_stages(costs, n_ranks, n_virtual)
    _check_saved_bytes(saved_bytes, n_ranks * v)
    costs.check_stages(n_ranks * v)
    weights = _weights(n_ranks, v, saved_bytes)
    unit = "bytes" if saved_bytes is not None else "microbatches"
    candidates = list(_builtins(n_ranks, n_microbatches, v, include_torch))
    candidates += list(_list_schedules(n_ranks, n_microbatches, v, costs, weights, memory_limit, unit,
                                       (False, True) if split_backward else (False,)))
    if v == 1 and split_backward:
        candidates += list(_heuristic_schedules(n_ranks, n_microbatches, costs, weights, memory_limit))
    if not split_backward:
        candidates = [c for c in candidates if c[1] is None or not _splits(c[1])]
    if exact and v != 1:
        raise ValueError(f"exact=True solves one stage per rank; these costs give {v} per rank: "
                         f"search without exact=True, or give one cost per rank")
    tried = []
    actions = 6 * n_ranks * v * n_microbatches  # about, per candidate, messages included
    progress = _progress(len(candidates), show if show is not None else len(candidates) * actions > 2_000_000)
    for name, schedule, builtin, note in candidates:
        tried.append(_evaluate(name, schedule, builtin, note, costs, weights, memory_limit))
        progress.update()
    progress.close()
    fitting = [c for c in tried if c.fits]
    if not fitting:
        measured = [c for c in tried if c.peak is not None]
        smallest = min(measured, key=lambda c: c.peak)
        raise NothingFitsError(f"no schedule fits memory_limit={memory_limit:g} {unit} per rank: the "
                               f"smallest budget that works is {smallest.peak:g} {unit} ({smallest.name}); "
                               f"give memory_limit >= {smallest.peak:g}")
    fastest = min(c.step_time for c in fitting)
    ties = [c for c in fitting if c.step_time <= fastest * (1 + 1e-9)]  # equal but for rounding
    best = next((c for c in ties if c.builtin), ties[0])  # a tie goes to the built-in
    # The fastest few candidates (one per kind of schedule) are each improved locally in turn.
    starts = sorted(fitting, key=lambda c: c.step_time)[:IMPROVED_STARTS]
    for start in starts:
        improved = _improve(start.schedule, costs, weights, memory_limit, deadline=started + improve_seconds)
        if improved is not None:
            tried.append(improved)
            if improved.step_time < best.step_time * (1 - 1e-9):
                best = improved
    proof = None
    if exact:  # the solver starts from the search's best, and proves what it can
        from pplab.planning.exact import exact_schedule  # OR-Tools, only on this path

        solved, proof = exact_schedule(n_ranks, n_microbatches, costs, memory_limit, weights, split_backward,
                                       exact_seconds, hint=best.schedule)
        tried.append(_evaluate(solved.name, solved, False, str(proof), costs, weights, memory_limit))
        if tried[-1].fits and tried[-1].step_time < best.step_time * (1 - 1e-9):
            best = tried[-1]
    schedule = best.schedule if best.schedule.has_communication else add_communication(best.schedule)
    validate(schedule)
    timeline = simulate(schedule, costs)
    if timeline.step_time() != best.step_time:  # the messages must not change the prediction
        raise RuntimeError(f"{best.name}: {timeline.step_time()} with its messages, {best.step_time} without")
    return Found(schedule, best.step_time, _peaks(schedule, weights), memory_limit, unit,
                 tuple(tried), time.perf_counter() - started, proof)


IMPROVED_STARTS = 4  # how many of the fastest candidates the local improvement starts from
IMPROVING_SHIFTS = (1, -1, 2, -2, 3, -3)  # how far an action may move in one step


def _improve(schedule: Schedule, costs: Costs, weights, memory_limit, deadline: float) -> Candidate | None:
    """A local improvement of `schedule`'s compute order: move one action of a rank a few places
    earlier or later, keep the move when the simulator says the step is shorter and the memory
    still fits, and go on until no move helps (or the deadline). A move that breaks the dependency
    rule deadlocks the simulation and is dropped. The result, if any, is validated like every
    other candidate."""
    orders = [list(actions) for actions in schedule.compute_only().actions]
    p, m, n_stages, v = schedule.n_ranks, schedule.n_microbatches, schedule.n_stages, schedule.n_virtual

    def step_time(candidate) -> float | None:
        trial = Schedule(candidate, p, m, n_stages, v, "improving", schedule.placement)
        if memory_limit is not None and max(_peaks(trial, weights)) > memory_limit * (1 + 1e-9):
            return None
        try:
            return simulate(trial, costs).step_time()
        except ScheduleError:  # a deadlock: the swap broke what an action needs
            return None

    best = step_time(orders)
    start = best
    moved = True
    while moved and best is not None and time.perf_counter() < deadline:
        moved = False
        for rank, i, shift in itertools.product(range(p), range(max(len(order) for order in orders)),
                                                IMPROVING_SHIFTS):
            order = orders[rank]
            j = i + shift
            if not (i < len(order) and 0 <= j < len(order)):
                continue
            action = order[i]
            passed = order[j:i] if j < i else order[i + 1:j + 1]
            if any((other.stage, other.kind) == (action.stage, action.kind) for other in passed):
                continue  # a stage's passes of one kind stay in microbatch order
            order.insert(j, order.pop(i))
            shorter = step_time(orders)
            if shorter is not None and shorter < best * (1 - 1e-9):
                best, moved = shorter, True
            else:
                order.insert(i, order.pop(j))
            if time.perf_counter() >= deadline:
                break
    if best is None or best >= start * (1 - 1e-9):
        return None
    name = f"{schedule.name}, improved"
    improved = Schedule(orders, p, m, n_stages, v, name, schedule.placement)
    candidate = _evaluate(name, add_communication(improved), False, "", costs, weights, memory_limit)
    return candidate if candidate.fits and candidate.step_time is not None else None


def _virtual_stages(costs: Costs, n_ranks: int, n_virtual: int | None) -> int:
    lengths = {len(value) for value in (costs.forward, costs.backward, costs.input_grad, costs.weight_grad)
               if isinstance(value, tuple)}
    if len(lengths) > 1:
        raise ValueError(f"costs give per-stage values of different lengths {sorted(lengths)}: "
                         f"give every one for the same number of stages")
    if lengths:
        (n_stages,) = lengths
        if n_stages % n_ranks:
            raise ValueError(f"costs are for {n_stages} stages, which do not spread over n_ranks={n_ranks}: "
                             f"give n_ranks * v values (v stages per rank)")
        if n_virtual is not None and n_virtual != n_stages // n_ranks:
            raise ValueError(f"n_virtual={n_virtual} but the costs are for {n_stages} stages = "
                             f"{n_stages // n_ranks} per rank over {n_ranks} ranks")
        return n_stages // n_ranks
    return 1 if n_virtual is None else n_virtual


def _check_costs(costs) -> None:
    if not isinstance(costs, Costs):
        raise ValueError(f"costs={costs!r} must be a pplab.Costs (a profile gives them: "
                         f"profile.costs(split_backward=True))")


def _check_sizes(n_ranks, n_microbatches, memory_limit, n_virtual=1) -> None:
    for name, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit,
                                                                                      (int, float))
                                     or not memory_limit > 0 or math.isinf(memory_limit)):
        raise ValueError(f"memory_limit={memory_limit!r} must be a number > 0 (or None for no limit)")


def _check_saved_bytes(saved_bytes, n_stages: int, what: str = "stage") -> None:
    if saved_bytes is None:
        return
    if len(saved_bytes) != n_stages:
        raise ValueError(f"saved_bytes has {len(saved_bytes)} values but there are {n_stages} {what}s: "
                         f"give each {what}'s activation bytes per microbatch")
    if any(isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0 for b in saved_bytes):
        raise ValueError(f"saved_bytes={list(saved_bytes)}: every {what} keeps some activations; give "
                         f"numbers > 0")


def _weights(n_ranks: int, v: int, saved_bytes: Sequence[int] | None) -> tuple[float, ...]:
    """What one microbatch's activations of each stage count against the limit."""
    if saved_bytes is not None:
        return tuple(float(b) for b in saved_bytes)
    return tuple(1.0 / v for _ in range(n_ranks * v))


def _progress(total: int, show: bool):
    if show:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="schedules tried", leave=False)

    class Silent:
        def update(self, n=1): pass
        def close(self): pass

    return Silent()


def _evaluate(name, schedule, builtin, note, costs, weights, memory_limit) -> Candidate:
    """Validate, simulate, measure the peak; a candidate that fails says why."""
    if schedule is None:
        return Candidate(name, builtin=builtin, note=note)
    try:
        validate(schedule)
    except ScheduleError as error:
        return Candidate(name, builtin=builtin, note=f"invalid: {error}")
    timeline = simulate(schedule, costs)
    peak = max(_peaks(schedule, weights))
    fits = memory_limit is None or peak <= memory_limit * (1 + 1e-9)
    return Candidate(name, timeline.step_time(), peak, fits, builtin, note, schedule)


def _peaks(schedule: Schedule, weights) -> tuple[float, ...]:
    """Per rank, the most activations held at once: a forward holds its stage's weight from its
    start until its B, or its W, ends (`Timeline.inflight` counts the same way). A rank runs one
    action at a time, in its order, so the order alone says it: a release ends before the next
    action starts, and the peak is reached as a forward starts. (No timeline needed: a search
    reads thousands.)"""
    peaks = []
    for actions in schedule.actions:
        held = peak = 0.0
        for action in actions:
            if action.kind == Kind.F:
                held += weights[action.stage]
                peak = max(peak, held)
            elif releases_activations(action.kind):
                held -= weights[action.stage]
        peaks.append(round(peak, 9))
    return tuple(peaks)


# ---------------------------------------------------------------- the candidates


def _builtins(p: int, m: int, v: int, include_torch: bool):
    """(name, schedule or None, builtin, note) for every built-in schedule of these sizes."""
    for name in SCHEDULE_NAMES:
        if (name == "interleaved-1f1b") != (v > 1):
            continue
        try:
            yield f"pplab {name}", build(name, p, m, v), True, ""
        except ValueError as error:
            yield f"pplab {name}", None, True, f"cannot build: {error}"
    if not include_torch:
        return
    for plan in TORCH_SCHEDULES.values():
        if plan.fewest_stages_per_rank != v:  # each plan at 1 stage per rank, or 2: none at v >= 3
            continue
        try:
            yield f"torch {plan.name}", from_torch(plan.name, p, m, v), True, ""
        except ImportError:  # no torch here: its plans cannot be asked for
            return
        except ValueError as error:
            yield f"torch {plan.name}", None, True, f"cannot plan: {error}"


def _splits(schedule: Schedule) -> bool:
    """True when the schedule splits backwards into I and W."""
    return any(a.kind == Kind.I for actions in schedule.actions for a in actions)


def _list_schedules(p: int, m: int, v: int, costs: Costs, weights, memory_limit, unit: str, splits):
    """List schedules for every cap up to the limit, backward- or forward-first, B or I+W; with two
    stages per rank, both looped and in a V (rank r holds stages r and 2p-1-r, as ZBV and DualPipeV)."""
    placements = [None, v_placement(p)] if v == 2 and p > 1 else [None]
    for placement in placements:
        pipeline = empty_pipeline(p, m, v, placement)
        for split, policy, cap in _list_policies(p, v, pipeline, weights, memory_limit, splits):
            backward_first, patient, alternate = policy
            orders = list_schedule(p, m, v, costs, weights, cap, split, backward_first, patient, alternate,
                                   placement)
            order = "alternating" if alternate else f"{'backward' if backward_first else 'forward'}-first"
            label = (f"list {'V ' if placement else ''}{'I+W' if split else 'B'} {order} "
                     f"{'patient ' if patient else ''}cap {_amount(cap, unit)}")
            if orders is None:
                yield label, None, False, "the cap leaves a rank unable to go on"
                continue
            # Compute order only: the simulator moves its data after the same message times as a
            # schedule with sends and receives would (they cost no rank time), at half the actions.
            yield label, Schedule(orders, p, m, p * v, v, label, placement), False, ""


def _list_policies(p: int, v: int, pipeline: Schedule, weights, memory_limit, splits):
    """(split, (backward_first, patient, alternate), cap) of every list schedule the search tries."""
    smallest = max(weights)  # one microbatch of the heaviest stage: the least a cap can be
    m = pipeline.n_microbatches
    most = max(sum(weights[s] for s in pipeline.stages_of(r)) for r in range(p)) * m  # all a rank could hold
    top = most if memory_limit is None else max(smallest, min(memory_limit, most))
    # Caps of 1, 2, ... heaviest-stage microbatches up to twice the stages (every one up to 8,
    # or 1, 2, 4, 8 beyond 16 stages, whose first ranks need more than 8 to fill the pipeline;
    # about 8 of them beyond 8, so that large pipelines stay quick to search), then sparser up
    # to the top: the smallest caps also say how little memory the search can make do with.
    count = int(top / smallest + 1e-9)
    dense = min(count, 2 * p * v)
    small = range(1, min(dense, 8) + 1) if p * v <= 16 else [k for k in (1, 2, 4, 8) if k <= dense]
    ks = set(small) | set(range(8, dense + 1, max(1, dense // 8))) | set(range(2 * p * v, count + 1, p * v))
    caps = sorted({smallest * k for k in ks} | {top})
    # (backward-first, patient, alternate); waiting and alternating are about where the Ws go
    variants = [(True, False, False), (False, False, False), (True, True, False), (True, True, True)]
    for split, variant, cap in itertools.product(splits, variants, caps):
        if (variant[1] or variant[2]) and not split:
            continue
        yield split, variant, cap


def _heuristic_schedules(p: int, m: int, costs: Costs, weights, memory_limit):
    """The zero-bubble paper's heuristic, each combination of its two hyperparameters."""
    limit = math.inf if memory_limit is None else memory_limit
    for extra_warmup, skip_forward in HYPERPARAMETERS:
        name = heuristic_name(extra_warmup, skip_forward)
        schedule = heuristic_schedule(p, m, costs, limit, extra_warmup, skip_forward, weights)
        yield name, schedule, False, "" if schedule is not None else "the limit leaves a rank unable to go on"
