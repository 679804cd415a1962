"""Checkpoint cost next to one training step: sync vs async save, load, resume to the first step.

On 2 ranks (plain gloo processes on CPU), 1f1b with 4 microbatches, a LLaMA-style model a
little wider than `LlamaConfig.tiny()` by default (hidden 128, 8 layers: a checkpoint of
about 20 MB with AdamW's two moments) so that a save is more than fixed overhead.

1. Steady state, on a `pplab.RankPool`: the session builds the pipeline on the ranks, a loop
   there makes one `RankTrainer` on it per rank, warms up, then times interleaved repeats of
     plain step      `trainer.train(until=step + 1)` with no checkpointer (a pure step)
     sync save       `trainer.save()` through a sync `Checkpointer`, written and committed
     async save      `trainer.save()` through an async `Checkpointer` (its own gloo group, as
                     `train_on_rank` makes it): the time until `save()` returns (what the
                     training loop is blocked for), then `finish()` at once: the time until
                     the checkpoint is committed
     async + step    another async save, then a step while it is being written (the step's
                     real slowdown), then `finish()` (what is left to wait for)
     load            `trainer.load()` of the sync checkpoint just saved (same state)
     plain step      a second plain sample, after the saves
   Sync and async-commit swap places every other repeat. Every operation starts after a
   barrier; its time is the slowest rank's. Medians over the repeats.
2. Resume to first step: fresh `run_ranks` launches, alternated, from the moment the launch is
   called (process start: spawn, imports, process group) to the end of the first step on the
   slowest rank, with `TrainOptions(resume=<the last sync checkpoint>)` vs a fresh start
   without resume. The resumed run's first loss is checked against the loss the steady-state
   run had at the same step (resume must continue exactly).

3. What verification costs: in each repeat of 1, right after the sync save, every rank hashes
   its share of the files just written (the share it hashes at commit and verifies at load)
   with xxh3-128 (what pplab uses), sha256 and zlib.crc32 (the standard library's fastest
   candidates), side by side. The saves and loads above include pplab's own xxh3 hashing;
   the ratios say what part of a save or a load each hash is, or would be.

Ratios: sync save / step, async blocking / step, step during an async write / plain step,
load / step, async blocking / sync save, and the whole cost of an async save to the loop
(blocking + the step's slowdown + the wait left at finish) / sync save.

Checkpoints go to a temporary directory (under --dir if given) that is removed at the end.
Timings on the 2-core machine are noisy: compare the ratios measured in one run, not the
absolute times across runs.

Run: python bench/bench_checkpoint.py [--repeats 10] [--warmup 1] [--launches 4]
     [--hidden-size 128] [--layers 8] [--dir DIR] [--quick]
Writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

import pplab
from measuring import load
from pplab.base.checkpoint_files import data_files, share
from pplab.drivers.local import run_ranks
from pplab.rank.checkpoint import Checkpointer
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline
from pplab.rank.train import RankTrainer, TrainOptions
from pplab.session.on_rank import built_pipeline

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
RANKS, MICROBATCHES, SCHEDULE = 2, 4, "1f1b"
TIMEOUT = 600.0


def make_config(hidden_size: int, layers: int, heads: int) -> pplab.LlamaConfig:
    """tiny() with another width and depth; the MLP keeps tiny's 11/4 ratio (64 -> 176)."""
    intermediate = -(-hidden_size * 11 // 4 // 8) * 8
    return pplab.LlamaConfig.tiny(hidden_size=hidden_size, intermediate_size=intermediate,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=max(1, heads // 2))


def _timed(fn):
    """(seconds, result) of fn() on this rank, started after a barrier so every rank starts together."""
    dist.barrier()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _directory_bytes(path: Path) -> int:
    """The size of every file under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


HASHES = ("xxh3_128", "sha256", "crc32")


def _hash_file(path: Path, algorithm: str) -> str:
    """One file's digest with `algorithm`, read in 4 MiB chunks as pplab reads it."""
    import hashlib
    import zlib

    import xxhash

    if algorithm == "crc32":
        value = 0
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                value = zlib.crc32(chunk, value)
        return f"{value:08x}"
    digest = xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def rank_steady(rank, world_size, pipeline_id, options, roots, warmup, repeats):
    """One rank of the steady-state run: interleaved steps, saves and loads; its times per kind.

    It runs on the ranks, on the pipeline the session built there, and times each operation
    between barriers: a save, a load or a step that overlaps a background write are operations
    of a training loop on the rank, which no call from the client can bracket.
    """
    # the background writer's own group (as RankTrainer makes it)
    async_group = dist.new_group(backend="gloo")
    trainer = RankTrainer(built_pipeline(pipeline_id), options)
    sync = Checkpointer(roots["sync"], rank, options.keep)
    async_commit = Checkpointer(roots["async_commit"], rank, options.keep, async_save=True, group=async_group)
    async_overlap = Checkpointer(roots["async_overlap"], rank, options.keep, async_save=True,
                                 group=async_group)

    def step():
        trainer.checkpointer = None  # train() would save (and finish a pending save) at its end
        return trainer.train(until=trainer.step + 1)

    def save_with(checkpointer):
        trainer.checkpointer = checkpointer
        try:
            return trainer.save()
        finally:
            trainer.checkpointer = None

    times = {k: [] for k in ("step_plain", "sync_save", "async_blocking", "async_commit",
                             "async_overlap_blocking", "step_during_async", "async_finish_wait_after_step",
                             "async_overlap_commit", "load", *(f"hash_{h}" for h in HASHES))}
    last = {}
    for repeat in range(warmup + repeats):
        sample = {k: [] for k in times}

        def sync_save():
            seconds, path = _timed(lambda: save_with(sync))
            sample["sync_save"].append(seconds)
            return path

        def async_save_commit():
            dist.barrier()
            started = time.perf_counter()
            save_with(async_commit)
            sample["async_blocking"].append(time.perf_counter() - started)
            async_commit.finish()
            sample["async_commit"].append(time.perf_counter() - started)

        seconds, _ = _timed(step)
        sample["step_plain"].append(seconds)
        if repeat % 2 == 0:
            path = sync_save()
            async_save_commit()
        else:
            async_save_commit()
            path = sync_save()
        mine = [Path(path) / name for name in share(data_files(Path(path)), rank, world_size)]
        for algorithm in (HASHES if repeat % 2 == 0 else HASHES[::-1]):
            seconds, _ = _timed(lambda: [_hash_file(file, algorithm) for file in mine])
            sample[f"hash_{algorithm}"].append(seconds)
        seconds, _ = _timed(lambda: trainer.load(path))
        sample["load"].append(seconds)
        saved_step = trainer.step

        dist.barrier()
        started = time.perf_counter()
        save_with(async_overlap)
        blocked = time.perf_counter()
        history = step()  # runs while the checkpoint is written in the background
        stepped = time.perf_counter()
        async_overlap.finish()
        done = time.perf_counter()
        sample["async_overlap_blocking"].append(blocked - started)
        sample["step_during_async"].append(stepped - blocked)
        sample["async_finish_wait_after_step"].append(done - stepped)
        sample["async_overlap_commit"].append(done - started)

        seconds, _ = _timed(step)
        sample["step_plain"].append(seconds)
        if repeat >= warmup:  # the first repeats warm allocators, gloo connections, DCP's imports
            for k, values in sample.items():
                times[k].extend(values)
        last = dict(checkpoint=str(path), checkpoint_step=saved_step,
                    next_step=history.records[0].step, next_loss=history.losses[0],
                    checkpoint_bytes=_directory_bytes(Path(path)) if rank == 0 else None)
    dist.barrier()
    return dict(times=times, last=last)


class TimedLoadTrainer(RankTrainer):
    """A RankTrainer that times its own load (called from __init__ when options.resume is set)."""

    load_seconds = 0.0

    def load(self, path) -> None:
        started = time.perf_counter()
        super().load(path)
        self.load_seconds = time.perf_counter() - started


def rank_first_step(rank, world_size, spec, options):
    """From the rank function's start: build the trainer (loading when resuming), one step; wall clocks.

    It builds its own RankPipeline: it runs in fresh processes (`first_step`), whose start is
    part of what is measured, where no session has built anything.
    """
    entered = time.time()
    trainer = TimedLoadTrainer(RankPipeline(spec, rank), options)
    built = time.time()
    history = trainer.train(until=trainer.step + 1)
    ended = time.time()
    return dict(entered=entered, built=built, ended=ended, load=trainer.load_seconds, step=trainer.step,
                loss=history.losses[0])


def first_step(spec, options) -> dict:
    """One fresh launch: seconds from calling run_ranks to the slowest rank's first step end.

    Fresh processes, not a pool's: what resuming costs is compared with a whole restart
    (spawn, imports, process group), the situation a resume is for.
    """
    launched = time.time()
    per_rank = run_ranks(RANKS, rank_first_step, spec, options, timeout=TIMEOUT)
    return dict(total_s=max(r["ended"] for r in per_rank) - launched,
                processes_and_group_s=max(r["entered"] for r in per_rank) - launched,
                build_and_load_s=max(r["built"] - r["entered"] for r in per_rank),
                first_step_s=max(r["ended"] - r["built"] for r in per_rank),
                load_s=max(r["load"] for r in per_rank),
                # What resume can change: from the process group being up to the first step's end.
                in_process_s=max(r["ended"] - r["entered"] for r in per_rank),
                step=per_rank[0]["step"], loss=per_rank[0]["loss"])


def parameter_count(config: pplab.LlamaConfig) -> int:
    """The full model's parameter count (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in pplab.LlamaModel(config).parameters())


def median(values):
    """statistics.median of any iterable."""
    return statistics.median(values)


def measure(args) -> dict:
    config = make_config(args.hidden_size, args.layers, args.heads)
    spec = PipelineSpec.create(config, SCHEDULE, RANKS, MICROBATCHES, record=False)
    base = TrainOptions(steps=1000, batch_size=args.batch_size, seq_len=args.seq_len, eval_every=0,
                        keep=args.keep)
    base.check(MICROBATCHES)
    workdir = Path(tempfile.mkdtemp(prefix="pplab-bench-ckpt-", dir=args.dir))
    try:
        roots = {k: str(workdir / k) for k in ("sync", "async_commit", "async_overlap")}
        started = time.perf_counter()
        with pplab.RankPool(RANKS) as pool:  # stopped before the fresh launches below
            pipe = pplab.Pipeline(pool, spec)  # the spec the fresh launches below build too
            per_rank = run_ranks(RANKS, rank_steady, pipe.pipeline_id,
                                 replace(base, checkpoint_dir=roots["sync"]), roots, args.warmup,
                                 args.repeats,
                                 timeout=TIMEOUT, pool=pool)
        steady_wall = time.perf_counter() - started
        n = len(per_rank[0]["times"]["sync_save"])
        slowest = {k: [max(r["times"][k][i] for r in per_rank) for i in range(len(per_rank[0]["times"][k]))]
                   for k in per_rank[0]["times"]}
        last = per_rank[0]["last"]

        started = time.perf_counter()
        fresh, resumed = [], []
        resume_options = replace(base, resume=last["checkpoint"])
        first_step(spec, base)  # not counted: the first launch after the steady run reads files cold-ish
        for launch in range(args.launches):  # alternated, the order swapped every other launch
            order = [(fresh, base), (resumed, resume_options)]
            for runs, options in (order if launch % 2 == 0 else order[::-1]):
                runs.append(first_step(spec, options))
        launches_wall = time.perf_counter() - started
        fs_type = subprocess.run(["stat", "-f", "-c", "%T", str(workdir)], capture_output=True,
                                 text=True).stdout.strip() or "unknown"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {k: median(v) for k, v in slowest.items()}
    step = med["step_plain"]
    async_blocking_all = slowest["async_blocking"] + slowest["async_overlap_blocking"]
    # Per repeat: the step during the write over the mean of that repeat's two plain steps.
    plain_pairs = list(zip(slowest["step_plain"][0::2], slowest["step_plain"][1::2]))
    paired_slowdown = median(d / ((a + b) / 2) for d, (a, b) in zip(slowest["step_during_async"],
                                                                    plain_pairs))
    # What an async save costs the training loop in all: blocked in save(), the step's slowdown,
    # and the wait left when the next save (or finish) comes right after one step.
    async_loop_cost = [b + (d - (a + c) / 2) + w for b, d, (a, c), w in
                       zip(slowest["async_overlap_blocking"], slowest["step_during_async"], plain_pairs,
                           slowest["async_finish_wait_after_step"])]
    plain = [(a + b) / 2 for a, b in plain_pairs]

    def per_repeat(kind: str, over=None) -> list[float]:
        """kind / (the same repeat's mean plain step, or its `over`), one value per sample."""
        denominators = plain if over is None else slowest[over]
        return [x / denominators[i] for i, x in enumerate(slowest[kind])]

    def paired(*kinds: str, over=None) -> float:
        """Median of the per-repeat ratios: robust to the machine getting busier during the run."""
        return median([x for kind in kinds for x in per_repeat(kind, over)])

    resume_med = {k: median([r[k] for r in resumed]) for k in resumed[0] if k.endswith("_s")}
    fresh_med = {k: median([r[k] for r in fresh]) for k in fresh[0] if k.endswith("_s")}
    resume_losses = sorted({r["loss"] for r in resumed})
    ratios = dict(
        sync_save_over_step=med["sync_save"] / step,
        async_blocking_over_step=median(async_blocking_all) / step,
        async_commit_over_step=med["async_commit"] / step,
        async_step_slowdown=med["step_during_async"] / step,
        load_over_step=med["load"] / step,
        async_blocking_over_sync_save=median(async_blocking_all) / med["sync_save"],
        async_commit_over_sync_save=med["async_commit"] / med["sync_save"],
        async_loop_cost_over_sync_save=median(async_loop_cost) / med["sync_save"],
        resume_over_fresh_first_step=resume_med["total_s"] / fresh_med["total_s"],
    )
    ratios_paired = dict(
        sync_save_over_step=paired("sync_save"),
        async_blocking_over_step=paired("async_blocking", "async_overlap_blocking"),
        async_commit_over_step=paired("async_commit"),
        async_step_slowdown=paired_slowdown,
        load_over_step=paired("load"),
        async_blocking_over_sync_save=paired("async_blocking", "async_overlap_blocking", over="sync_save"),
        async_commit_over_sync_save=paired("async_commit", over="sync_save"),
        async_loop_cost_over_sync_save=median(c / s for c, s in zip(async_loop_cost, slowest["sync_save"])),
        **{f"hash_{h}_over_sync_save": paired(f"hash_{h}", over="sync_save") for h in HASHES},
        **{f"hash_{h}_over_load": paired(f"hash_{h}", over="load") for h in HASHES},
        resume_minus_fresh_s=median(r["total_s"] - f["total_s"] for r, f in zip(resumed, fresh)),
        resume_minus_fresh_in_process_s=median(r["in_process_s"] - f["in_process_s"]
                                               for r, f in zip(resumed, fresh)),
        # (step during the write + wait left) / (plain step + the write alone, after save() returned):
        # below 1, running the write beside the step saved time; at or above 1, it did not overlap.
        overlapped_over_one_after_another=median(
            (d + w) / (q + c - b) for d, w, q, c, b in
            zip(slowest["step_during_async"], slowest["async_finish_wait_after_step"], plain,
                slowest["async_commit"], slowest["async_blocking"])),
    )
    return dict(
        config=asdict(config), parameters=parameter_count(config),
        batch_size=args.batch_size, seq_len=args.seq_len, keep=args.keep,
        checkpoint_bytes=last["checkpoint_bytes"], checkpoint_filesystem=fs_type,
        warmup_repeats=args.warmup, repeats=n, launches_each=args.launches,
        median_s=dict(**med, async_blocking_all=median(async_blocking_all),
                      async_loop_cost=median(async_loop_cost)),
        min_s={k: min(v) for k, v in slowest.items()},
        samples_s=slowest,
        ratios=ratios,
        ratios_paired_per_repeat=ratios_paired,
        resume_to_first_step=dict(
            fresh_median_s=fresh_med, resume_median_s=resume_med,
            resume_minus_fresh_s=resume_med["total_s"] - fresh_med["total_s"],
            load_in_resume_median_s=resume_med["load_s"],
            resume_minus_fresh_paired_median_s=ratios_paired["resume_minus_fresh_s"],
            in_process_resume_minus_fresh_s=resume_med["in_process_s"] - fresh_med["in_process_s"],
            in_process_resume_minus_fresh_paired_median_s=ratios_paired["resume_minus_fresh_in_process_s"],
            fresh_runs=fresh, resume_runs=resumed,
            resumed_from_step=last["checkpoint_step"], resumed_first_step=resumed[0]["step"],
            resumed_first_loss=resume_losses, steady_run_loss_at_that_step=last["next_loss"],
            resume_loss_matches=resume_losses == [last["next_loss"]]
            and resumed[0]["step"] == last["next_step"],
            fresh_first_step=fresh[0]["step"]),
        wall_s=dict(steady=steady_wall, launches=launches_wall),
    )


def notes(row: dict, loadavg_before: float) -> list[str]:
    """What the numbers say, written from this run's numbers (not a fixed verdict)."""
    r, p, med = row["ratios"], row["ratios_paired_per_repeat"], row["median_s"]
    out = []
    if loadavg_before > 0.5:
        out.append(f"the machine was not idle (1-min load average {loadavg_before:.2f} before the run, "
                   f"on {os.cpu_count()} cores): absolute times drift; the paired per-repeat ratios "
                   f"(each quantity over the plain steps of its own repeat) are the ones to read")
    mb = row["checkpoint_bytes"] / 1e6
    out.append(f"checkpoint {mb:.1f} MB (model + AdamW moments + scheduler/RNG) on "
               f"{row['checkpoint_filesystem']}; a sync save is {p['sync_save_over_step']:.2f}x a step and "
               f"writes {mb / med['sync_save']:.0f} MB/s end to end (state dict, DCP planning collectives, "
               f"files, barriers, rename, keep-{row['keep']} pruning)")
    if p["async_blocking_over_sync_save"] < 1:
        out.append(f"async save blocks the loop for {p['async_blocking_over_sync_save']:.2f}x the sync save "
                   f"time ({p['async_blocking_over_step']:.2f}x a step): save() only builds the state dict "
                   "and copies it (staging), the write and the commit happen later")
    else:
        out.append("async save's blocking time is NOT below sync save's "
                   f"({p['async_blocking_over_sync_save']:.2f}x): on CPU, async_save still builds the state "
                   "dict and copies every tensor (staging) in the caller, and writing a few MB to the page "
                   "cache costs about as much as that copy, so there is little left to hide")
    if p["async_commit_over_sync_save"] > 1:
        out.append("with no step beside it, an async save takes "
                   f"{p['async_commit_over_sync_save']:.2f}x a sync save to be committed (the "
                   "staging copy and a new writer thread on top of the same write)")
    else:
        out.append("with no step beside it, an async save is committed in "
                   f"{p['async_commit_over_sync_save']:.2f}x a sync save's time")
    overlap = p["overlapped_over_one_after_another"]
    out.append(f"a step that runs while an async save is written takes {p['async_step_slowdown']:.2f}x a "
               f"plain step (paired; ratio of medians {r['async_step_slowdown']:.2f}x); that step plus the "
               f"wait left at finish is {overlap:.2f}x a plain step followed by the write alone, i.e. "
               + ("the write partly overlaps the step" if overlap < 0.9 else
                  "the write hardly overlaps the step: together they take about as long "
                  "as one after the other"
                  if overlap <= 1.1 else
                  "the write does not overlap the step: they take turns, and the turns cost extra")
               + ". DCP's writer is a Python thread in each rank (the GIL, serialisation, file writes, its "
               "own collectives) and the 2 ranks' main threads already keep both cores busy, so the write "
               "competes with the step; a pipeline step also waits for its slowest rank at every hop")
    verdict = ("an async save saves the loop time here" if p["async_loop_cost_over_sync_save"] < 0.85 else
               "about the same as a sync save, no gain "
               "here" if p["async_loop_cost_over_sync_save"] <= 1.15 else
               "an async save costs the loop MORE than a sync one here")
    out.append("everything an async save costs the loop (blocking + the overlapped step's slowdown + the "
               f"wait left at finish) is {p['async_loop_cost_over_sync_save']:.2f}x a sync save: {verdict}. "
               "Where the ranks leave CPU cores idle (GPU training) the background write can overlap; that "
               "is not measured on this machine")
    out.append(f"load is {p['load_over_step']:.2f}x a step; it reads a checkpoint just written, from the "
               "page cache (a cold read from disk would be slower)")
    share_mb = row["checkpoint_bytes"] / 1e6 / RANKS
    speeds = ", ".join(f"{h} {share_mb / med[f'hash_{h}']:.0f} MB/s" for h in HASHES)
    out.append(f"hashing a rank's share of the files (about {share_mb:.1f} MB, from the page cache): "
               f"{speeds}. xxh3-128, which pplab uses, is {p['hash_xxh3_128_over_sync_save']:.1%} of a sync "
               f"save and {p['hash_xxh3_128_over_load']:.1%} of a load (both include it); sha256 would be "
               f"{p['hash_sha256_over_sync_save']:.1%} of a save, crc32 "
               f"{p['hash_crc32_over_sync_save']:.1%}. Reading the file back dominates xxh3's time; sha256's "
               "is mostly the hash itself")
    resume = row["resume_to_first_step"]
    f, s = resume["fresh_median_s"], resume["resume_median_s"]
    spread = max(x["processes_and_group_s"] for x in resume["fresh_runs"] + resume["resume_runs"]) - \
        min(x["processes_and_group_s"] for x in resume["fresh_runs"] + resume["resume_runs"])
    out.append(f"resume to first step, whole launch: {s['total_s']:.2f} s vs fresh {f['total_s']:.2f} s "
               f"(median of paired differences {resume['resume_minus_fresh_paired_median_s']:+.2f} s). "
               "Process start (spawn, imports, process group, the same for both) dominates and varied "
               f"by {spread:.1f} s across launches, more than resuming adds, so the sign of the "
               "whole-launch difference is noise")
    out.append("what resume adds, in process (process group up -> first step done): "
               f"{s['in_process_s']:.2f} s vs {f['in_process_s']:.2f} s (paired "
               f"{resume['in_process_resume_minus_fresh_paired_median_s']:+.2f} s); the load itself "
               f"takes {resume['load_in_resume_median_s']:.2f} s in a fresh process. The resumed first "
               f"loss {'equals' if resume['resume_loss_matches'] else 'DIFFERS from'} the uninterrupted "
               "run's at the same step")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="interleaved repeats in the steady-state run")
    parser.add_argument("--warmup", type=int, default=1, help="repeats run first and not counted")
    parser.add_argument("--launches", type=int, default=4, help="fresh and resumed launches, each")
    parser.add_argument("--hidden-size", type=int, default=128, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (tiny: 8)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (KV heads: half)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (4 microbatches)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept per directory")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes")
    parser.add_argument("--quick", action="store_true", help="2 repeats, 1 launch each, tiny model")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.launches, args.hidden_size = 2, 1, 64
    for name in ("repeats", "launches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: give at least 1")

    results = dict(
        benchmark="checkpoint cost vs one training step: sync vs async save, load, resume to first step",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, pplab_version=pplab.__version__,
        python=platform.python_version(), cpu_count=os.cpu_count(), ranks=RANKS, schedule=SCHEDULE,
        microbatches=MICROBATCHES, backend="gloo", device="cpu", load_before=load())
    started = time.perf_counter()
    load_before = os.getloadavg()
    row = measure(args)
    results.update(row)
    results["loadavg_1_5_15_before_after"] = [load_before, os.getloadavg()]
    results["load_after"] = load()
    results["total_wall_s"] = time.perf_counter() - started
    results["notes"] = notes(row, load_before[0])

    med, r, p = row["median_s"], row["ratios"], row["ratios_paired_per_repeat"]
    print(f"model hidden={args.hidden_size} layers={args.layers} ({row['parameters'] / 1e6:.2f} M "
          f"parameters), checkpoint {row['checkpoint_bytes'] / 1e6:.1f} MB, {RANKS} ranks, {SCHEDULE} x "
          f"{MICROBATCHES} microbatches, {row['repeats']} repeats (slowest rank)")
    wait = [w / s for w, s in zip(row["samples_s"]["async_finish_wait_after_step"],
                                  row["samples_s"]["step_plain"][0::2])]
    table = [("plain step", med["step_plain"], 1.0, 1.0),
             ("sync save (committed)", med["sync_save"], r["sync_save_over_step"], p["sync_save_over_step"]),
             ("async save: blocking in save()", med["async_blocking_all"], r["async_blocking_over_step"],
              p["async_blocking_over_step"]),
             ("async save: until committed", med["async_commit"], r["async_commit_over_step"],
              p["async_commit_over_step"]),
             ("step during async write", med["step_during_async"], r["async_step_slowdown"],
              p["async_step_slowdown"]),
             ("async: wait left after that step", med["async_finish_wait_after_step"],
              med["async_finish_wait_after_step"] / med["step_plain"], statistics.median(wait)),
             ("async: whole cost to the loop", med["async_loop_cost"],
              med["async_loop_cost"] / med["step_plain"],
              None),
             ("load", med["load"], r["load_over_step"], p["load_over_step"]),
             *((f"hash a rank's share: {h}", med[f"hash_{h}"], med[f"hash_{h}"] / med["step_plain"], None)
               for h in HASHES)]
    print(f"  {'':34s} {'median':>11s}  {'/ step':>7s}  {'paired':>7s}")
    for name, seconds, ratio, paired in table:
        print(f"  {name:34s} {seconds * 1000:8.1f} ms  {ratio:7.2f}  "
              f"{'' if paired is None else f'{paired:7.2f}'}")
    print(f"  vs sync save (paired): async blocking {p['async_blocking_over_sync_save']:.2f}, async until "
          f"committed {p['async_commit_over_sync_save']:.2f}, async whole cost to the loop "
          f"{p['async_loop_cost_over_sync_save']:.2f}")
    resume = row["resume_to_first_step"]
    f, s = resume["fresh_median_s"], resume["resume_median_s"]
    print("  hashing, paired per repeat: " + ", ".join(
        f"{h} {p[f'hash_{h}_over_sync_save']:.1%} of a sync save, {p[f'hash_{h}_over_load']:.1%} of a load"
        for h in HASHES))
    print(f"resume to first step ({args.launches} launches each, alternated, after 1 uncounted; from the "
          f"run_ranks call to the slowest rank's first step end, medians):")
    print(f"  {'':8s} {'total':>8s} {'procs+pg':>9s} {'in process':>11s} {'build(+load)':>13s} "
          f"{'of it load':>11s} {'1st step':>9s}")
    for name, m in (("fresh", f), ("resume", s)):
        print(f"  {name:8s} {m['total_s']:7.2f}s {m['processes_and_group_s']:8.2f}s "
              f"{m['in_process_s']:10.2f}s {m['build_and_load_s']:12.2f}s {m['load_s']:10.2f}s "
              f"{m['first_step_s']:8.2f}s")
    print(f"  resume - fresh: whole launch {resume['resume_minus_fresh_s']:+.2f} s (medians), "
          f"{resume['resume_minus_fresh_paired_median_s']:+.2f} s (paired); in process "
          f"{resume['in_process_resume_minus_fresh_s']:+.2f} s (medians), "
          f"{resume['in_process_resume_minus_fresh_paired_median_s']:+.2f} s (paired); resumed at "
          f"step {resume['resumed_first_step']}, first loss "
          f"{'matches' if resume['resume_loss_matches'] else 'DOES NOT match'} the uninterrupted run")
    print("notes:")
    for line in results["notes"]:
        print(f"  - {line}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {output} ({results['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
