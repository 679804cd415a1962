"""A checkpoint's files: where they live, the manifest that lists them, and their verification.

A committed checkpoint is a directory `step-N` (8 digits) under a run's root. It holds
torch.distributed.checkpoint's files (`.metadata` and one or more `__R_I.distcp` shards
per writing rank) and pplab's manifest, `pplab.json`: format, step, model config, layout,
and (since format 2) every other file's size and xxh3-128 hash, taken when the checkpoint
was committed. The manifest also carries a digest of its own content, so that a flipped
byte in it is found like one in a shard.

Loading checks everything here before a byte of state is read: a cut, emptied, lost or
altered file is a `CheckpointError` naming the checkpoint, the file, what was expected and
what was found. Why xxh3-128: the damage to catch is accidental (a copy cut short, a full
disk, a flipped bit), not an adversary's, and xxh3 hashes at memory speed: 33 GB/s here
against sha256's 2.2 and zlib.crc32's 7.5 (bench/bench_checkpoint.py measures what it adds
to a save and a load).

Pure Python (no torch), so that the `pplab` command can check a `--resume` path in a
fraction of a second, before it starts any rank.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import xxhash

FORMAT = 2  # 2: the manifest lists every file with its size and hash; a reader refuses newer formats
MANIFEST = "pplab.json"
PREFIX = "step-"
HASH = "xxh3_128"
REQUIRED = ("format", "step", "config")  # what every manifest holds; format 2 adds files and digest
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: missing, incomplete, damaged, of another model, newer."""


# --- where checkpoints live --------------------------------------------------------------


def step_directory(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` steps."""
    return Path(root) / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The committed checkpoints under `root` (each with a manifest, readable or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest reads, or None.

    A checkpoint whose manifest is damaged is skipped with a warning naming it (once).
    """
    for candidate in reversed(complete_checkpoints(root)):
        try:
            read_manifest(candidate)
        except CheckpointError as error:
            warnings.warn(f"skipping a damaged checkpoint: {error}", stacklevel=2)
            continue
        return candidate
    return None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the newest readable one when `path` is the root they live in."""
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
                              f"did not finish; load an earlier one (pplab.rank.checkpoint.latest(root))")
    raise CheckpointError(f"no loadable checkpoint in {str(path)!r}: it holds no {PREFIX}N "
                          f"directory with a readable {MANIFEST}; train without resume to make one")


def resume_path(resume: str | Path, checkpoint_dir: str | Path | None) -> Path:
    """The checkpoint that `resume` ("latest" in `checkpoint_dir`, or a path) names, its manifest read."""
    if resume == "latest":
        if checkpoint_dir is None:
            raise CheckpointError("resume='latest' needs checkpoint_dir=<the directory the run saves to>")
        path = resolve(checkpoint_dir)
    else:
        path = resolve(resume)
    read_manifest(path)
    return path


# --- the manifest ------------------------------------------------------------------------


def read_manifest(path: str | Path) -> dict:
    """What a checkpoint says about itself (format, step, model config, layout, files), checked."""
    directory = resolve(path)
    where = directory / MANIFEST
    try:
        manifest = json.loads(where.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {str(directory)!r}: its manifest {MANIFEST} is damaged "
                              f"({_first_line(error)}); load another checkpoint") from None
    if not isinstance(manifest, dict) or any(key not in manifest for key in REQUIRED):
        missing = [k for k in REQUIRED if not isinstance(manifest, dict) or k not in manifest]
        raise CheckpointError(f"checkpoint {str(directory)!r}: its manifest {MANIFEST} is incomplete "
                              f"(no {', '.join(missing)}); load another checkpoint")
    version = manifest["format"]
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"checkpoint {str(directory)!r}: its manifest {MANIFEST} gives format "
                              f"{version!r}, which no pplab wrote; load another checkpoint")
    if version > FORMAT:
        raise CheckpointError(f"checkpoint {str(directory)!r} has format {version}, written by a newer "
                              f"pplab ({manifest.get('pplab')}); this one reads format {FORMAT}: "
                              f"upgrade pplab")
    if version >= 2:
        expected = manifest.get("digest")
        found = _digest({k: v for k, v in manifest.items() if k != "digest"})
        if expected != found or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(f"checkpoint {str(directory)!r}: its manifest {MANIFEST} was altered "
                                  f"after it was written (digest {expected!r}, content hashes to "
                                  f"{found!r}); load another checkpoint")
    if not isinstance(manifest["config"], dict):
        raise CheckpointError(f"checkpoint {str(directory)!r}: its manifest {MANIFEST} has no model "
                              f"config; load another checkpoint")
    return manifest


def sealed(manifest: dict) -> str:
    """The manifest as written: JSON with a digest of its own content."""
    return json.dumps({**manifest, "digest": _digest(manifest)}, indent=1)


def check_config(path: Path, manifest: dict, config: dict) -> None:
    """A CheckpointError naming every setting in which the checkpoint's model differs from `config`."""
    saved = manifest["config"]
    differs = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
    if differs:
        what = ", ".join(f"{k}={old} in the checkpoint, {new} here" for k, (old, new) in differs.items())
        raise CheckpointError(f"checkpoint {str(path)!r} is of another model: {what}; build the pipeline "
                              f"with the checkpoint's config (read_manifest(path)['config'])")


def _digest(value: dict) -> str:
    return xxhash.xxh3_128(json.dumps(value, sort_keys=True).encode()).hexdigest()


# --- the files and their hashes ----------------------------------------------------------


def data_files(directory: Path) -> list[str]:
    """The files of a checkpoint directory other than the manifest, by name."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files one of `world_size` ranks hashes or verifies: every world_size-th shard, and `.metadata`.

    With the saving layout, rank r's share is the shard it wrote. Every rank reads
    `.metadata` when it loads, so every rank checks it.
    """
    shards = sorted((name for name in names if name != ".metadata"), key=_rank_order)
    return ([".metadata"] if ".metadata" in names else []) + shards[rank::world_size]


def file_record(path: Path) -> dict:
    """A file's size and content hash, as the manifest keeps them."""
    digest, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, HASH: digest.hexdigest()}


def verify(directory: Path, manifest: dict, names: list[str]) -> None:
    """Each named file is as the manifest recorded it, or a CheckpointError naming the first that is not."""
    for name in names:
        expected = manifest["files"][name]
        if not (directory / name).is_file():
            raise CheckpointError(f"checkpoint {str(directory)!r} is missing its file {name} "
                                  f"({expected['size']} bytes); restore it or load another checkpoint")
        size = (directory / name).stat().st_size
        if size != expected["size"]:
            state = "empty" if size == 0 else "cut short" if size < expected["size"] else "too long"
            raise CheckpointError(f"checkpoint {str(directory)!r}: its file {name} is {state} ({size} "
                                  f"bytes, {expected['size']} written); restore it or load another "
                                  f"checkpoint")
        found = file_record(directory / name)[HASH]
        if found != expected.get(HASH):
            raise CheckpointError(f"checkpoint {str(directory)!r}: its file {name} is damaged ({HASH} "
                                  f"{found}, {expected.get(HASH)} written); restore it or load another "
                                  f"checkpoint")


def unverifiable(directory: Path) -> None:
    """Say once that a checkpoint written before hashes (format 1) loads unverified."""
    warnings.warn(f"checkpoint {str(directory)!r} was written by an older pplab (format 1, without "
                  f"hashes): its files cannot be verified before loading; save it again to add them",
                  stacklevel=3)


def _rank_order(name: str) -> tuple:
    """DCP's shards `__R_I.distcp` by (R, I), then anything else by name."""
    match = re.fullmatch(r"__(\d+)_(\d+)\.distcp", name)
    return (0, int(match[1]), int(match[2]), name) if match else (1, 0, 0, name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
