"""Tensors that may be sharded: FSDP's and TP's DTensors, their local part and their whole.

pplab's own runtime holds plain tensors; on a mesh (`pplab.rank.mesh`) parameters and gradients
are DTensors. These helpers treat both alike. Floor 3.
"""

from __future__ import annotations

import logging
import sys

import torch


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a DTensor (FSDP's and TP's sharded tensors), without importing DTensor's package
    (slow to import): if nobody imported it, no tensor is one."""
    package = sys.modules.get("torch.distributed.tensor")
    return package is not None and isinstance(tensor, package.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank stores: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor. For a DTensor (FSDP, TP) this is a collective:
    every rank of its mesh must ask for it, in the same order."""
    if not is_dtensor(tensor):
        return tensor
    # Gathering a 2-D (dp x tp) shard warns that it takes two all-gathers: true, and fine here.
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        redistribute.setLevel(level)
