"""A pipeline session: its stages built once on the ranks, then stepped, checked and trained from here.

`Pipeline` works on any driver of ranks (see `pplab.session`): it checks the batch,
splits it into per-rank shares (token ids for stage 0, targets for the last stage; the
shares are small, so every rank is sent the list and uses only its own), and merges what
comes back into one `StepResult`: loss, timeline on one clock, the shapes that crossed
each boundary, gradient statistics. What runs on the ranks is in `pplab.session.on_rank`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from pplab._version import __version__
from pplab.base.arguments import check_positive_seconds
from pplab.base.checkpoint_files import CheckpointError, read_manifest, resume_path
from pplab.base.config import takes_options
from pplab.data import Batch, batches
from pplab.drivers.contract import PerRank
from pplab.models.llama import LlamaConfig
from pplab.planning.simulator import Costs, simulate
from pplab.rank.checks import (
    BoundaryTable,
    GradientFlowReport,
    ParityReport,
    check_gradient_flow,
    compare_with_reference,
)
from pplab.rank.mesh import Mesh
from pplab.rank.rank_context import RankError, StillRunningError
from pplab.rank.rank_pipeline import PipelineSpec, split_for_ranks
from pplab.rank.reference import ReferenceResult, reference_step
from pplab.rank.train import ProgressBar, TrainHistory, TrainOptions, TrainRecord, prepare_data
from pplab.schedules import TORCH_SCHEDULES, Schedule
from pplab.session.on_rank import (
    RANK_ITEMS,
    build_on_rank,
    drop_on_rank,
    memory_on_rank,
    step_on_rank,
    train_on_rank,
)
from pplab.session.results import MemoryTable, StepResult, merge_steps
from pplab.trace.timeline import Event, Now, Timeline

STREAM_DRAIN_SECONDS = 10.0  # how long a live step's result waits for events trailing it


def wrong_placement(spec: PipelineSpec, placement: list[dict]) -> str | None:
    """Why the ranks' stages (and mesh places), as `build_on_rank` reported them, are not the ones
    `spec` gives them (a rank running another pplab, on another host, builds others); None if they are."""
    for rank, built in enumerate(placement):
        expected = spec.schedule.stages_of(spec.pp_rank(rank))
        place = spec.mesh.coordinates(rank) if spec.mesh else None
        if built["stages"] != expected or built["coordinates"] != place:
            return (f"rank {rank} built stages {built['stages']} at {built['coordinates']}, not {expected} "
                    f"at {place} as this client's spec says; it runs pplab {built.get('pplab')}, this client "
                    f"{__version__}: give every host the same pplab")
    return None


class Pipeline:
    """A pipeline built on the ranks of a driver (a lab, a RankPool): step it, check it, train it.

    Made by `lab.pipeline(...)` (or `pool.pipeline(...)`), whose keywords say what it is
    (`pplab.session.drivers`); `Pipeline(ranks, spec)` builds one from a `PipelineSpec`.
    """

    def __init__(self, lab, spec: PipelineSpec):
        """Build `spec`'s stages on the ranks of `lab` (`pplab.Lab`, `pplab.RankPool`, see pplab.session)."""
        if spec.world_size != lab.world_size:
            raise ValueError(f"the pipeline is for {spec.world_size} ranks but the driver has "
                             f"{lab.world_size}: make its PipelineSpec for {lab.world_size} ranks")
        self.lab, self.spec = lab, spec
        self.pipeline_id = f"pipeline-{uuid.uuid4().hex[:8]}"  # unique even with two clients on one cluster
        self.last: StepResult | None = None
        self.history = TrainHistory()  # every step that `train` ran, across calls
        # Every wait between ranks is bounded by spec.op_timeout; timing mode adds the step's own length.
        padded = simulate(self.spec.schedule, self.spec.timing).step_time() if self.spec.timing else 0.0
        self._call_timeout = self.spec.op_timeout + 120.0 + 2 * padded
        self.placement = lab.run(build_on_rank, self.pipeline_id, self.spec, timeout=self._call_timeout)
        self._built_on = lab.rank_processes
        wrong = wrong_placement(self.spec, self.placement)
        if wrong:  # said now, before a step waits for messages that never come
            self.close()
            raise RuntimeError(wrong)

    def _check_engines(self) -> None:
        """The stages live on the processes that built them: once those are replaced, or the pipeline
        closed, they are gone (said here, before any rank is asked)."""
        if getattr(self, "closed", False):
            raise RuntimeError(f"{self!r} was closed (its stages freed on every rank): build the pipeline "
                               f"again (lab.pipeline(...))")
        if self.lab.rank_processes != self._built_on:
            raise RuntimeError(f"{self!r} was built on ranks that were replaced since (a restart, or a "
                               f"failed call on a pool): build the pipeline again (lab.pipeline(...))")

    @property
    def schedule(self) -> Schedule:
        """The (validated) schedule every rank follows."""
        return self.spec.schedule

    @property
    def config(self) -> LlamaConfig:
        """The model configuration."""
        return self.spec.config

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the ranks form (None for a pipeline alone); print it for the rank layout."""
        return self.spec.mesh

    @property
    def rank_labels(self) -> list[str]:
        """A name per rank for pictures: 'rank 3 · pp1 dp1' on a mesh, 'rank 3' otherwise."""
        mesh = self.spec.mesh
        return [mesh.label(r) if mesh else f"rank {r}" for r in range(self.spec.world_size)]

    @takes_options(TrainOptions, differs={"seq_len": "32: a short batch, quick on CPU, to show a step"})
    def default_batch(self, microbatch_size: int = 2, seq_len: int = 32, seed: int = 0) -> Batch:
        """A batch of the embedded corpus that splits into this pipeline's
        microbatches (of every dp replica)."""
        size = microbatch_size * self.schedule.n_microbatches * self.spec.replicas
        return next(batches(size, seq_len, seed=seed))

    def memory(self) -> MemoryTable:
        """Per rank, the bytes of parameters, gradients and AdamW state it holds, vs unsharded.

        Gradients are those the last step left (a step is run first if there was none); the
        optimizer state is measured with a real AdamW that steps with lr=0 and is dropped.
        """
        self._check_engines()
        if self.last is None:
            self.step()
        rows = self.lab.run(memory_on_rank, self.pipeline_id, timeout=self._call_timeout)
        return MemoryTable(sorted(rows, key=lambda row: row["rank"]), self.rank_labels)

    def step(self, batch: Batch | Sequence[Batch] | None = None, return_grads: bool = False) -> StepResult:
        """One step (forward and backward of every microbatch) on every rank."""
        return self.start_step(batch, return_grads).result()

    def start_step(self, batch: Batch | Sequence[Batch] | None = None, return_grads: bool = False,
                   live_interval: float | None = None) -> "LiveStep":
        """Start one step on every rank and return at once; with `live_interval`, watch it as it runs."""
        self._check_engines()
        if live_interval is not None:
            check_positive_seconds("live_interval", live_interval)
        batch = self.default_batch() if batch is None else batch
        data = PerRank(split_for_ranks(self.spec, batch))  # each rank is sent its own share only
        call = self.lab.run_async(step_on_rank, self.pipeline_id, data, return_grads, live_interval,
                                  timeout=self._call_timeout)
        return LiveStep(self, call)

    def train(self, steps: int | None = None, until: int | None = None, show: bool = True,
              live_interval: float = 0.25, **options) -> TrainHistory:
        """Train on every rank (AdamW, warm-up + cosine, global-norm clipping; see pplab.rank.train).

        `steps` is the training's length (the LR schedule's horizon); `until` stops earlier (a
        later call with the same options goes on). Other keywords are `TrainOptions`
        fields (batch_size, lr, eval_every, checkpoint_dir, checkpoint_every, resume, ...).
        With `show`, a progress bar (in a notebook, a lab's pipeline shows a live `TrainingView`:
        progress, loss curves and the latest step). The records are also kept in `pipe.history`.
        """
        if steps is not None:
            options["steps"] = steps
        train_options = TrainOptions(**options)
        # before any rank starts
        train_options.check(self.schedule.n_microbatches, self.config, self.spec.replicas)
        train_options = prepare_data(train_options, self.config)  # the tokenizer trained, the text checked
        self._check_engines()
        check_positive_seconds("live_interval", live_interval)
        first_step = self.history.records[-1].step if self.history.records else 0
        if train_options.resume is not None:  # the training goes back (or on) to the checkpoint's step
            resumed = resume_path(train_options.resume, train_options.checkpoint_dir)
            first_step = read_manifest(resumed)["step"]
        call = self.lab.run_async(train_on_rank, self.pipeline_id, train_options, until, live_interval)
        view = self.training_display(train_options.steps if until is None else until, first_step, show)
        world_size = self.lab.world_size
        since_last_record: dict[int, list[Event]] = {rank: [] for rank in range(world_size)}
        by_step: dict[int, dict[int, tuple[TrainRecord, list[Event]]]] = {}

        def show_arrived() -> None:
            # Each rank sends a step's events, then the step's record: the events since a rank's
            # last record are that step's. A step is shown once every rank is past it.
            for published in call.poll_events():
                for _, item in published.payload:
                    if isinstance(checked(item), Event):
                        since_last_record[published.rank].append(item)
                    elif isinstance(item, TrainRecord):
                        step = by_step.setdefault(item.step, {})
                        step[published.rank], since_last_record[published.rank] = (
                            item, since_last_record[published.rank]), []
                        if len(step) == world_size:
                            del by_step[item.step]
                            events = [event for rank in sorted(step) for event in step[rank][1]]
                            view.add(step[0][0], Timeline(events, world_size, label=f"step {item.step}"))

        try:
            while True:
                show_arrived()
                try:  # raises at once when a rank failed or died
                    history = call.result(timeout=0.1)[0]
                    break
                except StillRunningError:
                    continue
            call.wait_for_events()  # a rank's last records may trail its result
            show_arrived()
        except RankError as error:
            raised = error.first_raised()
            if raised and raised[0] == "CheckpointError":  # every rank refused it; the pipeline is unchanged
                raise CheckpointError(raised[1]) from error  # what each rank said stays with it
            raise
        finally:
            view.close()
        # what came after the checkpoint's step is not this pipeline's past
        if train_options.resume is not None:
            self.history.records = [r for r in self.history.records if r.step <= first_step]
        self.history.records += history.records
        self.history.resumed_from = history.resumed_from or self.history.resumed_from
        return history

    def training_display(self, total_steps: int, first_step: int, show: bool):
        """What shows training's progress: anything with `add(record, timeline)` and `close()`.

        Here a terminal's progress bar (or nothing); a notebook's pipeline shows a live view instead
        (pplab.views.notebook_pipeline.NotebookPipeline).
        """
        return ProgressBar(total_steps, first_step) if show else _NoDisplay()

    def check_parity(self, batch: Batch | Sequence[Batch] | None = None, loss_rtol: float = 1e-6,
                     grad_atol: float = 1e-5, *, reference: ReferenceResult | None = None) -> ParityReport:
        """Run a step and compare its loss and every gradient with the single-device reference.

        `reference`: that step computed once already (`pplab.reference_step` on the same batch and
        seed), for several pipelines checked against one device; the step itself is in `self.last`."""
        batch = self.default_batch() if batch is None else batch
        result = self.step(batch, return_grads=True)
        if reference is None:
            reference = reference_step(self.config, batch, None if isinstance(batch, list)
                                       else self.schedule.n_microbatches * self.spec.replicas,
                                       seed=self.spec.seed)
        return compare_with_reference(result.loss, result.grads, reference, loss_rtol, grad_atol)

    def check_gradient_flow(self, batch: Batch | Sequence[Batch] | None = None) -> GradientFlowReport:
        """Every parameter of the full model got a finite, non-zero gradient on some stage."""
        if self.last is None or batch is not None:
            self.step(batch)
        return check_gradient_flow(self.last.grad_stats, self.config.parameter_names())

    def boundary_shapes(self) -> BoundaryTable:
        """What crossed each stage boundary in the last step."""
        if self.last is None:
            self.step()
        return BoundaryTable(self.last.boundary_shapes)

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """The timeline the simulator predicts for this schedule (same type as a measured one)."""
        return simulate(self.schedule, costs or self.spec.timing)

    def close(self) -> None:
        """Free the stages on every rank."""
        if self.lab.state != "stopped":
            self.lab.run(drop_on_rank, self.pipeline_id, timeout=60)
        self.closed = True

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        """`with pool.pipeline(...) as pipe:` frees the stages at the end of the block."""
        self.close()

    def __repr__(self) -> str:
        s = self.schedule
        runtime = s.name if self.spec.impl != "torch" else (
            f"torch's {s.name}" if s.name in TORCH_SCHEDULES else f"{s.name} on torch's runtime")
        mesh = self.spec.mesh
        where = (f"{mesh.world_size} ranks as pp={mesh.pp} x dp={mesh.dp} x tp={mesh.tp}" if mesh
                 else f"{s.n_ranks} ranks")
        return f"<Pipeline {runtime}: {where}, {s.n_stages} stages, {s.n_microbatches} microbatches>"


class _NoDisplay:
    def add(self, record, timeline) -> None:
        pass

    def close(self) -> None:
        pass


def checked(item):
    """`item` if it is of a type ranks publish (pplab.session.on_rank.RANK_ITEMS), else a TypeError."""
    if not isinstance(item, RANK_ITEMS):
        raise TypeError(f"a rank published a {type(item).__name__}; ranks publish only "
                        f"{', '.join(kind.__name__ for kind in RANK_ITEMS)}")
    return item


class LiveStep:
    """One step running on the ranks: what they published so far, then the merged result.

    With a live interval, the ranks' events come only on the stream (each rank's result says
    how many it sent): the result waits for all of them, a bounded time.
    """

    def __init__(self, pipe: Pipeline, call):
        self.pipe, self.call = pipe, call
        self.events: list[Event] = []  # the step's events that have arrived, from every rank
        self._by_rank: dict[int, list[Event]] = {rank: [] for rank in range(pipe.spec.world_size)}
        self._unseen: list[tuple[float, Event | Now]] = []  # arrived, not yet given out by poll()
        self._result: StepResult | None = None

    def poll(self) -> list[tuple[float, Event | Now]]:
        """What arrived since the last look, as (time the rank put it, Event or Now), without waiting."""
        self._receive()
        items, self._unseen = self._unseen, []
        return items

    def _receive(self) -> None:
        for published in self.call.poll_events():
            for put_at, item in published.payload:
                if isinstance(checked(item), Event):
                    self.events.append(item)
                    self._by_rank[published.rank].append(item)
                self._unseen.append((put_at, item))

    def wait(self, timeout: float) -> None:
        """Block until every rank has finished, or `timeout` seconds (errors are left to `finished`)."""
        try:
            self.call.result(timeout=timeout)
        except (RankError, StillRunningError):  # a failure is kept by the call; finished() raises it
            pass

    def finished(self) -> bool:
        """True once every rank has finished; raises the call's error if a rank failed."""
        try:
            self.call.result(timeout=0)
        except StillRunningError:
            return False
        return True

    def timeline(self, label: str = "running") -> Timeline:
        """The events that have arrived, as a (growing) timeline."""
        return Timeline(list(self.events), self.pipe.spec.world_size, label=label)

    def result(self) -> StepResult:
        """Wait for every rank; the merged step (also kept as `pipe.last`)."""
        if self._result is None:
            rank_steps = self.call.result()
            self._wait_for_streamed(rank_steps)
            self.call.wait_for_events()  # what a rank told after its last event (it is "done") may trail
            self._result = merge_steps([dataclasses.replace(step, events=[*self._by_rank[step.rank],
                                                                          *step.events])
                                        for step in rank_steps])
            self.pipe.last = self._result
        return self._result

    def _wait_for_streamed(self, rank_steps, seconds: float = STREAM_DRAIN_SECONDS) -> None:
        """Until every event each rank streamed has arrived (they may trail its result), at most `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            self._receive()
            missing = {step.rank: (len(self._by_rank[step.rank]), step.streamed) for step in rank_steps
                       if len(self._by_rank[step.rank]) < step.streamed}
            if not missing:
                return
            if time.monotonic() > deadline:
                rank, (arrived, sent) = next(iter(missing.items()))
                raise RuntimeError(f"rank {rank} streamed {sent} events of its step, but {arrived} arrived "
                                   f"within {seconds:g} s: the timeline would miss some; step again")
            self.call.wait_for_events(0.1)
