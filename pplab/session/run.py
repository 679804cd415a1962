"""One training run from one configuration: what `pplab train` does, as a function.

`RunConfig` holds every option of a run: the model, the parallel layout (`pp`, `dp`, `tp`, the
mesh's names; `schedule`, `n_microbatches`, `n_virtual`, `balance`, the names `lab.pipeline`
uses; the older spellings `microbatches` and `virtual_stages` are read too), the stages' dtype, and
every field of `TrainOptions` (the optimizer, the schedule of the learning rate, the data,
the checkpoints). Each field is written once, with its help, section and kind
(`pplab.base.config.option`): the `pplab train` flags are made from them. `train(config, **keywords)` starts
the ranks (local processes, or
the processes torchrun started) and trains; `pplab train` builds the same configuration
from its flags or from a TOML file (`RunConfig.from_toml`), so that both give the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from pplab.base.config import (
    PATH,
    PipelineOptions,
    TrainOptions,
    option,
    sections_of,
)
from pplab.base.renames import keyword_renames, renamed_keywords, rows
from pplab.schedules import Schedule

if TYPE_CHECKING:
    from pplab.rank.train import TrainHistory

__all__ = ["RunConfig", "train"]

# Seconds a whole training run on local ranks may take (`pplab train --timeout`), unless told.
RUN_TIMEOUT = 3600.0

# Older names for two of them (pplab.base.renames), read in files and dicts and shown as the canonical
# name (a schedule's name may be spelled the older way too, "interleaved_1f1b": schedule_name reads
# every spelling).
ALIASES = keyword_renames("pplab.session.run.RunConfig.__init__")


@dataclass(frozen=True)
class RunConfig(TrainOptions, PipelineOptions):
    """Everything a training run takes: how to train (TrainOptions), the pipeline (PipelineOptions),
    and the model and its layout."""

    model: str = option("tiny", "tiny, small, or a config.json (pplab's fields, or a Hugging "
                                "Face config)", "model",
                        PATH)
    pp: int = option(2, "ranks along the pipeline; the run takes pp x dp x tp ranks", "parallel")
    dp: int = option(1, "FSDP replicas (a mesh; impl torch)", "parallel")
    tp: int = option(1, "tensor-parallel ranks (a mesh; impl torch)", "parallel")

    def __post_init__(self):
        super().__post_init__()
        if self.clip == 0:  # a file or a flag says "no clipping" as 0
            object.__setattr__(self, "clip", None)
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(self.balance))
        own = {f.name for f in fields(TrainOptions)}
        for each in fields(self):  # the layout's fields now; TrainOptions' in check(), as ever
            if each.name not in own:
                each.metadata["kind"].check(f"RunConfig.{each.name}", getattr(self, each.name),
                                            each.metadata["optional"], each.metadata["example"])

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name."""
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls, values: dict, where: str = "the configuration") -> "RunConfig":
        """A configuration from a dict of options (tables flattened, the older spellings taken);
        an unknown key is a ValueError that lists the known ones."""
        options = {}
        for key, value in flattened(values).items():
            name = key.replace("-", "_")
            name = ALIASES.get(name, name)
            if name not in cls.names():
                raise ValueError(f"{where}: unknown key {key!r}; the keys are "
                                 f"{', '.join(sorted(cls.names()))}")
            options[name] = value
        try:
            return cls(**options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None

    def with_changes(self, **changes) -> "RunConfig":
        """This configuration with some options changed (names checked as `of` checks them)."""
        return self.of({**{name: getattr(self, name) for name in self.names()}, **changes}, "train(...)")

    @classmethod
    def from_toml(cls, path: str | Path) -> "RunConfig":
        """The configuration a TOML file writes (tables such as [parallel] are for the reader)."""
        import tomllib

        try:
            return cls.of(tomllib.loads(Path(path).read_text(encoding="utf-8")), f"--config {str(path)!r}")
        except OSError as error:
            raise ValueError(f"--config {str(path)!r}: {error.strerror}; give the path "
                             "of a TOML file") from None
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"--config {str(path)!r} is not TOML: {error}") from None

    @classmethod
    def from_torchtitan(cls, path: str | Path) -> "RunConfig":
        """The run a torchtitan job's TOML describes (`pplab.session.torchtitan`). The fields pplab
        does not model are said in a warning; `pplab.session.read_torchtitan(path).text()` shows
        them with what was read."""
        import warnings

        from pplab.session import read_torchtitan  # the package's: the reader imports this module

        job = read_torchtitan(path)
        if job.unmodeled:
            warnings.warn(f"{path}: not modeled by pplab: "
                          f"{', '.join(job.unmodeled)}", UserWarning, stacklevel=2)
        return job.config

    def to_toml(self) -> str:
        """The configuration as a TOML file that `from_toml` reads back, a table per section."""
        lines = []
        for section, names in sections_of(self).items():
            lines.append(f"{chr(10) if lines else ''}[{section}]")
            for name in names:
                lines.append(_toml_line(name, getattr(self, name)))
        return "\n".join(lines) + "\n"

    @property
    def microbatches(self) -> int:
        """The last release's name of `n_microbatches` (one more release, with a DeprecationWarning)."""
        _warn_old_attribute("microbatches")
        return self.n_microbatches

    @property
    def virtual_stages(self) -> int:
        """The last release's name of `n_virtual` (one more release, with a DeprecationWarning)."""
        _warn_old_attribute("virtual_stages")
        return self.n_virtual

    @property
    def n_ranks(self) -> int:
        """The ranks the run takes: pp x dp x tp."""
        return self.pp * self.dp * self.tp

    def training(self) -> TrainOptions:
        """The TrainOptions part."""
        return TrainOptions(**{f.name: getattr(self, f.name) for f in fields(TrainOptions)})

    def pipeline_spec(self, world_size: int | None = None):
        """The pipeline it trains, checked (before any rank starts)."""
        from pplab.rank.rank_pipeline import PipelineSpec

        n_ranks = self.n_ranks if world_size is None else world_size
        pp = stages_of(n_ranks, self.dp, self.tp)
        mesh = {"pp": pp, "dp": self.dp, "tp": self.tp} if self.dp > 1 or self.tp > 1 else None
        vocabulary = _vocabulary(self.tokenizer, self.vocab_size)
        return PipelineSpec.create(model_of(self.model, vocabulary), self.schedule, n_ranks,
                                   self.n_microbatches,
                                   self.n_virtual, impl=self.impl, seed=self.seed, mesh=mesh,
                                   balance=self.balance, param_dtype=self.param_dtype)


# RunConfig(microbatches=4), the last release's keywords: one more release, with a DeprecationWarning.
RunConfig.__init__ = renamed_keywords(RunConfig.__init__)


def _warn_old_attribute(old: str) -> None:
    """`config.microbatches`: its keyword's row says what it is now, and until when the old one works."""
    row = rows("keyword", "pplab.session.run.RunConfig.__init__")[old]
    warnings.warn(f"RunConfig.{old} is now RunConfig.{row.new}; RunConfig.{old} works until {row.until}",
                  DeprecationWarning, stacklevel=3)


def _toml_line(name: str, value) -> str:
    if isinstance(value, Schedule):
        return f"# {name} is a Schedule ({value.name}): a file names one"
    if name == "clip" and value is None:
        return "clip = 0.0  # no clipping"
    if value is None:
        return f"# {name} is not set"
    if isinstance(value, bool):
        return f"{name} = {str(value).lower()}"
    if isinstance(value, (list, tuple)):
        return f"{name} = [{', '.join(json.dumps(v) for v in value)}]"
    return f"{name} = {json.dumps(value)}"


def stages_of(n_ranks: int, dp: int, tp: int, said: str = "dp={dp} x tp={tp}") -> int:
    """The pipeline's stages (pp) when `n_ranks` ranks form dp replicas of tp ranks each; a ValueError
    naming the sizes (as `said` spells them: the command line says --dp 2 x --tp 2) if they do not fit."""
    if n_ranks % (dp * tp):
        raise ValueError(f"{said.format(dp=dp, tp=tp)} does not divide {n_ranks} ranks: give a rank count "
                         f"that is a multiple of {dp * tp}")
    return n_ranks // (dp * tp)


def flattened(document: dict) -> dict:
    """A configuration's options, out of their tables ([parallel], [optimizer]: for the reader only)."""
    flat = {}
    for key, value in document.items():
        flat.update(flattened(value) if isinstance(value, dict) else {key: value})
    return flat


def model_of(name: str, vocab_size: int | None = None):
    """'tiny', 'small' (both with the tokenizer's vocabulary), or a config.json: pplab's own fields,
    or a Hugging Face config (it has a model_type)."""
    from pplab.models.llama import LlamaConfig

    sizes = {} if vocab_size is None else {"vocab_size": vocab_size}
    if name in ("tiny", "small"):
        return getattr(LlamaConfig, name)(**sizes)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"model={name!r}: give tiny, small, or the path of a config.json")
    try:
        values = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"model={name!r} is not JSON ({error}): give a config.json") from None
    if "model_type" in values:
        return str(path.parent)  # a Hugging Face model's directory (weights read from it if it has them)
    try:
        # its own vocabulary: checked against the tokenizer's before any rank starts
        return LlamaConfig(**values)
    except TypeError as error:
        known = ", ".join(f.name for f in fields(LlamaConfig))
        raise ValueError(f"model={name!r}: {error}; pplab's model takes {known} (a Hugging Face config "
                         f"has a model_type)") from None


def _vocabulary(tokenizer: str, bpe_size: int) -> int | None:
    """The vocabulary the model must have for `tokenizer`: the BPE's size, a saved tokenizer's, or
    None (the model's own, which holds the characters)."""
    if tokenizer == "char":
        return None
    if tokenizer == "bpe":
        return bpe_size
    from pplab.data.text import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def train(config: RunConfig | None = None, *, timeout: float = RUN_TIMEOUT, show: bool = True,
          **keywords) -> TrainHistory:
    """Train as `config` (and/or keywords: RunConfig's fields) says, on local ranks, or on the processes
    torchrun started (each process calls it: rank 0 gets the history, the others None)."""
    from pplab.drivers.torchrun import run_as_torchrun_rank, under_torchrun
    from pplab.rank.train import build_and_train_on_rank, prepare_data
    from pplab.session import Pipeline, RankPool

    config = (config or RunConfig()).with_changes(**keywords)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    spec = config.pipeline_spec(world_size)
    options = config.training()
    options.check(spec.schedule.n_microbatches, spec.config, spec.replicas)  # before any rank starts
    # The data made ready before any rank starts (a bad path fails here); a BPE trained here, alike on
    # every torchrun process. Pipeline.train looks at the prepared options again: it only re-reads the text.
    options = prepare_data(options, spec.config)
    if under_torchrun():
        histories = run_as_torchrun_rank(build_and_train_on_rank, spec, options, None, show)
        return histories[0] if histories else None
    with RankPool(spec.world_size, timeout=timeout) as pool:
        return Pipeline(pool, spec).train(show=show, **dataclasses.asdict(options))
