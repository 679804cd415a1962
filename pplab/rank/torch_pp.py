"""The same stage modules under torch.distributed.pipelining, recorded in pplab's timeline.

torch runs its own schedules (`ScheduleGPipe`, `Schedule1F1B`, the multi-stage ones), and any
other pplab schedule from its CSV on `_PipelineScheduleRuntime` (as torchtitan does), over
`PipelineStage`s; pplab gives them its stage modules and records what torch executed by
subclassing the stage (`RecordingStage`): each forward, backward (full or input-only) and
weight-gradient pass is timed around torch's own method, padded to its cost in timing mode,
and kept as an `Event` on the step clock the hand-written runtime uses. Nothing in torch is
patched; the waits torch does for its receives are recorded too (`_Recorder`). Ranks that
share a GPU get stages whose messages go through host memory (`host_messages_stage_class`).
`TorchRankRuntime.step` has the hand-written `RankRuntime.step`'s signature and
result, so a pipeline switches with one argument (`impl="torch"`).

Names: the canonical ones (`pplab.schedules.schedule_name`); `pplab.schedules.TORCH_SCHEDULES` holds
torch's class name for each. Floor 3: torch only, no Jupyter.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from pplab.models import dropout_streams
from pplab.models.llama import loss_fn
from pplab.planning.simulator import Costs
from pplab.rank.comm import dtype_name
from pplab.rank.gradients import gradient_report
from pplab.rank.host_messages import HOST, messages_through_host, to_host
from pplab.rank.memory import ForwardBytes
from pplab.rank.runtime import Boundary, RankStep, device_memory, reported_once
from pplab.rank.step_clock import DeviceClock, StepClock, on_device, pad_to_cost, step_clock, timed_on
from pplab.schedules import TORCH_SCHEDULES, Action, Kind, Schedule, build, from_torch, torch_plan
from pplab.trace.timeline import Event, Now


def torch_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The pplab schedule torch will run for `name`, any spelling (checked on the client, torch's
    constraints included); it carries the canonical name.

    For the schedules pplab builds too, pplab's own (torch 2.13's static 1F1B plan numbers the
    last rank's forwards wrongly, though torch executes them right); for the others, torch's plan.
    """
    entry = torch_plan(name)
    # torch's planner applies torch's own constraints (e.g. 1F1B needs n_microbatches >= stages).
    plan = from_torch(entry.name, n_ranks, n_microbatches, n_virtual)
    if entry.built_by_pplab:
        return build(entry.name, n_ranks, n_microbatches, n_virtual)
    return plan


def is_torch_plan(schedule: Schedule) -> bool:
    """True when `schedule` is one of torch's own schedules (by name, and action for action); any
    other runs on torch's `_PipelineScheduleRuntime` from its CSV, as torchtitan runs one."""
    if schedule.name not in TORCH_SCHEDULES:
        return False
    try:
        own = torch_schedule(schedule.name, schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual)
    except ValueError:  # torch does not plan it at these sizes
        return False
    return own == schedule


@functools.cache
def recording_stage_class():
    """A `PipelineStage` subclass that records F, B, I and W (made on first use: torch's
    pipelining package is imported only by those who run it)."""
    from torch.distributed.pipelining import PipelineStage

    class RecordingStage(PipelineStage):
        recorder: "_Recorder"
        forward_bytes: ForwardBytes  # keyed by the input shapes

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            with self.recorder.action(Kind.F, self.stage_index, fwd_chunk_id) as note:
                # torch computes the loss outside the stage: on the last stage its saved
                # tensors are not counted here (pplab's runtime counts them).
                shape_key = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
                with self.forward_bytes.measure(shape_key, self.submod):
                    output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
                note.update(shape=tuple(output.shape), dtype=dtype_name(output),
                            bytes=self.forward_bytes.known[shape_key])
            if not self.is_last:
                self.recorder.boundary_shapes.append(Boundary(self.stage_index, fwd_chunk_id,
                                                              tuple(output.shape),
                                                         note["dtype"],
                                                         output.numel() * output.element_size()))
            return output

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with self.recorder.action(Kind.B if full_backward else Kind.I, self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with self.recorder.action(Kind.W, self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

        # torch waits for its receives in the schedule, not in the stage; the stage is asked
        # for the receive ops first, so the wait is what lies between that and the compute.
        def get_fwd_recv_ops(self, fwd_chunk_id):
            ops = super().get_fwd_recv_ops(fwd_chunk_id)
            if ops:
                self.recorder.posted(Action(self.stage_index, Kind.RECV_F, fwd_chunk_id))
            return ops

        def get_bwd_recv_ops(self, bwd_chunk_id):
            ops = super().get_bwd_recv_ops(bwd_chunk_id)
            if ops:
                self.recorder.posted(Action(self.stage_index, Kind.RECV_B, bwd_chunk_id))
            return ops

    return RecordingStage


@functools.cache
def host_messages_stage_class(base):
    """`base` (torch's `PipelineStage`, or the recording one) with its messages through host memory,
    for ranks that share a GPU and talk over gloo (see `pplab.rank.host_messages`).

    torch asks a stage for its send and receive ops: the sends get host copies of their tensors,
    the receives host buffers, which land in the stage's own buffers just before the compute
    that needs them (torch has waited for them by then). torch's set-up messages (the warm-up
    vote, the neighbours' first exchange) are made on the host by giving the stage the host as its
    device meanwhile; the shapes need none: such stages are built with example arguments.
    """

    class HostMessagesStage(base):
        def get_fwd_recv_ops(self, fwd_chunk_id):
            return self._through_host(("F", fwd_chunk_id), super().get_fwd_recv_ops(fwd_chunk_id))

        def get_bwd_recv_ops(self, bwd_chunk_id):
            return self._through_host(("B", bwd_chunk_id), super().get_bwd_recv_ops(bwd_chunk_id))

        def get_fwd_send_ops(self, fwd_chunk_id):
            return [_on(op, to_host(op.tensor)) for op in super().get_fwd_send_ops(fwd_chunk_id)]

        def get_bwd_send_ops(self, bwd_chunk_id):
            return [_on(op, to_host(op.tensor)) for op in super().get_bwd_send_ops(bwd_chunk_id)]

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            self._land(("F", fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            self._land(("B", bwd_chunk_id))
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def _through_host(self, key, ops):
            landings = self.__dict__.setdefault("_landings", {})
            staged = []
            for op in ops:
                host = torch.empty_like(op.tensor, device=HOST)
                landings.setdefault(key, []).append((host, op.tensor))
                staged.append(_on(op, host))
            return staged

        def _land(self, key) -> None:
            with torch.no_grad():  # the stage's buffers are leaves that may require grad
                for host, buffer in self.__dict__.get("_landings", {}).pop(key, []):
                    buffer.copy_(host)

        @contextlib.contextmanager
        def _on_host(self):
            device, self.device = self.device, HOST
            try:
                yield
            finally:
                self.device = device

    # torch's set-up messages (the warm-up vote, the neighbours' first exchange, shapes if it asks) are
    # made where the stage's device is: the host, meanwhile. (A method this torch lacks is skipped.)
    for name in ("_send_meta", "_recv_meta", "_warmup_forward_vote", "_warmup_backward_result",
                 "_get_init_p2p_neighbors_ops"):
        if hasattr(base, name):
            setattr(HostMessagesStage, name, _made_on_host(getattr(base, name)))

    HostMessagesStage.__name__ = f"HostMessages{base.__name__}"
    return HostMessagesStage


def _made_on_host(method):
    """`method` of a stage, run with the host as the stage's device."""
    @functools.wraps(method)
    def on_host(self, *args, **kwargs):
        with self._on_host():
            return method(self, *args, **kwargs)
    return on_host


def _on(op, tensor):
    """The same P2P op on another tensor."""
    import torch.distributed as dist

    return dist.P2POp(op.op, tensor, op.peer, op.group, op.tag)


class _Recorder:
    """The events of one step on one rank, on the step's clock; tells a watcher as it goes.

    A receive's event is the wait torch did for it: from when its receive was posted (or the
    rank's previous compute ended, if later) to when the compute that needs it began.
    """

    def __init__(self, rank: int, timing: Costs | None, schedule: Schedule, global_rank=None):
        self.rank, self.timing, self.schedule = rank, timing, schedule
        self.global_rank = global_rank or (lambda pp_rank: pp_rank)  # a peer's rank, from its schedule rank
        self.clock = None
        self.watch, self.events_live = None, True
        self.events: list[Event] = []
        self.boundary_shapes: list[Boundary] = []
        self.pending: dict[Action, float] = {}  # receive -> when torch posted it
        self.last_end = 0.0  # end of this rank's latest compute
        self.labels = False  # write pplab's profiler labels (where torch's schedule writes none of its own)

    def start(self, origin: float, watch, device: torch.device) -> None:
        self.clock = step_clock(origin, device, self.timing)
        # On a GPU the events are told once the step has ended, in the device's times.
        self.events_live = not isinstance(self.clock, DeviceClock)
        self.watch, self.events, self.boundary_shapes, self.pending, self.last_end = watch, [], [], {}, 0.0

    def tell(self, event: Event) -> None:
        if self.watch is not None and self.events_live:
            self.watch(event)

    def action(self, kind: Kind, stage: int, microbatch: int):
        return _Timed(self, Action(stage, kind, microbatch))

    def posted(self, receive: Action) -> None:
        """torch asked for a receive's ops: it will wait for them before the compute that needs them."""
        self.pending[receive] = self.clock()
        if self.watch is not None:
            sender = self.global_rank(self.schedule.peer_rank(receive))
            self.watch(Now(self.rank, str(receive), self.pending[receive],
                           ((sender, str(receive.partner())),)))

    def waited(self, compute: Action, started: float) -> None:
        """Record the wait for the receive `compute` consumes, if torch posted one."""
        kind = Kind.RECV_F if compute.kind == Kind.F else Kind.RECV_B
        receive = Action(compute.stage, kind, compute.microbatch)
        posted = self.pending.pop(receive, None)
        if posted is None or compute.kind == Kind.W:
            return
        event = Event(self.rank, kind.value, compute.stage, compute.microbatch,
                      min(max(posted, self.last_end), started), started)
        self.events.append(event)
        self.tell(event)


class _Timed:
    """Context manager around one of torch's passes: announce, time, pad, record."""

    def __init__(self, recorder: _Recorder, action: Action):
        self.recorder, self.action, self.extra = recorder, action, {}

    def __enter__(self) -> dict:
        recorder = self.recorder
        if recorder.labels:  # torch's single-stage schedules write none (1F1B) or wider ones (GPipe)
            self.label = record_function(self.action.profiler_label)
            self.label.__enter__()
        self.started = recorder.clock()
        recorder.waited(self.action, self.started)
        self.drawing = dropout_streams.microbatch(self.action.microbatch)  # a model that drops draws alike
        self.drawing.__enter__()
        if recorder.watch is not None:
            recorder.watch(Now(recorder.rank, str(self.action), self.started))
        return self.extra

    def __exit__(self, exc_type, *_) -> None:
        recorder = self.recorder
        self.drawing.__exit__(None, None, None)
        if exc_type is not None:
            if recorder.labels:
                self.label.__exit__(exc_type, None, None)
            return
        pad_to_cost(recorder.timing, self.action, self.started, recorder.clock)
        ended = recorder.clock()
        if recorder.labels:
            self.label.__exit__(None, None, None)
        event = Event(recorder.rank, self.action.kind.value, self.action.stage, self.action.microbatch,
                      self.started, ended, **self.extra)
        recorder.events.append(event)
        recorder.last_end = event.end
        recorder.tell(event)


class TorchRankRuntime:
    """One rank's stages under a torch.distributed.pipelining schedule; `step` as `RankRuntime.step`."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, nn.Module],
                 device="cpu", timing: Costs | None = None, group=None, record: bool = True,
                 place=None, collectives=None, tied=None):
        """`schedule` is what `torch_schedule` made: its name says which of torch's schedules runs.

        With `record=False` (and no timing mode) torch's own PipelineStage runs, untouched:
        the baseline the recording's overhead is measured against.

        On a mesh (`place`, a `pplab.rank.mesh.MeshPlace`), `rank` is the global rank, the stages talk
        over the pipeline's own group, and `collectives` (a `CollectiveLog`) records dp and tp.
        `tied` (a `pplab.rank.tied.TiedGradients`) sums a tied weight's gradients after the step.
        """
        from torch.distributed.pipelining import PipelineStage

        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.device = torch.device(device)
        self.place, self.collectives, self.tied = place, collectives, tied
        self.recorder = _Recorder(rank, timing, schedule, place.global_rank if place else None)
        self._stage_class = recording_stage_class() if record or timing is not None else PipelineStage
        self._stage_group = place.pp_group if place else group
        self._microbatch_shape = None  # what torch's stages inferred their shapes from
        self._through_host = messages_through_host(self.device, self._stage_group)
        if self._through_host:
            # Their stages are given example arguments (torch then sends no shapes, which it would
            # send from the stage's device): built at the first step, when the shapes are known.
            self._stage_class = host_messages_stage_class(self._stage_class)
            self.torch_schedule = None
        else:
            self._build_torch_schedule()
        self._clock = StepClock(group, self.device)

    def _build_torch_schedule(self, activation_shape=None) -> None:
        """torch's PipelineStage for each of this rank's stages, and torch's schedule over them."""
        from torch.distributed.pipelining import schedules as torch_schedules

        schedule = self.schedule
        self.torch_stages = []
        for index in sorted(self.stages):
            examples = self._example_arguments(index, activation_shape) if self._through_host else {}
            stage = self._stage_class(self.stages[index], index, schedule.n_stages, self.device,
                                      group=self._stage_group, **examples)
            stage.recorder, stage.forward_bytes = self.recorder, ForwardBytes()
            self.torch_stages.append(stage)
        plan = is_torch_plan(schedule)
        schedule_class = (torch_schedules.get_schedule_class(torch_plan(schedule.name).torch_name) if plan
                          else torch_schedules._PipelineScheduleRuntime)  # any other: torch runs its CSV
        single = issubclass(schedule_class, torch_schedules.PipelineScheduleSingle)
        self.recorder.labels = single  # the multi-stage ones label each action "PP:<action>" themselves
        # scale_grads: torch divides every gradient by the number of microbatches, so they are
        # those of the mean loss, as pplab's runtime and the single-device reference compute.
        self.torch_schedule = schedule_class(self.torch_stages[0] if single else self.torch_stages,
                                             schedule.n_microbatches, loss_fn=loss_fn, scale_grads=True)
        if not plan:  # a schedule read with its messages (compute_comms) runs in its own order
            format = "compute_only" if schedule.stage_actions is None else "compute_comms"
            with tempfile.TemporaryDirectory() as folder:
                path = schedule.to_torch_csv(Path(folder) / "schedule.csv", format)
                self.torch_schedule._load_csv(str(path), format=format)

    def _example_arguments(self, index: int, activation_shape) -> dict:
        """A stage's input and output, for torch's `input_args` and `output_args`: zeros of the
        microbatch's shape, run through the stage (the random streams left as they were)."""
        if activation_shape is None:
            raise ValueError("messages through host memory need the microbatches' shapes before torch's "
                             "schedule runs: give microbatches of one shape (no forced handshake)")
        module = self.stages[index]
        if index == 0:
            example = torch.zeros(activation_shape[:-1], dtype=torch.long, device=self.device)
        else:  # a received activation: a leaf that asks for its gradient
            example = torch.zeros(activation_shape, dtype=next(module.parameters()).dtype, device=self.device,
                                  requires_grad=True)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            output = module(example)  # (with autograd on: torch reads from it that a gradient comes back)
        return {"input_args": example, "output_args": output.detach().requires_grad_(output.requires_grad)}

    def _follow_shape(self, activation_shapes) -> None:
        """torch's stages infer their activations' shapes once, on their first step: when the
        microbatches change shape (a step, then training with other sizes), every rank (each is
        told the same shapes) builds them anew, so that they infer again."""
        shape = tuple(activation_shapes[0]) if activation_shapes else None
        if self.torch_schedule is None:  # stages built with example arguments, at the first step
            self._build_torch_schedule(shape)
        elif shape is not None and self._microbatch_shape is not None and shape != self._microbatch_shape:
            self._build_torch_schedule(shape)
        self._microbatch_shape = shape or self._microbatch_shape

    def step(self, inputs, targets, activation_shapes=None, return_grads: bool = False,
             watch=None) -> RankStep:
        """One step of torch's schedule on this rank (same arguments and result as RankRuntime.step)."""
        self._follow_shape(activation_shapes)
        first = 0 in self.stages
        last = self.schedule.n_stages - 1 in self.stages
        args = (_whole_batch(inputs, "inputs"),) if first else ()
        target = _whole_batch(targets, "targets") if last else None
        losses: list | None = [] if last else None
        self.recorder.start(self._clock.origin(), watch, self.device)
        tensor_parallel = contextlib.nullcontext()
        if self.collectives is not None:
            self.collectives.start(self.recorder.clock, watch if self.recorder.events_live else None)
            if self.place.mesh.tp > 1:
                tensor_parallel = self.collectives.tensor_parallel_mode()
        try:
            with tensor_parallel:
                self.torch_schedule.step(*[a.to(self.device) for a in args],
                                         target=None if target is None else target.to(self.device),
                                         losses=losses, return_outputs=False)
        finally:
            collective_events = self.collectives.stop() if self.collectives is not None else []
        # torch has scaled the gradients: sum the tied ones now
        tied = [] if self.tied is None else self.tied.sum(
            self.stages, self.recorder.clock if self.recorder.clock else None)
        every_event = on_device(self.recorder.clock, [*self.recorder.events, *collective_events, *tied])
        kept, streamed = reported_once(every_event, watch,
                                       untold=every_event if not self.recorder.events_live else tied)
        if watch is not None:
            watch(Now(self.rank, "done", self.recorder.clock()))
        losses_by_microbatch = {mb: float(loss.detach()) for mb, loss in enumerate(losses or [])}
        return RankStep(self.rank, kept, losses_by_microbatch, list(self.recorder.boundary_shapes),
                        *gradient_report(self.stages.values(), return_grads), streamed=streamed,
                        device_memory=device_memory(self.device), timed_on=timed_on(self.recorder.clock))


def _whole_batch(microbatches, what: str) -> torch.Tensor:
    """torch's schedules take the whole batch and split it themselves: put the microbatches back together."""
    shapes = {tuple(mb.shape) for mb in microbatches}
    if len(shapes) != 1:
        raise ValueError(f"torch's schedules split one batch into equal microbatches, but the {what} "
                         f"have shapes {sorted(shapes)}: give microbatches of one shape")
    return torch.cat(list(microbatches))
