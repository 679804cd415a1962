"""A torchtitan job's TOML read as a pplab run, so its schedule, bubble and memory show unretyped.

torchtitan writes a training job as a TOML file of tables ([parallelism], [training],
[optimizer], [lr_scheduler], [checkpoint], [model], ...). `read_torchtitan(path)` maps what pplab
models onto a `RunConfig`: the pipeline's degree, schedule (torch's class name, or the CSV of
`pipeline_parallel_schedule_csv`), microbatches (the local batch over the microbatch size) and
stages per rank; the data-parallel and tensor-parallel degrees; the batch, sequence length,
steps, clipping, optimizer and warm-up. Everything else is kept in `unmodeled`, key by key, and
shown: nothing is dropped silently. A key of a table pplab reads that torchtitan does not have but
that is near one it has (`pipeline_paralel_degree`) is a misspelling that would silently change the
job: refused, with the key meant. A llama3 flavor torchtitan ships (`[model] flavor`) gives the
model's sizes (`model`), from Meta's published Llama 3 configurations.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from pplab.models.llama import LlamaConfig
from pplab.planning.bubble import named_schedule
from pplab.schedules import Schedule, torch_plan
from pplab.schedules.names import schedule_name
from pplab.session.run import RunConfig

__all__ = ["TorchtitanJob", "read_torchtitan"]

# torchtitan's llama3 flavors: (hidden, feed-forward, layers, attention heads, key-value heads, vocabulary).
LLAMA3_FLAVORS = {
    "debugmodel": (256, 768, 6, 16, 16, 2048),
    "8B": (4096, 14336, 32, 32, 8, 128256),
    "70B": (8192, 28672, 80, 64, 8, 128256),
    "405B": (16384, 53248, 126, 128, 8, 128256),
}
# torchtitan's keys in the tables pplab reads (its job config's fields, over its recent releases):
# a key of these tables near one of them is a misspelling.
TORCHTITAN_KEYS = {
    "parallelism": {"data_parallel_replicate_degree", "enable_compiled_autograd",
                    "data_parallel_shard_degree", "fsdp_reshard_after_forward", "tensor_parallel_degree",
                    "disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_degree",
                    "pipeline_parallel_split_points", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                 "steps", "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile",
                 "gc_freq", "gc_debug", "seed", "deterministic"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation",
                  "early_step_in_backward"},
    "lr_scheduler": {"warmup_steps", "decay_ratio", "decay_type", "lr_min", "min_lr_factor"},
    "checkpoint": {"enable", "enable_checkpoint", "folder", "initial_load_path", "initial_load_model_only",
                   "interval", "last_save_model_only", "export_dtype", "create_seed_checkpoint", "async_mode",
                   "keep_latest_k", "load_step", "exclude_from_loading"},
    "model": {"name", "flavor", "tokenizer_path", "hf_assets_path", "converters", "print_after_conversion"},
}
# The schedule classes torchtitan takes with a CSV: the file says the order, not the name.
CSV_RUNTIMES = ("PipelineScheduleSingle", "PipelineScheduleMulti", "_PipelineScheduleRuntime")


@dataclass
class TorchtitanJob:
    """A torchtitan job as pplab reads it: the run, the model's sizes, and what pplab leaves out."""

    path: Path
    config: RunConfig
    model: LlamaConfig | None  # the flavor's sizes, where pplab knows the flavor
    read: dict[str, object] = field(default_factory=dict)  # "table.key" -> value, the ones mapped
    unmodeled: dict[str, object] = field(default_factory=dict)  # "table.key" -> value, shown, not modeled
    notes: list[str] = field(default_factory=list)  # what pplab assumed where the file says nothing

    def schedule(self) -> Schedule:
        """The job's schedule at its sizes: the CSV's, or the one its class name plans."""
        c = self.config
        return c.schedule if isinstance(c.schedule, Schedule) else named_schedule(c.schedule, c.pp,
                                                                                  c.n_microbatches,
                                                                                  c.n_virtual)

    def text(self) -> str:
        """What was read, and every field pplab does not model."""
        c = self.config
        schedule = c.schedule.name if isinstance(c.schedule, Schedule) else c.schedule
        lines = [f"torchtitan job {self.path}: pp={c.pp} x dp={c.dp} x tp={c.tp}, schedule {schedule}, "
                 f"{c.n_microbatches} microbatches, {c.n_virtual} stage(s) per rank; batch {c.batch_size} x "
                 f"{c.seq_len} tokens, {c.steps} steps"]
        if self.model is not None:
            m = self.model
            lines.append(f"  model: {m.num_hidden_layers} layers, {m.hidden_size} wide, "
                         f"{m.num_attention_heads} heads ({m.num_key_value_heads} key-value), "
                         f"vocabulary {m.vocab_size}")
        lines += [f"  note: {note}" for note in self.notes]
        if self.unmodeled:
            lines.append(f"  not modeled by pplab ({len(self.unmodeled)}): " +
                         ", ".join(f"{key} = {value!r}" for key, value in self.unmodeled.items()))
        return "\n".join(lines)


def read_torchtitan(path) -> TorchtitanJob:
    """Read a torchtitan job's TOML (a ValueError naming the file and the key for what cannot be read)."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}; give the path of a torchtitan job's TOML") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not TOML: {error}") from None
    values = {f"{table}.{key}": value for table, keys in document.items() if isinstance(keys, dict)
              for key, value in keys.items()}
    _refuse_misspellings(path, values)
    job = TorchtitanJob(path, RunConfig(), None)
    take = _Taker(values, job)

    job.model = _flavor(take, job)
    options = dict(pp=take("parallelism.pipeline_parallel_degree", 1),
                   tp=take("parallelism.tensor_parallel_degree", 1))
    shard = take("parallelism.data_parallel_shard_degree", -1)
    if shard == -1:
        job.notes.append("data_parallel_shard_degree = -1 takes every rank left, which torchrun's process "
                         "count decides: pplab takes dp=1 (give dp to change it)")
    options["dp"] = max(1, shard)
    for key in ("data_parallel_replicate_degree", "context_parallel_degree", "expert_parallel_degree"):
        take.unless_one(f"parallelism.{key}")
    batch = take("training.local_batch_size", RunConfig.batch_size)
    microbatch = take("parallelism.pipeline_parallel_microbatch_size", 1)
    if batch % microbatch:
        raise ValueError(f"{path}: training.local_batch_size = {batch} is not a multiple of "
                         f"parallelism.pipeline_parallel_microbatch_size = {microbatch}")
    options.update(batch_size=batch, n_microbatches=batch // microbatch,
                   seq_len=take("training.seq_len", RunConfig.seq_len),
                   steps=take("training.steps", RunConfig.steps))
    options.update(_schedule(take, job, options["pp"], options["n_microbatches"]))
    max_norm = take("training.max_norm", RunConfig.clip)
    options["clip"] = max_norm if max_norm and max_norm > 0 else None
    if take.has("training.mixed_precision_param"):
        dtype = take("training.mixed_precision_param")
        if dtype in ("float32", "bfloat16"):
            options["param_dtype"] = dtype
        else:
            job.unmodeled["training.mixed_precision_param"] = dtype
    optimizer = take("optimizer.name", "AdamW")
    if optimizer != "AdamW":
        job.unmodeled["optimizer.name"] = optimizer
        job.notes.append(f"optimizer {optimizer}: pplab trains with AdamW")
    options.update(lr=take("optimizer.lr", RunConfig.lr), eps=take("optimizer.eps", RunConfig.eps),
                   weight_decay=take("optimizer.weight_decay", RunConfig.weight_decay),
                   warmup=take("lr_scheduler.warmup_steps", RunConfig.warmup))
    if take.has("lr_scheduler.min_lr_factor"):
        options["min_lr"] = options["lr"] * take("lr_scheduler.min_lr_factor")
    if take("checkpoint.enable", False):
        options.update(checkpoint_dir=str(take("checkpoint.folder", "checkpoint")),
                       checkpoint_every=take("checkpoint.interval", 0))
    job.unmodeled.update({key: value for key, value in values.items() if key not in take.seen})
    job.unmodeled = {key: job.unmodeled[key] for key in values if key in job.unmodeled}  # in the file's order
    try:
        job.config = RunConfig(**options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    return job


def _refuse_misspellings(path: Path, values: dict) -> None:
    """Raise a ValueError for a key of a table pplab reads that torchtitan does not have, where one
    it has is near (a misspelt degree would otherwise leave the job at its default)."""
    for key in values:
        table, _, name = key.partition(".")
        known = TORCHTITAN_KEYS.get(table)
        if known is None or name in known:
            continue
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        if near:
            raise ValueError(f"{path}: [{table}] {name} is not a torchtitan key; did you mean {near[0]}?")


class _Taker:
    """Reads the file's keys, noting each one it maps."""

    def __init__(self, values: dict, job: TorchtitanJob):
        self.values, self.job, self.seen = values, job, set()

    def has(self, key: str) -> bool:
        return key in self.values

    def __call__(self, key: str, default=None):
        self.seen.add(key)
        if key in self.values:
            self.job.read[key] = self.values[key]
            return self.values[key]
        return default

    def unless_one(self, key: str) -> None:
        """A degree pplab does not model: fine at 1, listed otherwise."""
        value = self(key, 1)
        if value not in (0, 1):
            self.job.unmodeled[key] = value
            self.job.read.pop(key, None)


def _flavor(take: _Taker, job: TorchtitanJob) -> LlamaConfig | None:
    """The model's sizes, from a llama3 flavor pplab knows."""
    name, flavor = take("model.name", None), take("model.flavor", None)
    if name is None and flavor is None:
        job.notes.append("no [model] name and flavor: the model's sizes are not read")
        return None
    if name not in (None, "llama3") or flavor not in LLAMA3_FLAVORS:
        for key, value in (("model.name", name), ("model.flavor", flavor)):
            if value is not None:
                job.unmodeled[key] = value
        job.notes.append(f"model {name}/{flavor}: pplab knows llama3's flavors {', '.join(LLAMA3_FLAVORS)}; "
                         f"the model's sizes are not read")
        return None
    hidden, ffn, layers, heads, kv_heads, vocab = LLAMA3_FLAVORS[flavor]
    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab)


def _schedule(take: _Taker, job: TorchtitanJob, pp: int, n_microbatches: int) -> dict:
    """The schedule and stages per rank: the CSV's when one is given, else torch's class by name."""
    name = take("parallelism.pipeline_parallel_schedule", "1F1B")
    csv = take("parallelism.pipeline_parallel_schedule_csv", "")
    if name in CSV_RUNTIMES and not csv:
        raise ValueError(f"{job.path}: pipeline_parallel_schedule = {name!r} runs the schedule of a CSV, and "
                         f"pipeline_parallel_schedule_csv is not given")
    if csv:
        found = next((p for p in (job.path.parent / csv, Path(csv)) if p.is_file()), None)
        if found is None:
            raise ValueError(f"{job.path}: pipeline_parallel_schedule_csv = {csv!r}: no such file (looked "
                             "beside the TOML and in the current directory)")
        schedule = Schedule.from_torch_csv(found)
        if schedule.n_ranks != pp or schedule.n_microbatches != n_microbatches:
            raise ValueError(f"{job.path}: {csv} is for {schedule.n_ranks} ranks and "
                             f"{schedule.n_microbatches} microbatches, the job for pipeline_parallel_degree "
                             f"= {pp} and {n_microbatches} (local_batch_size / "
                             "pipeline_parallel_microbatch_size)")
        return dict(schedule=schedule, impl="torch", n_virtual=schedule.n_virtual)
    canonical = schedule_name(name)  # torch's class names read as pplab's names
    plan = torch_plan(canonical)
    layers_per_stage = take("parallelism.pipeline_parallel_layers_per_stage", None)
    n_virtual = plan.fewest_stages_per_rank
    if layers_per_stage and job.model is not None:
        n_virtual = max(1, math.ceil(job.model.num_hidden_layers / layers_per_stage) // pp)
    elif layers_per_stage:
        job.notes.append(f"pipeline_parallel_layers_per_stage = {layers_per_stage} without a known model: "
                         f"{n_virtual} stage(s) per rank assumed")
    return dict(schedule=canonical, impl="torch", n_virtual=n_virtual)

