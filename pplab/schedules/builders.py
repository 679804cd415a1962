"""The classic schedules, built for p ranks, m microbatches and v stages per rank.

Each builder returns the compute order of every rank (loop placement: stage s
on rank s % p); `build` checks the sizes and adds the communication.
"""

from __future__ import annotations

from pplab.base.arguments import check_positive_int
from pplab.schedules.actions import Action, Kind
from pplab.schedules.communication import add_communication
from pplab.schedules.names import SCHEDULE_NAMES, schedule_name
from pplab.schedules.schedule import Schedule


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [
        [Action(r, Kind.F, mb) for mb in range(m)] + [Action(r, Kind.B, mb) for mb in range(m)]
        for r in range(p)
    ]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """Warm up with p-1-r forwards, then alternate one forward and one backward (PipeDream-Flush).

    torch's Schedule1F1B refuses m < p; the schedule is still well defined
    there (the warm-up is cut short at m forwards), so this one accepts it.
    """
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, Kind.F, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            order += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, k)]
        order += [Action(r, Kind.B, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return orders


def _microbatches_per_round(p: int, m: int) -> int:
    """How many microbatches go through a chunk before the next chunk, as torch counts them.

    Megatron's interleaved schedule needs m to be a multiple of p; torch
    relaxes that to rounds of m // rounds microbatches with rounds =
    max(1, m // p), which needs m to be a multiple of the number of rounds.
    """
    rounds = max(1, m // p)
    if m % rounds:
        fits = [k for k in range(max(1, m - p), m + p + 1) if k % max(1, k // p) == 0]
        raise ValueError(
            f"interleaved-1f1b with n_ranks={p} cannot use n_microbatches={m}: "
            f"it runs in {rounds} rounds of equal size, so n_microbatches must be a "
            f"multiple of {rounds}; nearby values that work: {fits}"
        )
    return m // rounds


def _interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021), with torch's round sizes."""
    per_round = _microbatches_per_round(p, m)
    orders = []
    for r in range(p):
        # Every extra chunk needs a round of forwards before the first
        # backward, and each hop away from the last rank two more.
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), v * m)
        forward_stages = [r + p * ((op // per_round) % v) for op in range(v * m)]
        backward_stages = [r + p * (v - 1 - (op // per_round) % v) for op in range(v * m)]
        next_mb = {Kind.F: [0] * (v * p), Kind.B: [0] * (v * p)}

        def take(kind: Kind, stage: int) -> Action:
            mb = next_mb[kind][stage]
            next_mb[kind][stage] += 1
            return Action(stage, kind, mb)

        order = [take(Kind.F, forward_stages[op]) for op in range(warmup)]
        for op in range(warmup, v * m):
            order.append(take(Kind.F, forward_stages[op]))
            order.append(take(Kind.B, backward_stages[op - warmup]))
        order += [take(Kind.B, backward_stages[op]) for op in range(v * m - warmup, v * m)]
        orders.append(order)
    return orders


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with B split into I and W.

    Rank r holds back its first r weight-gradient passes W and runs them at
    the end, where 1F1B would leave rank r idle; the last rank, which would
    idle longest, holds back the most.
    """
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, Kind.F, mb) for mb in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                order.append(Action(r, Kind.F, warmup + k))
            order.append(Action(r, Kind.I, k))
            if k >= r:
                order.append(Action(r, Kind.W, k - r))
        order += [Action(r, Kind.W, mb) for mb in range(max(0, m - r), m)]
        orders.append(order)
    return orders


_BUILDERS = {  # by canonical name: SCHEDULE_NAMES
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved_1f1b,
    "zb-h1": _zb_h1,
}


def build(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The named schedule for these sizes, with its communication (any spelling of
    the name, see `schedule_name`)."""
    return add_communication(build_compute_order(name, n_ranks, n_microbatches, n_virtual))


def build_compute_order(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The named schedule's compute actions alone (what `build` gives before the communication
    pass, the costly part: enough to recognise a schedule by its order)."""
    check_positive_int("n_ranks", n_ranks)
    check_positive_int("n_microbatches", n_microbatches)
    check_positive_int("n_virtual", n_virtual, example=2)
    key = schedule_name(name)
    if key not in _BUILDERS:
        raise ValueError(f"pplab does not build {key}: it builds {', '.join(SCHEDULE_NAMES)}; torch runs "
                         f"{key} (impl='torch'), and from_torch imports its plan")
    if key == "interleaved-1f1b" and n_virtual < 2:
        raise ValueError(
            f"interleaved-1f1b needs n_virtual >= 2 stages per rank, got n_virtual={n_virtual}; "
            f"use n_virtual=2 or more, or '1f1b' for one stage per rank"
        )
    if key != "interleaved-1f1b" and n_virtual != 1:
        raise ValueError(
            f"{key} runs one stage per rank, got n_virtual={n_virtual}; "
            f"use n_virtual=1, or 'interleaved-1f1b' for several stages per rank"
        )
    compute = _BUILDERS[key](n_ranks, n_microbatches, n_virtual)
    return Schedule(compute, n_ranks, n_microbatches, n_ranks * n_virtual, n_virtual, key)
