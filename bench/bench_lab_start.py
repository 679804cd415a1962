"""Time to a ready lab against torchrun, and the cost of lab.run on a warm lab.

"Ready" means the same for both: one process per rank is up, torch is imported,
the gloo process group is initialised and one barrier is done.

* torchrun: `torchrun --standalone --nproc_per_node=N ready.py`, timed from launch
  until rank 0 has passed the barrier (it prints the time).
* lab, fresh kernel: a new Python process that has already imported pplab (as a
  notebook after its first cell) times `pplab.Lab(n_ranks=N)`, its first lab. Its client
  has not imported torch (the engines have theirs): the kernel imports it when it first
  needs it (a pipeline, a tensor in a result), timed apart as "client torch" and added
  in a second ratio, for a kernel whose next cell uses torch at once.
* lab, warm kernel, from nothing: `pplab.Lab(n_ranks=N)` in this process with nothing kept
  (ipyparallel already imported; its controller and fork server started afresh).
* lab, next in the process: `pplab.Lab(n_ranks=N)` after a lab of this process stopped, which
  kept its controller and fork server (pplab.drivers.cluster.kept): a learner's second lab.
  Goal (issue 66): at most 1 s here, and at most 0.25 of torchrun's time.
* restart: `lab.restart()` of a running lab (new engines forked from the kept fork server, on the
  same controller). Goal: at most 0.5 s here.

The trials are interleaved (torchrun, lab, lab warm, then the next repeat in
reverse order) so that a machine getting busier or quieter affects all alike; the
ratio (lab / torchrun, medians) is the result, not the absolute seconds.

Run: python bench/bench_lab_start.py [--repeats 3] [--n-ranks 2 4]   (about five minutes)
Writes bench/results/lab_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lab_start.json")

TORCHRUN_SCRIPT = """\
import datetime, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.barrier()
if dist.get_rank() == 0:
    print(f"READY {time.time()!r}", flush=True)
dist.destroy_process_group()
"""

FRESH_LAB_SCRIPT = """\
import sys, time
import pplab
started = time.perf_counter()
lab = pplab.Lab(n_ranks=int(sys.argv[1]), verbose=False)
print(f"READY {time.perf_counter() - started!r}", flush=True)
started = time.perf_counter()
import torch
print(f"CLIENT_TORCH {time.perf_counter() - started!r}", flush=True)
lab.stop()
"""


def time_torchrun(ranks: int, script: str, environment: dict) -> float:
    """Seconds from launching torchrun until its rank 0 has passed the first barrier."""
    launched = time.time()
    finished = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", script],
        capture_output=True, text=True, env=environment, timeout=300, check=True)
    return _ready_value(finished.stdout) - launched


def time_fresh_lab(ranks: int, environment: dict) -> tuple[float, float]:
    """Seconds a new process that has imported pplab takes to get its first ready lab, and then
    to import torch in that process."""
    finished = subprocess.run([sys.executable, "-c", FRESH_LAB_SCRIPT, str(ranks)],
                              capture_output=True, text=True, env=environment, timeout=300,
                              check=True)
    return _ready_value(finished.stdout), _ready_value(finished.stdout, "CLIENT_TORCH ")


def time_warm_lab(ranks: int, kept: bool) -> float:
    """Seconds `pplab.Lab(ranks)` takes in this (warm) process: on what the last lab kept, or with
    nothing kept (a start from nothing)."""
    import pplab
    from pplab.drivers.cluster.kept import kept_now, stop_kept

    if kept and kept_now() is None:  # a lab first, to keep its controller and fork server
        pplab.Lab(n_ranks=ranks, verbose=False).stop()
    if not kept:
        stop_kept()
    started = time.perf_counter()
    lab = pplab.Lab(n_ranks=ranks, verbose=False)
    elapsed = time.perf_counter() - started
    lab.stop()
    return elapsed


def time_restart(ranks: int) -> float:
    """Seconds `lab.restart()` takes on a running lab of this process."""
    import pplab

    with pplab.Lab(n_ranks=ranks, verbose=False) as lab:
        started = time.perf_counter()
        lab.restart()
        return time.perf_counter() - started


def _ready_value(stdout: str, prefix: str = "READY ") -> float:
    for line in stdout.splitlines():
        if line.startswith(prefix):
            return float(line.split()[1])
    raise RuntimeError(f"no {prefix.strip()} line in the output:\n{stdout}")


def noop():
    """The function whose round trip is measured."""


def time_noop_calls(ranks: int, calls: int) -> dict:
    """Median milliseconds of lab.run(noop), and of ipyparallel's own apply underneath it."""
    import pplab

    with pplab.Lab(n_ranks=ranks, verbose=False) as lab:
        for _ in range(20):  # warm up both paths
            lab.run(noop)
            lab.view.apply_async(noop).get()
        lab_run, raw_apply = [], []
        for _ in range(calls):  # interleaved, like the start-up trials
            started = time.perf_counter()
            lab.run(noop)
            lab_run.append(time.perf_counter() - started)
            started = time.perf_counter()
            lab.view.apply_async(noop).get()
            raw_apply.append(time.perf_counter() - started)
    return {"ranks": ranks, "calls": calls,
            "lab_run_ms": 1000 * statistics.median(lab_run),
            "ipyparallel_apply_ms": 1000 * statistics.median(raw_apply)}


def measure_start(ranks: int, repeats: int, script: str, environment: dict) -> dict:
    """Interleaved trials of the three ways to get N ready ranks; medians and ratios."""
    kinds = {"torchrun": lambda: time_torchrun(ranks, script, environment),
             "lab_fresh_kernel": lambda: time_fresh_lab(ranks, environment),
             "lab_warm_kernel": lambda: time_warm_lab(ranks, kept=False),
             "lab_next_in_process": lambda: time_warm_lab(ranks, kept=True),
             "restart": lambda: time_restart(ranks)}
    trials = {kind: [] for kind in kinds}
    client_torch = []  # after each fresh kernel's lab: its own `import torch`
    order = list(kinds)
    for repeat in range(repeats):
        for kind in order if repeat % 2 == 0 else reversed(order):
            seconds = kinds[kind]()
            if kind == "lab_fresh_kernel":
                seconds, imported = seconds
                client_torch.append(imported)
            trials[kind].append(seconds)
            print(f"  N={ranks} repeat {repeat + 1}/{repeats}: {kind:17s} {seconds:6.2f} s", flush=True)
    medians = {kind: statistics.median(values) for kind, values in trials.items()}
    then_torch = statistics.median(ready + imported for ready, imported in zip(trials["lab_fresh_kernel"],
                                                                               client_torch))
    return {"trials_s": trials, "median_s": medians, "client_torch_s": client_torch,
            "ratio_fresh_kernel": medians["lab_fresh_kernel"] / medians["torchrun"],
            "ratio_fresh_kernel_then_client_torch": then_torch / medians["torchrun"],
            "ratio_warm_kernel": medians["lab_warm_kernel"] / medians["torchrun"],
            "ratio_next_in_process": medians["lab_next_in_process"] / medians["torchrun"],
            "goals": {"next lab <= 1 s": medians["lab_next_in_process"] <= 1.0,
                      "next lab / torchrun <= 0.25":
                          medians["lab_next_in_process"] / medians["torchrun"] <= 0.25,
                      "restart <= 0.5 s": medians["restart"] <= 0.5}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--noop-calls", type=int, default=200)
    parser.add_argument("--output", default=RESULT_PATH)
    args = parser.parse_args()

    import ipyparallel
    import torch

    from pplab.drivers.cluster.plan import loopback_interface

    with tempfile.TemporaryDirectory(prefix="pplab-bench-") as scratch:
        # Both sides get the same settings a lab uses: one thread, gloo on loopback.
        os.environ["IPYTHONDIR"] = os.path.join(scratch, "ipython")  # no user profile touched
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": loopback_interface()}
        script = os.path.join(scratch, "ready.py")
        with open(script, "w") as file:
            file.write(TORCHRUN_SCRIPT)

        start = {}
        for ranks in args.n_ranks:
            print(f"time to ready ranks, N={ranks} (interleaved, {args.repeats} repeats)")
            start[str(ranks)] = measure_start(ranks, args.repeats, script, environment)
        print(f"lab.run(noop) on a warm 2-rank lab, {args.noop_calls} calls")
        noop_result = time_noop_calls(2, args.noop_calls)

    result = {
        "benchmark": "time to a ready lab vs torchrun --standalone; lab.run no-op overhead",
        "ready_means": "one process per rank up, torch imported, gloo group initialised, one barrier done",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "ipyparallel": ipyparallel.__version__,
                    "platform": platform.platform()},
        "repeats": args.repeats,
        "start": start,
        "noop": noop_result,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as file:
        json.dump(result, file, indent=2)

    print("\nresult (medians; ratio = lab / torchrun, goal <= 1.0)")
    for ranks, row in start.items():
        medians = row["median_s"]
        print(f"  N={ranks}: torchrun {medians['torchrun']:.2f} s | lab, fresh kernel "
              f"{medians['lab_fresh_kernel']:.2f} s (ratio {row['ratio_fresh_kernel']:.2f}) | "
              f"lab, warm kernel {medians['lab_warm_kernel']:.2f} s (ratio {row['ratio_warm_kernel']:.2f}) | "
              f"fresh kernel, then its own torch: ratio {row['ratio_fresh_kernel_then_client_torch']:.2f}")
        print(f"  N={ranks}: next lab in the process {medians['lab_next_in_process']:.2f} s (ratio "
              f"{row['ratio_next_in_process']:.2f}) | restart {medians['restart']:.2f} s | goals: "
              + ", ".join(f"{goal} {'met' if met else 'NOT met'}" for goal, met in row["goals"].items()))
    print(f"  lab.run(noop), 2 ranks: {noop_result['lab_run_ms']:.1f} ms "
          f"(ipyparallel apply alone: {noop_result['ipyparallel_apply_ms']:.1f} ms)")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
