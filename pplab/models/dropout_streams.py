"""Dropout masks that one device and every pipeline draw alike.

Dropout draws its masks from the global random stream, in the order the modules run. One device
runs a microbatch through the whole model; a pipeline runs it stage by stage, on other processes,
with other microbatches in between. The two draw different masks, so their losses and gradients
differ by chance (GPT-2's dropout of 0.1: a relative loss difference of 3e-4), and even one device
draws new masks at every call.

Here each unit of a model that may draw (a decoder block, the dropout after the embeddings)
reseeds the stream as it starts, from (the model's seed, the step, the microbatch, the unit's
path), while a step says which microbatch runs (`step` around the step, `microbatch` around each
of its actions; a backward too, so that a recomputed block draws its forward's masks again).
One device and any pipeline then draw the same masks, a step repeated draws them again, and
training draws new ones at every step. Outside a step, or in eval mode, dropout is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable

import torch
from torch import nn

_step: tuple[int, int, int] | None = None  # (the model's seed, the step, the first microbatch's number)
_microbatch: int | None = None  # the microbatch whose action runs now (numbered within the step's part)


@contextlib.contextmanager
def step(seed: int, number: int = 0, first_microbatch: int = 0):
    """Within: step `number` of a model built from `seed`, its microbatches numbered from
    `first_microbatch` (a data-parallel replica's first). The global random state is put back after."""
    global _step
    previous, _step = _step, (seed, number, first_microbatch)
    try:
        with torch.random.fork_rng(devices=_cuda_devices()):
            yield
    finally:
        _step = previous


@contextlib.contextmanager
def microbatch(index: int):
    """Within: the actions of microbatch `index` (its forward, backward, input or weight gradient)."""
    global _microbatch
    previous, _microbatch = _microbatch, index
    try:
        yield
    finally:
        _microbatch = previous


def draw_alike(model: nn.Module, paths: Iterable[str]) -> None:
    """Make the submodules of `model` at `paths` (its blocks, its dropout) reseed the random stream
    as they start, within a step's microbatch, in training mode."""
    for path in paths:
        model.get_submodule(path).register_forward_pre_hook(_reseed_for(path))


def has_dropout(model: nn.Module) -> bool:
    """Whether any module of `model` drops (an nn.Dropout, or attention dropout in its config)."""
    config = getattr(model, "config", None)
    rates = [getattr(config, name, 0.0) or 0.0 for name in ("attn_pdrop", "attention_dropout")]
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()) \
        or any(rate > 0 for rate in rates)


def stream_seed(seed: int, number: int, microbatch_index: int, path: str) -> int:
    """A 63-bit seed that depends on (seed, step, microbatch, path) only, stable across runs and hosts."""
    digest = hashlib.sha256(f"dropout:{seed}:{number}:{microbatch_index}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _reseed_for(path: str):
    def reseed(module: nn.Module, _inputs) -> None:
        if module.training and _step is not None and _microbatch is not None:
            seed, number, first = _step
            torch.manual_seed(stream_seed(seed, number, first + _microbatch, path))
    return reseed


def _cuda_devices() -> list[int]:
    """The GPU whose random state a step may change: this process's, where it has one in use."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
