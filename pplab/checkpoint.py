"""Distributed checkpoints of a pipelined training run (torch.distributed.checkpoint).

Each rank writes its own shard: the parameters of its stages, their optimizer
state, and what the run needs to go on exactly where it stopped (LR scheduler,
step, data position, RNG). Names are the full model's (`layers.5.mlp.up_proj.weight`),
so a checkpoint saved with p stages loads into any other cut of the same model,
another schedule or implementation, or one device.

Two pitfalls decide how the state is written:

- Optimizer state is saved *flattened* (`flatten_optimizer_state_dict=True`): each
  parameter's moments and its param-group settings (lr, betas, ...) under its own
  name. Unflattened, every rank's `param_groups` is a list indexed 0, 1, ... and
  the ranks' lists collide on save; a resharded load then loses or mixes them.
- DCP reshards tensors, not Python state: the LR scheduler, step and data position
  are saved as objects that every rank holds equally, so that any layout reads them.

A save is atomic: shards go to a hidden `.step-N.partial` directory, and only when
every rank has finished does rank 0 write `pplab.json` (the manifest) and rename the
directory to `step-N`. A crash mid-save leaves the previous checkpoints untouched;
`latest(root)` is the newest directory with a manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from pplab.model import LlamaConfig, LlamaModel, build_model

FORMAT = 1  # bump when the layout changes; a reader refuses newer formats
MANIFEST = "pplab.json"
PREFIX = "step-"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here (missing, partial, of another model, newer)."""


# --- where checkpoints live --------------------------------------------------------------


def step_directory(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` steps."""
    return Path(root) / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root` (with a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete one when `path` is the root they live in."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; give a checkpoint "
                              f"directory (step-N) or the root of a run's checkpoints")
    if (path / MANIFEST).is_file():
        return path
    newest = latest(path)
    if newest is not None:
        return newest
    if path.name.startswith((PREFIX, f".{PREFIX}")) or (path / ".metadata").exists():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete (no {MANIFEST}): its save "
                              f"did not finish; load an earlier one (pplab.checkpoint.latest(root))")
    raise CheckpointError(f"no complete checkpoint in {str(path)!r}: it holds no {PREFIX}N "
                          f"directory with a {MANIFEST}")


def read_manifest(path: str | Path) -> dict:
    """What a checkpoint says about itself: format, step, model config, layout."""
    return json.loads((resolve(path) / MANIFEST).read_text())


def check_loadable(path: str | Path, config: LlamaConfig) -> dict:
    """The manifest of a checkpoint that a model with `config` can load, or a CheckpointError."""
    path = resolve(path)
    manifest = read_manifest(path)
    if manifest.get("format", 0) > FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {manifest['format']}, written by "
                              f"a newer pplab ({manifest.get('pplab')}); this one reads format "
                              f"{FORMAT}: upgrade pplab")
    saved = manifest["config"]
    differs = {k: (saved.get(k), v) for k, v in asdict(config).items() if saved.get(k) != v}
    if differs:
        what = ", ".join(f"{k}={old} in the checkpoint, {new} here" for k, (old, new) in differs.items())
        raise CheckpointError(f"checkpoint {str(path)!r} is of another model: {what}; build the run "
                              f"with the checkpoint's config (read_manifest(path)['config'])")
    _check_shards(path)
    return manifest


def _check_shards(path: Path) -> None:
    """Every file DCP's metadata names is there (a lost shard is reported by its name)."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no .metadata: it is not a complete "
                              f"torch.distributed.checkpoint directory")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing shard(s) {missing} of "
                              f"{len(files)}; restore them or load another checkpoint")


# --- one rank's state --------------------------------------------------------------------


def rank_module(stages: dict[int, nn.Module]) -> nn.Module:
    """One module over a rank's stage modules whose parameter names are the full model's.

    The stages' own submodules are shared, not copied, so an optimizer over its
    parameters is the optimizer over the stages.
    """
    module = nn.Module()
    layers = nn.ModuleDict()
    for index in sorted(stages):
        stage = stages[index]
        if stage.embed_tokens is not None:
            module.embed_tokens = stage.embed_tokens
        layers.update(stage.layers)
        if stage.lm_head is not None:
            module.norm, module.lm_head = stage.norm, stage.lm_head
    module.layers = layers
    return module


class Checkpointer:
    """Saves and loads one rank's part of a run under `root`; every rank calls each method together.

    `group` carries the checkpoint's own collectives: with `async_save=True` they run in
    a background thread, which must not share the pipeline's process group.
    """

    def __init__(self, root: str | Path, rank: int, keep: int = 3, async_save: bool = False,
                 group=None, before_commit: Callable[[], None] | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least the newest checkpoint (keep >= 1)")
        self.root, self.rank, self.keep = Path(root), rank, keep
        self.async_save, self.group = async_save, group
        self.before_commit = before_commit  # a test's way to crash between writing and committing
        self._pending = None  # (future, partial, final, manifest) of an async save

    def save(self, step: int, module: nn.Module, optimizer, scheduler, train_state: dict,
             manifest: dict) -> Path:
        """Write a checkpoint of this step; visible (committed) once every rank has written it.

        With async_save the write continues in the background after the state is copied;
        it is committed at the next save, at `finish()`, or before a load.
        """
        self.finish()
        final = step_directory(self.root, step)
        partial = self.root / f".{final.name}.partial"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        self._barrier()
        model_state, optimizer_state = get_state_dict(module, optimizer, options=OPTIONS)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "scheduler": scheduler.state_dict(), "train": dict(train_state),
                 f"rng_rank{self.rank}": torch.get_rng_state()}
        manifest = {"format": FORMAT, "step": step, "saved": time.time(), **manifest}
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self._pending = (future, partial, final, manifest)
        else:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            self._commit(partial, final, manifest)
        return final

    def finish(self) -> None:
        """Wait for an async save still being written, and commit it."""
        if self._pending is not None:
            future, partial, final, manifest = self._pending
            self._pending = None
            getattr(future, "upload_completion", future).result()
            self._commit(partial, final, manifest)

    def _commit(self, partial: Path, final: Path, manifest: dict) -> None:
        """Once every rank has written: the manifest, then one rename makes the checkpoint visible."""
        if self.before_commit is not None:
            self.before_commit()
        self._barrier()
        if self.rank == 0:
            _write_atomically(partial / MANIFEST, json.dumps(manifest, indent=1))
            if final.exists():  # the same step saved again (a resumed run): replace it whole
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                shutil.rmtree(old)
            partial.rename(final)
            for stale in complete_checkpoints(self.root)[:-self.keep]:
                shutil.rmtree(stale)
        self._barrier()

    def load(self, path: str | Path, module: nn.Module, optimizer, scheduler,
             config: LlamaConfig) -> dict:
        """Load a checkpoint into this rank's modules, optimizer and scheduler; its train state.

        Every check (model config, format, shards) runs before anything is overwritten.
        """
        self.finish()
        path = resolve(path)
        manifest = check_loadable(path, config)
        model_state, optimizer_state = get_state_dict(module, optimizer, options=OPTIONS)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "scheduler": scheduler.state_dict(), "train": {"step": 0, "data_position": 0}}
        same_layout = manifest.get("world_size") == _world_size(self.group)
        if same_layout:  # RNG states are per rank: they mean something only in the same layout
            state[f"rng_rank{self.rank}"] = torch.get_rng_state()
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        set_state_dict(module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=OPTIONS)
        scheduler.load_state_dict(state["scheduler"])
        if same_layout:
            torch.set_rng_state(state[f"rng_rank{self.rank}"])
        return {**state["train"], "path": str(path), "manifest": manifest}

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)


def _world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


# --- the whole model, on one device ------------------------------------------------------


def load_model(path: str | Path, config: LlamaConfig | None = None, device="cpu") -> LlamaModel:
    """The full model from a checkpoint of any layout, on one device (no process group needed)."""
    path = resolve(path)
    config = config or LlamaConfig(**read_manifest(path)["config"])
    check_loadable(path, config)
    model = build_model(config, device=device)
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # one process reading every shard is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model


def export_model(path: str | Path, out: str | Path) -> Path:
    """Write the full model of a checkpoint as one `torch.save` file (a single-device state dict)."""
    model = load_model(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(f".{out.name}.tmp")
    torch.save(model.state_dict(), scratch)
    os.replace(scratch, out)
    return out
