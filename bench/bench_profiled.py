"""Reading torch.profiler traces, and what pplab's profiler labels cost a step.

1. Import speed. A real run of p=8 ranks (gloo processes), 1f1b with m=64 microbatches, pplab's
   runtime, is profiled with torch.profiler (CPU activity, one active step) and every rank's
   trace written. `pplab.trace.read_profiler_traces` then reads the folder, on one core, in
   `--repeats` rounds: events per second and megabytes per second, and the time a 1 GB trace
   folder would take at that rate (extrapolated: reading is linear in the spans).
   Goal: a 1 GB folder in under a minute.

2. Label cost. Every compute action of both runtimes runs inside `record_function("PP:<action>")`.
   With no profiler active that costs one call in and one out. On 2 ranks (1f1b, m=8), steps with
   the labels and with them replaced by a no-op are timed in interleaved rounds (order reversed
   every other round); the ratio of medians is the cost. Beside it, the cost of one label measured
   alone times the labels of a step, over the step's time. Goal: <= 1 %.

Run: python bench/bench_profiled.py [--rounds N] [--repeats N]   (about two minutes)
Writes bench/results/profiled.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from measuring import load
from pplab.drivers.local import run_ranks
from pplab.models.llama import LlamaConfig
from pplab.trace import read_profiler_traces

RESULTS = Path(__file__).parent / "results" / "profiled.json"
GOAL_IMPORT_SECONDS_PER_GB, GOAL_LABEL_COST = 60.0, 0.01


def profiled_step(rank, world_size, n_microbatches, folder):
    """One warm-up and one profiled step of 1f1b on this rank; its trace written to `folder`."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from pplab.data import batches
    from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline, split_for_ranks

    spec = PipelineSpec.create(LlamaConfig.tiny(), "1f1b", world_size, n_microbatches, record=False)
    pipeline = RankPipeline(spec, rank)
    data = split_for_ranks(spec, next(batches(n_microbatches, 16, 0)))[rank]
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda done: done.export_chrome_trace(f"{folder}/rank{rank}.json")
                 ) as profiler:
        for _ in range(2):
            pipeline.step(data)
            profiler.step()


def timed_steps(rank, world_size, rounds):
    """Step times with pplab's labels and with a no-op in their place, in interleaved rounds."""
    import torch.distributed as dist

    from pplab.data import batches
    from pplab.rank import runtime
    from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline, split_for_ranks

    spec = PipelineSpec.create(LlamaConfig.tiny(), "1f1b", world_size, 8, record=False)
    pipeline = RankPipeline(spec, rank)
    data = split_for_ranks(spec, next(batches(16, 32, 0)))[rank]
    labelled, bare = runtime.record_function, lambda name: contextlib.nullcontext()
    times = {"labels": [], "no labels": []}
    for _ in range(3):
        pipeline.step(data)
    for round_ in range(rounds):
        order = ["labels", "no labels"] if round_ % 2 == 0 else ["no labels", "labels"]
        for variant in order:
            runtime.record_function = labelled if variant == "labels" else bare
            dist.barrier()
            started = time.perf_counter()
            pipeline.step(data)
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            times[variant].append(elapsed.item())
    runtime.record_function = labelled
    return times


def one_label_seconds(repeats: int = 20000) -> float:
    """What entering and leaving one record_function costs with no profiler active."""
    from torch.profiler import record_function

    started = time.perf_counter()
    for _ in range(repeats):
        with record_function("PP:0F0"):
            pass
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="reads of the trace folder")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of the label cost")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="pplab-bench-traces-") as folder:
        print(f"profiling 1f1b on {args.ranks} ranks, {args.microbatches} microbatches ...", flush=True)
        run_ranks(args.ranks, profiled_step, args.microbatches, folder, timeout=600)
        size = sum(os.path.getsize(path) for path in Path(folder).iterdir())
        reads = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            run = read_profiler_traces(folder)
            reads.append(time.perf_counter() - started)
        spans = sum(1 for path in Path(folder).iterdir()
                    for event in json.loads(path.read_text())["traceEvents"] if event.get("ph") == "X")
    read = statistics.median(reads)
    seconds_per_gb = read * 1e9 / size
    print(f"read {size / 1e6:.1f} MB, {spans} spans, {len(run.timeline)} events in {read:.2f} s: "
          f"{spans / read:,.0f} spans/s, {size / read / 1e6:.1f} MB/s -> 1 GB in {seconds_per_gb:.0f} s")

    print(f"timing steps with and without labels, {args.rounds} interleaved rounds ...", flush=True)
    times = run_ranks(2, timed_steps, args.rounds, timeout=600)[0]
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    ratio = medians["labels"] / medians["no labels"]
    label = one_label_seconds()
    labels_per_step = 2 * 8 * 2  # per rank: 8 forwards and 8 backwards, each label entered and left
    computed = label * labels_per_step / 2 / medians["no labels"]
    print(f"step {medians['labels'] * 1e3:.2f} ms with labels, {medians['no labels'] * 1e3:.2f} ms without: "
          f"ratio {ratio:.4f}; one label {label * 1e6:.2f} us -> {computed:.4%} of a step")

    result = dict(
        benchmark="bench_profiled", when=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__, load=load()),
        trace_import=dict(n_ranks=args.ranks, n_microbatches=args.microbatches, schedule="1f1b",
                          bytes=size, spans=spans, events=len(run.timeline), read_seconds=reads,
                          spans_per_second=spans / read, megabytes_per_second=size / read / 1e6,
                          one_gigabyte_seconds_extrapolated=seconds_per_gb,
                          goal_one_gigabyte_seconds=GOAL_IMPORT_SECONDS_PER_GB,
                          met=seconds_per_gb <= GOAL_IMPORT_SECONDS_PER_GB),
        label_cost=dict(n_ranks=2, n_microbatches=8, schedule="1f1b", rounds=args.rounds,
                        median_step_seconds=medians, ratio=ratio, one_label_seconds=label,
                        computed_fraction_of_step=computed, goal=GOAL_LABEL_COST,
                        met=ratio - 1 <= GOAL_LABEL_COST and computed <= GOAL_LABEL_COST),
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
