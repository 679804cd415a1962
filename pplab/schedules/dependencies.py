"""The one rule of what an action needs before it can run.

Written once and used by `validate` (is every need met, in order, without a
deadlock?), by `simulate` (when can the action start?) and by the runtime
(where does its input tensor come from?). A new kind of action is taught here,
once, and all three follow.

For stage ``s`` and microbatch ``mb``:

* a forward ``F`` needs the activation of stage ``s-1``: the forward itself
  when that stage lives on the same rank (it hands the tensor over in memory),
  else the receive ``RECV_F`` of it;
* a backward ``B`` or input-gradient pass ``I`` needs its own forward, and,
  except on the last stage, the gradient of its output: the backward of stage
  ``s+1`` (its ``I`` when it is split, else its ``B``) or the receive
  ``RECV_B`` of it;
* a weight-gradient pass ``W`` needs its ``I``;
* a send needs the compute that produces what it sends (``SEND_B`` leaves
  after ``I``: the input gradient is ready before the weight gradient);
* a receive needs its partner send.

A schedule with no sends and receives at all (``schedule.compute_only()``)
is read as if data moved by itself: a forward or backward then needs its
producer on the other rank directly, plus the time its message takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pplab.schedules.actions import Action, Kind
from pplab.schedules.schedule import Schedule


@dataclass(frozen=True)
class Need:
    """One thing an action waits for: ``action`` has finished (a send: its message has arrived).

    ``transfer`` is the boundary (the stage whose output moves) whose message
    time comes on top, when data crosses ranks without a send and a receive
    in the schedule; None otherwise. ``label`` says what the need is, in words.
    """

    action: Action
    label: str
    transfer: int | None = None


class Dependencies:
    """What every action of one schedule needs (see the module docstring for the rule)."""

    def __init__(self, schedule: Schedule, with_communication: bool | None = None,
                 present: set[Action] | None = None):
        """``with_communication`` overrides what the lists say (the communication pass asks
        what a compute action would need once the sends and receives are in). ``present``
        replaces the schedule's actions where the rule asks whether an action exists (the
        integer form asks for one microbatch and applies the answer to all)."""
        self.schedule = schedule
        self.with_communication = (schedule.has_communication if with_communication is None
                                   else with_communication)
        self.last_stage = schedule.n_stages - 1
        self._present = {a for acts in schedule.actions for a in acts} if present is None else present

    def needs(self, action: Action) -> tuple[Need, ...]:
        """What ``action`` waits for, in the order it is checked."""
        stage, kind, mb = action.stage, action.kind, action.microbatch
        if kind == Kind.F:
            return () if stage == 0 else (self._activation(stage, mb),)
        if kind in (Kind.B, Kind.I):
            own_forward = Need(Action(stage, Kind.F, mb), "its forward")
            if stage == self.last_stage:
                return (own_forward,)
            return own_forward, self._output_gradient(stage, mb)
        if kind == Kind.W:
            return (Need(Action(stage, Kind.I, mb), "its input-gradient pass"),)
        if kind == Kind.SEND_F:
            return (Need(Action(stage, Kind.F, mb), "its forward"),)
        if kind == Kind.SEND_B:
            return (Need(self.gradient_pass(stage, mb), "its backward"),)
        if kind in (Kind.RECV_F, Kind.RECV_B):
            return (Need(action.partner(), "the send"),)
        raise ValueError(f"no dependency rule for action kind {kind!r} (action {action})")

    def gradient_pass(self, stage: int, microbatch: int) -> Action:
        """The action that produces the input gradient of ``stage``: its I if it has one, else its B."""
        split = Action(stage, Kind.I, microbatch)
        return split if split in self._present else Action(stage, Kind.B, microbatch)

    def _activation(self, stage: int, mb: int) -> Need:
        producer = Action(stage - 1, Kind.F, mb)
        if self.schedule.same_rank(stage, stage - 1):
            return Need(producer, "the forward of the previous stage")
        if self.with_communication:
            return Need(Action(stage, Kind.RECV_F, mb), "the receive of its input")
        return Need(producer, "the forward of the previous stage", transfer=stage - 1)

    def _output_gradient(self, stage: int, mb: int) -> Need:
        producer = self.gradient_pass(stage + 1, mb)
        if self.schedule.same_rank(stage, stage + 1):
            return Need(producer, "the backward of the next stage")
        if self.with_communication:
            return Need(Action(stage, Kind.RECV_B, mb), "the receive of its output gradient")
        return Need(producer, "the backward of the next stage", transfer=stage)
