"""The GPU path, checked by hand on a machine with one NVIDIA GPU (no CI machine has one).

What ../shared/GPU.md asks, each check on its own so that one failure leaves the others' results:

1. a 1-rank lab (CUDA, NCCL): a step's parity against one device (at the tolerances stated
   below), gradient flow, 50 training steps with a checkpoint at step 25, and a resume from it
   (losses compared step by step); the same training under torchrun (1 process, `pplab train`);
2. `Lab(2)` on one GPU: `device='cuda'` is refused with its message; auto falls back to CPU (gloo);
3. two labs (two seats) on the one GPU at once: each parity-checked, the GPU memory of each;
4. `pplab.profile` on the GPU for the tiny and the small config (F, B, I, W per stage; (I+W)/B),
   and the profiler's synchronised clock against CUDA events for the same forward;
5. bf16 stages: the loss against fp32's;
6. a torch.profiler trace of a GPU step (CPU and CUDA activity), gzipped beside the results and
   read back with `pplab.trace`;
7. ranks that share the GPU (messages through host memory over gloo): 4 ranks on it (parity and
   gradient flow on both runtimes, training with a checkpoint and a bitwise resume, a live step as
   the dashboard watches it, a profiled trace of the 4 ranks read back, one action timed by the
   host clock and by CUDA events); `pplab train` under torchrun with 2 processes on it; then 8
   seats of 2 ranks at once, each exact, with the device memory of each.

Run: python bench/bench_gpu.py --out DIR   (about four minutes on an H100/H200)
     python bench/bench_gpu.py --out DIR --device cpu   (the same flows on CPU: a dry run of this script;
     the shared-GPU checks then force host messages on CPU)
Writes DIR/gpu.json (bench/results/gpu.json is the copy kept) and DIR/gpu_step_trace.json.gz.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import pplab
from pplab.base.checkpoint_files import step_directory
from pplab.models.llama import LlamaConfig

# GPU tolerances: cuBLAS may pick other kernels (another summation order) than the CPU reference,
# so fp32 results agree to rounding, not bitwise. TF32 stays off (torch's default for matmul).
LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-4
BF16_LOSS_RTOL = 2e-2


def parity(pipe) -> dict:
    report = pipe.check_parity(loss_rtol=LOSS_RTOL, grad_atol=GRAD_ATOL)
    return {"passed": report.passed, "loss": report.loss, "reference_loss": report.reference_loss,
            "loss_rel_diff": report.loss_rel_diff, "max_grad_abs_diff": report.max_abs_diff,
            "loss_rtol": LOSS_RTOL, "grad_atol": GRAD_ATOL}


def gpu_memory_on_rank() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "reserved_mib": torch.cuda.memory_reserved() / 2**20}


def lab_one_rank(device: str, work: Path) -> dict:
    """A step, parity, gradient flow, 50 steps with a checkpoint, a resume from step 25."""
    out = {}
    with pplab.Lab(1, device=device, verbose=False) as lab:
        out["backend"], out["device"] = lab.backend, lab.device
        pipe = lab.pipeline(LlamaConfig.tiny(), "1f1b", 4)
        started = time.perf_counter()
        pipe.step()
        out["first_step_s"] = time.perf_counter() - started
        out["parity"] = parity(pipe)
        out["gradient_flow_passed"] = pipe.check_gradient_flow().passed
        pipe.close()
        checkpoints = work / "lab-checkpoints"
        options = dict(batch_size=16, seq_len=64, eval_every=0, checkpoint_dir=str(checkpoints),
                       checkpoint_every=25, show=False)
        pipe = lab.pipeline(LlamaConfig.tiny(), "1f1b", 4)
        started = time.perf_counter()
        whole = pipe.train(50, **options)
        out["train_50_steps_s"] = time.perf_counter() - started
        pipe.close()
        pipe = lab.pipeline(LlamaConfig.tiny(), "1f1b", 4)
        resumed = pipe.train(50, resume=str(step_directory(checkpoints, 25)), **options)
        pipe.close()
        out.update(compare_resumed(whole, resumed, 25, 50))
        out["memory"] = lab.run(gpu_memory_on_rank)[0]
    return out


def torchrun_one_rank(work: Path) -> dict:
    """`pplab train` under torchrun (1 process): 50 steps with a checkpoint at 25, then a resume."""
    checkpoints, reports = work / "torchrun-checkpoints", work / "torchrun-reports"
    reports.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "pplab", "train", "--steps", "50", "--n-microbatches", "4", "--eval-every", "0",
            "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "25"]
    out = {}
    for name, extra in (("whole", []), ("resumed", ["--resume", str(step_directory(checkpoints, 25))])):
        started = time.perf_counter()
        done = subprocess.run(base + extra + ["--report", str(reports / f"{name}.json")],
                              capture_output=True, text=True, timeout=240)
        out[f"{name}_s"] = time.perf_counter() - started
        out[f"{name}_rc"] = done.returncode
        if done.returncode:
            out[f"{name}_tail"] = (done.stdout + done.stderr)[-1500:]
            return out
    whole, resumed = ({r["step"]: r["loss"]
                       for r in json.loads((reports / f"{name}.json").read_text())["records"]}
                      for name in ("whole", "resumed"))
    out["losses"] = {"step_1": whole[1], "step_50": whole[50]}
    out["resume"] = {"steps": [min(resumed), max(resumed)],
                     "bitwise_equal": all(resumed[s] == whole[s] for s in resumed),
                     "max_abs_diff": max(abs(resumed[s] - whole[s]) for s in resumed)}
    return out


def two_ranks_on_one_gpu(device: str) -> dict:
    """Lab(2) on one GPU: NCCL forced is refused with its message; by default the ranks share it."""
    out = {}
    try:
        pplab.Lab(2, backend="nccl", verbose=False).stop()
        out["forced_nccl"] = "started (not refused)"
    except ValueError as error:
        out["forced_nccl_refused"] = str(error)
    with pplab.Lab(2, verbose=False) as lab:
        out["auto"] = {"backend": lab.backend, "device": lab.device, "placement": lab.placement}
    return out


def shared_lab(n_ranks: int, device: str, **options):
    """A lab whose ranks share the GPU (on CPU: host messages forced, the same path)."""
    return pplab.Lab(n_ranks, verbose=False, **options,
                     **({} if device == "cuda" else {"host_messages": True}))


def four_ranks_on_one_gpu(device: str, work: Path) -> dict:
    """4 ranks on the one GPU: parity on both runtimes, training and a bitwise resume, a live
    step, one action timed by the host clock and by CUDA events, the memory of each rank.
    Each part on its own: a failure is written down, the lab restarted, the next part run."""
    out = {}
    config = LlamaConfig.tiny()
    with shared_lab(4, device) as lab:
        out["placement"], out["gpus"], out["host_messages"] = lab.placement, lab.gpus, lab.host_messages

        def part(name, measure):
            try:
                out[name] = measure()
            except Exception as error:  # a finding; the other parts still run
                out[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
                if lab.state != "running":
                    lab.restart()

        for impl, schedule, n_virtual in (("pplab", "1f1b", 1), ("pplab", "zb-h1", 1),
                                          ("pplab", "interleaved-1f1b", 2),
                                          ("torch", "1f1b", 1), ("torch", "interleaved-1f1b", 2),
                                          ("torch", "zbv-zero-bubble", 2)):
            def checked(impl=impl, schedule=schedule, n_virtual=n_virtual):
                with lab.pipeline(config, schedule, 8, n_virtual=n_virtual, impl=impl) as pipe:
                    return {**parity(pipe), "gradient_flow_passed": pipe.check_gradient_flow().passed}
            part(f"parity {impl} {schedule}", checked)
        part("training", lambda: train_and_resume(lab, config, work))
        part("live_step", lambda: live_step(lab, config))
        part("one_forward_on_rank_1", lambda: lab.run(action_timed_three_ways, device)[1])
        part("memory_by_rank", lambda: lab.run(gpu_memory_on_rank))
    return out


def train_and_resume(lab, config, work: Path) -> dict:
    """20 steps of 1f1b with a checkpoint at 10; zb-h1 resumed from it must give the same losses."""
    checkpoints = work / "shared-checkpoints"
    options = dict(batch_size=16, seq_len=64, eval_every=10, checkpoint_dir=str(checkpoints),
                   checkpoint_every=10, show=False)
    out = {}
    with lab.pipeline(config, "1f1b", 8) as pipe:
        started = time.perf_counter()
        whole = pipe.train(20, **options)
        out["train_20_steps_s"] = time.perf_counter() - started
    with lab.pipeline(config, "zb-h1", 8) as pipe:
        resumed = pipe.train(20, resume=str(step_directory(checkpoints, 10)), **options)
    out.update(compare_resumed(whole, resumed, 10, 20))
    return out


def compare_resumed(whole, resumed, checkpoint_step: int, steps: int) -> dict:
    """The first and last loss of the whole run, and whether the resumed one repeats it bitwise."""
    before = {r.step: r.loss for r in whole.records}
    after = {r.step: r.loss for r in resumed.records}
    return {"losses": {"step_1": before[1], f"step_{steps}": before[steps]},
            "resume": {"steps_compared": sorted(after) == list(range(checkpoint_step + 1, steps + 1)),
                       "bitwise_equal": all(after[s] == before[s] for s in after),
                       "max_abs_diff": max(abs(after[s] - before[s]) for s in after)}}


def live_step(lab, config) -> dict:
    """A step watched as it runs (what the dashboard draws from): items streamed, each rank's forwards."""
    with lab.pipeline(config, "1f1b", 8) as pipe:
        live = pipe.start_step(live_interval=0.05)
        seen = []
        while not live.finished():
            seen.extend(live.poll())
            time.sleep(0.02)
        seen.extend(live.poll())
        result = live.result()
    events = result.timeline.events
    return {"items_streamed": len(seen), "events": len(events), "step_ms": result.timeline.step_time() * 1e3,
            "forward_ms_median_by_rank": {rank: 1e3 * sorted(e.end - e.start for e in events
                                                              if e.rank == rank and e.kind == "F")[4]
                                          for rank in range(lab.world_size)}}


def action_timed_three_ways(device: str) -> dict:
    """One stage's forward of a microbatch (a middle stage of tiny, 4 x 64 tokens): the host clock
    around the launch, the host clock around launch and synchronise, and CUDA events (medians of 9)."""
    import time  # (this runs on a rank: what it needs, it imports)

    import torch

    from pplab.models.llama import LlamaConfig
    from pplab.models.partition import build_stage
    from pplab.rank.rank_context import rank_context

    place = rank_context().device
    config = LlamaConfig.tiny()
    stage = build_stage(config, 1, 4, 0, place)
    x = torch.randn(4, 64, config.hidden_size, device=place)
    launch, synchronised, events = [], [], []
    for _ in range(12):
        if place.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        stage(x)
        launched = time.perf_counter()
        if place.type == "cuda":
            end.record()
            torch.cuda.synchronize()
        done = time.perf_counter()
        launch.append((launched - began) * 1e3)
        synchronised.append((done - began) * 1e3)
        if place.type == "cuda":
            events.append(start.elapsed_time(end))
    median = lambda values: sorted(values[3:])[len(values[3:]) // 2] if values else None  # noqa: E731
    return {"device": str(place), "host_launch_ms": median(launch),
            "host_synchronised_ms": median(synchronised),
            "cuda_events_ms": median(events)}


def torchrun_two_ranks_on_one_gpu(work: Path) -> dict:
    """`pplab train` under torchrun with 2 processes and one GPU: they share it (gloo, host messages)."""
    reports = work / "torchrun-shared"
    reports.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "pplab", "train", "--steps", "20", "--n-microbatches", "4", "--eval-every", "0",
               "--report", str(reports / "report.json")]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    out = {"seconds": time.perf_counter() - started, "rc": done.returncode}
    if done.returncode:
        out["tail"] = (done.stdout + done.stderr)[-1500:]
        return out
    records = json.loads((reports / "report.json").read_text())["records"]
    out["losses"] = {"step_1": records[0]["loss"], "step_20": records[-1]["loss"]}
    return out


def eight_seats(device: str, n_seats: int = 8) -> dict:
    """8 labs of 2 ranks at once on the one GPU, each parity-checked; the device memory of each."""
    labs = []
    try:
        for _ in range(n_seats):
            labs.append(shared_lab(2, device))
        pipes = [lab.pipeline(LlamaConfig.tiny(), "1f1b", 4) for lab in labs]
        steps = [pipe.start_step() for pipe in pipes]  # all seats at once
        for step in steps:
            step.result()
        seats = {f"seat_{i}": {"placement": lab.placement, "parity": parity(pipe),
                               "memory_by_rank": lab.run(gpu_memory_on_rank), "pids": lab.run(os.getpid)}
                 for i, (lab, pipe) in enumerate(zip(labs, pipes))}
        used = process_gpu_memory()
        for seat in seats.values():
            seat["device_memory_mib_by_rank"] = [used.get(pid) for pid in seat["pids"]]
        return seats
    finally:
        for lab in labs:
            lab.stop()


def allocate_gib(gib: float) -> str:
    """Try to hold `gib` GiB on this rank's device: "held", or the allocator's refusal."""
    import torch

    from pplab.rank.rank_context import rank_context

    try:
        block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=rank_context().device)
        del block
        return "held"
    except torch.OutOfMemoryError as error:
        return f"refused: {str(error).splitlines()[0][:200]}"


def memory_cap(device: str) -> dict:
    """A seat capped at 2 % of the GPU (`Lab(gpu_memory_fraction=0.02)`, 2.8 GiB of an H200): a step
    runs, 1 GiB is held, 8 GiB is refused on each rank; the seat's memory from nvidia-smi."""
    if device != "cuda":
        return {"skipped": "a cap on GPU memory: CUDA only"}
    lab = pplab.Lab(2, verbose=False, gpu_memory_fraction=0.02)
    try:
        pipe = lab.pipeline(LlamaConfig.tiny(), "1f1b", 4)
        return {"placement": lab.placement, "fraction": lab.gpu_memory_fraction, "parity": parity(pipe),
                "one_gib": lab.run(allocate_gib, 1.0), "eight_gib": lab.run(allocate_gib, 8.0),
                "device_memory_mib_by_rank": [process_gpu_memory().get(pid) for pid in lab.run(os.getpid)]}
    finally:
        lab.stop()


def process_gpu_memory() -> dict[int, float]:
    """MiB of device memory each process holds (its CUDA context included), as nvidia-smi reads it."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used = {}
    for line in done.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            used[int(pid)] = float(mib)
    return used


def two_seats(device: str) -> dict:
    """Two labs on the one GPU at once, each checked; the memory each holds."""
    labs = [pplab.Lab(1, device=device, verbose=False) for _ in range(2)]
    try:
        pipes = [lab.pipeline(LlamaConfig.tiny(), "1f1b", 4) for lab in labs]
        steps = [pipe.start_step() for pipe in pipes]  # both at once
        for step in steps:
            step.result()
        return {f"seat_{i}": {"parity": parity(pipe), "memory": lab.run(gpu_memory_on_rank)[0],
                              "backend": lab.backend, "device": lab.device}
                for i, (lab, pipe) in enumerate(zip(labs, pipes))}
    finally:
        for lab in labs:
            lab.stop()


def profile_costs(device: str) -> dict:
    out = {}
    for name, config, microbatch, seq_len, n_stages in (
            ("tiny", LlamaConfig.tiny(), 4, 64, 4),
            ("small", LlamaConfig.small(), 8, 512, 4)):
        if name == "small" and device == "cpu":
            continue  # minutes on CPU
        started = time.perf_counter()
        prof = pplab.profile(config, microbatch, seq_len, n_stages, device=device, threads=None, show=False)
        stages = [{k: getattr(s, k) * 1e3 for k in ("forward", "backward", "input_grad", "weight_grad")}
                  for s in prof.stages]
        middle = prof.stages[1]
        out[name] = {"microbatch": [microbatch, seq_len], "n_stages": n_stages, "ms": stages,
                     "middle_stage_I_plus_W_over_B":
                         (middle.input_grad + middle.weight_grad) / middle.backward,
                     "seconds": time.perf_counter() - started}
    if device == "cuda":
        out["small_forward_cuda_events_vs_clock"] = forward_by_cuda_events()
    return out


def forward_by_cuda_events() -> dict:
    """A middle stage's forward timed by CUDA events and by the profiler's synchronised clock."""
    from pplab.models.partition import build_stage

    config = LlamaConfig.small()
    stage = build_stage(config, 1, 4, 0, torch.device("cuda"))
    x = torch.randn(8, 512, config.hidden_size, device="cuda")
    for _ in range(3):
        stage(x)
    events, clock = [], []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        stage(x)
        end.record()
        torch.cuda.synchronize()
        clock.append((time.perf_counter() - began) * 1e3)
        events.append(start.elapsed_time(end))
    events.sort(), clock.sort()
    return {"cuda_events_median_ms": events[3], "synchronised_clock_median_ms": clock[3]}


def bf16_stages(device: str) -> dict:
    with pplab.Lab(1, device=device, verbose=False) as lab:
        losses = {}
        for dtype in ("float32", "bfloat16"):
            pipe = lab.pipeline(LlamaConfig.tiny(), "1f1b", 4, param_dtype=dtype)
            losses[dtype] = pipe.step().loss
            pipe.close()
    rel = abs(losses["bfloat16"] - losses["float32"]) / abs(losses["float32"])
    return {"losses": losses, "rel_diff": rel, "rtol": BF16_LOSS_RTOL, "within": rel <= BF16_LOSS_RTOL}


def traced_step_on_rank(rank, world_size, folder, device):
    """One warm-up and one profiled step of 1f1b with CPU and CUDA activity; the trace written."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from pplab.data import batches
    from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline, split_for_ranks

    # Ranks beyond the GPUs share them (their group is gloo's: messages through host memory).
    device = (torch.device(device, rank % torch.cuda.device_count()) if device == "cuda"
              else torch.device(device))
    spec = PipelineSpec.create(LlamaConfig.tiny(), "1f1b", world_size, 4, record=False)
    pipeline = RankPipeline(spec, rank, device)
    data = split_for_ranks(spec, next(batches(4, 64, 0)))[rank]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda done: done.export_chrome_trace(f"{folder}/rank{rank}.json")
                 ) as profiler:
        for _ in range(2):
            pipeline.step(data)
            profiler.step()
    return str(device)


def profiler_trace_shared(device: str, work: Path) -> dict:
    """A profiled step of 4 ranks sharing the GPU, read back: each action's span on the device."""
    from pplab.drivers.local import run_ranks
    from pplab.trace import read_profiler_traces

    folder = work / "trace-shared"
    folder.mkdir()
    ran_on = run_ranks(4, traced_step_on_rank, str(folder), device, backend="gloo")
    run = read_profiler_traces(sorted(str(path) for path in folder.glob("rank*.json")))
    events = run.timeline.events
    by_kind = {}
    for kind in ("F", "B", "SEND_F", "RECV_F"):
        spans = sorted((e.end - e.start) * 1e3 for e in events if e.kind == kind)
        if spans:
            by_kind[kind] = {"count": len(spans), "median_ms": spans[len(spans) // 2]}
    return {"ran_on": ran_on, "events": len(events), "ranks": sorted({e.rank for e in events}),
            "step_time_ms": run.timeline.step_time() * 1e3, "by_kind": by_kind}


def device_timed_step_on_rank(rank, world_size, folder, device, impl, batch=(8, 512)):
    """Two real-mode steps of 1f1b (the small config, 4 microbatches of `batch` / 4), the second
    under torch.profiler with CUDA activity: that step's events (times on the step's clock) and the
    device's memory, with the trace written beside the other ranks'."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from pplab.data import batches
    from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline, split_for_ranks

    device = (torch.device(device, rank % torch.cuda.device_count()) if device == "cuda"
              else torch.device(device))
    on_gpu = device.type == "cuda"  # (a dry run on CPU takes the tiny config, 8 x 64 tokens)
    spec = PipelineSpec.create(LlamaConfig.small() if on_gpu else LlamaConfig.tiny(), "1f1b", world_size, 4,
                               impl=impl)
    pipeline = RankPipeline(spec, rank, device)
    data = split_for_ranks(spec, next(batches(batch[0], batch[1] if on_gpu else 64, 0)))[rank]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda done: done.export_chrome_trace(f"{folder}/rank{rank}.json")
                 ) as profiler:
        for _ in range(2):
            step = pipeline.step(data)
            profiler.step()
    return {"timed_on": step.timed_on, "device_memory": step.device_memory,
            "events": [(e.kind, e.stage, e.microbatch, e.start, e.end) for e in step.events]}


def device_timed_step(device: str, work: Path, impl: str = "pplab", batch=(8, 512)) -> dict:
    """Issue 42 part 2: a step of 2 ranks sharing the GPU, timed on the step's device clock, against
    the same step's profiler trace: per compute action, the duration pplab's timeline gives, the
    kernels' span on the device, and the host's span of its label (the launch)."""
    from pplab.drivers.local import run_ranks
    from pplab.trace import read_profiler_traces

    folder = work / f"device-timed-{impl}-{batch[0]}x{batch[1]}"
    folder.mkdir()
    by_rank = run_ranks(2, device_timed_step_on_rank, str(folder), device, impl, batch, backend="gloo")
    paths = sorted(str(path) for path in folder.glob("rank*.json"))
    traced = {(e.rank, e.kind, e.stage, e.microbatch): (e.end - e.start) * 1e3
              for e in read_profiler_traces(paths).timeline.events if e.kind in ("F", "B")}
    host = {}  # the CPU span of each action's label: how long the host took to launch it
    for rank, path in enumerate(paths):
        for span in json.loads(Path(path).read_text()).get("traceEvents", []):
            match = re.fullmatch(r"PP:(\d+)([FB])(\d+)", span.get("name", ""))
            if match and span.get("cat") == "user_annotation":
                stage, kind, microbatch = int(match[1]), match[2], int(match[3])
                host[(rank, kind, stage, microbatch)] = span["dur"] / 1e3
    rows = []
    for rank, result in enumerate(by_rank):
        for kind, stage, microbatch, start, end in result["events"]:
            key = (rank, kind, stage, microbatch)
            if kind in ("F", "B") and key in traced:
                rows.append({"action": f"rank {rank} {stage}{kind}{microbatch}",
                             "pplab_ms": (end - start) * 1e3,
                             "trace_device_ms": traced[key], "host_label_ms": host.get(key)})
    median = lambda values: sorted(values)[len(values) // 2] if values else None  # noqa: E731
    summary = {}
    for kind in ("F", "B"):
        mine = [r for r in rows if f"{kind}" in r["action"].split()[-1]]
        summary[kind] = {"count": len(mine), "pplab_median_ms": median([r["pplab_ms"] for r in mine]),
                         "trace_device_median_ms": median([r["trace_device_ms"] for r in mine]),
                         "host_label_median_ms": median([r["host_label_ms"] for r in mine
                                                         if r["host_label_ms"]]),
                         "median_relative_difference": median([abs(r["pplab_ms"] - r["trace_device_ms"])
                                                               / r["trace_device_ms"] for r in mine])}
    return {"impl": impl, "batch": batch, "timed_on": [r["timed_on"] for r in by_rank],
            "device_memory_mib": [{k: v / 2**20 for k, v in (r["device_memory"] or {}).items()}
                                  for r in by_rank],
            "by_kind": summary, "actions": rows[:8]}


def profiler_trace(device: str, out_dir: Path, work: Path) -> dict:
    from pplab.drivers.local import run_ranks
    from pplab.trace import read_profiler_traces

    folder = work / "trace"
    folder.mkdir()
    ran_on = run_ranks(1, traced_step_on_rank, str(folder), device,
                       backend="nccl" if device == "cuda" else "gloo")
    raw = folder / "rank0.json"
    kept = out_dir / "gpu_step_trace.json.gz"
    with open(raw, "rb") as source, gzip.open(kept, "wb") as target:
        shutil.copyfileobj(source, target)
    trace = json.loads(raw.read_text())
    kernels = sum(1 for e in trace.get("traceEvents", []) if e.get("cat") == "kernel")
    out = {"ran_on": ran_on[0], "raw_bytes": raw.stat().st_size, "gzipped_bytes": kept.stat().st_size,
           "cuda_kernel_events": kernels}
    try:
        run = read_profiler_traces([str(raw)])
        timeline = run.timeline
        out["imported"] = {"events": len(timeline.events),
                           "kinds": sorted({e.kind.name if hasattr(e.kind, "name") else str(e.kind)
                                            for e in timeline.events}),
                           "step_time_ms": timeline.step_time() * 1e3}
    except Exception as error:  # what the import says of a GPU trace is itself a finding
        out["import_error"] = f"{type(error).__name__}: {error}"
    return out


def environment() -> dict:
    facts = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
             "torch": torch.__version__, "cuda": torch.version.cuda, "host_cpus": os.cpu_count()}
    if torch.cuda.is_available():
        facts.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                     nccl=".".join(map(str, torch.cuda.nccl.version())),
                     tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu.json and the trace")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", nargs="*", default=None, help="run these checks only")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "tolerances": {"loss_rtol": LOSS_RTOL, "grad_atol": GRAD_ATOL},
               "checks": {}}
    work = Path(tempfile.mkdtemp(prefix="pplab-gpu-"))
    checks = {
        "lab_one_rank": lambda: lab_one_rank(args.device, work),
        "torchrun_one_rank": lambda: torchrun_one_rank(work),
        "two_ranks_on_one_gpu": lambda: two_ranks_on_one_gpu(args.device),
        "four_ranks_on_one_gpu": lambda: four_ranks_on_one_gpu(args.device, work),
        "torchrun_two_ranks_on_one_gpu": lambda: torchrun_two_ranks_on_one_gpu(work),
        "eight_seats": lambda: eight_seats(args.device),
        "profiler_trace_shared": lambda: profiler_trace_shared(args.device, work),
        "two_seats": lambda: two_seats(args.device),
        "profile": lambda: profile_costs(args.device),
        "bf16_stages": lambda: bf16_stages(args.device),
        "profiler_trace": lambda: profiler_trace(args.device, out_dir, work),
        "device_timed_step": lambda: device_timed_step(args.device, work),
        "device_timed_step_torch": lambda: device_timed_step(args.device, work, "torch"),
        "device_timed_step_long": lambda: device_timed_step(args.device, work, "pplab", (32, 1024)),
        "memory_cap": lambda: memory_cap(args.device),
    }
    for name, check in checks.items():
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            results["checks"][name] = {"result": check()}
        except Exception as error:
            results["checks"][name] = {"error": f"{type(error).__name__}: {error}",
                                       "traceback": traceback.format_exc()[-3000:]}
        results["checks"][name]["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(results["checks"][name], indent=1, default=str)[:3000], flush=True)
        (out_dir / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
