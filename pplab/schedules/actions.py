"""Actions: what one rank does at one position of a schedule, and their text form.

Compute actions are the forward ``F``, the full backward ``B``, or the
zero-bubble split of ``B`` into the input-gradient pass ``I`` and the
weight-gradient pass ``W``. Communication actions move activations forward
(``SEND_F`` / ``RECV_F``) and gradients backward (``SEND_B`` / ``RECV_B``).

The text form is torch's ``_Action``: ``2F0`` is stage 2 running the forward of
microbatch 0, ``1SEND_F3`` is stage 1 sending the activation of microbatch 3
to stage 2.

Two pipeline rules live here, once, for every other module to read: where a
message goes (`message_peer`, `message_sender`, `message_receiver`, `message_boundary`)
and which pass frees a forward's activations (`releases_activations`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does; the values are torch's text forms."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble paper's name for the input-gradient pass
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})

# Which neighbour a communication action talks to: activations flow to the
# next stage, gradients to the previous one.
_PEER_OFFSET = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}
_PARTNER_KIND = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F,
                 Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}

# A forward's activations are held until the last pass that reads them ends: the full
# backward B or, when the backward is split, W (it still reads the layer inputs the forward
# saved); I alone frees nothing.
RELEASE_KINDS = frozenset({Kind.B, Kind.W})


def releases_activations(kind: Kind | str) -> bool:
    """True for the passes whose end frees a forward's activations: B, or W when the backward is split."""
    return kind in RELEASE_KINDS  # a Kind is the str of its text form, so an event's kind ("B") is found too


def message_peer(kind: Kind, stage: int) -> int:
    """The stage at the other end of a message that ``stage`` sends or receives (it may not exist)."""
    return stage + _PEER_OFFSET[kind]


def message_sender(kind: Kind, stage: int) -> int:
    """The stage that sends the message of a send or receive of ``kind`` on ``stage``."""
    return stage if kind in SEND_KINDS else message_peer(kind, stage)


def message_receiver(kind: Kind, stage: int) -> int:
    """The stage that receives the message of a send or receive of ``kind`` on ``stage``."""
    return message_peer(kind, stage) if kind in SEND_KINDS else stage


def message_boundary(kind: Kind, stage: int) -> int:
    """The boundary a message of ``kind`` on ``stage`` crosses, named by the stage before it.

    The activation leaving stage s and its gradient coming back both cross boundary s
    (between s and s+1) and have the same size, so message costs are per boundary.
    """
    return min(stage, message_peer(kind, stage))


# Longest names first so that "SEND_F" is not read as "S..." and "F".
_ACTION_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")

_DESCRIPTIONS = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.I: "input-gradient pass",
    Kind.W: "weight-gradient pass",
    Kind.SEND_F: "send of the activation",
    Kind.RECV_F: "receive of the activation",
    Kind.SEND_B: "send of the gradient",
    Kind.RECV_B: "receive of the gradient",
}


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of ``stage`` for ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def profiler_label(self) -> str:
        """The name of this action's `record_function` span, as torch's multi-stage schedules write
        it ("PP:1F3"): a torch.profiler trace of any run then reads the same (`pplab.trace`)."""
        return f"PP:{self}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form, e.g. ``"2F0"`` or ``"1SEND_F3"``."""
        match = _ACTION_PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: write <stage><kind><microbatch>, "
                f"e.g. '2F0' or '1SEND_F3', with kind one of "
                f"{', '.join(k.value for k in Kind)}"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for sends and receives."""
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self.kind in SEND_KINDS

    @property
    def peer_stage(self) -> int | None:
        """The stage a send goes to or a receive comes from; None for compute."""
        return message_peer(self.kind, self.stage) if self.is_comm else None

    @property
    def sender_stage(self) -> int | None:
        """The stage that sends this send's or receive's message; None for compute."""
        return message_sender(self.kind, self.stage) if self.is_comm else None

    @property
    def receiver_stage(self) -> int | None:
        """The stage that receives this send's or receive's message; None for compute."""
        return message_receiver(self.kind, self.stage) if self.is_comm else None

    @property
    def boundary(self) -> int | None:
        """The boundary a send or receive crosses (see `message_boundary`); None for compute."""
        return message_boundary(self.kind, self.stage) if self.is_comm else None

    def partner(self) -> Action:
        """The receive that matches a send, or the send that matches a receive."""
        if not self.is_comm:
            raise ValueError(f"{self} is a compute action: only sends and receives have partners")
        return Action(self.peer_stage, _PARTNER_KIND[self.kind], self.microbatch)

    def describe(self) -> str:
        """The action in words, e.g. 'forward of microbatch 0 on stage 2'."""
        return f"{_DESCRIPTIONS[self.kind]} of microbatch {self.microbatch} on stage {self.stage}"
