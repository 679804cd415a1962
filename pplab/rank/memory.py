"""Meters of activation memory: the bytes a forward saves for its backward.

The runtime records them on each forward event, so a timeline knows how many bytes each
rank holds at each moment; the profiler measures them per stage for `predict`; the mesh
counts the inputs that activation checkpointing keeps. Floor 3.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pplab.rank.shards import local_tensor


class SavedBytes:
    """Counts the bytes autograd saves for backward in a forward of `module`, parameters excluded.

    Which storages are parameters is asked anew for each saved tensor: FSDP gathers a
    block's weights into fresh storage just before the block runs, and frees it after.
    `current` is the count a forward is taking now: a block under activation checkpointing
    saves nothing through autograd's hooks but keeps its input, and adds it here (`keep`).
    """

    current: "SavedBytes | None" = None

    def __init__(self, module: nn.Module):
        self.module = module
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """autograd's pack hook: count what it saves, and save it unchanged."""
        self.keep(tensor)
        return tensor

    def keep(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage once, unless a parameter owns it."""
        storage = local_tensor(tensor).untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.seen:
            return
        if any(local_tensor(p).untyped_storage().data_ptr() == pointer for p in self.module.parameters()):
            return
        self.seen.add(pointer)
        self.bytes += storage.nbytes()

    @contextlib.contextmanager
    def hooks(self):
        """While open, saved tensors go through `pack` and `SavedBytes.current` is this count."""
        previous, SavedBytes.current = SavedBytes.current, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield self
        finally:
            SavedBytes.current = previous


class ForwardBytes:
    """What a forward saves for backward, measured once per key (a stage and its input's shape:
    the hooks cost time on every saved tensor) and remembered."""

    def __init__(self):
        self.known: dict = {}

    @contextlib.contextmanager
    def measure(self, key, module: nn.Module):
        """Around a forward of `module`: measure it if `key` is new (then `known[key]` holds it)."""
        if key in self.known:
            yield
            return
        with SavedBytes(module).hooks() as saved:
            yield
        self.known[key] = saved.bytes
