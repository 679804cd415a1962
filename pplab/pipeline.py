"""A pipeline run: what each rank holds between steps, what it is sent, what comes back.

`PipelineSpec` is everything the ranks must agree on (model config, schedule,
seed, partition, timeouts); it is small and picklable, so a notebook sends it
to every engine, or every torchrun process builds it itself. `RankPipeline` is
one rank's half: its stage modules and its `RankRuntime`. `split_for_ranks`
decides what data each rank gets: token ids only where stage 0 lives, targets
only where the last stage lives, nothing elsewhere. `merge_steps` turns the
ranks' reports into one `StepResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pplab.data import Batch
from pplab.model import LlamaConfig
from pplab.partition import build_stage, layer_ranges
from pplab.reference import as_microbatches
from pplab.runtime import Boundary, RankRuntime, RankStep
from pplab.schedules import Schedule, build, validate
from pplab.simulator import Costs
from pplab.trace import Timeline


@dataclass
class PipelineSpec:
    """What every rank must agree on to run a pipeline."""

    config: LlamaConfig
    schedule: Schedule
    seed: int = 0
    balance: Sequence[int] | None = None
    allow_empty: bool = False
    timeout: float = 30.0
    timing: Costs | None = None
    record: bool = True

    @classmethod
    def create(cls, config: LlamaConfig, schedule: str | Schedule, n_ranks: int,
               microbatches: int | None = None, n_virtual: int = 1, **options) -> "PipelineSpec":
        """Build (or take) the schedule, validate it and check it fits the model, before any rank runs."""
        if isinstance(schedule, str):
            if microbatches is None:
                raise ValueError(f"schedule={schedule!r} needs microbatches=<count>")
            schedule = build(schedule, n_ranks, microbatches, n_virtual)
        elif schedule.n_ranks != n_ranks:
            raise ValueError(f"the schedule is for {schedule.n_ranks} ranks but the pipeline has "
                             f"{n_ranks}; build it for {n_ranks} ranks")
        validate(schedule)
        spec = cls(config, schedule, **options)
        # Raises a clear error now if the stages cannot be cut (e.g. more stages than layers).
        layer_ranges(config.num_hidden_layers, schedule.n_stages, spec.balance, spec.allow_empty)
        return spec


class RankPipeline:
    """One rank's stages and runtime, kept between steps."""

    def __init__(self, spec: PipelineSpec, rank: int, device="cpu", group=None):
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        schedule = spec.schedule
        self.stages = {s: build_stage(spec.config, s, schedule.n_stages, spec.seed, self.device,
                                      spec.balance, spec.allow_empty)
                       for s in schedule.stages_of(rank)}
        self.runtime = RankRuntime(schedule, rank, self.stages, self.device, spec.timeout,
                                   spec.record, spec.timing, group)

    def parameters(self):
        """All parameters of this rank's stages."""
        return [p for stage in self.stages.values() for p in stage.parameters()]

    def named_parameters(self):
        """(full-model name, parameter) for this rank's stages."""
        return [item for stage in self.stages.values() for item in stage.named_parameters()]

    def zero_grad(self) -> None:
        """Forget the previous step's gradients."""
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=True)

    def step(self, data: dict, zero_grad: bool = True, return_grads: bool = False) -> RankStep:
        """One step on this rank with the data `split_for_ranks` prepared for it."""
        if zero_grad:
            self.zero_grad()
        return self.runtime.step(data.get("inputs"), data.get("targets"),
                                 data.get("activation_shapes"), return_grads)


def split_for_ranks(spec: PipelineSpec, batch: Batch | Sequence[Batch],
                    handshake: bool | None = None) -> list[dict]:
    """Per rank, the data it needs: token ids where stage 0 is, targets where the last stage is.

    When every microbatch has the same shape the receivers are told the activation
    shape and skip the handshake (unless `handshake=True`); otherwise they learn each
    shape from a header.
    """
    schedule = spec.schedule
    microbatches = as_microbatches(batch, schedule.n_microbatches)
    token_shapes = {tuple(ids.shape) for ids, _ in microbatches}
    for ids, _ in microbatches:
        if ids.numel() and int(ids.max()) >= spec.config.vocab_size:
            raise ValueError(f"a token id {int(ids.max())} is outside the vocabulary "
                             f"(vocab_size={spec.config.vocab_size}); check the tokenizer and config")
    fixed = len(token_shapes) == 1 and handshake is not True
    activation_shapes = ([(*ids.shape, spec.config.hidden_size) for ids, _ in microbatches]
                         if fixed else None)
    per_rank = []
    for rank in range(schedule.n_ranks):
        stages = schedule.stages_of(rank)
        per_rank.append(dict(
            inputs=[ids for ids, _ in microbatches] if 0 in stages else None,
            targets=[t for _, t in microbatches] if schedule.n_stages - 1 in stages else None,
            activation_shapes=activation_shapes))
    return per_rank


@dataclass
class StepResult:
    """One pipeline step seen from the client: loss, timeline, shapes, gradients."""

    loss: float
    microbatch_losses: list[float]
    timeline: Timeline
    shapes: list[Boundary]
    grad_stats: dict[str, dict]
    grads: dict[str, torch.Tensor] | None = None
    rank_steps: list[RankStep] = field(default_factory=list, repr=False)


def merge_steps(rank_steps: Sequence[RankStep], label: str = "measured") -> StepResult:
    """Combine the ranks' reports (ordered by rank) into one StepResult."""
    losses = {}
    for rank_step in rank_steps:
        losses.update(rank_step.microbatch_losses)
    ordered = [losses[mb] for mb in sorted(losses)]
    grad_stats, grads = {}, {}
    for rank_step in rank_steps:
        grad_stats.update(rank_step.grad_stats)
        grads.update(rank_step.grads or {})
    timeline = Timeline([e for r in rank_steps for e in r.events], n_ranks=len(rank_steps), label=label)
    shapes = sorted((b for r in rank_steps for b in r.boundaries), key=lambda b: (b.source, b.microbatch))
    return StepResult(sum(ordered) / len(ordered), ordered, timeline, shapes, grad_stats,
                      grads or None, list(rank_steps))


def run_jobs_on_rank(rank: int, world_size: int, jobs: Sequence[tuple[PipelineSpec, list[dict]]],
                     return_grads: bool = True) -> list[RankStep]:
    """For each (spec, per-rank data) job, build this rank's stages and run one step.

    The entry point for plain processes (`pplab.launch.run_ranks`) and torchrun scripts.
    """
    steps = []
    for spec, data in jobs:
        if spec.schedule.n_ranks != world_size:
            raise ValueError(f"the schedule is for {spec.schedule.n_ranks} ranks but "
                             f"world_size={world_size}")
        steps.append(RankPipeline(spec, rank).step(data[rank], return_grads=return_grads))
    return steps
