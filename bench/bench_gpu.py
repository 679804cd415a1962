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
   read back with `pplab.trace`.

Run: python bench/bench_gpu.py --out DIR   (about four minutes on an H100/H200)
     python bench/bench_gpu.py --out DIR --device cpu   (the same flows on CPU: a dry run of this script)
Writes DIR/gpu.json (bench/results/gpu.json is the copy kept) and DIR/gpu_step_trace.json.gz.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
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
from pplab.model import LlamaConfig

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
        before = {r.step: r.loss for r in whole.records}
        after = {r.step: r.loss for r in resumed.records}
        out["losses"] = {"step_1": before[1], "step_50": before[50]}
        out["resume"] = {"steps_compared": sorted(after) == list(range(26, 51)),
                         "bitwise_equal": all(after[s] == before[s] for s in after),
                         "max_abs_diff": max(abs(after[s] - before[s]) for s in after)}
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
    whole, resumed = ({r["step"]: r["loss"] for r in json.loads((reports / f"{name}.json").read_text())["records"]}
                      for name in ("whole", "resumed"))
    out["losses"] = {"step_1": whole[1], "step_50": whole[50]}
    out["resume"] = {"steps": [min(resumed), max(resumed)],
                     "bitwise_equal": all(resumed[s] == whole[s] for s in resumed),
                     "max_abs_diff": max(abs(resumed[s] - whole[s]) for s in resumed)}
    return out


def two_ranks_on_one_gpu(device: str) -> dict:
    out = {}
    try:
        pplab.Lab(2, device="cuda", verbose=False).stop()
        out["forced_cuda"] = "started (not refused)"
    except ValueError as error:
        out["forced_cuda_refused"] = str(error)
    with pplab.Lab(2, verbose=False) as lab:
        out["auto"] = {"backend": lab.backend, "device": lab.device}
    return out


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
                     "middle_stage_I_plus_W_over_B": (middle.input_grad + middle.weight_grad) / middle.backward,
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

    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    spec = PipelineSpec.create(LlamaConfig.tiny(), "1f1b", world_size, 4, record=False)
    pipeline = RankPipeline(spec, rank, device)
    data = split_for_ranks(spec, next(batches(4, 64, 0)))[rank]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda done: done.export_chrome_trace(f"{folder}/rank{rank}.json")) as profiler:
        for _ in range(2):
            pipeline.step(data)
            profiler.step()
    return str(device)


def profiler_trace(device: str, out_dir: Path, work: Path) -> dict:
    from pplab.drivers.local import run_ranks
    from pplab.trace import read_profiler_traces

    folder = work / "trace"
    folder.mkdir()
    ran_on = run_ranks(1, traced_step_on_rank, str(folder), device, backend="nccl" if device == "cuda" else "gloo")
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
        "two_seats": lambda: two_seats(args.device),
        "profile": lambda: profile_costs(args.device),
        "bf16_stages": lambda: bf16_stages(args.device),
        "profiler_trace": lambda: profiler_trace(args.device, out_dir, work),
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
