"""What a pipeline session runs on each rank: its stages, built once and kept, stepped and trained.

What a rank publishes while a call runs is one of three types, each sent once: an `Event`
(something it did, as it ends), a `Now` (what it starts, whom it waits on) and, in
training, a `TrainRecord` (a step done, after that step's events). A live step's events
travel only on the stream: the step's result says how many there were.

Ranks are long-lived (lab engines, a pool's processes), so each keeps its `RankPipeline`
in a registry keyed by the pipeline's id, and its trainer (optimizer, LR schedule, step)
beside it. The client side is `pplab.session.pipeline`; these functions are called
through a driver's `run` / `run_async`, on every rank, and publish through
`pplab.rank.rank_context`, so they work the same on every driver. Code of one's own that
runs on the ranks (a benchmark timing steps between barriers) takes the stages the session
built there from `built_pipeline(pipe.pipeline_id)`.
"""

from __future__ import annotations

import dataclasses

from pplab._version import __version__
from pplab.rank import faults
from pplab.rank.mesh import memory_held, optimizer_state_bytes
from pplab.rank.rank_context import Feed, rank_context
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline
from pplab.rank.runtime import RankStep
from pplab.rank.train import RankTrainer, TrainHistory, TrainOptions, TrainRecord
from pplab.trace.timeline import Event, Now

RANK_ITEMS = (Event, Now, TrainRecord)  # what a rank publishes (see above)

_pipelines: dict[str, RankPipeline] = {}
_trainers: dict[str, RankTrainer] = {}


def build_on_rank(pipeline_id: str, spec: PipelineSpec) -> dict:
    """Build this rank's stages for `spec` and keep them under `pipeline_id`."""
    context = rank_context()
    pipeline = RankPipeline(spec, context.rank, context.device)
    _pipelines[pipeline_id] = pipeline
    return {"rank": context.rank, "pplab": __version__, "stages": sorted(pipeline.stages),
            "parameters": sum(p.numel() for p in pipeline.parameters()),
            "coordinates": pipeline.place.coordinates if pipeline.place else None}


def built_pipeline(pipeline_id: str) -> RankPipeline:
    """This rank's part of the pipeline `pipeline_id`, as the session built it (`pipe.pipeline_id`).

    For a function sent to the ranks (`pool.run(fn, pipe.pipeline_id, batch)`) that steps the
    pipeline itself: `pipeline = built_pipeline(pipeline_id); pipeline.step(pipeline.share(batch))`.
    """
    if pipeline_id not in _pipelines:
        raise LookupError(f"pipeline {pipeline_id} is not built on rank {rank_context().rank} (were the "
                          f"ranks replaced since?): build the pipeline again (lab.pipeline(...))")
    return _pipelines[pipeline_id]


def step_on_rank(pipeline_id: str, data: dict, return_grads: bool,
                 live_interval: float | None = None) -> RankStep:
    """Run one step of the pipeline `pipeline_id` with this rank's share of the data (what
    `split_for_ranks` gives this rank: the client sends it as a `PerRank`).

    With `live_interval`, what the rank starts and every event it records are published
    while the step runs (see `pplab.rank.rank_context.Feed`), for live views.
    """
    pipeline = built_pipeline(pipeline_id)
    with faults.in_pipeline(pipeline_id):  # the faults armed for this pipeline may fire (pplab.rank.faults)
        if live_interval is None:
            return pipeline.step(data, return_grads=return_grads)
        with Feed(live_interval) as feed:  # the events go out on the stream; the result says how many
            return pipeline.step(data, return_grads=return_grads, watch=feed.put)


def train_on_rank(pipeline_id: str, options: TrainOptions, until: int | None,
                  live_interval: float) -> TrainHistory:
    """Train the pipeline `pipeline_id` (the loop of `pplab.rank.train`), publishing each step as it ends.

    The rank keeps its trainer (optimizer, LR schedule, step) between calls, so a call
    with the same options (whatever the last one resumed from) goes on where the last
    stopped. A call that resumes from a checkpoint, or changes the options, starts a
    new trainer: loaded from the checkpoint, or a fresh optimizer on the current weights.
    """
    pipeline = built_pipeline(pipeline_id)
    trainer = _trainers.get(pipeline_id)
    goes_on = (trainer is not None and options.resume is None
               and dataclasses.replace(trainer.options, resume=None) == options)
    if not goes_on:
        if trainer is not None:
            trainer.close()
        trainer = _trainers[pipeline_id] = RankTrainer(pipeline, options)
    with Feed(live_interval) as feed, faults.in_pipeline(pipeline_id):  # each step's events, then its record
        return trainer.train(until, on_step=feed.put, watch=feed.put)


def memory_on_rank(pipeline_id: str) -> dict:
    """The bytes this rank holds for its stages (see pplab.rank.mesh.memory_held), AdamW's state measured."""
    stages = built_pipeline(pipeline_id).stages.values()
    return {**memory_held(stages), "optimizer": optimizer_state_bytes(stages),
            "rank": rank_context().rank}


def drop_on_rank(pipeline_id: str) -> None:
    """Forget the pipeline `pipeline_id` (frees its stages, its trainer, its process groups and its
    faults not fired)."""
    trainer = _trainers.pop(pipeline_id, None)
    if trainer is not None:
        trainer.close()
    _pipelines.pop(pipeline_id, None)
    faults.disarm_on_rank(pipeline_id)
