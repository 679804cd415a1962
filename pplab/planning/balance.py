"""Floor 2, the stage balance: how many layers each stage gets, searched with its schedule.

`search_balance` tries cuts of the model's layers (an even split, and the lightest cuts by the
per-layer costs), runs `pplab.planning.search.search` on each cut's stage costs (`stage_costs`),
and keeps the fastest that fits the memory limit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from pplab.base.formatting import ShownAsText
from pplab.planning.search import Found, NothingFitsError, _check_saved_bytes, _check_sizes, search
from pplab.planning.simulator import Costs
from pplab.schedules import Kind


@dataclass(frozen=True, repr=False)
class Balanced(ShownAsText):
    """The layers per stage that the search found fastest, with the schedule for them."""

    balance: tuple[int, ...]
    found: Found
    even: Found  # the default split (extras on early stages), searched the same way
    tried: tuple[tuple[tuple[int, ...], float], ...]  # (balance, best step time) for each tried

    def __str__(self) -> str:
        gain = 1 - self.found.step_time / self.even.step_time
        return (f"balance {list(self.balance)}: step {self.found.step_time:.4g} (in the costs' units) with "
                f"{self.found.schedule.name} ({gain:.1%} faster than the even split "
                f"{list(self.even_balance)} at {self.even.step_time:.4g}); {len(self.tried)} balances tried")

    @property
    def even_balance(self) -> tuple[int, ...]:
        """The default split of the same layers over the same stages (extras on early stages)."""
        return _even(sum(self.balance), len(self.balance))


def stage_costs(layer_costs: Costs, balance: Sequence[int]) -> Costs:
    """Per-stage costs from per-layer ones: each stage sums its layers' F, B, I, W; its message
    is the one leaving its last layer. The first layer's costs include the embedding, the
    last's the final norm, LM head and loss (as `pplab.profile` with one layer per stage gives)."""
    n_layers = _layer_count(layer_costs)
    if sum(balance) != n_layers or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                       for n in balance):
        raise ValueError(f"balance={list(balance)} must give each stage at least one of the {n_layers} "
                         f"layers the costs describe, {n_layers} in all")
    bounds = list(itertools.accumulate(balance, initial=0))

    def summed(values):  # a stage's cost: its layers' added up
        if values is None:
            return None
        if not isinstance(values, tuple):
            return [values * count for count in balance]
        return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]

    def last_of(values):  # a stage's message: its last layer's
        if not isinstance(values, tuple):
            return values
        return [values[b - 1] for b in bounds[1:]]

    # Only what was given is summed: a half left out stays derived from B, stage by stage.
    given = {name: summed(getattr(layer_costs, name)) for name in ("input_grad", "weight_grad")
             if getattr(layer_costs, name) is not None}
    backward = {} if len(given) == 2 else {"backward": summed(layer_costs.backward)}
    return Costs(forward=summed(layer_costs.forward), **backward, **given, latency=layer_costs.latency,
                 bandwidth=layer_costs.bandwidth, activation_bytes=last_of(layer_costs.activation_bytes),
                 link_contention=layer_costs.link_contention, link=layer_costs.link)


def _layer_count(layer_costs: Costs) -> int:
    if not isinstance(layer_costs, Costs) or not isinstance(layer_costs.forward, tuple):
        raise ValueError("per-layer costs are a pplab.Costs with forward (and backward, or input_grad and "
                         "weight_grad) given as one value per layer")
    return len(layer_costs.forward)


def search_balance(n_ranks: int, n_microbatches: int, layer_costs: Costs, memory_limit: float | None = None,
                   saved_bytes: Sequence[int] | None = None, n_virtual: int = 1, split_backward: bool = True,
                   include_torch: bool = True, most: int = 64) -> Balanced:
    """The layers per stage (and schedule) with the least simulated step time (arguments in `search`'s order).

    `layer_costs` has one value per layer for F and B (or I and W): measure them with
    `pplab.profile(config, ..., n_stages=config.num_hidden_layers)`, whose first and last
    "stages" carry the embedding and the LM head. The `most` splits whose heaviest stage is
    lightest are searched (all of them when there are no more; with very many, those around
    the split that makes the heaviest stage lightest). `saved_bytes` per layer makes the
    limit one of bytes; the other options are `search`'s.
    """
    _check_sizes(n_ranks, n_microbatches, memory_limit, n_virtual)
    n_layers, n_stages = _layer_count(layer_costs), n_ranks * n_virtual
    _check_saved_bytes(saved_bytes, n_layers, "layer")
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} stages cannot each take one of {n_layers} layers: use fewer ranks or "
                         f"virtual stages")
    per_layer = [layer_costs.compute_time(Kind.F, i) + layer_costs.compute_time(Kind.B, i)
                 for i in range(n_layers)]
    even = _even(n_layers, n_stages)
    chosen = _lightest_splits(per_layer, n_stages, most)
    if even not in chosen:
        chosen.append(even)
    results = {}
    for split in chosen:
        stage_saved = None if saved_bytes is None else [sum(saved_bytes[a:a + n]) for a, n in
                                                        zip(itertools.accumulate(split, initial=0), split)]
        try:
            results[split] = search(n_ranks, n_microbatches, stage_costs(layer_costs, split), memory_limit,
                                    stage_saved, n_virtual, split_backward, include_torch, show=False)
        except NothingFitsError:
            continue
    if even not in results:
        raise NothingFitsError(f"no schedule fits memory_limit={memory_limit} with the even split "
                               f"{list(even)}: raise the limit")
    best = min(results, key=lambda split: (results[split].step_time, split != even))
    return Balanced(best, results[best], results[even],
                    tuple((split, found.step_time) for split, found in results.items()))


def _lightest_splits(per_layer: list[float], n_stages: int, most: int) -> list[tuple[int, ...]]:
    """Up to `most` splits of the layers into n_stages runs, those whose heaviest run is lightest."""
    n_layers = len(per_layer)
    starts = list(itertools.accumulate(per_layer, initial=0.0))

    def heaviest(split):
        bounds = list(itertools.accumulate(split, initial=0))
        return max(starts[b] - starts[a] for a, b in zip(bounds, bounds[1:]))

    if math.comb(n_layers - 1, n_stages - 1) <= 20_000:
        splits = [tuple(b - a for a, b in zip((0,) + cuts, cuts + (n_layers,)))
                  for cuts in itertools.combinations(range(1, n_layers), n_stages - 1)]
        return sorted(splits, key=heaviest)[:most]
    # Too many to list: the split with the lightest heaviest run (by dynamic programming over
    # prefixes), and the splits one layer away from it at each boundary.
    best = _minimax_split(starts, n_stages)
    near = {best}
    for stage in range(n_stages - 1):
        for shift in (-1, 1):
            split = list(best)
            split[stage] += shift
            split[stage + 1] -= shift
            if min(split) >= 1:
                near.add(tuple(split))
    return sorted(near, key=heaviest)[:most]


def _minimax_split(starts: list[float], n_stages: int) -> tuple[int, ...]:
    """The split into n_stages runs whose heaviest run is lightest (prefix sums in `starts`)."""
    n_layers = len(starts) - 1
    inf = float("inf")
    # cost[k][i]: the lightest heaviest run splitting layers [0, i) into k runs; cut[k][i]: its last cut
    cost = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    cost[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n_layers - (n_stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(cost[k - 1][j], starts[i] - starts[j])
                if candidate < cost[k][i]:
                    cost[k][i], cut[k][i] = candidate, j
    split, i = [], n_layers
    for k in range(n_stages, 0, -1):
        split.append(i - cut[k][i])
        i = cut[k][i]
    return tuple(reversed(split))


def _even(n_layers: int, n_stages: int) -> tuple[int, ...]:
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(n_stages))
