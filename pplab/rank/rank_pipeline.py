"""A pipeline on its ranks: what each rank holds between steps, what it is sent, what comes back.

`PipelineSpec` is everything the ranks must agree on (model config, schedule,
seed, partition, timeouts); it is small and picklable, so a notebook sends it
to every engine, or every torchrun process builds it itself. `RankPipeline` is
one rank's half: its stage modules and its `RankRuntime`. `split_for_ranks`
decides what data each rank gets: token ids only where stage 0 lives, targets
only where the last stage lives, nothing elsewhere. The client turns the ranks'
reports into one step (`pplab.session.results`).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from pplab.base.arguments import check_positive_int
from pplab.base.config import OP_TIMEOUT, LabOptions, PipelineOptions, check_option, takes_options
from pplab.base.renames import renamed_keywords
from pplab.data import Batch
from pplab.models import dropout_streams
from pplab.models.llama import IGNORE_INDEX, LlamaConfig
from pplab.models.partition import as_model, build_stage, layer_ranges
from pplab.planning.simulator import Costs
from pplab.rank.mesh import CollectiveLog, Mesh, MeshPlace, parallelize_stage
from pplab.rank.reference import as_microbatches
from pplab.rank.runtime import RankRuntime, RankStep
from pplab.rank.tied import TiedGradients, tie_on_rank
from pplab.schedules import Schedule, build, check_runnable, check_torch_runs, validate
from pplab.schedules.torch_csv import read_either_csv
from pplab.trace.timeline import Event


def make_first_calls() -> None:
    """Make now, while the pipeline is built and no peer waits, the calls a step would otherwise be
    the first to make in this process, and that import modules then.

    The costly one: given an output's gradient, `torch.autograd.backward` (and `.grad`) import
    torch's symbolic shapes, and with them sympy, on their first call, which costs a large part of
    a second of CPU. Inside a step, that would make the first B several times longer than the next
    ones in the first step's timeline, and keep the next rank waiting for it under the op timeout,
    which a busy machine can run out. The last stage's backward starts from the scalar loss, but it
    makes the call here too: a trainer's optimizer imports the same modules, and ranks that did
    unequal one-time work would wait for each other in their first training step. The other calls
    cost milliseconds: a step's profiler labels, and unpickling the tensors a step is sent.
    """
    (torch.zeros(1, requires_grad=True) * 1).backward(torch.ones(1))
    with record_function("pplab: first calls"):
        pass
    buffer = io.BytesIO()
    torch.save(torch.zeros(1), buffer)
    buffer.seek(0)
    torch.load(buffer)


@takes_options(LabOptions)
@takes_options(PipelineOptions)
@dataclass
class PipelineSpec:
    """What every rank must agree on to run a pipeline.

    Its fields, but the schedule, are keywords of `lab.pipeline(...)`, which documents them
    (`pplab.session.drivers`); those that are options take their defaults from their fields
    (pplab.base.config: PipelineOptions, LabOptions), as `create` does, checked at import.
    """

    config: LlamaConfig  # the model: a LlamaConfig or a pplab.models.hf.HFModel (see pplab.models.partition)
    schedule: Schedule
    seed: int = PipelineOptions.seed
    balance: Sequence[int] | None = PipelineOptions.balance
    allow_empty: bool = False
    op_timeout: float = OP_TIMEOUT
    timing: Costs | None = None
    record: bool = True
    impl: str = PipelineOptions.impl  # the hand-written runtime, or "torch": torch.distributed.pipelining
    mesh: Mesh | None = None  # PP as one dimension of a mesh with FSDP (dp) and TP (tp)
    param_dtype: str = PipelineOptions.param_dtype  # the stages' parameters (so their activations)

    @classmethod
    @renamed_keywords
    @takes_options(LabOptions)
    @takes_options(PipelineOptions, every=True, differs={
        "n_microbatches": "None: a Schedule's own count; {default} for a schedule's name"})
    def create(cls, config: LlamaConfig, schedule: str | Schedule, n_ranks: int,
               n_microbatches: int | None = None, n_virtual: int = PipelineOptions.n_virtual, *,
               impl: str = PipelineOptions.impl, seed: int = PipelineOptions.seed,
               balance: Sequence[int] | None = PipelineOptions.balance, allow_empty: bool = False,
               op_timeout: float = OP_TIMEOUT, timing: Costs | None = None, record: bool = True,
               mesh: Mesh | dict | None = None,
               param_dtype: str = PipelineOptions.param_dtype) -> "PipelineSpec":
        """Build (or take) the schedule, validate it and check it fits the model, before any rank runs.

        The arguments are those of `lab.pipeline(...)` (pplab.session.drivers), with `n_ranks`
        the number of ranks. With a `mesh` (e.g. {"pp": 2, "dp": 2}), the `n_ranks` ranks form
        that mesh and the schedule is one pipeline's, over the mesh's pp ranks.
        """
        for name, value in (("impl", impl), ("param_dtype", param_dtype), ("n_virtual", n_virtual),
                            ("seed", seed), ("balance", balance)):
            check_option(PipelineOptions, name, value)
        if isinstance(schedule, str) and schedule.endswith(".csv"):  # a file torch's runtime reads
            schedule = read_either_csv(schedule)
        if n_microbatches is None and isinstance(schedule, str):
            n_microbatches = PipelineOptions.n_microbatches
        config = as_model(config)
        if mesh is not None and not isinstance(config, LlamaConfig):
            raise ValueError(f"mesh={mesh!r} with a {type(config).__name__}: the mesh's "
                             "tensor-parallel plans and sharded training know pplab's own model "
                             "only; pipeline it without a mesh")
        if n_microbatches is not None:
            check_option(PipelineOptions, "n_microbatches", n_microbatches)
        if param_dtype != "float32" and mesh is not None:
            raise ValueError(f"param_dtype={param_dtype!r} makes plain bf16 stages for a pipeline alone; "
                             "on a mesh use FSDP's mixed precision instead: mesh={..., "
                             "'mixed_precision': True}")
        if mesh is not None:
            mesh = Mesh.of(mesh)
            mesh.check(config, n_ranks, impl)
            n_ranks = mesh.pp
        if impl == "torch" and isinstance(schedule, str):
            from pplab.rank.torch_pp import torch_schedule

            schedule = torch_schedule(schedule, n_ranks, n_microbatches, n_virtual)
        elif impl == "torch":  # any schedule: torch's runtime runs it from its CSV
            _check_matches(schedule, n_ranks, n_microbatches, n_virtual)
            check_torch_runs(schedule)
        elif isinstance(schedule, str):
            schedule = build(schedule, n_ranks, n_microbatches, n_virtual)
        else:
            _check_matches(schedule, n_ranks, n_microbatches, n_virtual)
        if impl == "pplab":  # torch runs its own plan; pplab's runtime runs exactly this one
            validate(schedule)
            check_runnable(schedule)
        if mesh is not None and mesh.activation_checkpointing and any(
                action.kind.value in ("I", "W") for actions in schedule.actions for action in actions):
            raise ValueError(f"activation checkpointing with {schedule.name!r}: its backward is split into "
                             f"I and W, and each would recompute the checkpointed blocks (torch's "
                             f"checkpoint recomputes once per forward); use a schedule with whole "
                             f"backwards (gpipe, 1f1b, interleaved-1f1b) or leave checkpointing out")
        spec = cls(config, schedule, seed=seed, balance=balance, allow_empty=allow_empty,
                   op_timeout=op_timeout,
                   timing=timing, record=record, impl=impl, mesh=mesh, param_dtype=param_dtype)
        if not spec.op_timeout > 0:
            raise ValueError(f"op_timeout={spec.op_timeout!r}: give the seconds a rank may wait for a "
                             f"neighbour, > 0")
        if spec.timing is not None:
            if not isinstance(spec.timing, Costs):
                raise ValueError(f"timing={spec.timing!r}: give a pplab.Costs (seconds per action)")
            spec.timing.check_stages(schedule.n_stages)
        # Raises a clear error now if the stages cannot be cut (e.g. more stages than layers).
        if hasattr(config, "check_stages"):  # a traced model's cut is fixed by its split points
            config.check_stages(schedule.n_stages, spec.balance)
        layer_ranges(config.num_hidden_layers, schedule.n_stages, spec.balance, spec.allow_empty)
        return spec

    @property
    def world_size(self) -> int:
        """How many ranks run it: the schedule's, times the mesh's dp and tp."""
        return self.mesh.world_size if self.mesh else self.schedule.n_ranks

    @property
    def replicas(self) -> int:
        """How many pipelines take different data: the mesh's dp (1 without a mesh)."""
        return self.mesh.dp if self.mesh else 1

    def pp_rank(self, rank: int) -> int:
        """The schedule rank (position in its pipeline) of global rank `rank`."""
        return self.mesh.coordinates(rank)["pp"] if self.mesh else rank


def _check_matches(schedule: Schedule, n_ranks: int, n_microbatches, n_virtual: int) -> None:
    """A ready-made schedule fixes its sizes: arguments that disagree are mistakes, not hints."""
    if schedule.n_ranks != n_ranks:
        raise ValueError(f"the schedule is for {schedule.n_ranks} ranks but the pipeline has "
                         f"{n_ranks}; build it for {n_ranks} ranks")
    for what, given, actual in (("n_microbatches", n_microbatches, schedule.n_microbatches),
                                ("n_virtual", n_virtual, schedule.n_virtual)):
        if given is not None and given != actual and not (what == "n_virtual" and given == 1):
            raise ValueError(f"the schedule is for {what}={actual} but {what}={given} was asked for; "
                             f"build the schedule for {what}={given} or leave {what} out")


class RankPipeline:
    """One rank's stages and runtime, kept between steps."""

    def __init__(self, spec: PipelineSpec, rank: int, device="cpu", group=None):
        """On a mesh every rank must build its pipeline at the same time (it makes the mesh's groups)."""
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        schedule = spec.schedule
        self.place = MeshPlace(spec.mesh, rank, self.device) if spec.mesh else None
        collectives = CollectiveLog(rank) if spec.mesh and spec.record else None
        self.stages = {s: build_stage(spec.config, s, schedule.n_stages, spec.seed, self.device,
                                      spec.balance, spec.allow_empty)
                       for s in schedule.stages_of(spec.pp_rank(rank))}
        if spec.param_dtype != "float32":
            for stage in self.stages.values():
                parameters_in(stage, getattr(torch, spec.param_dtype))
        tie_on_rank(self.stages, spec.config.tied, schedule.n_stages)
        tied = TiedGradients.for_rank(spec.config, schedule, spec.pp_rank(rank), spec.op_timeout, group)
        if self.place:
            for stage in self.stages.values():
                parallelize_stage(stage, self.place.device_mesh, spec.mesh, collectives)
        if spec.impl == "torch":
            from pplab.rank.torch_pp import TorchRankRuntime

            self.runtime = TorchRankRuntime(schedule, rank, self.stages, self.device,
                                            spec.timing, group, spec.record, self.place, collectives, tied)
        else:  # (a mesh here has pp only: Mesh.check refuses dp and tp without torch's schedules)
            self.runtime = RankRuntime(schedule, rank, self.stages, self.device, spec.op_timeout,
                                       spec.record, spec.timing, group, tied)
        make_first_calls()

    def parameters(self):
        """All parameters of this rank's stages (a weight two of them tie, once)."""
        return list({id(p): p for stage in self.stages.values() for p in stage.parameters()}.values())

    def named_parameters(self):
        """(full-model name, parameter) for this rank's stages."""
        return [item for stage in self.stages.values() for item in stage.named_parameters()]

    def zero_grad(self) -> None:
        """Forget the previous step's gradients."""
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=True)

    def share(self, batch: Batch | Sequence[Batch]) -> dict:
        """This rank's share of a whole batch: what `split_for_ranks` gives it, ready for `step`."""
        return split_for_ranks(self.spec, batch)[self.rank]

    def step(self, data: dict, zero_grad: bool = True, return_grads: bool = False,
             watch=None, number: int = 0) -> RankStep:
        """One step on this rank with the data `split_for_ranks` prepared for it (`watch`: see
        RankRuntime.step);
        `number`: which step of a run it is (a model that drops draws new masks at each: training's step)."""
        if zero_grad:
            self.zero_grad()
        # On a dp mesh, microbatches are numbered within the whole batch: the events a watcher is
        # told as the ones a result carries.
        first = self.place.first_microbatch(self.spec.schedule.n_microbatches) if self.place else 0
        numbered = watch if watch is None or not first else (
            lambda item: watch(_renumbered(item, first) if isinstance(item, Event) else item))
        with dropout_streams.step(self.spec.seed, number, first):  # as one device draws them
            result = self.runtime.step(data.get("inputs"), data.get("targets"),
                                       data.get("activation_shapes"), return_grads, numbered)
        if first:
            result.losses_by_microbatch = {first + mb: loss
                                           for mb, loss in result.losses_by_microbatch.items()}
            result.boundary_shapes = [dataclasses.replace(b, microbatch=first + b.microbatch)
                                      for b in result.boundary_shapes]
            result.events = [_renumbered(e, first) for e in result.events]
        return result


def parameters_in(stage, dtype: torch.dtype) -> None:
    """The stage's parameters in `dtype`; its buffers (RoPE's frequencies) stay as precise as they are."""
    for module in stage.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                module._parameters[name] = torch.nn.Parameter(parameter.detach().to(dtype),
                                                               parameter.requires_grad)


def _renumbered(event: Event, first: int) -> Event:
    """The event with its microbatch counted from `first` (a dp replica's share of the batch)."""
    return (event if event.microbatch is None
            else dataclasses.replace(event, microbatch=first + event.microbatch))


def split_for_ranks(spec: PipelineSpec, batch: Batch | Sequence[Batch],
                    handshake: bool | None = None) -> list[dict]:
    """Per rank, the data it needs: token ids where stage 0 is, targets where the last stage is.

    The microbatches are checked here, on the client, so that bad data fails before any
    rank waits for a neighbour. When every microbatch has the same shape the receivers are
    told the activation shape and skip the handshake (unless `handshake=True`); otherwise
    they learn each shape from a header.
    """
    schedule = spec.schedule
    m, replicas = schedule.n_microbatches, spec.replicas
    if replicas > 1:  # say it in terms of the mesh
        whole = isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)
        if whole and batch[0].shape[0] % (m * replicas):
            raise ValueError(f"a batch of {batch[0].shape[0]} sequences does not split into dp={replicas} "
                             f"pipelines x {m} microbatches: give a batch size that is a multiple of "
                             f"{m * replicas}")
        if not whole and len(batch) != m * replicas:
            raise ValueError(f"{len(batch)} microbatches were given, but dp={replicas} pipelines of {m} "
                             f"microbatches take {m * replicas}: give that many, or one whole batch")
    microbatches = as_microbatches(batch, m * replicas)
    for index, (input_ids, target_ids) in enumerate(microbatches):
        check_microbatch(spec.config, index, input_ids, target_ids)
    fixed = len({tuple(ids.shape) for ids, _ in microbatches}) == 1 and handshake is not True
    activation_shapes = ([(*ids.shape, spec.config.hidden_size) for ids, _ in microbatches]
                         if fixed else None)
    per_rank = []
    for rank in range(spec.world_size):
        stages = schedule.stages_of(spec.pp_rank(rank))
        replica = spec.mesh.coordinates(rank)["dp"] if spec.mesh else 0
        share = microbatches[replica * m:(replica + 1) * m]  # each dp replica its own microbatches
        per_rank.append(dict(
            inputs=[ids for ids, _ in share] if 0 in stages else None,
            targets=[t for _, t in share] if schedule.n_stages - 1 in stages else None,
            activation_shapes=activation_shapes and activation_shapes[replica * m:(replica + 1) * m]))
    return per_rank


def check_microbatch(config: LlamaConfig, index: int, input_ids: torch.Tensor,
                     target_ids: torch.Tensor) -> None:
    """Token ids and targets a model with `config` can take, or a ValueError naming the problem."""
    where = f"microbatch {index}"
    if input_ids.dtype != torch.int64 or target_ids.dtype != torch.int64:
        raise ValueError(f"{where}: token ids and targets must be int64 tensors, got "
                         f"{input_ids.dtype} and {target_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape != target_ids.shape:
        raise ValueError(f"{where}: input_ids {tuple(input_ids.shape)} and target_ids "
                         f"{tuple(target_ids.shape)} must both be [batch, seq] of the same shape")
    if input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"{where}: sequence length {input_ids.shape[1]} exceeds "
                         f"max_position_embeddings={config.max_position_embeddings}; use shorter "
                         f"sequences or a larger config")
    if hasattr(config, "check_microbatch_shape"):  # a traced model runs the shape it was traced at
        config.check_microbatch_shape(input_ids.shape)
    for name, ids, allowed in (("token id", input_ids, ()), ("target id", target_ids, (IGNORE_INDEX,))):
        bad = ids[(ids < 0) | (ids >= config.vocab_size)]
        bad = bad[~torch.isin(bad, torch.tensor(allowed, dtype=torch.int64))]
        if bad.numel():
            raise ValueError(f"{where}: a {name} {int(bad[0])} is outside the vocabulary "
                             f"0..{config.vocab_size - 1} (vocab_size={config.vocab_size}); check "
                             f"the tokenizer and the config")


def run_jobs_on_rank(rank: int, world_size: int, jobs: Sequence[tuple[PipelineSpec, list[dict]]],
                     return_grads: bool = True, device="cpu", steps: int | None = None) -> list:
    """For each (spec, per-rank data) job, build this rank's stages and run one step (or `steps` steps).

    The entry point for plain processes (`pplab.drivers.local.run_ranks`) and torchrun scripts.
    Without `steps`, one RankStep per job; with `steps=n`, per job a list of n RankSteps
    on the same stages (gradients zeroed before each): with no optimizer every step must
    repeat the first, so anything one step leaks into the next shows.
    """
    if steps is not None:
        check_positive_int("steps", steps, example=2)
    results = []
    for spec, data in jobs:
        if spec.world_size != world_size:
            raise ValueError(f"the pipeline is for {spec.world_size} ranks but "
                             f"world_size={world_size}")
        pipeline = RankPipeline(spec, rank, device)
        job_steps = [pipeline.step(data[rank], return_grads=return_grads) for _ in range(steps or 1)]
        results.append(job_steps if steps is not None else job_steps[0])
    return results
