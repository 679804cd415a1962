"""Executing one rank's part of a schedule: autograd across stages, events on one clock.

The rank walks its action list in order. A forward keeps the tensor it consumed
(a received activation, marked `requires_grad_`) and the output it produced; a
backward runs autograd from that output, and the consumed tensor's `.grad` is
what goes upstream. The last stage divides each microbatch's loss by the number
of microbatches, so the accumulated gradients are those of the mean loss, as in
`pplab.reference_step`.

Neighbouring stages on the same rank (interleaved schedules with one rank, or
custom placements) hand tensors over locally, through the same detach-and-keep
boundary a network hop has, so every stage's backward stays its own action.

What the executor uses lives beside it: the step's clock and timing mode's padding in
`pplab.rank.step_clock`, the meter of saved activation bytes in `pplab.rank.memory`, the I/W split
of a backward in `pplab.rank.split_backward`, the gradients' report in `pplab.rank.gradients`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from pplab.base.config import LabOptions, takes_options
from pplab.models import dropout_streams
from pplab.models.llama import loss_fn
from pplab.planning.simulator import Costs
from pplab.rank.comm import PipelineTimeoutError, StageLink, dtype_name, in_order_mismatch
from pplab.rank.faults import strike
from pplab.rank.gradients import gradient_report
from pplab.rank.memory import ForwardBytes
from pplab.rank.split_backward import input_gradient, torch_split_backward, weight_gradients
from pplab.rank.step_clock import DeviceClock, StepClock, on_device, pad_to_cost, step_clock, timed_on
from pplab.schedules import Action, Dependencies, Kind, Schedule, check_runnable
from pplab.schedules.communication import comm_batches, receives_to_prepost
from pplab.trace.timeline import Event, Now

Key = tuple[int, int]  # (stage, microbatch)


@dataclass
class Boundary:
    """What crossed from stage `source` to stage `source + 1` for one microbatch."""

    source: int
    microbatch: int
    shape: tuple[int, ...]
    dtype: str
    bytes: int


class _Teller:
    """Tells a step's watcher what the rank starts and each event as it ends (nothing without one)."""

    def __init__(self, rank: int, watch, link_events: list[Event], clock, events_live: bool = True):
        self.rank, self.watch, self.link_events, self.clock = rank, watch, link_events, clock
        self.events_live = events_live  # False: the events are told at the step's end (`reported_once`)
        self.messages_told = 0

    def starting(self, actions: list[Action], waits_for: tuple[tuple[int, str], ...] = ()) -> None:
        if self.watch is not None:
            doing = " ".join(map(str, actions)) or "done"
            self.watch(Now(self.rank, doing, self.clock(), waits_for))

    def event(self, event: Event) -> None:
        if self.watch is not None and self.events_live:
            self.watch(event)

    def messages(self) -> None:
        """The send and receive events the link recorded since the last call."""
        if self.watch is not None and self.events_live:
            for event in self.link_events[self.messages_told:]:
                self.watch(event)
            self.messages_told = len(self.link_events)


@dataclass
class RankStep:
    """What one rank did in one step: events, losses (last stage), boundary shapes, gradient stats."""

    rank: int
    events: list[Event]
    losses_by_microbatch: dict[int, float]  # only the microbatches whose last stage this rank runs
    boundary_shapes: list[Boundary]  # what this rank sent across a stage boundary
    grad_stats: dict[str, dict]
    grads: dict[str, torch.Tensor] | None = None
    streamed: int = 0  # events a watcher was told while the step ran, and so left out of `events`
    device_memory: dict[str, int] | None = None  # on a GPU: the step's peak allocated bytes, and reserved
    timed_on: str = "host"  # "device": the events' times are when the GPU ran them (step_clock.DeviceClock)


def device_memory(device: torch.device) -> dict[str, int] | None:
    """On a GPU, the bytes this process's allocator held at its peak since the last call
    ("allocated") and holds from the device ("reserved"); None on CPU."""
    if device.type != "cuda":
        return None
    held = {"allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}
    torch.cuda.reset_peak_memory_stats(device)  # the next step's peak is its own
    return held


def reported_once(events: list[Event], watch, untold: Sequence[Event] = ()) -> tuple[list[Event], int]:
    """A step's events for its result, each reported once: without a watcher, all of them; with one,
    those it was not told as they ended (`untold`) are told now, and the result keeps none of them,
    only how many there were (the client waits for that many on the stream)."""
    if watch is None:
        return events, 0
    for event in untold:
        watch(event)
    return [], len(events)


@dataclass
class _StepState:
    """The tensors a step keeps between actions, released as soon as they are spent."""

    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)      # what each forward consumed
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)     # hidden states, or scaled loss
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # first stage: kept from I for its W
    # what I kept for W: graph parts and their grads
    weight_work: dict[Key, list] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)   # to send (or hand) upstream
    received: dict[Action, torch.Tensor] = field(default_factory=dict)   # the link's mailbox
    losses: dict[int, float] = field(default_factory=dict)


class RankRuntime:
    """Runs one rank's action list of a schedule with that rank's stage modules."""

    @takes_options(LabOptions, differs={"device": "the rank's torch.device, its pipeline's"})
    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, nn.Module],
                 device="cpu", op_timeout: float = LabOptions.op_timeout, record: bool = True,
                 timing: Costs | None = None, group=None, tied=None):
        """`tied`: a `pplab.rank.tied.TiedGradients` when this rank holds one end of a tied weight."""
        missing = set(schedule.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} runs stages {sorted(missing)} of schedule "
                             f"{schedule.name!r} but was given modules for {sorted(stages)}")
        check_runnable(schedule)
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.rule = Dependencies(schedule)
        self.device, self.op_timeout = torch.device(device), op_timeout
        self.record, self.timing = record, timing
        self.group, self.tied = group, tied
        self.last_stage = schedule.n_stages - 1
        self._forward_bytes = ForwardBytes()  # keyed by (stage, input shape, dtype)
        self._steps = comm_batches(schedule.actions[rank])  # the rule in pplab.schedules.communication
        self._receives_to_prepost = receives_to_prepost(self._steps)
        self._clock = StepClock(self.group, self.device)
        if any(a.kind == Kind.I for acts in schedule.actions for a in acts):
            torch_split_backward()  # import it now: a step should not pay for it (0.7 s on a busy CPU)

    # --- one step ---------------------------------------------------------------------------

    def step(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
             activation_shapes: list[tuple[int, ...]] | None = None,
             return_grads: bool = False, watch: Callable[[Event | Now], None] | None = None) -> RankStep:
        """Run this rank's actions for one step; gradients accumulate into the stages' `.grad`.

        `inputs` (token ids per microbatch) are needed where stage 0 lives, `targets` where
        the last stage lives. `activation_shapes` (per microbatch) lets receives skip the
        shape handshake; without it every activation is preceded by a header. `watch`, if
        given, is told what the rank starts (a `Now`) and every event as soon as it ends,
        so that a live view can follow the step while it runs; the result then carries no
        events, only their count (`streamed`): each event travels once.
        """
        self._check_data(inputs, targets)
        self._check_backend_can_match(handshake=activation_shapes is None)
        link = StageLink(self.schedule, self.rank, self.device, self.op_timeout,
                         handshake=activation_shapes is None, group=self.group, record=self.record)
        state, events, boundary_shapes = _StepState(received=link.mailbox.received), [], []
        try:
            origin = self._clock.origin()
        except RuntimeError as error:  # gloo's words for a peer that died or a link that was cut
            raise PipelineTimeoutError(
                f"rank {self.rank} could not start the step with the other ranks: the barrier that "
                f"gives them one clock failed ({error}).\nA rank has died, or the link between the "
                f"ranks is cut. This process group cannot be used again: start the ranks afresh.") from error
        clock = step_clock(origin, self.device, self.timing)
        # On a GPU the events are told once the step has ended, in the device's times.
        tell = _Teller(self.rank, watch, link.events, clock, events_live=not isinstance(clock, DeviceClock))
        for step, early_receives in zip(self._steps, self._receives_to_prepost):
            if step[0].is_comm:  # adjacent sends/receives travel as one batch
                batch = list(step)
                tell.starting(batch, self._waits_for(batch) if watch is not None else ())
                self._exchange(link, batch, state, activation_shapes, clock)
                tell.messages()
                continue
            (action,) = step
            self._prepost(link, list(early_receives), state, activation_shapes)
            tell.starting([action])
            with record_function(action.profiler_label):  # what a torch.profiler trace will show
                started = clock()
                strike(action)  # a fault armed on purpose (pplab.rank.faults) fires inside its action
                with dropout_streams.microbatch(action.microbatch):
                    event_extra = self._compute(action, state, inputs, targets, boundary_shapes)
                pad_to_cost(self.timing, action, started, clock)
            if self.record:
                events.append(Event(self.rank, action.kind.value, action.stage, action.microbatch,
                                    started, clock(), **event_extra))
                tell.event(events[-1])
        link.finish()
        tell.messages()
        self._check_all_released(state)
        # The tied weights' gradients summed after the last backward, before anything reads them.
        tied = [] if self.tied is None else self.tied.sum(self.stages, clock if self.record else None)
        every_event = on_device(clock, [*events, *link.events, *tied])
        kept, streamed = reported_once(every_event, watch,
                                       untold=every_event if not tell.events_live else tied)
        tell.starting([])  # done
        return RankStep(self.rank, kept, state.losses, boundary_shapes,
                        *gradient_report(self.stages.values(), return_grads), streamed=streamed,
                        device_memory=device_memory(self.device), timed_on=timed_on(clock))

    def _waits_for(self, batch: list[Action]) -> tuple[tuple[int, str], ...]:
        """(peer rank, the peer's send) for every receive in a batch: whom the rank waits on."""
        return tuple((self.schedule.peer_rank(a), str(a.partner()))
                     for a in batch if not a.is_send)

    def _check_data(self, inputs, targets) -> None:
        stages = self.schedule.stages_of(self.rank)
        m = self.schedule.n_microbatches
        for needed, given, what in ((0 in stages, inputs, "inputs"),
                                    (self.last_stage in stages, targets, "targets")):
            if needed and (given is None or len(given) != m):
                count = "none" if given is None else len(given)
                raise ValueError(f"rank {self.rank} runs stage {0 if what == 'inputs' else self.last_stage} "
                                 f"and needs {what} for all {m} microbatches, got {count}")

    def _check_backend_can_match(self, handshake: bool) -> None:
        """NCCL matches messages by order, not tag: refuse what it cannot do, before any wait."""
        if not dist.is_initialized() or dist.get_backend(self.group) != "nccl":
            return
        mismatch = in_order_mismatch(self.schedule)
        if mismatch:
            raise ValueError(f"schedule {self.schedule.name!r} cannot run on NCCL: {mismatch}; "
                             f"use the gloo backend or reorder its communication")
        if handshake:
            raise ValueError("microbatches of different shapes need the shape handshake, whose "
                             "headers are matched by tag (gloo); on NCCL give every microbatch "
                             "the same shape")

    def _check_all_released(self, state: _StepState) -> None:
        """A valid schedule consumes every tensor it keeps: anything left is a leak (a bug)."""
        held = {name: sorted(map(str, getattr(state, name))) for name in
                ("inputs", "outputs", "output_grads", "weight_work", "input_grads", "received")
                if getattr(state, name)}
        if held:
            raise RuntimeError(f"rank {self.rank} still holds tensors after the step: {held}")


    # --- compute actions ----------------------------------------------------------------------

    def _compute(self, action: Action, state: _StepState, inputs, targets, boundary_shapes) -> dict:
        key = (action.stage, action.microbatch)
        if action.kind == Kind.F:
            return self._forward(key, state, inputs, targets, boundary_shapes)
        if action.kind == Kind.B:
            self._backward(key, state)
        elif action.kind == Kind.I:
            self._input_grad(key, state)
        elif action.kind == Kind.W:
            self._weight_grad(key, state)
        return {}

    def _forward(self, key: Key, state: _StepState, inputs, targets, boundary_shapes) -> dict:
        stage, microbatch = key
        module = self.stages[stage]
        if stage == 0:
            x = inputs[microbatch].to(self.device)
        else:
            (need,) = self.rule.needs(Action(stage, Kind.F, microbatch))
            x = self._received(state, need.action) if need.action.is_comm else state.inputs.pop(key)
            x.requires_grad_(True)  # a fresh leaf: its .grad is what goes upstream
        state.inputs[key] = x
        shape_key = (stage, tuple(x.shape), x.dtype)
        with self._forward_bytes.measure(shape_key, module) if self.record else contextlib.nullcontext():
            out = module(x)
            if stage == self.last_stage:
                loss = loss_fn(out, targets[microbatch].to(self.device))
        extra = dict(bytes=self._forward_bytes.known.get(shape_key), shape=tuple(out.shape),
                     dtype=dtype_name(out)) if self.record else {}
        if stage == self.last_stage:
            state.losses[microbatch] = loss.item()
            state.outputs[key] = loss / self.schedule.n_microbatches
            return extra
        state.outputs[key] = out
        boundary_shapes.append(Boundary(stage, microbatch, tuple(out.shape), dtype_name(out),
                                   out.numel() * out.element_size()))
        if self.schedule.same_rank(stage, stage + 1):
            state.inputs[(stage + 1, microbatch)] = out.detach()  # same boundary as a network hop
        return extra

    def _output_grad(self, key: Key, state: _StepState) -> torch.Tensor | None:
        """The gradient of this stage's output: None on the last stage (the loss is a scalar)."""
        stage, microbatch = key
        if stage == self.last_stage:
            return None
        _, need = self.rule.needs(Action(stage, Kind.B, microbatch))
        if need.action.is_comm:
            return self._received(state, need.action)
        return state.input_grads.pop((stage + 1, microbatch))  # handed over by the next stage here

    def _backward(self, key: Key, state: _StepState) -> None:
        output, grad = state.outputs.pop(key), self._output_grad(key, state)
        output.backward(grad)
        self._keep_input_grad(key, state, state.inputs.pop(key).grad)

    def _input_grad(self, key: Key, state: _StepState) -> None:
        """Zero-bubble I: the gradient of the stage input only, keeping what W will need."""
        grad = self._output_grad(key, state)
        if key[0] == 0:  # the input is token ids: no input gradient, W does the whole backward
            state.output_grads[key] = grad
            return
        input_grad, state.weight_work[key] = input_gradient(state.outputs.pop(key), grad, state.inputs[key],
                                                            self._weights(key[0]))
        self._keep_input_grad(key, state, input_grad)

    def _weight_grad(self, key: Key, state: _StepState) -> None:
        """Zero-bubble W: the parameter gradients, accumulated into `.grad` like B does."""
        state.inputs.pop(key)
        if key[0] > 0:
            weight_gradients(self._weights(key[0]), state.weight_work.pop(key))
        else:
            state.outputs.pop(key).backward(state.output_grads.pop(key))

    def _weights(self, stage: int) -> list[torch.Tensor]:
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def _keep_input_grad(self, key: Key, state: _StepState, input_grad) -> None:
        if key[0] > 0:
            state.input_grads[key] = input_grad

    # --- communication ------------------------------------------------------------------------

    def _exchange(self, link: StageLink, batch: list[Action], state: _StepState,
                  activation_shapes, clock) -> None:
        outgoing = {}
        for action in batch:
            key = (action.stage, action.microbatch)
            if action.kind == Kind.SEND_F:
                outgoing[action] = state.outputs[key].detach()
            elif action.kind == Kind.SEND_B:
                outgoing[action] = state.input_grads.pop(key)
        link.exchange(batch, outgoing, self._known_shapes(batch, state, activation_shapes), clock)

    def _prepost(self, link: StageLink, receives: list[Action], state: _StepState, activation_shapes) -> None:
        """Post the next batch's receives before this compute, those whose shapes are known by now."""
        if receives:
            link.prepost(receives, self._known_shapes(receives, state, activation_shapes))

    def _known_shapes(self, receives: list[Action], state: _StepState,
                      activation_shapes) -> dict[Action, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each receive known here: a gradient once its forward has run; an
        activation when the caller gave the shapes (else the shape handshake tells it)."""
        shapes = {}
        for action in receives:
            key = (action.stage, action.microbatch)
            if action.kind == Kind.RECV_B and key in state.outputs:
                output = state.outputs[key]
                shapes[action] = (output.dtype, tuple(output.shape))
            elif action.kind == Kind.RECV_F and activation_shapes is not None:
                shapes[action] = (self._activation_dtype(), activation_shapes[action.microbatch])
        return shapes

    def _received(self, state: _StepState, action: Action) -> torch.Tensor:
        try:
            return state.received.pop(action)
        except KeyError:
            what = "activation" if action.kind == Kind.RECV_F else "gradient"
            raise RuntimeError(
                f"rank {self.rank} needs the {what} of microbatch {action.microbatch} for stage "
                f"{action.stage} but nothing received it: the schedule lacks {action} before "
                f"its use (run pplab.schedules.validate on it)") from None

    def _activation_dtype(self) -> torch.dtype:
        return next(iter(p.dtype for m in self.stages.values() for p in m.parameters()), torch.float32)
