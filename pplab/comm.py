"""Point-to-point communication between pipeline stages over torch.distributed.

A rank's communication actions (SEND_F, RECV_F, SEND_B, RECV_B) that stand next
to each other in its schedule are posted together as one `batch_isend_irecv`
batch, so that in the steady state "send my activation, receive the next
gradient" is a single exchange that neighbours cannot deadlock on.

Sends are buffered: a rank posts them and moves on (the validator assumes the
same); only receives are waited for, and every wait is bounded. A timeout
names this rank, the peer, what it waited for and the action.

Gradients need no shape handshake: a gradient has the shape of the activation
this rank sent. Activations do when microbatch shapes vary; then each one is
preceded by a small header tensor carrying its dtype and shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pplab.schedules import Action, Kind, Schedule
from pplab.trace import Event

MAX_DIMS = 6
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class PipelineTimeout(TimeoutError):
    """A rank waited longer than the timeout for a message from a neighbour."""


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    """The handshake: [dtype code, ndim, d0, ..., d5] as one small int64 tensor."""
    if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot describe a {tensor.dtype} tensor of {tensor.dim()} dims in the "
                         f"shape handshake (at most {MAX_DIMS} dims, dtypes {_DTYPES})")
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """Inverse of `encode_header`."""
    code, ndim, *dims = header.tolist()
    return _DTYPES[code], tuple(dims[:ndim])


def message_tag(action: Action, n_stages: int, header: bool = False) -> int:
    """A tag unique to one message of a step, the same on sender and receiver (gloo matches on it)."""
    sender_stage = action.stage if action.kind in (Kind.SEND_F, Kind.SEND_B) else action.peer_stage
    forward = action.kind in (Kind.SEND_F, Kind.RECV_F)
    return ((action.microbatch * n_stages + sender_stage) * 2 + forward) * 2 + header


@dataclass
class Mailbox:
    """What a rank has received and not yet consumed, and the sends still in flight."""

    received: dict[Action, torch.Tensor] = field(default_factory=dict)
    # A send's tensor must stay alive until the send completes: keep it beside its handle.
    pending_sends: list[tuple[Action, dist.Work, torch.Tensor]] = field(default_factory=list)


class StageLink:
    """One rank's P2P endpoint in a pipeline: posts batches of sends and receives, bounded waits."""

    def __init__(self, schedule: Schedule, rank: int, device: torch.device,
                 timeout: float = 30.0, handshake: bool = True, group=None):
        self.schedule, self.rank, self.device = schedule, rank, torch.device(device)
        self.timeout, self.handshake, self.group = timeout, handshake, group
        self.mailbox = Mailbox()
        self.events: list[Event] = []

    def peer_rank(self, action: Action) -> int:
        """The rank on the other end of a send or receive."""
        return self.schedule.stage_to_rank(action.peer_stage)

    def exchange(self, actions: list[Action], outgoing: dict[Action, torch.Tensor],
                 expected: dict[Action, tuple[torch.dtype, tuple[int, ...]]], clock) -> None:
        """Post these adjacent comm actions as one batch and wait for their receives.

        `outgoing` holds the tensor of each send; `expected` the dtype and shape of each
        receive whose shape is known here (all gradients; activations when shapes are fixed).
        """
        sends = [a for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_B)]
        receives = [a for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        started = clock()
        headers_in = self._exchange_headers(sends, receives, outgoing)
        ops, buffers = [], {}
        for action in sends:
            ops.append(self._op(dist.isend, outgoing[action], action))
        for action in receives:
            dtype, shape = headers_in[action] if action in headers_in else expected[action]
            buffers[action] = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(self._op(dist.irecv, buffers[action], action))
        works = dist.batch_isend_irecv(ops) if ops else []
        for action, work in zip(sends, works):
            self.mailbox.pending_sends.append((action, work, outgoing[action]))
        for action, work in zip(receives, works[len(sends):]):
            self._wait(work, action)
        ended = clock()
        for action in sends:
            self._record(action, outgoing[action], started, ended)
        for action in receives:
            self.mailbox.received[action] = buffers[action]
            self._record(action, buffers[action], started, ended)

    def _exchange_headers(self, sends, receives, outgoing) -> dict[Action, tuple]:
        """Send a header before each activation and receive the headers of incoming ones."""
        if not self.handshake:
            return {}
        header_sends = [a for a in sends if a.kind == Kind.SEND_F]
        header_recvs = [a for a in receives if a.kind == Kind.RECV_F]
        if not header_sends and not header_recvs:
            return {}
        ops, incoming = [], {}
        headers_out = {a: encode_header(outgoing[a]).to(self.device) for a in header_sends}
        for action, header in headers_out.items():
            ops.append(self._op(dist.isend, header, action, header=True))
        for action in header_recvs:
            incoming[action] = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
            ops.append(self._op(dist.irecv, incoming[action], action, header=True))
        works = dist.batch_isend_irecv(ops)
        for action, work in zip(header_sends, works):
            self.mailbox.pending_sends.append((action, work, headers_out[action]))
        for action, work in zip(header_recvs, works[len(header_sends):]):
            self._wait(work, action)
        return {action: decode_header(h.cpu()) for action, h in incoming.items()}

    def _op(self, fn, tensor: torch.Tensor, action: Action, header: bool = False) -> dist.P2POp:
        tag = message_tag(action, self.schedule.n_stages, header)
        return dist.P2POp(fn, tensor, self.peer_rank(action), self.group, tag)

    def _wait(self, work: dist.Work, action: Action) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise PipelineTimeout(self.describe_wait(action)) from error

    def describe_wait(self, action: Action) -> str:
        """'rank 2 waited 30 s for the activation of microbatch 3 from rank 1 (action 2RECV_F3)'."""
        what = {Kind.RECV_F: "the activation", Kind.RECV_B: "the gradient",
                Kind.SEND_F: "the send of the activation", Kind.SEND_B: "the send of the gradient"}
        direction = "from" if action.kind in (Kind.RECV_F, Kind.RECV_B) else "to"
        return (f"rank {self.rank} waited {self.timeout:g} s for {what[action.kind]} of microbatch "
                f"{action.microbatch} {direction} rank {self.peer_rank(action)} (action {action}); "
                f"the peer may have failed or its schedule lacks the matching action. The process "
                f"group is now unusable: restart the ranks (lab.restart()).")

    def _record(self, action: Action, tensor: torch.Tensor, started: float, ended: float) -> None:
        self.events.append(Event(self.rank, action.kind.value, action.stage, action.microbatch,
                                 started, ended, tensor.numel() * tensor.element_size(),
                                 tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))

    def finish(self) -> None:
        """Wait (bounded) until every send of the step has left, so its buffers can be freed."""
        for action, work, _ in self.mailbox.pending_sends:
            self._wait(work, action)
        self.mailbox.pending_sends.clear()


def monotonic_clock():
    """The clock events are measured on (seconds, monotonic)."""
    return time.perf_counter()
