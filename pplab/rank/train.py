"""Training a pipelined model: the same loop on lab engines, under torchrun, or in local processes.

Every rank runs `RankTrainer.train` together. A step is one pipeline step (either
implementation) followed by what a pipeline must do across its ranks:

- the loss is known on the last stage only: it is broadcast, so every rank reports it;
- gradient clipping uses the *global* norm. Each rank computes the norm of each of its
  parameters' gradients, the ranks sum them into one vector ordered like the full
  model's parameters (each slot filled by its one owner, so the sum is exact), and the
  total is computed from that vector exactly as `torch.nn.utils.clip_grad_norm_` does on
  one device. Clipping each stage by its own norm, as some walkthroughs do, scales the
  stages differently and is not the single-device update. On a mesh a parameter is spread
  over its dp and tp ranks (FSDP shards, TP shards, or whole copies: norms, embedding and
  head under TP): each rank adds the squares of the elements only it counts, so that every
  element of the model is counted exactly once, and one all-reduce over all ranks sums them;
- AdamW and the LR schedule (linear warm-up, then cosine decay to `min_lr`) step locally.

The data is a pure function of (seed, position): every rank draws the same global batch
and keeps its share (on a mesh each dp replica its own microbatches of it), and a resumed
run continues at the saved position. The step's loss is the mean over the whole batch. Evaluation runs
the stages forward only, microbatch by microbatch, on held-out text.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from pplab._version import __version__
from pplab.base.config import TrainOptions
from pplab.data import HELDOUT_FRACTION, batches
from pplab.models.llama import loss_fn
from pplab.models.partition import layer_ranges
from pplab.rank.checkpoint import Checkpointer, rank_module
from pplab.rank.host_messages import HOST, from_host, messages_through_host, to_host
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline
from pplab.rank.reference import as_microbatches
from pplab.trace.timeline import Event, Now

__all__ = ["TrainOptions", "train_batch"]


def lr_factor(options: TrainOptions, step_index: int) -> float:
    """The LR of step `step_index` (0-based) as a fraction of options.lr: warm-up, then cosine."""
    if step_index < options.warmup:
        return (step_index + 1) / options.warmup
    progress = min(1.0, (step_index - options.warmup) / max(1, options.steps - options.warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return (options.min_lr + (options.lr - options.min_lr) * cosine) / options.lr


def make_optimizer(named_parameters, options: TrainOptions):
    """AdamW (decay on matrices only) and its LR schedule; the same for a stage and the full model."""
    named = list(named_parameters)
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": options.weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=options.lr,
                                  betas=tuple(options.betas), eps=options.eps, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, options))
    return optimizer, scheduler


@dataclass
class TrainRecord:
    """One step as every rank saw it."""

    step: int
    loss: float
    lr: float                   # the LR this step used
    grad_norm: float            # global, before clipping
    seconds: float
    eval_loss: float | None = None
    checkpoint: str | None = None


@dataclass
class TrainHistory:
    """The records of a `train` call, and where it left off."""

    records: list[TrainRecord] = field(default_factory=list)
    resumed_from: str | None = None

    @property
    def losses(self) -> list[float]:
        """The training loss of each step."""
        return [r.loss for r in self.records]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        """(step, held-out loss) of each evaluation."""
        return [(r.step, r.eval_loss) for r in self.records if r.eval_loss is not None]


class RankTrainer:
    """One rank's optimizer, schedule and checkpoints around its `RankPipeline`."""

    def __init__(self, pipeline: RankPipeline, options: TrainOptions, group=None,
                 checkpoint_group=None):
        """`checkpoint_group`: the checkpoints' own process group (made here for async saves if not given)."""
        spec, schedule = pipeline.spec, pipeline.spec.schedule
        options.check(schedule.n_microbatches, replicas=spec.replicas)
        _check_every_rank_has_parameters(spec)
        self.pipeline, self.options, self.place = pipeline, options, pipeline.place
        # The pipeline's own ranks (on a mesh: those that share this rank's dp and tp coordinates).
        self.group = group if group is not None or self.place is None else self.place.pp_group
        self.rank = pipeline.rank
        self.pp_rank = spec.pp_rank(self.rank)  # its place in its pipeline (the global rank without a mesh)
        self.module = rank_module(pipeline.stages)
        self.optimizer, self.scheduler = make_optimizer(self.module.named_parameters(), options)
        # the full model's order
        self.slot = {name: index for index, name in enumerate(spec.config.parameter_names())}
        self.step = 0            # steps done
        self.data_position = 0   # batches consumed
        self.checkpointer = None
        self._own_group = None  # a process group made here, destroyed by close()
        if options.checkpoint_dir is not None:
            if options.async_save and checkpoint_group is None and dist.is_initialized():
                # An async save writes from a thread: its collectives need a process group of their own.
                checkpoint_group = self._own_group = dist.new_group(backend="gloo")
            self.checkpointer = Checkpointer(options.checkpoint_dir, self.rank, options.keep,
                                             options.async_save, checkpoint_group)
        self.resumed_from = None
        if options.resume is not None:
            self.load(options.checkpoint_dir if options.resume == "latest" else options.resume)

    # --- one step -----------------------------------------------------------------------

    def train_step(self, watch: Callable[[Event | Now], None] | None = None) -> TrainRecord:
        """One optimizer step on the next batch (`watch` is told what the step
        does, as in RankPipeline.step)."""
        started = time.perf_counter()
        batch = train_batch(self.options, self.data_position)
        lr = self.optimizer.param_groups[0]["lr"]
        rank_step = self.pipeline.step(self.pipeline.share(batch), watch=watch, number=self.step)
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.data_position += 1
        loss = self._over_replicas(self._from_last_stage(rank_step.losses_by_microbatch))
        return TrainRecord(self.step, loss, lr, grad_norm, time.perf_counter() - started)

    def clip_gradients(self) -> float:
        """The global gradient norm (what one device would compute); gradients clipped to options.clip."""
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        # A tied weight's second copy (its gradient already summed with the first's) is not counted
        # again: one device holds it once.
        grads = [(self.slot[name], p.grad) for name, p in self.module.named_parameters()
                 if p.grad is not None and name in self.slot]
        norms = torch.zeros(len(self.slot), dtype=torch.float32, device=self.pipeline.device)
        if self.place is None:
            for slot, grad in grads:
                norms[slot] = torch.linalg.vector_norm(grad, 2.0)
            if dist.is_initialized():
                dist.all_reduce(norms, group=self.group)  # each slot has one owner: an exact sum
        else:
            for slot, grad in grads:
                norms[slot] = counted_square_sum(grad, self.place.coordinates)
            dist.all_reduce(norms)  # over every rank: each element was counted by exactly one
            norms = norms.sqrt()
        total = torch.linalg.vector_norm(norms, 2.0)
        if not torch.isfinite(total):
            raise FloatingPointError(f"step {self.step + 1}: the global gradient norm is {float(total)}; "
                                     f"lower the learning rate (lr={self.options.lr}) or check the data")
        if self.options.clip is not None:
            torch.nn.utils.clip_grads_with_norm_(parameters, self.options.clip, total, foreach=False)
        return float(total)

    def _from_last_stage(self, losses_by_microbatch: dict[int, float]) -> float:
        """The step's mean loss, known on the last stage's rank, given to every rank."""
        schedule = self.pipeline.spec.schedule
        owner = schedule.stage_to_rank(schedule.n_stages - 1)
        mean = sum(losses_by_microbatch[mb]
                   for mb in sorted(losses_by_microbatch)) / max(1, len(losses_by_microbatch))
        if not dist.is_initialized():
            return mean
        value = torch.tensor([mean if self.pp_rank == owner else 0.0], dtype=torch.float64,
                             device=self.pipeline.device)
        dist.broadcast(value, src=dist.get_global_rank(self.group, owner) if self.group else owner,
                       group=self.group)
        return float(value)

    def _over_replicas(self, loss: float) -> float:
        """The mean loss of the whole batch: each dp replica's mean, averaged (equal shares)."""
        if self.place is None or self.place.mesh.dp == 1:
            return loss
        value = torch.tensor([loss], dtype=torch.float64, device=self.pipeline.device)
        dist.all_reduce(value, group=self.place.device_mesh["dp"].get_group())
        return float(value) / self.place.mesh.dp

    # --- evaluation -----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss on `eval_batches` held-out batches (the same ones every time), forward only."""
        losses = [self._forward_only(batch) for batch in heldout_batches(self.options)]
        if self.place is not None:  # FSDP keeps what a forward gathered until a backward: free it
            reshard(self.pipeline.stages.values())
        return sum(losses) / len(losses)

    def _forward_only(self, batch) -> float:
        """Every microbatch through the stages in order, activations sent to the next stage's rank."""
        spec, schedule = self.pipeline.spec, self.pipeline.spec.schedule
        stages, device = self.pipeline.stages, self.pipeline.device
        op_timeout = timedelta(seconds=spec.op_timeout)
        through_host = messages_through_host(device, self.group)
        wire = HOST if through_host else device  # where a message lives while it travels
        losses, sends = {}, []
        for mb, (input_ids, target_ids) in enumerate(as_microbatches(batch, schedule.n_microbatches)):
            x = None
            for stage in range(schedule.n_stages):
                if schedule.stage_to_rank(stage) != self.pp_rank:
                    continue
                if stage == 0:
                    x = input_ids.to(device)
                elif schedule.stage_to_rank(stage - 1) != self.pp_rank:
                    x = torch.empty((*input_ids.shape, spec.config.hidden_size), device=wire,
                                    dtype=self._activation_dtype(stages[stage]))
                    self._peer(dist.irecv, x, schedule.stage_to_rank(stage - 1)).wait(op_timeout)
                    x = from_host(x, device) if through_host else x
                x = stages[stage](x)
                if stage == schedule.n_stages - 1:
                    losses[mb] = float(loss_fn(x, target_ids.to(device)))
                elif schedule.stage_to_rank(stage + 1) != self.pp_rank:
                    # (the sent tensor stays alive in the send's work until it is waited for)
                    sends.append(self._peer(dist.isend, to_host(x) if through_host else x,
                                            schedule.stage_to_rank(stage + 1)))
        for send in sends:
            send.wait(op_timeout)
        return self._from_last_stage(losses)

    def _activation_dtype(self, stage) -> torch.dtype:
        """What a stage's forward passes on: bf16 under FSDP's mixed precision, else its parameters'."""
        mesh = self.pipeline.spec.mesh
        return torch.bfloat16 if mesh and mesh.mixed_precision else next(stage.parameters()).dtype

    def _peer(self, operation, tensor, rank: int):
        if self.group is None:
            return operation(tensor, rank)
        return operation(tensor, group=self.group, group_dst=rank) if operation is dist.isend else \
            operation(tensor, group=self.group, group_src=rank)

    # --- the loop ---------------------------------------------------------------------------

    def train(self, until: int | None = None, on_step: Callable[[TrainRecord], None] | None = None,
              watch: Callable[[Event | Now], None] | None = None) -> TrainHistory:
        """Steps until step `until` (default: options.steps), evaluating and saving as configured.

        `on_step` gets each step's record when the step is done; `watch` what each step does
        while it runs (its events and what the rank starts), for live views.
        """
        until = self.options.steps if until is None else until
        if not isinstance(until, int) or until < self.step:
            raise ValueError(f"until={until!r}: this run has done {self.step} steps; give a step >= "
                             f"{self.step}")
        history = TrainHistory(resumed_from=self.resumed_from)
        while self.step < until:
            record = self.train_step(watch)
            every = self.options.eval_every
            if every and (self.step % every == 0 or self.step == until):
                record.eval_loss = self.evaluate()
            every = self.options.checkpoint_every
            if self.checkpointer and (self.step == until or (every and self.step % every == 0)):
                record.checkpoint = str(self.save())
            history.records.append(record)
            if on_step is not None:
                on_step(record)
        if self.checkpointer:
            self.checkpointer.finish()
        return history

    def close(self) -> None:
        """Destroy the process group this run made for its async saves, if it did (every rank
        closes its run at the same time, as it made it). A gloo group keeps a thread that wakes
        every few milliseconds until it is destroyed."""
        if self._own_group is not None:
            dist.destroy_process_group(self._own_group)
            self._own_group = None

    # --- checkpoints ----------------------------------------------------------------------

    def save(self):
        """A checkpoint of this step under options.checkpoint_dir (every rank calls it)."""
        if self.checkpointer is None:
            raise ValueError("this run has no checkpoint_dir: give TrainOptions(checkpoint_dir=...)")
        spec = self.pipeline.spec
        manifest = {"pplab": __version__, "torch": torch.__version__,
                    "config": spec.config.record(), "n_stages": spec.schedule.n_stages,
                    "schedule": spec.schedule.name, "impl": spec.impl,
                    "world_size": spec.world_size, "mesh": spec.mesh.sizes if spec.mesh else None,
                    "options": {k: v for k, v in asdict(self.options).items()
                                if k in ("batch_size", "seq_len", "data_seed", "steps", "data", "tokenizer")}}
        train_state = {"step": self.step, "data_position": self.data_position}
        return self.checkpointer.save(self.step, self.module, self.optimizer, self.scheduler,
                                      train_state, manifest)

    def load(self, path) -> None:
        """Continue from a checkpoint (any layout of the same model), whatever this trainer did before.

        Model, optimizer (moments and step counts), scheduler, RNG, gradients (dropped), step
        and data position all become the checkpoint's; on a CheckpointError nothing changes.
        """
        checkpointer = self.checkpointer or Checkpointer(path, self.rank)
        state = checkpointer.load(path, self.module, self.optimizer, self.scheduler,
                                  self.pipeline.spec.config)
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        self.resumed_from = state["path"]


# --- the data ---------------------------------------------------------------------------------


def train_batch(options: TrainOptions, position: int):
    """The run's batch number `position`: random windows of the embedded corpus, or the packed
    sequences of `options.data`, epoch by epoch."""
    if options.data is None:
        return next(batches(options.batch_size, options.seq_len, options.data_seed, split="train",
                            start=position))
    return _packed(options).train_batch(position)


def heldout_batches(options: TrainOptions) -> list:
    """The held-out batches every evaluation uses (the same each time)."""
    if options.data is None:
        return list(batches(options.batch_size, options.seq_len, options.data_seed, split="heldout",
                            steps=options.eval_batches))
    return _packed(options).heldout_batches(options.eval_batches)


def _packed(options: TrainOptions):
    from pplab.data.text import packed_text

    stamp = (_stamp(options.data), _stamp(options.tokenizer) if options.tokenizer != "char" else 0)
    return packed_text(options.data, options.tokenizer, options.seq_len, options.batch_size,
                       options.data_seed,
                       stamp)


def prepare_data(options: TrainOptions, config) -> TrainOptions:
    """The options with their data made ready, on the client before any rank starts: a BPE
    tokenizer trained on the training text (or the one a checkpoint directory already holds)
    and saved beside the checkpoints, the vocabulary checked against the model's, the text
    checked to make whole batches, and `epochs` turned into steps."""
    if options.data is None:
        return options
    from pplab.data.text import PackedText, load_tokenizer, read_documents

    documents = read_documents(options.data)
    if options.tokenizer == "bpe":
        options = replace(options, tokenizer=str(_bpe_tokenizer(options, documents)))
    tokenizer = load_tokenizer(options.tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: build the model with vocab_size={tokenizer.vocab_size}, or "
                         f"train a smaller tokenizer (vocab_size=)")
    packed = PackedText(documents, tokenizer, options.seq_len, options.batch_size, options.data_seed)
    if options.epochs is not None:
        options = replace(options, steps=options.epochs * packed.batches_per_epoch)
    return options


def _bpe_tokenizer(options: TrainOptions, documents: list[str]) -> Path:
    """The tokenizer file of a run with tokenizer="bpe": a resumed run's is the one beside its
    checkpoint; otherwise one is trained on the training text and saved beside the checkpoints
    (or, without a checkpoint_dir, in a temporary folder named after the data and the size, so
    that a later call with the same options finds the same file). A different tokenizer already
    in that place is refused rather than replaced: checkpoints beside it were made with it."""
    from pplab.base.checkpoint_files import resume_path
    from pplab.data.text import TOKENIZER_FILE, BPETokenizer

    if options.resume is not None:
        beside = resume_path(options.resume, options.checkpoint_dir).parent / TOKENIZER_FILE
        if beside.is_file():
            return beside
    if options.checkpoint_dir is not None:
        where = Path(options.checkpoint_dir)
    else:
        key = hashlib.sha256(f"{Path(options.data).resolve()}:{_stamp(options.data)}:{options.vocab_size}"
                             .encode()).hexdigest()[:16]
        where = Path(tempfile.gettempdir()) / f"pplab-tokenizer-{key}"
    path = where / TOKENIZER_FILE
    trained = BPETokenizer.train(_training_part(documents), options.vocab_size)
    if path.is_file():
        if BPETokenizer.load(path).same_as(trained):
            return path
        raise ValueError(f"{str(path)!r} holds another tokenizer (other data or vocab_size), which the "
                         f"checkpoints beside it were made with: resume from them, or give another "
                         f"checkpoint_dir")
    where.mkdir(parents=True, exist_ok=True)
    return trained.save(path)


def _stamp(path: str) -> int:
    """When the data (a file, or the newest file of a folder) last changed, in nanoseconds."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return max((p.stat().st_mtime_ns for p in files), default=0)


def _training_part(documents: list[str]) -> list[str]:
    """What the tokenizer may learn from: the text before the held-out tenth (roughly, by characters)."""
    total = sum(map(len, documents))
    keep, kept = total - int(total * HELDOUT_FRACTION), []
    for document in documents:
        kept.append(document[:max(0, keep)])
        keep -= len(document)
    return [d for d in kept if d]


def counted_square_sum(grad: torch.Tensor, coordinates: dict[str, int]) -> torch.Tensor:
    """The sum of squares of the gradient's elements that this rank counts for the global norm.

    A DTensor's shard is this rank's own where it is sharded (over dp, tp or both);
    where it is replicated, only the copy at coordinate 0 counts. A plain tensor on a mesh
    is a whole copy held by every dp and tp rank: counted at dp 0, tp 0. Summed over all
    ranks, every element of the model is counted exactly once.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    spans = ()
    counted = True
    if isinstance(grad, DTensor):
        if any(isinstance(p, Partial) for p in grad.placements):  # unreduced: reduce it first
            grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                 for p in grad.placements])
        mesh, spans = grad.device_mesh, grad.device_mesh.mesh_dim_names
        # Sharded (Shard, or FSDP's strided shard of a TP shard): this rank's own elements.
        counted = all(mesh.get_local_rank(i) == 0 for i, placement in enumerate(grad.placements)
                      if placement.is_replicate())
        grad = grad.to_local()
    counted = counted and all(index == 0 for name, index in coordinates.items()
                              if name != "pp" and name not in spans)
    if not counted:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    local = grad.float()
    return (local * local).sum()


def reshard(stages) -> None:
    """Free the parameters FSDP gathered for a forward that no backward followed (evaluation)."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _check_every_rank_has_parameters(spec: PipelineSpec) -> None:
    """AdamW needs parameters: a rank of pass-through stages only cannot train (same answer on every rank)."""
    schedule = spec.schedule
    ranges = layer_ranges(spec.config.num_hidden_layers, schedule.n_stages, spec.balance, spec.allow_empty)
    for rank in range(schedule.n_ranks):
        stages = schedule.stages_of(rank)
        if not any(ranges[s][1] > ranges[s][0] or s in (0, schedule.n_stages - 1) for s in stages):
            raise ValueError(f"rank {rank} holds only empty stages {stages} (no parameters), which "
                             f"cannot be trained; use a balance that gives it layers")


class ProgressBar:
    """A terminal progress bar (tqdm) of a training run: steps, loss, LR, held-out loss.

    The bar appears with the first finished step: a run refused before it starts (a damaged
    checkpoint) prints only its error.
    """

    def __init__(self, total_steps: int, first_step: int = 0):
        self.total_steps, self.first_step, self.bar = total_steps, first_step, None

    def add(self, record: TrainRecord, timeline=None) -> None:
        """Show one finished step (`timeline` is ignored: a terminal has no picture)."""
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=self.first_step, desc="training", unit="step")
        extra = {} if record.eval_loss is None else {"eval": f"{record.eval_loss:.3f}"}
        self.bar.set_postfix(loss=f"{record.loss:.3f}", lr=f"{record.lr:.1e}", **extra, refresh=False)
        self.bar.update(record.step - self.bar.n)

    def close(self) -> None:
        """Leave the bar as it ended."""
        if self.bar is not None:
            self.bar.close()


def build_and_train_on_rank(rank: int, world_size: int, spec: PipelineSpec, options: TrainOptions,
                            until: int | None = None, progress: bool = True, device="cpu") -> TrainHistory:
    """Build this rank's stages and train them: the entry point for torchrun and plain processes
    (a session's ranks keep their stages built and train them with `pplab.session.on_rank.train_on_rank`).

    Rank 0 shows a progress bar (tqdm) when `progress` is true.
    """
    if spec.world_size != world_size:
        raise ValueError(f"the pipeline is for {spec.world_size} ranks but world_size={world_size}")
    trainer = RankTrainer(RankPipeline(spec, rank, device), options)
    bar = (ProgressBar(options.steps if until is None else until, trainer.step) if progress and rank == 0
           else None)
    try:
        return trainer.train(until, on_step=bar.add if bar else None)
    finally:
        trainer.close()
        if bar is not None:
            bar.close()


def __getattr__(name: str):
    """`train_on_rank`, the last release's name of `build_and_train_on_rank` (it shared its name with
    the session's `train_on_rank`, which trains stages already built)."""
    from pplab.base.renames import renamed_attribute

    if renamed_attribute("pplab.rank.train", name) is not None:
        return build_and_train_on_rank
    raise AttributeError(f"module 'pplab.rank.train' has no attribute {name!r}")
