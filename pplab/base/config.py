"""Floor 1, every option, each written once: its name, default, help, section and kind.

A field is declared with `option(default, help, section, kind)` in one of the families: `TrainOptions`
(how to train, what every rank agrees on), `PipelineOptions` (the schedule and what a pipeline is
built with), `LabOptions` (how ranks start and wait, whichever driver holds them) and the cost
model's `pplab.planning.simulator.Costs`. Everything else is read from the fields:
`pplab.session.run.RunConfig` (a training run: train, pipeline, and the model's layout) checks its
values by kind; the commands' flags are made from them (`--batch-size` from `batch_size`, its help,
default and check); a TOML file's keys are their names, in tables named by their sections. A function
that takes options as keywords (`lab.pipeline`, `pplab.Lab`, `PipelineSpec.create`, ...) says so with
`takes_options`, which checks at import that it takes every field with the field's default, or says
why not. `tests/test_config.py` walks every field of every family through all of them.

Pure Python (no torch): the command line reads these fields before it decides to start anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

from pplab.base.checkpoint_files import check_config, read_manifest, resume_path
from pplab.schedules.names import SCHEDULE_NAMES, TORCH_ONLY_NAMES

__all__ = ["TrainOptions", "PipelineOptions", "LabOptions", "option", "takes_options", "SECTIONS"]

# The tables of a TOML file, in the order `to_toml` writes them (a reader's grouping: the keys are
# the fields' names, whatever table they sit in).
SECTIONS = ("model", "parallel", "schedule", "data", "optimizer", "run", "lab", "costs")
IMPLEMENTATIONS = ("pplab", "torch")  # the hand-written runtime, torch.distributed.pipelining
PARAM_DTYPES = ("float32", "bfloat16")  # bf16: weights, activations and gradients; the loss in fp32


@dataclass(frozen=True)
class ValueKind:
    """What a field holds: how a flag's text becomes a value, and which values it takes."""

    said: str                              # "a whole number >= 1", in errors
    from_text: Callable[[str], object]     # raises ValueError on text it cannot read
    valid: Callable[[object], bool]
    example: str
    choices: tuple[str, ...] = ()          # a choice's names, for a flag's help

    def check(self, name: str, value: object, optional: bool = False, example: str | None = None) -> None:
        """Raise a ValueError naming `name`, `value` and an example (the field's own, else the kind's)
        if the value is not of this kind."""
        if value is None and optional:
            return
        if not self.valid(value):
            raise ValueError(f"{name}={value!r}: give {self.said}, e.g. "
                             f"{name.rpartition('.')[2]}={example or self.example}")


def _whole(text: str) -> int:
    value = int(text)
    if str(value) != text.strip().lstrip("+"):  # "1.0", "1e3": not a count
        raise ValueError(text)
    return value


def _real(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int, but no count


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(text: str, of: Callable[[str], object]) -> tuple:
    return tuple(of(part.strip()) for part in text.split(","))


COUNT = ValueKind("a whole number >= 1", _whole, lambda v: _is_int(v) and v >= 1, "4")
COUNT_OR_ZERO = ValueKind("a whole number >= 0", _whole, lambda v: _is_int(v) and v >= 0, "0")
INTEGER = ValueKind("a whole number", _whole, _is_int, "0")
POSITIVE = ValueKind("a number > 0", _real, lambda v: _is_real(v) and v > 0, "0.001")
NUMBER_OR_ZERO = ValueKind("a number >= 0", _real, lambda v: _is_real(v) and v >= 0, "0")
BETAS = ValueKind("two numbers in [0, 1)", lambda text: _numbers(text, _real),
                  lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_real(b) and 0 <= b < 1
                                                                                 for b in v),
                  "0.9,0.95")
LAYERS = ValueKind("layers per stage, whole numbers >= 1", lambda text: _numbers(text, _whole),
                   lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and all(COUNT.valid(n) for n in v),
                   "3,5")
TEXT = ValueKind("a text", str, lambda v: isinstance(v, str), "'tiny'")
PATH = ValueKind("a text or a path", str, lambda v: isinstance(v, (str, os.PathLike)), "'run'")  # as text
CLIP_NORM = ValueKind("a norm > 0 (None: no clipping; 0 in a file or a flag)",
                      lambda text: _real(text) or None, lambda v: _is_real(v) and v > 0, "1.0")
SWITCH = ValueKind("true or false", str, lambda v: isinstance(v, bool), "true")


def choice(*names: str) -> ValueKind:
    """One of `names`."""
    return ValueKind(f"one of {', '.join(map(repr, names))}", str, lambda v: v in names, repr(names[0]),
                     names)


def _per_stage(text: str, of: Callable[[str], object] = None):
    values = _numbers(text, of or _real)
    return values[0] if len(values) == 1 else values


def _each_of(kind: ValueKind, value) -> bool:
    """One value of `kind`, or a non-empty sequence of them (one per stage)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return len(values) > 0 and all(kind.valid(v) for v in values)


PER_STAGE = ValueKind("a duration >= 0, or one per stage separated by commas", _per_stage,
                      lambda v: _each_of(NUMBER_OR_ZERO, v), "1,1,2,1")
PER_STAGE_BYTES = ValueKind("bytes >= 1, or one count per stage separated by commas",
                            lambda text: _per_stage(text, _whole), lambda v: _each_of(COUNT, v), "1048576")
INDICES = ValueKind("whole numbers >= 0, one per rank", lambda text: _numbers(text, _whole),
                    lambda v: isinstance(v, (tuple, list)) and len(v) > 0
                    and all(COUNT_OR_ZERO.valid(n) for n in v), "0,1")
FRACTION = ValueKind("a share in (0, 1]", _real, lambda v: _is_real(v) and 0 < v <= 1, "0.45")
def _switch_or_none(text: str):
    said = {"true": True, "false": False, "none": None}
    if text.strip().lower() not in said:
        raise ValueError(text)
    return said[text.strip().lower()]


OPTIONAL_SWITCH = ValueKind("true, false or None (decided for you)", _switch_or_none,
                            lambda v: v is None or isinstance(v, bool), "true")


def _is_schedule(value) -> bool:
    from pplab.schedules import Schedule  # the same floor's; loaded when a value is checked

    return isinstance(value, Schedule)


# A schedule by name (flags, files), or in Python a Schedule itself (built, written, searched).
SCHEDULE = ValueKind("a schedule's name, or a Schedule", str, lambda v: isinstance(v, str) or _is_schedule(v),
                     "'1f1b'")

KINDS = {int: COUNT, float: POSITIVE, str: TEXT, bool: SWITCH}


def option(default, help: str, section: str, kind: ValueKind | None = None, metavar: str | None = None,
           optional: bool | None = None, example: str | None = None):
    """A configuration field: its default, its help (the flag's and the reader's), the TOML table it
    sits in, and its kind (by default from the default's type: an int a count, a float > 0).
    `optional`: None is a value too, "not set" (by default where None is the default); `example`:
    a good value, as errors show it (by default the kind's)."""
    if section not in SECTIONS:
        raise ValueError(f"section={section!r}: choose one of {', '.join(SECTIONS)}")
    kind = kind or KINDS[type(default)]
    return field(default=default, metadata={"help": help, "section": section, "kind": kind,
                                            "metavar": metavar,
                                            "optional": default is None if optional is None else optional,
                                            "example": example})


def takes_options(family, every: bool = False, differs: dict[str, str] | None = None):
    """Decorate a function (or a dataclass) whose keywords are options of `family`: checked now, at
    import, each keyword named as a field defaults to the field's default, but those `differs` names,
    each with the reason its default differs (and it must differ); a keyword without a default is
    always given, and says nothing. `every`: the function takes every field of the family, so that a
    field added to it cannot be left out by mistake.

    The family and the reasons stay on the function (`__takes_options__`), for tests/test_config.py."""
    import inspect

    differs = dict(differs or {})

    def checked(function):
        name = getattr(function, "__qualname__", function)
        if isinstance(function, type):  # a dataclass: its fields are its keywords
            defaults = {each.name: each.default for each in fields(function)}
        else:
            defaults = {key: parameter.default
                        for key, parameter in inspect.signature(function).parameters.items()}
        defaults = {key: value for key, value in defaults.items()
                    if value is not inspect.Parameter.empty and value is not MISSING}
        options = {each.name: each.default for each in fields(family)}
        wrong = []
        for key in sorted(options.keys() & defaults.keys()):
            # (True == 1 in Python: a switch's default is not a count's)
            same = (defaults[key] == options[key]
                    and isinstance(defaults[key], bool) == isinstance(options[key], bool))
            if same == (key in differs):
                wrong.append(f"{key}={defaults[key]!r}" + (" is the field's default: leave it out of differs"
                                                           if same else f" (the field's: {options[key]!r})"))
        taken = defaults.keys() | {key for key in _keywords(function)}
        missing = sorted(options.keys() - taken) if every else []
        unknown = sorted(differs.keys() - options.keys())
        if wrong or missing or unknown:
            raise TypeError(f"{name} takes {family.__name__}'s options: "
                            + "; ".join([*(f"default {w}" for w in wrong),
                                         *(f"it lacks {m}" for m in missing),
                                         *(f"differs names {u}, not a field" for u in unknown)])
                            + ". Write the field's default, or say why it differs in takes_options(...)")
        function.__takes_options__ = {**getattr(function, "__takes_options__", {}), family: differs}
        return function

    return checked


def _keywords(function) -> list[str]:
    """The names a function (or a dataclass) takes."""
    import inspect

    if isinstance(function, type):
        return [each.name for each in fields(function)]
    return list(inspect.signature(function).parameters)


def keywords_help(function, config_class, own: dict[str, str], indent: int = 8, width: int = 104) -> str:
    """A table of `function`'s keywords for its docstring, in its signature's order: each keyword that
    is a field of `config_class` with that field's help (written once, in the field), the others with
    the words `own` gives them."""
    import inspect
    import textwrap

    helps = {each.name: each.metadata["help"] for each in fields(config_class) if "help" in each.metadata}
    defaults = {each.name: each.default for each in fields(config_class)}
    for family, differs in getattr(function, "__takes_options__", {}).items():  # why a default differs
        helps.update({name: f"{helps[name]} (default {reason.replace('{default}', str(defaults[name]))})"
                      for name, reason in differs.items() if name in helps and family is config_class})
    names = [name for name in inspect.signature(function).parameters if name != "self"]
    missing = [name for name in names if name not in own and name not in helps]
    twice = [name for name in own if name in helps]
    if missing or twice:
        raise ValueError(f"{function.__qualname__}: no help for {missing}, and help written twice for "
                         f"{twice}: give a keyword's help in `own` only when it is not a field")
    column = max(map(len, names)) + 2
    lines = []
    for name in names:
        wrapped = textwrap.wrap(own[name] if name in own else helps[name], width - indent - column)
        lines += [" " * indent + f"{name:{column}s}{wrapped[0]}",
                  *(" " * (indent + column) + line for line in wrapped[1:])]
    return "\n".join(lines)


def check_option(family, name: str, value: object) -> None:
    """Raise a ValueError naming `name` and `value`, with an example, if `value` is not of the kind of
    the field `name` of the dataclass `family` (None passes where the field is optional)."""
    each = next(each for each in fields(family) if each.name == name)
    each.metadata["kind"].check(name, value, each.metadata["optional"], each.metadata["example"])


def check_fields(options) -> None:
    """Raise a ValueError naming the first field of the dataclass `options` whose value is not of its
    kind (None passes where the field is optional: not set)."""
    for each in fields(options):
        if "kind" in each.metadata:
            each.metadata["kind"].check(f"{type(options).__name__}.{each.name}", getattr(options, each.name),
                                        each.metadata["optional"], each.metadata["example"])


@dataclass(frozen=True)
class TrainOptions:
    """How to train: what every rank must agree on (small and picklable)."""

    steps: int = option(200, "training steps: the LR reaches min_lr at this step", "run")
    batch_size: int = option(8, "sequences per step, cut into the schedule's microbatches", "data")
    seq_len: int = option(64, "tokens per sequence", "data")
    lr: float = option(3e-3, "AdamW's learning rate after the warm-up", "optimizer")
    min_lr: float = option(3e-4, "the LR at the end of the cosine (0 decays to "
                                 "zero)", "optimizer", NUMBER_OR_ZERO)
    warmup: int = option(20, "steps of linear warm-up", "optimizer", COUNT_OR_ZERO)
    weight_decay: float = option(0.1, "AdamW's, on matrices only (not norms), as LLaMA "
                                      "recipes do", "optimizer",
                                 NUMBER_OR_ZERO)
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW's two betas", "optimizer", BETAS, "B1,B2")
    eps: float = option(1e-8, "AdamW's epsilon", "optimizer")
    clip: float | None = option(1.0, "the largest global gradient norm (None, or 0 in a "
                                     "file or flag: no clipping)",
                                "optimizer", CLIP_NORM, optional=True)
    data_seed: int = option(0, "the seed of the batches drawn", "data", COUNT_OR_ZERO)
    data: str | None = option(None, "a text file, a directory of .txt files or a dataset saved with the "
                                    "datasets library (default: the embedded corpus)", "data", PATH, "PATH",
                                example="'notes.txt'")
    tokenizer: str = option("char", "char, bpe (byte-level, learned from data and saved beside the "
                                    "checkpoints), or a tokenizer.json", "data", PATH, example="'bpe'")
    vocab_size: int = option(512, "the BPE's vocabulary (the model's vocab_size must hold it)", "data")
    epochs: int | None = option(None, "passes over data's training sequences (instead of "
                                      "steps)", "data", COUNT)
    eval_every: int = option(50, "steps between held-out evaluations (0: never)", "run", COUNT_OR_ZERO)
    eval_batches: int = option(2, "held-out batches per evaluation", "run")
    checkpoint_dir: str | None = option(None, "where checkpoints go", "run", PATH, "DIR", example="'run'")
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)", "run", COUNT_OR_ZERO)
    keep: int = option(3, "complete checkpoints kept, newest first", "run")
    async_save: bool = option(False, "write checkpoints in the background", "run")
    resume: str | None = option(None, "'latest' (in checkpoint_dir) or a checkpoint's "
                                      "path", "run", PATH, "PATH",
                                example="'latest'")

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # from TOML or JSON: a list
        for each in fields(self):  # a path is kept as its text: the manifest and a TOML file hold it so
            if isinstance(getattr(self, each.name), os.PathLike):
                object.__setattr__(self, each.name, os.fspath(getattr(self, each.name)))

    def check(self, n_microbatches: int, config=None, replicas: int = 1) -> None:
        """Raise a ValueError naming the first option that cannot work, before any rank blocks.

        Each field by its kind, then what fields must agree on. A checkpoint to resume from is
        found and its manifest read (and, given the run's model `config`, a `LlamaConfig`,
        matched against it): a CheckpointError now, not on the ranks.
        """
        check_fields(self)
        if self.batch_size % (n_microbatches * replicas):
            across = f"dp={replicas} pipelines x {n_microbatches}" if replicas > 1 else f"{n_microbatches}"
            raise ValueError(f"TrainOptions.batch_size={self.batch_size} does not split into "
                             f"{across} microbatches; use a multiple of {n_microbatches * replicas}")
        if not self.min_lr <= self.lr:
            raise ValueError(f"lr={self.lr}, min_lr={self.min_lr}: need min_lr <= lr")
        if self.tokenizer != "char" and self.data is None:
            raise ValueError(f"tokenizer={self.tokenizer!r} tokenises (and 'bpe' learns from) the training "
                             "text: give data=<a text file, a directory of .txt files or a saved dataset>, "
                             "or tokenizer='char' for the embedded corpus")
        if self.epochs is not None and self.data is None:
            raise ValueError("epochs count passes over data=...: the embedded corpus is drawn at random "
                             "without end; give data=<text>, or steps=<count>")
        if (self.checkpoint_every or self.resume == "latest") and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every and resume='latest' need checkpoint_dir=<a directory>")
        if self.resume is not None:
            path = resume_path(self.resume, self.checkpoint_dir)
            if config is not None:
                check_config(path, read_manifest(path), config.record())


@dataclass(frozen=True)
class PipelineOptions:
    """What a pipeline is built with: its schedule, its runtime and its stages' weights; a training
    run's (RunConfig) and `lab.pipeline(...)`'s."""

    param_dtype: str = option("float32", "the stages' weights and activations (bfloat16: a pipeline alone; "
                                         "the loss in fp32)", "model", choice(*PARAM_DTYPES))
    seed: int = option(0, "the model's initialisation: each parameter from (seed, its name)", "model",
                       INTEGER)
    schedule: str = option("1f1b", f"one of {', '.join(SCHEDULE_NAMES)}; with impl torch also "
                                   f"{', '.join(TORCH_ONLY_NAMES)} (any case; torch's class names work too); "
                                   "or a torch CSV (FILE.csv, either format); in Python also a Schedule",
                            "schedule", SCHEDULE, "NAME")
    impl: str = option("pplab", "the hand-written runtime (pplab), or torch.distributed.pipelining's "
                                "schedules (torch)", "schedule", choice(*IMPLEMENTATIONS))
    n_microbatches: int = option(4, "microbatches per pipeline per step (a Schedule brings its own)",
                                 "schedule", metavar="N")
    n_virtual: int = option(1, "stages per rank (interleaved and torch's multi-stage schedules: 2+)",
                            "schedule", metavar="N")
    balance: tuple[int, ...] | None = option(
        None, "layers per stage (3,5 on the command line, [3, 5] in Python; default: as even as possible)",
        "schedule", LAYERS, "L1,L2,...")


@dataclass(frozen=True)
class LabOptions:
    """How ranks start and wait, whichever driver holds them: `pplab.Lab`'s keywords, and those of
    `pplab.RankPool`, `pplab.TorchrunRanks` and the commands that start ranks that take them."""

    n_ranks: int = option(2, "ranks (processes): one per pipeline stage, or pp x dp x tp on a mesh (under "
                             "torchrun: its --nproc_per_node)", "lab", metavar="N")
    op_timeout: float = option(60.0, "seconds ONE wait between ranks (a rendezvous, a collective, a P2P op) "
                                     "may take before it gives up (roomy, for a workshop server's busy "
                                     "cores); a call's own bound is run(fn, timeout=...)", "lab")
    start_timeout: float = option(120.0, "seconds the ranks may take to start and join their process group, "
                                         "at a quiet machine's pace (stretched by this one's load)", "lab")
    grace: float = option(3.0, "seconds the other ranks get to finish after the first rank raises", "lab")
    threads: int | None = option(1, "torch threads per rank (None keeps torch's default)", "lab", COUNT,
                                 optional=True)
    backend: str = option("auto", "auto (nccl between GPUs, else gloo), gloo or nccl", "lab",
                          choice("auto", "gloo", "nccl"))
    device: str = option("auto", "auto (cuda where there are GPUs, else cpu), cpu or cuda", "lab",
                         choice("auto", "cpu", "cuda"))
    gpus: tuple[int, ...] | None = option(
        None, "the CUDA devices of the ranks, one per rank (2,3: a workshop's attendee their own; 0,0: two "
              "ranks share GPU 0; see pplab.drivers.cluster.plan_room); default: rank r on GPU r % the "
              "host's GPUs", "lab", INDICES, "G1,G2,...")
    cores: tuple[int, ...] | None = option(
        None, "one core per rank to keep its threads on (0,1), where every rank can have a core of its "
              "own; default: none, the kernel places them (see pplab.drivers.cores)", "lab", INDICES,
        "C1,C2,...")
    gpu_memory_fraction: float | None = option(
        None, "the share of its GPU's memory each rank may take (on CPU: no effect), so that in a room one "
              "attendee cannot take a GPU from the others; default: PPLAB_GPU_MEMORY_FRACTION where a "
              "workshop's hub set it, else no cap", "lab", FRACTION)
    host_messages: bool | None = option(
        None, "copy each message through host memory and send it over gloo; default (None): where ranks "
              "share a GPU (NCCL holds one rank per device); True also on CPU, where it runs the same path",
        "lab", OPTIONAL_SWITCH)


# Every driver, pipeline and runtime starts from this one number (a fault demo passes a short one).
OP_TIMEOUT = LabOptions.op_timeout


def sections_of(options) -> dict[str, list[str]]:
    """The dataclass `options`' field names by section, in SECTIONS' order (a field with no section
    in "run")."""
    grouped = {section: [] for section in SECTIONS}
    for each in fields(options):
        grouped[each.metadata.get("section", "run")].append(each.name)
    return {section: names for section, names in grouped.items() if names}
