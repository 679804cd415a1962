"""Messages through host memory, for ranks that compute on a GPU but talk over gloo.

NCCL holds one rank of a group per device, so ranks that share a GPU join a gloo group
instead; and gloo's send and receive read and write host memory only. Such a rank copies
each message to the host before sending it, receives it into a host buffer, and copies it to
its GPU once it has arrived: the copies are part of the message, in its time and its event.

A lab can ask for the same path on CPU (`Lab(..., host_messages=True)`): each message is then
copied into a host buffer of its own and out again, so that tests run on every change what
ranks sharing a GPU run. Floor 3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pplab.rank.rank_context import rank_context

__all__ = ["messages_through_host", "to_host", "from_host", "HOST"]

HOST = torch.device("cpu")


def messages_through_host(device, group=None) -> bool:
    """True when this rank's messages travel through host memory: it computes on a GPU and its
    group is gloo's, or the lab asked for it."""
    if not dist.is_initialized():
        return False
    if torch.device(device).type != "cpu" and dist.get_backend(group) == "gloo":
        return True
    try:
        return rank_context().host_messages
    except RuntimeError:  # under torchrun or in a plain process: nobody asked
        return False


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory, to send (a buffer of its own, also on CPU)."""
    return tensor.detach().to(HOST, copy=True)


def from_host(tensor: torch.Tensor, device) -> torch.Tensor:
    """A message that arrived in host memory, copied to the rank's device."""
    return tensor.to(device, copy=True)
