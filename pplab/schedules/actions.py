"""Actions: what one rank does at one position of a schedule, and their text form.

Compute actions are the forward ``F``, the full backward ``B``, or the
zero-bubble split of ``B`` into the input-gradient pass ``I`` and the
weight-gradient pass ``W``. Communication actions move activations forward
(``SEND_F`` / ``RECV_F``) and gradients backward (``SEND_B`` / ``RECV_B``).

The text form is torch's ``_Action``: ``2F0`` is stage 2 running the forward of
microbatch 0, ``1SEND_F3`` is stage 1 sending the activation of microbatch 3
to stage 2.
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
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset

    @property
    def boundary(self) -> int | None:
        """The stage whose output a send or receive moves (or whose output's gradient); None for compute.

        Both directions across the boundary after stage s carry a tensor of the
        same size (the activation, then its gradient), so costs are per boundary.
        """
        if not self.is_comm:
            return None
        return self.stage if self.kind in (Kind.SEND_F, Kind.RECV_B) else self.stage - 1

    def partner(self) -> Action:
        """The receive that matches a send, or the send that matches a receive."""
        if not self.is_comm:
            raise ValueError(f"{self} is a compute action: only sends and receives have partners")
        return Action(self.peer_stage, _PARTNER_KIND[self.kind], self.microbatch)

    def describe(self) -> str:
        """The action in words, e.g. 'forward of microbatch 0 on stage 2'."""
        return f"{_DESCRIPTIONS[self.kind]} of microbatch {self.microbatch} on stage {self.stage}"
