"""Pipeline parallelism as one dimension of a DeviceMesh, with FSDP2 (dp) and tensor parallelism (tp).

Real training runs PP beside data and tensor parallelism. `Mesh` says how many ranks each
dimension has and how the global ranks are laid out: row-major over ("pp", "dp", "tp"), so
tp varies fastest (TP ranks talk inside every block: they belong closest, on one host's
fastest links) and pp slowest (a pipeline hop moves one activation per microbatch: it may
cross hosts). Each rank is one (pp, dp, tp) coordinate; the ranks that share dp and tp form
one pipeline, those that share pp and tp one FSDP group, those that share pp and dp one TP group.

`parallelize_stage` applies the production recipe to one stage module, in this order:

1. tensor parallelism (`apply_tensor_parallel`), first, because it must see the raw blocks;
2. activation checkpointing (`apply_activation_checkpointing`), per block;
3. FSDP2 (`apply_fsdp`), per block and then the stage root, with reshard_after_forward=False.

torch's pipeline schedules know FSDP: they keep gradients unreduced across a step's
microbatches and reduce-scatter once after the last backward. pplab's hand-written runtime
does not, so a mesh with dp or tp needs `impl="torch"` (refused otherwise, before any rank
starts). `CollectiveLog` records the collectives of dp and tp as timeline events beside the
pipeline's compute and P2P; `memory_held` counts the bytes a rank holds. Floor 3: torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pplab.base.arguments import check_positive_int
from pplab.base.formatting import html_table, text_table
from pplab.models.llama import LlamaConfig, LlamaModel
from pplab.rank.memory import SavedBytes
from pplab.rank.shards import local_tensor
from pplab.trace.timeline import Event

__all__ = ["MeshPlace", "parallelize_stage", "apply_tensor_parallel", "apply_activation_checkpointing",
           "apply_fsdp", "communicated_bytes", "all_gathers_per_unit"]

MESH_DIMS = ("pp", "dp", "tp")  # outermost first: the order of the global rank layout


@dataclass(frozen=True)
class Mesh:
    """The sizes of the pipeline (pp), FSDP (dp) and tensor-parallel (tp) dimensions, and the
    per-stage options: activation checkpointing, FSDP's resharding and mixed precision."""

    pp: int
    dp: int = 1
    tp: int = 1
    activation_checkpointing: bool = False
    reshard_after_forward: bool = False  # True re-gathers the parameters for every microbatch
    mixed_precision: bool = False  # bf16 parameters and compute, fp32 gradient reduction (needs dp >= 2)

    def __post_init__(self):
        for name in MESH_DIMS:
            check_positive_int(f"mesh {name}", getattr(self, name), example=2)
        for name in ("activation_checkpointing", "reshard_after_forward", "mixed_precision"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: give True or False")
        for name in ("reshard_after_forward", "mixed_precision"):
            if getattr(self, name) and self.dp < 2:
                raise ValueError(f"{name}=True is an FSDP option, but the mesh has dp={self.dp}: "
                                 f"give the mesh a dp dimension of 2 or more, or leave {name} out")

    @classmethod
    def of(cls, mesh: "Mesh | Mapping[str, int]") -> "Mesh":
        """A `Mesh`, or one made from a dict of sizes such as {"pp": 2, "dp": 2}."""
        if isinstance(mesh, Mesh):
            return mesh
        if not isinstance(mesh, Mapping):
            raise ValueError(f"mesh={mesh!r}: give sizes by name, e.g. mesh={{'pp': 2, 'dp': 2}}, "
                             f"or a pplab.rank.mesh.Mesh")
        options = [f.name for f in fields(cls)]
        unknown = sorted(set(mesh) - set(options))
        if unknown:
            raise ValueError(f"mesh has unknown dimensions {unknown}: use {', '.join(MESH_DIMS)} "
                             f"(pipeline, FSDP data parallel, tensor parallel) and the options "
                             f"{', '.join(options[len(MESH_DIMS):])}")
        if "pp" not in mesh:
            raise ValueError(f"mesh={dict(mesh)} has no 'pp' dimension: say how many pipeline "
                             f"stages (ranks) a pipeline has, e.g. {{'pp': 2, **{dict(mesh)}}}")
        return cls(**mesh)

    @property
    def sizes(self) -> dict[str, int]:
        """{"pp": .., "dp": .., "tp": ..}, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int:
        """The number of ranks the mesh spans."""
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """The (pp, dp, tp) coordinate of global rank `rank`."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is not a rank of this mesh: use 0..{self.world_size - 1}")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def rank_of(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        """The global rank at coordinate (pp, dp, tp)."""
        for name, index in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not isinstance(index, int) or not 0 <= index < self.sizes[name]:
                raise ValueError(f"{name}={index!r} is outside this mesh: use 0..{self.sizes[name] - 1}")
        return (pp * self.dp + dp) * self.tp + tp

    def label(self, rank: int) -> str:
        """'rank 3 · pp1 dp1': the rank and its coordinate in the dimensions bigger than one."""
        where = " ".join(f"{name}{index}" for name, index in self.coordinates(rank).items()
                         if self.sizes[name] > 1)
        return f"rank {rank} · {where}"

    def check(self, config: LlamaConfig, n_ranks: int, impl: str) -> None:
        """Raise a ValueError (before any rank starts) if this mesh cannot run `config` on `n_ranks`."""
        if self.world_size != n_ranks:
            product = " x ".join(f"{name}={size}" for name, size in self.sizes.items())
            raise ValueError(f"the mesh {product} spans {self.world_size} ranks but the lab has "
                             f"{n_ranks}: make the sizes multiply to {n_ranks}")
        for what, count in (("num_attention_heads", config.num_attention_heads),
                            ("num_key_value_heads", config.num_key_value_heads),
                            ("intermediate_size", config.intermediate_size)):
            if count % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {what}={count}: each TP rank must "
                                 f"hold whole heads and an equal slice of the MLP; choose tp among "
                                 f"{_divisors_of_all(config)}")
        if impl != "torch" and (self.dp > 1 or self.tp > 1):
            raise ValueError(f"impl={impl!r}: pplab's hand-written runtime runs a pipeline with "
                             f"activation checkpointing but not FSDP or TP (it does not unshard "
                             f"before a step's first forward nor reduce-scatter after its last "
                             f"backward); use impl='torch', whose schedules do")

    def table(self) -> list[list]:
        """One row per global rank: rank, pp, dp, tp."""
        return [[rank, *self.coordinates(rank).values()] for rank in range(self.world_size)]

    def __str__(self) -> str:
        return (f"mesh pp={self.pp} x dp={self.dp} x tp={self.tp} ({self.world_size} ranks, tp varies "
                f"fastest)\n" + text_table(["rank", "pp", "dp", "tp"], self.table(), right=True))

    def _repr_html_(self) -> str:
        return html_table(["rank", "pp", "dp", "tp"], self.table(), str(self).splitlines()[0])


def _divisors_of_all(config: LlamaConfig) -> list[int]:
    """The tp sizes that divide the query heads, the KV heads and the MLP width."""
    return [d for d in range(1, config.num_key_value_heads + 1)
            if not (config.num_attention_heads % d or config.num_key_value_heads % d
                    or config.intermediate_size % d)]


# torch's DeviceMesh of each shape this rank process has used, with the default group it was made
# in: (device type, sizes) -> (default group, mesh). Made once and shared by every pipeline of that
# shape. A mesh made per pipeline leaked its process groups: DTensor's caches keep every mesh alive,
# and each gloo group keeps a thread that wakes every few milliseconds (30 idle groups on two
# ranks took 6 % of a core; the suite's long-lived ranks held up to 27 each).
_DEVICE_MESHES: dict[tuple, tuple] = {}


def _device_mesh(device_type: str, sizes: tuple[int, ...]):
    """The DeviceMesh of `sizes` over the current process group, made on first use (every rank
    of the group together, as each builds its pipeline) and then kept."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.distributed_c10d._get_default_group()
    if any(made_in is not world for made_in, _ in _DEVICE_MESHES.values()):
        _DEVICE_MESHES.clear()  # the process group was made again: the old meshes' groups are gone
    key = (device_type, sizes)
    if key not in _DEVICE_MESHES:
        _DEVICE_MESHES[key] = world, init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    return _DEVICE_MESHES[key][1]


class MeshPlace:
    """One rank's place in a mesh: its coordinate, torch's DeviceMesh and its pipeline's group."""

    def __init__(self, mesh: Mesh, rank: int, device: torch.device):
        """Take torch's DeviceMesh (dimensions named pp, dp, tp): every rank must call this together."""
        if dist.get_world_size() != mesh.world_size:
            raise ValueError(f"the mesh spans {mesh.world_size} ranks but the process group has "
                             f"{dist.get_world_size()}: start {mesh.world_size} ranks, or give a mesh "
                             f"whose sizes multiply to {dist.get_world_size()}")
        self.mesh, self.rank = mesh, rank
        self.coordinates = mesh.coordinates(rank)
        self.device_mesh = _device_mesh(torch.device(device).type, tuple(mesh.sizes.values()))

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline."""
        return self.coordinates["pp"]

    @property
    def pp_group(self):
        """The process group of this rank's pipeline (same dp and tp, every pp)."""
        return self.device_mesh["pp"].get_group()

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of stage rank `pp_rank` of this rank's pipeline."""
        return self.mesh.rank_of(pp_rank, self.coordinates["dp"], self.coordinates["tp"])

    def first_microbatch(self, n_microbatches: int) -> int:
        """The global number of this pipeline's microbatch 0 (dp replica d runs d*m .. d*m+m-1)."""
        return self.coordinates["dp"] * n_microbatches


# --- the recipe, one step at a time -------------------------------------------------------------


def parallelize_stage(stage: LlamaModel, device_mesh, mesh: Mesh, log: "CollectiveLog | None" = None
                      ) -> LlamaModel:
    """Apply TP, then activation checkpointing, then FSDP2 to one stage module (in place).

    The order matters. TP replaces the blocks' linear weights by DTensors sharded over the tp
    ranks, so it must see the raw modules; activation checkpointing then makes each block
    recompute its forward during its backward; FSDP2 comes last, outermost, so that its
    all-gather (before a block runs) and reduce-scatter (after its gradients exist) wrap
    everything the block does, recomputation included, and so that it shards the DTensors TP
    made (2-D parameters: sharded over dp, and over tp inside).
    """
    if mesh.tp > 1:
        apply_tensor_parallel(stage, device_mesh["tp"])
    if mesh.activation_checkpointing:
        apply_activation_checkpointing(stage)
    if mesh.dp > 1:
        apply_fsdp(stage, device_mesh["dp"], mesh.reshard_after_forward, mesh.mixed_precision, log)
    return stage


def apply_tensor_parallel(stage: LlamaModel, tp_mesh) -> None:
    """Megatron-style TP per block: q, k, v, gate and up split by output columns, o and down by
    input rows, so each block needs one all-reduce after attention and one after the MLP.

    Column-wise q/k/v give each TP rank whole heads: query heads 0..H/tp-1 and the KV heads
    they share on rank 0, and so on, so grouped-query attention stays inside a rank. RoPE
    rotates within a head, so it needs no change. The embedding, the norms and the LM head
    stay replicated (a 128-token vocabulary is not worth sharding; large models shard the
    head and compute a loss-parallel cross entropy).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    tp = tp_mesh.size()
    for layer in stage.layers.values():
        parallelize_module(layer, tp_mesh, plan)
        # The projections now return this rank's heads only: attention must reshape to them.
        layer.self_attn.n_heads //= tp
        layer.self_attn.n_kv_heads //= tp


def apply_activation_checkpointing(stage: LlamaModel) -> None:
    """Keep only each block's input for backward, and recompute the block's forward there.

    torch's composable `checkpoint` hooks the module instead of wrapping it, so parameter
    names (and checkpoints) stay those of the full model.
    """
    from torch.distributed._composable import checkpoint

    for layer in stage.layers.values():
        checkpoint(layer)
        layer.register_forward_pre_hook(_count_kept_input)


def _count_kept_input(layer, args) -> None:
    """A checkpointed block keeps its input for the recomputation: count it as saved."""
    if SavedBytes.current is not None and torch.is_grad_enabled():
        for tensor in args:
            if isinstance(tensor, torch.Tensor):
                SavedBytes.current.keep(tensor)


def apply_fsdp(stage: LlamaModel, dp_mesh, reshard_after_forward: bool = False,
               mixed_precision: bool = False, log: "CollectiveLog | None" = None) -> None:
    """FSDP2 per block, then the stage root (which takes the embedding, final norm and head).

    Each block is one all-gather unit, so only one block's full weights need exist at a time
    (between steps every rank holds 1/dp of them). `reshard_after_forward=False` keeps the
    gathered weights from a microbatch's forward to its backward and to the next
    microbatches: a pipeline runs several microbatches through a stage per step, and
    resharding would repeat the all-gather for each. With `mixed_precision`, weights are
    gathered and used in bf16 while the gradients are reduced, and kept, in fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in stage.layers.values():
        fully_shard(layer, **options)
    fully_shard(stage, **options)
    if log is not None:
        for module in [*stage.layers.values(), stage]:
            module.set_custom_all_gather(_RecordedAllGather(log))
            module.set_custom_reduce_scatter(_RecordedReduceScatter(log))


# --- collectives on the timeline -------------------------------------------------------------------


class CollectiveLog:
    """The dp and tp collectives one rank ran in a step, as timeline events on the step's clock.

    FSDP's all-gathers and reduce-scatters come through FSDP's custom-communication hooks;
    TP's all-reduces through a dispatch mode (`tensor_parallel_mode`) around the step.
    With gloo (CPU) a recorded collective completes before the rank goes on, so each event's
    length is that collective's whole time (gloo overlaps little anyway). With NCCL a
    collective runs on a stream of its own: on the step's device clock (real mode) an event
    runs from when the compute stream reached the collective to when it could go on. A
    collective's bytes are those of
    its full buffer: the gathered parameters, the gradients before scattering, the
    all-reduced activation.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.clock = None  # set for the length of a step
        self.watch = None
        self.events: list[Event] = []

    def start(self, clock, watch=None) -> None:
        """Record from now on, on `clock` (seconds since the step began)."""
        self.clock, self.watch, self.events = clock, watch, []

    def stop(self) -> list[Event]:
        """Stop recording; the events of the step."""
        self.clock = None
        return self.events

    @contextlib.contextmanager
    def timed(self, kind: str, nbytes: int):
        """Time one collective (nothing is kept outside a step)."""
        clock = self.clock
        started = clock() if clock is not None else 0.0
        yield
        if clock is not None:
            event = Event(self.rank, kind, None, None, started, clock(), bytes=int(nbytes))
            self.events.append(event)
            if self.watch is not None:
                self.watch(event)

    def tensor_parallel_mode(self):
        """A dispatch mode that records (and completes) TP's functional collectives."""
        return _TensorParallelCollectives(self)


class _RecordedAllGather:
    """FSDP's all-gather, run to completion and recorded (FSDP's custom-comm interface)."""

    def __init__(self, log: CollectiveLog):
        self.log = log

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        with self.log.timed("ALL_GATHER", output_tensor.numel() * output_tensor.element_size()):
            dist.all_gather_single(output_tensor, input_tensor, group=group)
        return None  # done: FSDP waits on no work


class _RecordedReduceScatter:
    """FSDP's reduce-scatter, run to completion and recorded."""

    def __init__(self, log: CollectiveLog):
        self.log = log

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        with self.log.timed("REDUCE_SCATTER", input_tensor.numel() * input_tensor.element_size()):
            dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group)
        return None


_FUNCTIONAL_COLLECTIVES = {"all_reduce": "ALL_REDUCE", "all_gather_into_tensor": "ALL_GATHER",
                           "reduce_scatter_tensor": "REDUCE_SCATTER"}


class _TensorParallelCollectives(TorchDispatchMode):
    """Records TP's functional collectives (DTensor's redistributions) as they are dispatched."""

    def __init__(self, log: CollectiveLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _FUNCTIONAL_COLLECTIVES.get(func._opname) if func.namespace == "_c10d_functional" else None
        if kind is None:
            return func(*args, **kwargs)
        tensor = args[0]
        # An all-gather's buffer is its output: group_size (its second argument) inputs.
        buffer = tensor.numel() * tensor.element_size() * (args[1] if kind == "ALL_GATHER" else 1)
        with self.log.timed(kind, buffer):
            # Wait here, so the event is the collective's time (the later wait finds it done).
            return torch.ops._c10d_functional.wait_tensor(func(*args, **kwargs))


# --- what a rank holds ---------------------------------------------------------------------------


def _bytes(tensors) -> int:
    return sum(local.numel() * local.element_size() for local in map(local_tensor, tensors))


def memory_held(modules, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for `modules`: parameters, gradients, optimizer state (its shards),
    and the parameters' unsharded size (what the rank would hold without dp and tp)."""
    parameters = [p for module in modules for p in module.parameters()]
    state = [] if optimizer is None else [value for per_param in optimizer.state.values()
                                          for value in per_param.values()
                                          if isinstance(value, torch.Tensor) and value.dim() > 0]
    return dict(parameters=_bytes(parameters),
                gradients=_bytes(p.grad for p in parameters if p.grad is not None),
                optimizer=_bytes(state),
                unsharded_parameters=sum(p.numel() * p.element_size() for p in parameters))


def optimizer_state_bytes(modules) -> int:
    """The bytes of AdamW's state for these modules' parameters, measured: a real AdamW takes one
    step with lr=0 (its state is allocated, the weights do not change), then is dropped."""
    parameters = [p for module in modules for p in module.parameters() if p.grad is not None]
    if not parameters:
        raise ValueError("no parameter has a gradient yet: run a step first, then measure")
    optimizer = torch.optim.AdamW(parameters, lr=0.0, weight_decay=0.0, foreach=False)
    optimizer.step()
    held = memory_held(modules, optimizer)["optimizer"]
    del optimizer
    return held


# --- what a step communicates, measured and in theory ----------------------------------------------


def communicated_bytes(rank_steps, schedule, mesh: Mesh | None = None) -> list[dict[str, int]]:
    """Per rank (`rank_steps` ordered by rank), the bytes its step moved in each dimension: pp
    (the activations it sent on and the gradients it sent back), dp (FSDP's all-gathers and
    reduce-scatters) and tp (all-reduces: the only collective TP issues in `apply_tensor_parallel`).

    A collective counts its full buffer (see `CollectiveLog`), the volume the formulas in
    bench/bench_mesh.py predict; what crosses the wire depends on the algorithm (a ring
    all-gather sends (n-1)/n of its buffer from each rank, a ring all-reduce 2(n-1)/n).
    """
    mesh = mesh or Mesh(pp=schedule.n_ranks)
    per_rank = []
    for step in rank_steps:
        where = mesh.coordinates(step.rank)
        row = {"pp": sum(b.bytes for b in step.boundary_shapes), "dp": 0, "tp": 0}  # activations sent on
        for stage in schedule.stages_of(where["pp"]):
            if stage > 0:  # the gradient of each activation it received goes back, as large
                sender = mesh.rank_of(schedule.stage_to_rank(stage - 1), where["dp"], where["tp"])
                row["pp"] += sum(b.bytes for b in rank_steps[sender].boundary_shapes if b.source == stage - 1)
        for event in step.events:
            if event.kind in ("ALL_GATHER", "REDUCE_SCATTER"):
                row["dp"] += event.bytes or 0
            elif event.kind == "ALL_REDUCE":
                row["tp"] += event.bytes or 0
        per_rank.append(row)
    return per_rank


def all_gathers_per_unit(schedule, stage: int, reshard_after_forward: bool) -> int:
    """How often torch's schedules all-gather each FSDP unit (block or root) of `stage` in a step.

    A unit starts the step sharded, and a forward or backward that finds it sharded gathers
    it. After a backward it stays gathered (the schedules reshard once, after the step's last
    backward); after a forward only with `reshard_after_forward=False`. So False gathers once
    per step, and True once more for every action that directly follows a forward. (Split
    backwards, I and W, are not covered: refused.)
    """
    actions = [a for a in schedule.actions[schedule.stage_to_rank(stage)]
               if a.stage == stage and a.is_compute]
    if any(a.kind.value not in ("F", "B") for a in actions):
        raise ValueError(f"{schedule.name!r} splits backwards into I and W: this count covers "
                         f"schedules with whole backwards (F and B) only")
    count, sharded = 0, True
    for action in actions:
        count += sharded
        sharded = reshard_after_forward and action.kind.value == "F"
    return count


def __getattr__(name: str):
    """Names that moved up to the client's floor (pplab.base.renames), served one more release."""
    from pplab.base.renames import renamed_attribute, resolve

    row = renamed_attribute("pplab.rank.mesh", name)
    if row is not None:
        return resolve(row.new)
    raise AttributeError(f"module 'pplab.rank.mesh' has no attribute {name!r}")
