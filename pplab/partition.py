"""Cutting the model into pipeline stages.

A stage is a `LlamaModel` slice: the first owns the embedding, the last the final
norm and LM head, and each owns a contiguous run of layers. Stages are built on
the meta device and then materialised, so a rank allocates only what it owns,
and their parameter names are the full model's, so checkpoints line up.
"""

from __future__ import annotations

from collections.abc import Sequence

from pplab.arguments import check_positive_int
from pplab.model import LlamaConfig, LlamaModel, materialise


def layer_ranges(n_layers: int, n_stages: int, balance: Sequence[int] | None = None,
                 allow_empty: bool = False) -> list[tuple[int, int]]:
    """One (start, end) layer range per stage, end exclusive; earlier stages take the extra layers."""
    check_positive_int("n_layers", n_layers)
    check_positive_int("n_stages", n_stages)
    counts = _balanced_counts(n_layers, n_stages, allow_empty) if balance is None else \
        _checked_balance(balance, n_layers, n_stages, allow_empty)
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _balanced_counts(n_layers: int, n_stages: int, allow_empty: bool) -> list[int]:
    if n_stages > n_layers and not allow_empty:
        raise ValueError(
            f"n_stages={n_stages} is more than n_layers={n_layers}: some stages would hold no "
            f"layer. Use at most {n_layers} stages, or pass allow_empty=True for pass-through stages")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage < extra else 0) for stage in range(n_stages)]


def _checked_balance(balance: Sequence[int], n_layers: int, n_stages: int,
                     allow_empty: bool) -> list[int]:
    counts = list(balance)
    if len(counts) != n_stages:
        raise ValueError(f"balance={counts} has {len(counts)} entries but n_stages={n_stages}; "
                         f"give one layer count per stage")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        raise ValueError(f"balance={counts}: layer counts must be non-negative integers")
    if sum(counts) != n_layers:
        raise ValueError(f"balance={counts} sums to {sum(counts)} but the model has "
                         f"n_layers={n_layers}; the counts must add up to it")
    if 0 in counts and not allow_empty:
        raise ValueError(f"balance={counts} leaves stage {counts.index(0)} without layers; "
                         f"pass allow_empty=True for pass-through stages")
    return counts


def stage_of_parameter(name: str, ranges: Sequence[tuple[int, int]]) -> int:
    """The stage that holds parameter `name` (a full-model name) under `layer_ranges`' cut."""
    if name.startswith("embed_tokens."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(stage for stage, (start, end) in enumerate(ranges) if start <= layer < end)
    return len(ranges) - 1  # the final norm and the LM head


def build_stage(config: LlamaConfig, stage_index: int, n_stages: int, seed: int = 0,
                device="cpu", balance: Sequence[int] | None = None,
                allow_empty: bool = False) -> LlamaModel:
    """The module pipeline stage `stage_index` of `n_stages` owns, with the full model's weights."""
    ranges = layer_ranges(config.num_hidden_layers, n_stages, balance, allow_empty)
    if not isinstance(stage_index, int) or not 0 <= stage_index < n_stages:
        raise ValueError(f"stage_index={stage_index!r} is not a stage of n_stages={n_stages}; "
                         f"use 0..{n_stages - 1}")
    start, end = ranges[stage_index]
    return materialise(config, seed, device, layers=range(start, end),
                       embed=stage_index == 0, head=stage_index == n_stages - 1)

