"""Tied weights across a pipeline: one weight that the first and the last stage both hold.

Models that tie their input and output embeddings (GPT-2, small Qwen and Llama 3.2
configs) use one matrix twice: to look tokens up on the first stage and to score them
on the last. On one device the two uses add their gradients into one `.grad`. Cut into
a pipeline, each end holds a copy and sees only its own use's gradient; the copies stay
equal only if each takes the sum before anything reads the gradients (clipping, the
optimizer step, a parity check).

When both ends live on one rank (a single stage, a V-shaped placement) they share one
Parameter and autograd adds the gradients itself. Otherwise, after the rank's last
backward of the step, the two ranks swap their gradients (one send and one receive each,
a vocabulary x hidden matrix) and each adds the other's: the same sum on both, as
floating-point addition is commutative. The swap is an ALL_REDUCE event on the
collectives track of both ranks' timelines, at the end of the step. Floor 3.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pplab.rank.comm import PipelineTimeoutError
from pplab.rank.host_messages import from_host, messages_through_host, to_host
from pplab.trace.timeline import Event

TIED_TAG = 1 << 30  # above every pipeline message's tag (pplab.rank.comm.message_tag)


def tie_on_rank(stages: dict[int, nn.Module], tied, n_stages: int) -> None:
    """On a rank that holds both the first and the last stage, make the last use the first's Parameter."""
    if 0 not in stages or n_stages - 1 not in stages or n_stages == 1:
        return  # one stage holding both ends was tied when it was built
    for first_name, last_name in tied:
        owner, attribute = _owner(stages[n_stages - 1], last_name)
        setattr(owner, attribute, stages[0].get_parameter(first_name))


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return module.get_submodule(path), attribute


class TiedGradients:
    """Sums, between the first and the last stage's ranks, the gradients of the weights they tie."""

    def __init__(self, tied, first_rank: int, last_rank: int, rank: int, op_timeout: float, group=None):
        self.tied, self.rank, self.group = tuple(tied), rank, group
        self.peer = last_rank if rank == first_rank else first_rank
        self.side = 0 if rank == first_rank else 1  # which name of each pair this rank holds
        self.op_timeout = op_timeout

    @classmethod
    def for_rank(cls, model, schedule, rank: int, op_timeout: float, group=None) -> "TiedGradients | None":
        """The summing this rank takes part in, or None (no tied weights, both ends here, or switched off)."""
        first_rank, last_rank = schedule.stage_to_rank(0), schedule.stage_to_rank(schedule.n_stages - 1)
        if not model.tied or not model.sum_tied_gradients or first_rank == last_rank \
                or rank not in (first_rank, last_rank):
            return None
        return cls(model.tied, first_rank, last_rank, rank, op_timeout, group)

    def sum(self, stages: dict[int, nn.Module], clock=None) -> list[Event]:
        """Add the peer's gradient of each tied weight to this rank's (every `.grad` then holds the sum)."""
        events = []
        for pair in self.tied:
            name = pair[self.side]
            param = next(stage.get_parameter(name) for stage in stages.values()
                         if name in dict(stage.named_parameters()))
            mine = param.grad if param.grad is not None else torch.zeros_like(param)
            started = clock() if clock else 0.0
            through_host = messages_through_host(mine.device, self.group)
            outgoing = to_host(mine) if through_host else mine.contiguous()
            theirs = torch.empty_like(outgoing)
            tag = TIED_TAG + self.tied.index(pair)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, self.peer, self.group, tag),
                                            dist.P2POp(dist.irecv, theirs, self.peer, self.group, tag)])
            for work in works:
                self._wait(work, name)
            param.grad = mine + (from_host(theirs, mine.device) if through_host else theirs)
            if clock:
                events.append(Event(self.rank, "ALL_REDUCE", None, None, started, clock(),
                                    bytes=mine.numel() * mine.element_size()))
        return events

    def _wait(self, work, name: str) -> None:
        try:
            work.wait(timedelta(seconds=self.op_timeout))
        except RuntimeError as error:
            raise PipelineTimeoutError(
                f"rank {self.rank} waited more than {self.op_timeout:g} s for rank {self.peer}'s gradient "
                f"of the tied weight {name!r} ({error}); that rank is stuck or gone: restart the ranks"
            ) from error
