"""List scheduling: per-rank compute orders built in time order on the cost model.

Whenever a rank is idle it starts what a policy prefers among the passes whose inputs are
there: the search (`pplab.planning.search`) tries such schedules under many memory caps and
policies, and the zero-bubble paper's heuristic (`pplab.planning.zero_bubble_heuristic`) is one more
policy of the same kind. Both ask this module what each pass waits for, from the schedules'
one dependency rule.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from pplab.planning.simulator import Costs
from pplab.schedules import Action, Dependencies, Kind, Schedule, releases_activations


def list_schedule(p: int, m: int, v: int, costs: Costs, weights, cap: float, split: bool,
                  backward_first: bool, patient: bool = False, alternate: bool = False,
                  placement: tuple[int, ...] | None = None) -> list[list[Action]] | None:
    """Per rank compute orders from a list schedule in time order on the cost model (stages placed
    by `placement`, default the loop: stage s on rank s % p); None when the cap leaves a rank
    unable to go on.

    At every moment something finishes or arrives, each idle rank starts, in this order of
    preference: a backward (B, or I) whose output gradient is there (with `backward_first`),
    a forward whose input is there if its activations fit under `cap`, a backward, and, with
    `split`, a W it held back. A `patient` rank starts no such filler when a backward's input
    arrives before the filler would end: it waits, so that the critical backward is not delayed
    (the zero-bubble paper's scheduler does the same). An `alternate` rank, once it has run a
    backward, prefers a backward after a forward and a forward after a backward (the paper's
    steady 1F1B pattern) instead of always the one `backward_first` says. Each stage runs its
    forwards, and its backwards, in microbatch order.
    What a pass waits for is the schedules' one dependency rule; what it holds, their release rule.
    """
    pipeline = empty_pipeline(p, m, v, placement)
    n_stages = pipeline.n_stages
    backward_kind = Kind.I if split else Kind.B
    inputs = inputs_of_passes(pipeline, backward_kind, costs)
    arrivals = outputs_reach(inputs, pipeline)
    ended = {key: [None] * m for key in inputs}  # per (kind, stage): when its pass of each microbatch ended
    # Per stage, the same as plain lists, which the loop below reads without building keys:
    # when its forward (backward) of each microbatch ended, and the lists its needs are read from.
    every_stage = range(n_stages)
    forward_ended = [ended[Kind.F, s] for s in every_stage]
    backward_ended = [ended[backward_kind, s] for s in every_stage]
    forward_needs = [_Needs((ended[producer], delay) for producer, delay in inputs[Kind.F, s])
                     for s in every_stage]
    backward_needs = [_Needs((ended[producer], delay) for producer, delay in inputs[backward_kind, s])
                      for s in every_stage]
    for needs in (*forward_needs, *backward_needs):
        needs.ready = [None] * m
    stages_of = [pipeline.stages_of(rank) for rank in range(p)]
    # Per stage, what the loop asks of each pass again and again: how long it takes, and who its
    # output reaches when (a W's reaches no one).
    forward_cost = [costs.compute_time(Kind.F, s) for s in every_stage]
    backward_cost = [costs.compute_time(backward_kind, s) for s in every_stage]
    weight_cost = [costs.compute_time(Kind.W, s) for s in every_stage]
    forward_reaches = [arrivals.get((Kind.F, s), ()) for s in every_stage]
    backward_reaches = [arrivals.get((backward_kind, s), ()) for s in every_stage]
    next_forward, next_backward = [0] * n_stages, [0] * n_stages
    next_backward_run = [False] * p  # has the rank run a backward yet (its warm-up is over)
    held_back = [[] for _ in range(p)]  # (stage, microbatch) whose W waits
    held = [0.0] * p
    busy_until = [0.0] * p
    orders = [[] for _ in range(p)]
    # (moment, rank): when something may let that rank start (it is free, or an input of its came).
    # Only those ranks are looked at then: the others' choices are what they were.
    wakes, now = [(0.0, rank) for rank in range(p)], 0.0
    remaining = n_stages * m * (3 if split else 2)

    def inputs_at(needs, mb: int) -> float | None:
        """When the inputs of a pass with these needs are there for `mb`; None while one is not made.
        Once every producer has started it is known for good: it is kept in `needs.ready`."""
        ready = needs.ready[mb]
        if ready is not None:
            return ready
        at = 0.0
        for producer_ended, delay in needs:
            done = producer_ended[mb]
            if done is None:
                return None
            arrived = done + delay
            at = arrived if arrived > at else at  # max(at, arrived), ties as max() breaks them
        needs.ready[mb] = at
        return at

    def start(rank: int, action: Action, duration: float, reaches=()) -> float:
        """Put `action` on `rank` now; return when it ends."""
        nonlocal remaining
        orders[rank].append(action)
        end = busy_until[rank] = now + duration
        heapq.heappush(wakes, (end, rank))  # the rank is free again
        for consumer, delay in reaches:  # its output reaches who needs it
            heapq.heappush(wakes, (end + delay, consumer))
        if action.kind == Kind.F:
            held[rank] += weights[action.stage]
        elif releases_activations(action.kind):  # booked now: nothing else starts on the rank before it ends
            held[rank] -= weights[action.stage]
        remaining -= 1
        return end

    while remaining:
        if not wakes:
            return None  # nothing will ever happen again: a rank is stuck under the cap
        now, first = heapq.heappop(wakes)
        woken = {first}
        while wakes and wakes[0][0] <= now:
            woken.add(heapq.heappop(wakes)[1])
        for rank in sorted(woken):
            if busy_until[rank] > now:
                continue
            stages = stages_of[rank]
            backwards = [(t, s) for s in stages if next_backward[s] < m
                         for t in [inputs_at(backward_needs[s], next_backward[s])]
                         if t is not None and t <= now]
            forwards = [(t, s) for s in stages
                        if next_forward[s] < m and held[rank] + weights[s] <= cap * (1 + 1e-9)
                        for t in [inputs_at(forward_needs[s], next_forward[s])]
                        if t is not None and t <= now]
            if patient and not backwards and (forwards or held_back[rank]):
                soon = [t for s in stages if next_backward[s] < m
                        for t in [inputs_at(backward_needs[s], next_backward[s])]
                        if t is not None and t > now]
                if forwards:
                    filler = forward_cost[min(forwards, key=lambda ts: (ts[0], ts[1]))[1]]
                else:
                    filler = weight_cost[held_back[rank][0][0]]
                # A filler that ends as the input arrives delays nothing: the two times may differ by
                # rounding alone (idling there kept the search at 48.2 against the proved 47.4, p=8, m=8).
                if soon and min(soon) < (now + filler) * (1 - 1e-9):
                    continue  # woken again when that input arrives
            first = backward_first
            if alternate and orders[rank] and next_backward_run[rank]:
                first = orders[rank][-1].kind == Kind.F  # after a forward a backward, and the reverse
                if not first and not forwards and held_back[rank] and any(
                        next_forward[s] < m
                        and (t := inputs_at(forward_needs[s], next_forward[s])) is not None
                        and t <= now for s in stages):
                    backwards = []  # the forward it wants waits for memory: a held-back W frees some
            if backwards and (first or not forwards):
                _, stage = min(backwards, key=lambda ts: (ts[0], -ts[1]))
                mb = next_backward[stage]
                next_backward[stage] += 1
                backward_ended[stage][mb] = start(rank, Action(stage, backward_kind, mb),
                                                  backward_cost[stage],
                                                  backward_reaches[stage])
                next_backward_run[rank] = True
                if split:
                    held_back[rank].append((stage, mb))
            elif forwards:
                _, stage = min(forwards, key=lambda ts: (ts[0], ts[1]))
                mb = next_forward[stage]
                next_forward[stage] += 1
                forward_ended[stage][mb] = start(rank, Action(stage, Kind.F, mb), forward_cost[stage],
                                                 forward_reaches[stage])
            elif held_back[rank]:
                stage, mb = held_back[rank].pop(0)
                start(rank, Action(stage, Kind.W, mb), weight_cost[stage])
    return orders


def outputs_reach(inputs: dict, pipeline: Schedule) -> dict:
    """Per (kind, stage) whose output some pass needs: (the rank that needs it, how long after the
    pass ends it is there), sorted, once each; the inversion of `inputs_of_passes`."""
    rank_of = {stage: rank for rank in range(pipeline.n_ranks) for stage in pipeline.stages_of(rank)}
    reaches = defaultdict(set)
    for (_, consumer), needs in inputs.items():
        for producer, delay in needs:
            reaches[producer].add((rank_of[consumer], delay))
    return {producer: sorted(ranks) for producer, ranks in reaches.items()}


class _Needs(list):
    """A pass's needs, (when each producer's pass of a microbatch ended, the data's delay), with
    `ready`: per microbatch, when they are all there, once that is known."""

    ready: list


def empty_pipeline(p: int, m: int, v: int, placement: tuple[int, ...] | None = None) -> Schedule:
    """A pipeline before any action: p ranks, m microbatches, v stages per rank, placed by `placement`
    (None: the loop)."""
    return Schedule([[] for _ in range(p)], p, m, p * v, v, "list", placement)


def inputs_of_passes(pipeline: Schedule, backward_kind: Kind, costs: Costs) -> dict:
    """Per (kind, stage) of every forward and backward: ((kind, stage) it waits for, the time the data
    takes to come) for each need, from the one dependency rule for a compute order without messages.

    The rule is asked for microbatch 0: every need of a pass is of its own microbatch.
    """
    stages = range(pipeline.n_stages)
    rule = Dependencies(pipeline, with_communication=False,
                        present={Action(stage, backward_kind, 0) for stage in stages})

    def delay(need) -> float:
        return 0.0 if need.transfer is None else costs.transfer_time(need.transfer)

    return {(kind, stage): [((need.action.kind, need.action.stage), delay(need))
                            for need in rule.needs(Action(stage, kind, 0))]
            for kind in (Kind.F, backward_kind) for stage in stages}
