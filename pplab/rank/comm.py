"""Point-to-point communication between pipeline stages over torch.distributed.

A rank's communication actions (SEND_F, RECV_F, SEND_B, RECV_B) that stand next
to each other in its schedule are posted together as one `batch_isend_irecv`
batch, so that in the steady state "send my activation, receive the next
gradient" is a single exchange that neighbours cannot deadlock on.

Sends are buffered: a rank posts them and moves on (the validator assumes the
same); only receives are waited for, and every wait is bounded (`op_timeout`). A timeout
names this rank, the peer, what it waited for and the action.

On gloo a receive whose shape is known is posted ahead of its turn (`prepost`),
before the compute that precedes it: gloo moves a message only once its receive
is posted, so a receive posted at its turn pays a round trip ("ready", then the
data); posted ahead, a message sent earlier is there when its compute needs it (the
figures: commit 3eed488, and bench/results/predict.json).

Gradients need no shape handshake: a gradient has the shape of the activation
this rank sent. Activations do when microbatch shapes vary; then each one is
preceded by a small header tensor carrying its dtype and shape.

gloo matches a receive to its send by tag; NCCL by order between two ranks, and
returns one work for a whole batch. So on NCCL the runtime first checks that a
schedule receives in the order it sends (`in_order_mismatch`), needs fixed
shapes, and waits for a batch as a whole; the bound on a wait there is the
process group's timeout.

Ranks that share a GPU talk over gloo, which moves host memory only: their messages are
copied to the host and back (`pplab.rank.host_messages`), inside the message's own event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pplab.base.config import LabOptions, takes_options
from pplab.base.machine import busy_note
from pplab.rank.host_messages import HOST, from_host, messages_through_host, to_host
from pplab.schedules import Action, Kind, Schedule
from pplab.trace.timeline import Event

__all__ = ["encode_header", "decode_header", "MAX_DIMS"]

MAX_DIMS = 6
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class PipelineTimeoutError(TimeoutError):
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
    forward = action.kind in (Kind.SEND_F, Kind.RECV_F)
    return ((action.microbatch * n_stages + action.sender_stage) * 2 + forward) * 2 + header


@dataclass
class Mailbox:
    """What a rank has received and not yet consumed, and the sends still in flight."""

    received: dict[Action, torch.Tensor] = field(default_factory=dict)
    # A send's tensor must stay alive until the send completes: keep it beside its handle.
    pending_sends: list[tuple[Action, dist.Work, torch.Tensor]] = field(default_factory=list)
    preposted: dict[Action, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)


class StageLink:
    """One rank's P2P endpoint in a pipeline: posts batches of sends and receives, bounded waits."""

    @takes_options(LabOptions, differs={"device": "the rank's torch.device, its pipeline's"})
    def __init__(self, schedule: Schedule, rank: int, device: torch.device,
                 op_timeout: float = LabOptions.op_timeout, handshake: bool = True, group=None,
                 record: bool = True):
        """`op_timeout`: seconds one wait (a receive, a send's completion) may take before it gives up."""
        self.schedule, self.rank, self.device = schedule, rank, torch.device(device)
        self.op_timeout, self.handshake, self.group, self.record = op_timeout, handshake, group, record
        self.mailbox = Mailbox()
        self.events: list[Event] = []
        # NCCL matches by order on one stream: a receive posted early would block the sends behind it.
        self.can_prepost = dist.is_initialized() and dist.get_backend(group) == "gloo"
        # Where messages live while they travel: this rank's device, or the host (gloo with a GPU).
        self.through_host = messages_through_host(self.device, group)
        self.wire = HOST if self.through_host else self.device

    def peer_rank(self, action: Action) -> int:
        """The rank on the other end of a send or receive."""
        return self.schedule.peer_rank(action)

    def exchange(self, actions: list[Action], outgoing: dict[Action, torch.Tensor],
                 expected: dict[Action, tuple[torch.dtype, tuple[int, ...]]], clock) -> None:
        """Post these adjacent comm actions as one batch and wait for their receives.

        `outgoing` holds the tensor of each send; `expected` the dtype and shape of each
        receive whose shape is known here (all gradients; activations when shapes are fixed).
        """
        sends = [a for a in actions if a.is_send]
        receives = [a for a in actions if not a.is_send]
        early = {a: self.mailbox.preposted.pop(a) for a in receives if a in self.mailbox.preposted}
        fresh = [a for a in receives if a not in early]
        started = clock()
        if self.through_host:  # the copy to the host is part of the send
            outgoing = {a: to_host(outgoing[a]) for a in sends}
        shapes = dict(expected)
        if self.handshake:
            shapes.update(self._exchange_headers(sends, fresh, outgoing))
        buffers = {a: torch.empty(shapes[a][1], dtype=shapes[a][0], device=self.wire) for a in fresh}
        posted = self._post([(a, outgoing[a], False) for a in sends] +
                            [(a, buffers[a], False) for a in fresh], clock)
        for action, (work, buffer) in early.items():
            self._wait(work, action)
            buffers[action] = buffer
        if self.through_host:  # and the copy from the host part of the receive
            buffers = {a: from_host(buffers[a], self.device) for a in receives}
        ended = clock()
        for action in sends:  # a send costs its rank only the posting
            self._record(action, outgoing[action], started, posted)
        for action in receives:
            self.mailbox.received[action] = buffers[action]
            self._record(action, buffers[action], started, ended)

    def prepost(self, receives: list[Action],
                shapes: dict[Action, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """Post these receives now, ahead of their turn, where the backend allows it and the
        shape is known; `exchange` then only waits for them."""
        if not self.can_prepost:
            return
        for action in receives:
            if action in shapes and action not in self.mailbox.preposted:
                dtype, shape = shapes[action]
                buffer = torch.empty(shape, dtype=dtype, device=self.wire)
                try:
                    work = dist.irecv(buffer, self.peer_rank(action), group=self.group,
                                      tag=message_tag(action, self.schedule.n_stages))
                except RuntimeError as error:  # the connection to the peer is gone
                    raise PipelineTimeoutError(self.describe_wait(action, 0.0, error)) from error
                self.mailbox.preposted[action] = (work, buffer)

    def _exchange_headers(self, sends, receives, outgoing) -> dict[Action, tuple]:
        """Send a header before each activation and receive the headers of incoming ones."""
        headers_out = {a: encode_header(outgoing[a]).to(self.wire) for a in sends if a.kind == Kind.SEND_F}
        headers_in = {a: torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.wire)
                      for a in receives if a.kind == Kind.RECV_F}
        if headers_out or headers_in:
            self._post([(a, h, True) for a, h in headers_out.items()] +
                       [(a, h, True) for a, h in headers_in.items()], monotonic_clock)
        return {action: decode_header(header.cpu()) for action, header in headers_in.items()}

    def _post(self, posts: list[tuple[Action, torch.Tensor, bool]], clock) -> float:
        """Post (action, tensor, is_header) as one batch of P2P ops, wait (bounded) for the
        receives; return the time on `clock` at which everything was posted."""
        # Sends that have left no longer need their tensors kept alive.
        self.mailbox.pending_sends = [p for p in self.mailbox.pending_sends if not p[1].is_completed()]
        if not posts:  # every receive was posted ahead
            return clock()
        ops = [(dist.isend if action.is_send else dist.irecv, tensor, self.peer_rank(action),
                message_tag(action, self.schedule.n_stages, header)) for action, tensor, header in posts]
        try:
            if len(ops) == 1:  # one message: no batch to coalesce, skip the batching machinery
                function, tensor, peer, tag = ops[0]
                works = [function(tensor, peer, group=self.group, tag=tag)]
            else:
                works = dist.batch_isend_irecv([dist.P2POp(function, tensor, peer, self.group, tag)
                                                for function, tensor, peer, tag in ops])
        except RuntimeError as error:  # the connection to a peer is gone (it died, the link was cut)
            raise PipelineTimeoutError(self.describe_wait(posts[0][0], 0.0, error)) from error
        posted = clock()
        if len(works) != len(ops):
            # Backends that coalesce a batch (NCCL) return one work for all of it.
            first_receive = next((a for a, _, _ in posts if not a.is_send), posts[0][0])
            for work in works:
                self._wait(work, first_receive)
            return posted
        for (action, tensor, _), work in zip(posts, works):
            if action.is_send:
                self.mailbox.pending_sends.append((action, work, tensor))
            else:
                self._wait(work, action)
        return posted

    def _wait(self, work: dist.Work, action: Action) -> None:
        started = time.monotonic()
        try:
            work.wait(timedelta(seconds=self.op_timeout))
        except RuntimeError as error:
            waited = time.monotonic() - started
            raise PipelineTimeoutError(self.describe_wait(action, waited, error)) from error

    def describe_wait(self, action: Action, waited: float | None = None, error=None) -> str:
        """What went wrong in a wait, in lines: what happened (who waited on whom), why, the fix.

        'rank 2 waited 30 s for the activation of microbatch 3 from rank 1 (action 2RECV_F3).'
        The fix says what any launcher can do (this runs under torchrun too); a lab adds its own.
        """
        what = {Kind.RECV_F: "the activation", Kind.RECV_B: "the gradient",
                Kind.SEND_F: "the send of the activation", Kind.SEND_B: "the send of the gradient"}
        direction = "from" if action.kind in (Kind.RECV_F, Kind.RECV_B) else "to"
        peer = self.peer_rank(action)
        subject = (f"{what[action.kind]} of microbatch {action.microbatch} {direction} rank "
                   f"{peer} (action {action})")
        if waited is None or waited >= 0.9 * self.op_timeout:
            lines = [f"rank {self.rank} waited {self.op_timeout:g} s for {subject}.",
                     f"Rank {peer} may have failed, or its schedule lacks the matching action."
                     + busy_note()]
        else:  # not a timeout: the connection failed (a peer died, say)
            lines = [f"rank {self.rank} lost {subject} after {waited:.1f} s.",
                     f"Cause: {error}"]
        lines.append("This process group cannot be used again: start the ranks afresh.")
        return "\n".join(lines)

    def _record(self, action: Action, tensor: torch.Tensor, started: float, ended: float) -> None:
        if self.record:
            self.events.append(Event(self.rank, action.kind.value, action.stage, action.microbatch,
                                     started, ended, tensor.numel() * tensor.element_size(),
                                     tuple(tensor.shape), dtype_name(tensor)))

    def finish(self) -> None:
        """Wait (bounded) until every send of the step has left, so its buffers can be freed."""
        for action, work, _ in self.mailbox.pending_sends:
            self._wait(work, action)
        self.mailbox.pending_sends.clear()


def dtype_name(tensor: torch.Tensor) -> str:
    """'float32' for a torch.float32 tensor."""
    return str(tensor.dtype).removeprefix("torch.")


def in_order_mismatch(schedule: Schedule) -> str | None:
    """Where messages between two ranks would be received in another order than sent, or None.

    gloo matches a receive to its send by tag; NCCL by order, so a schedule for NCCL
    must receive every peer's messages in the order that peer sends them.
    """
    sent, received = {}, {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if not action.is_comm:
                continue
            peer = schedule.peer_rank(action)
            message = (action.sender_stage, action.kind in (Kind.SEND_F, Kind.RECV_F), action.microbatch)
            book = sent if action.is_send else received
            book.setdefault((rank, peer) if action.is_send else (peer, rank), []).append(message)
    for (source, target), messages in sent.items():
        if received.get((source, target)) != messages:
            return (f"rank {target} receives rank {source}'s messages in another order than rank "
                    f"{source} sends them")
    return None


def monotonic_clock():
    """The clock events are measured on (seconds, monotonic)."""
    return time.perf_counter()
