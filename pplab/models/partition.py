"""Cutting a model into pipeline stages.

A stage is a slice of the model: the first owns the embedding, the last the final
norm and LM head, and each owns a contiguous run of layers. Stages are built on
the meta device and then materialised, so a rank allocates only what it owns,
and their parameter names are the full model's, so checkpoints line up.

The model is described by a `LlamaConfig` (pplab's own) or a `pplab.models.hf.HFModel` (a
Hugging Face decoder); both answer the same questions: sizes (`num_hidden_layers`,
`hidden_size`, `vocab_size`, `max_position_embeddings`), `build_stage`, `build_model`,
`parameter_names`, `part_of(name)`, `tied` weights and a manifest `record()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pplab.base.arguments import check_positive_int
from pplab.models.llama import LlamaConfig


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


def as_model(model):
    """The model description a pipeline takes: a LlamaConfig, an HFModel or a TracedModel as it is; a
    Hugging Face config or a directory holding one as a `pplab.models.hf.HFModel` (importing transformers only
    then)."""
    if isinstance(model, LlamaConfig) or hasattr(model, "build_stage"):
        return model
    if isinstance(model, (str, Path)) or "transformers" in type(model).__module__:
        from pplab.models.hf import HFModel

        return HFModel.of(model)
    own = (" For a module of your own, describe how to build and cut it: "
           "pplab.models.traced.TracedModel(make=YourModel, "
           "split_at=['layers.4'])") if hasattr(model, "forward") else ""
    raise TypeError(f"cannot pipeline a {type(model).__name__}: give a pplab.LlamaConfig, a transformers "
                    f"causal-LM config, or a directory holding a config.json (save_pretrained).{own}")


def stage_of_parameter(name: str, ranges: Sequence[tuple[int, int]], model=None) -> int:
    """The stage that holds parameter `name` (a full-model name) under `layer_ranges`' cut."""
    part = (model or LlamaConfig).part_of(name)
    if part == "embed":
        return 0
    if part == "head":
        return len(ranges) - 1  # the final norm and the LM head
    return next(stage for stage, (start, end) in enumerate(ranges) if start <= part < end)


def build_stage(config, stage_index: int, n_stages: int, seed: int = 0,
                device="cpu", balance: Sequence[int] | None = None,
                allow_empty: bool = False):
    """The module pipeline stage `stage_index` of `n_stages` owns, with the full model's weights.

    `config` is a LlamaConfig, or any model `as_model` takes.
    """
    config = as_model(config)
    ranges = layer_ranges(config.num_hidden_layers, n_stages, balance, allow_empty)
    if not isinstance(stage_index, int) or not 0 <= stage_index < n_stages:
        raise ValueError(f"stage_index={stage_index!r} is not a stage of n_stages={n_stages}; "
                         f"use 0..{n_stages - 1}")
    start, end = ranges[stage_index]
    return config.build_stage(range(start, end), embed=stage_index == 0, head=stage_index == n_stages - 1,
                              seed=seed, device=device)

