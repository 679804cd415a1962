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

A save is atomic: shards go to a hidden `.step-N.partial` directory; when every rank
has written, the ranks hash the files (each its share), rank 0 writes `pplab.json` (the
manifest, listing every file's size and hash; see pplab.base.checkpoint_files) and renames
the directory to `step-N`. A crash mid-save leaves the previous checkpoints untouched.

A load never changes a run halfway. Every rank checks the manifest and verifies its
share of the files, and the ranks agree that all is well before anything is read; then
each rank reads into copies of its module and optimizer, the ranks agree again, and only
then does the run take the loaded model, optimizer, scheduler and RNG (gradients are
dropped). Any failure, on any rank, is a `CheckpointError` on every rank, and leaves
every rank's run as it was. (`dcp.load` fills the tensors it is given, and
`get_state_dict` hands out the live parameters: loading into them directly would
overwrite the model before a later file turned out to be damaged.)
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.export.unflatten import InterpreterModule

from pplab.base.checkpoint_files import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    check_config,
    complete_checkpoints,
    data_files,
    file_record,
    latest,
    read_manifest,
    resolve,
    sealed,
    share,
    step_directory,
    unverifiable,
    verify,
)
from pplab.models.llama import LlamaConfig, LlamaModel

__all__ = ["CheckpointError", "export_model", "export_pretrained", "latest", "load_model", "read_manifest",
           "step_directory"]

# torch.distributed.checkpoint is imported where it is used: it brings DTensor and sympy with it
# (1.2 s of CPU), which every process that imports the training loop would pay, checkpointing or
# not: each lab's kernel and engine fork server among them.


def _flattened():
    """The state-dict options of every save and load (see the module's docstring)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP call can raise: any Exception, and torch's CheckpointException, a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def check_loadable(path: str | Path, config: LlamaConfig) -> dict:
    """The manifest of a checkpoint that a model with `config` can load, every file
    verified; or a CheckpointError."""
    path = resolve(path)
    manifest = _check_manifest(path, config)
    _check_files(path, manifest, 0, 1)
    return manifest


def _check_manifest(path: Path, config: LlamaConfig) -> dict:
    manifest = read_manifest(path)
    check_config(path, manifest, config.record())
    return manifest


def _check_files(path: Path, manifest: dict, rank: int, world_size: int) -> None:
    """This rank's share of the files is as committed (format 2), or at least
    there and long enough (format 1)."""
    if manifest["format"] >= 2:
        verify(path, manifest, share(list(manifest["files"]), rank, world_size))
        return
    unverifiable(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no .metadata: it is not a complete "
                              f"torch.distributed.checkpoint directory")
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as error:
        raise CheckpointError(f"checkpoint {str(path)!r}: its file .metadata is damaged "
                              f"({_cause(error)}); load another checkpoint") from None
    missing = sorted(name for name in ends if not (path / name).is_file())
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing shard(s) {missing} of "
                              f"{len(ends)}; restore them or load another checkpoint")
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint {str(path)!r}: its file {name} is cut short ({size} "
                                  f"bytes, .metadata places data up to byte {end}); restore it or "
                                  f"load another checkpoint")


# --- one rank's state --------------------------------------------------------------------


def rank_module(stages: dict[int, nn.Module]) -> nn.Module:
    """One module over a rank's stage modules whose parameter names are the full model's.

    The stages' own submodules are shared, not copied, so an optimizer over its
    parameters is the optimizer over the stages. Containers the stages both have (the
    `layers` of pplab's model, the `model.layers` of a Hugging Face one) are merged.
    """
    module = nn.Module()
    for index in sorted(stages):
        _merge_into(module, stages[index])
    return module


# Exact types of modules that only hold others (torch's tracer holds a traced stage's in InterpreterModules).
_CONTAINERS = (nn.Module, nn.ModuleDict, InterpreterModule)


def _merge_into(target: nn.Module, source: nn.Module) -> None:
    for name, child in source.named_children():
        if type(child) in _CONTAINERS and not child._parameters and not child._buffers:
            if name not in target._modules:
                target.add_module(name, nn.ModuleDict() if type(child) is nn.ModuleDict else nn.Module())
            _merge_into(target._modules[name], child)
        else:
            target.add_module(name, child)


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
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer, options=_flattened())
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
        """Once every rank has written: the files hashed, the manifest, then one rename makes it visible."""
        if self.before_commit is not None:
            self.before_commit()
        self._barrier()  # every rank's shard and rank 0's .metadata are on disk
        names = data_files(partial)
        mine = {name: file_record(partial / name)
                for name in share(names, self._group_rank(), _world_size(self.group))}
        files = {name: record for records in self._gather(mine) for name, record in records.items()}
        if self.rank == 0:
            _write_atomically(partial / MANIFEST, sealed({**manifest, "files": dict(sorted(files.items()))}))
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
        """Replace this rank's model, optimizer, scheduler and RNG with a checkpoint's; its train state.

        Nothing changes unless every rank verified and read the checkpoint: a failure on
        any rank is a CheckpointError on every rank, and every run stays as it was.
        """
        self.finish()
        rank, world_size = self._group_rank(), _world_size(self.group)

        def check() -> tuple[Path, dict]:
            where = resolve(path)
            manifest = _check_manifest(where, config)
            _check_files(where, manifest, rank, world_size)
            return where, manifest

        path, manifest = self._agree(path, check)
        # RNG states are per rank: they mean something only in the layout that saved them.
        same_layout = manifest.get("world_size") == world_size

        def read() -> dict:
            state = {**_staged_state(module, optimizer), "scheduler": scheduler.state_dict(),
                     "train": {"step": 0, "data_position": 0}}
            if same_layout:
                state[f"rng_rank{self.rank}"] = torch.get_rng_state()
            _read(state, path, self.group)
            return state

        state = self._agree(path, read)
        # Every rank has it all: take it (nothing below reads a file or waits for a peer).
        module.zero_grad(set_to_none=True)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=_flattened())
        scheduler.load_state_dict(state["scheduler"])
        if same_layout:
            torch.set_rng_state(state[f"rng_rank{self.rank}"])
        return {**state["train"], "path": str(path), "manifest": manifest}

    def _agree(self, path, work: Callable):
        """`work()` on every rank; its result once every rank succeeded, else
        every rank raises the first error."""
        try:
            result, error = work(), None
        except CheckpointError as failure:
            result, error = None, str(failure)
        except _dcp_errors() as failure:
            result, error = None, (f"checkpoint {str(path)!r} could not be loaded ({_cause(failure)}); "
                                   f"load another checkpoint")
        errors = self._gather(error)
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        if not failed:
            return result
        rank, text = failed[0]
        if len(errors) > 1:
            text += f" (found by rank {rank}" + (f" and {len(failed) - 1} more)" if len(failed) > 1 else ")")
        raise CheckpointError(text)

    def _gather(self, value) -> list:
        """`value` from every rank of the checkpoint's group, by rank (also a barrier)."""
        if not dist.is_initialized():
            return [value]
        gathered = [None] * _world_size(self.group)
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _group_rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)


def _staged_state(module: nn.Module, optimizer) -> dict:
    """Copies of the module's and the optimizer's state dicts (flattened, full-model names) for
    `dcp.load` to fill, so that the live ones change only once every rank has read the checkpoint.

    The optimizer's template comes from a scratch optimizer of the same kind and settings over
    the same parameters, initialised by torch with zero gradients at lr 0 (for AdamW an exact
    no-op on the parameters): it asks the checkpoint for every moment even when the live
    optimizer has none yet, and leaves the live one untouched. No module is copied: FSDP's
    modules cannot be.
    """
    scratch = type(optimizer)([{**{k: v for k, v in group.items() if k != "params"},
                                "params": list(group["params"])} for group in optimizer.param_groups])
    held = {p: p.grad for p in module.parameters()}
    for p in held:
        p.grad = None  # with gradients present, torch would leave the scratch optimizer's state empty
    from torch.distributed.checkpoint.state_dict import get_state_dict

    try:
        model_state, optimizer_state = get_state_dict(module, scratch, options=_flattened())
    finally:
        for p, grad in held.items():
            p.grad = grad
    return {"model": {name: value.detach().clone() for name, value in model_state.items()},
            "optimizer": {key: (value.detach().clone() if isinstance(value, torch.Tensor)
                                else copy.deepcopy(value))
                          for key, value in optimizer_state.items()}}


def _read(state: dict, path: Path, group=None) -> None:
    """dcp.load into `state`, with torch's errors (a BaseException among them) as a CheckpointError."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # one process reading every shard is the intent without a group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    except _dcp_errors() as error:
        raise CheckpointError(f"checkpoint {str(path)!r} could not be read ({_cause(error)}); it may "
                              f"be damaged: load another checkpoint") from None


def _cause(error: BaseException) -> str:
    """The first line of what went wrong, with torch's CheckpointException opened to the rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


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
    if config is None:
        saved = read_manifest(path)["config"]
        try:
            config = _model_of_record(saved)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint {str(path)!r}: its model config is not one this pplab builds "
                                  f"({_cause(error)}); give config= or load another checkpoint") from None
    check_loadable(path, config)
    model = config.build_model(device=device)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {"model": get_model_state_dict(model)}
    _read(state, path)
    model.load_state_dict(state["model"])
    return model


def _model_of_record(saved: dict):
    """The model description a manifest's `config` record was written from."""
    if "hf_config.model_type" in saved:
        from pplab.models.hf import HFModel

        return HFModel.of_record(saved)
    return LlamaConfig(**saved)


def export_model(path: str | Path, out: str | Path) -> Path:
    """Write the full model of a checkpoint as one `torch.save` file (a single-device state dict)."""
    model = load_model(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(f".{out.name}.tmp")
    torch.save(model.state_dict(), scratch)
    os.replace(scratch, out)
    return out


def export_pretrained(path: str | Path, out: str | Path) -> Path:
    """Write a checkpoint of a Hugging Face model (pplab.models.hf) as a directory that
    `from_pretrained` loads."""
    model = load_model(path)
    if not hasattr(model, "save_pretrained"):
        raise CheckpointError(f"checkpoint {str(path)!r} is of pplab's own model, not a Hugging Face one: "
                              f"write it with export_model(path, out) instead")
    out = Path(out)
    model.save_pretrained(out)
    return out
