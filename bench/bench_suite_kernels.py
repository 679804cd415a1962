"""The suite's notebook kernels: launched as jupyter_client launches them, against forked from the
worker's kernel zygote (tests/kernel_zygote.py), which imported torch, IPython's kernel and pplab once.

One trial starts a kernel through the suite's own kernel manager (conftest's
UnixSocketKernelManager), runs one cell that uses torch and pplab, and shuts the kernel down.
It counts the machine's CPU-seconds (every process: the kernel, the zygote's fork) and the wall
seconds. The zygote is started, and its imports counted, before the first forked trial: that
cost is paid once per test worker, and is reported apart.

The trials alternate (plain, forked, then forked, plain, ...) so that a machine getting busier
or quieter affects both alike; the ratio of medians (forked / plain) is the result.

Run: python bench/bench_suite_kernels.py [--repeats 5]
Writes bench/results/suite_kernels.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_PATH = os.path.join(HERE, "results", "suite_kernels.json")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the suite sets it

import conftest  # noqa: E402  (the suite's kernel manager)
import kernel_zygote  # noqa: E402
from pplab.base.machine import _machine_busy_seconds as machine_busy_seconds  # noqa: E402

CELL = "import torch, pplab; assert torch.ones(2).sum().item() == 2"


async def one_kernel() -> None:
    manager = conftest.UnixSocketKernelManager(kernel_name="python3")
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=120)
        reply = await client.execute_interactive(CELL, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
        await manager.shutdown_kernel()


def trial(forked: bool) -> dict:
    launch = kernel_zygote.launch_kernel
    if not forked:
        kernel_zygote.launch_kernel = lambda *args, **kwargs: False  # jupyter_client launches it
    busy, started = machine_busy_seconds(), time.perf_counter()
    try:
        asyncio.run(one_kernel())
    finally:
        kernel_zygote.launch_kernel = launch
    return {"cpu_s": machine_busy_seconds() - busy, "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    conftest._KERNEL_SOCKETS.append(tempfile.mkdtemp(prefix="pplab-bench-kernels-"))

    busy, started = machine_busy_seconds(), time.perf_counter()
    kernel_zygote._ZYGOTE.append(kernel_zygote.Zygote())  # what a worker's first kernel pays
    zygote = {"cpu_s": machine_busy_seconds() - busy, "wall_s": time.perf_counter() - started}
    trials = {"plain": [], "forked": []}
    try:
        for repeat in range(args.repeats):
            for forked in ((False, True) if repeat % 2 == 0 else (True, False)):
                result = trial(forked)
                trials["forked" if forked else "plain"].append(result)
                print(f"{'forked' if forked else 'plain ':6s} cpu {result['cpu_s']:5.2f} s  "
                      f"wall {result['wall_s']:5.2f} s", flush=True)
    finally:
        kernel_zygote.stop()

    medians = {kind: {key: statistics.median(t[key] for t in runs) for key in ("cpu_s", "wall_s")}
               for kind, runs in trials.items()}
    result = {
        "what": "a notebook kernel of the suite: start, one cell using torch and pplab, shut down",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "repeats": args.repeats,
        "zygote_start": zygote,
        "median": medians,
        "ratio_forked_over_plain": {key: medians["forked"][key] / medians["plain"][key]
                                    for key in ("cpu_s", "wall_s")},
        "trials": trials,
    }
    os.makedirs(os.path.dirname(RESULT_PATH), exist_ok=True)
    with open(RESULT_PATH, "w") as file:
        json.dump(result, file, indent=1)
    print(f"median per kernel: plain {medians['plain']['cpu_s']:.2f} CPU-s, {medians['plain']['wall_s']:.2f} "
          f"s; forked {medians['forked']['cpu_s']:.2f} CPU-s, {medians['forked']['wall_s']:.2f} s (the "
          f"zygote's own start, once a worker: {zygote['cpu_s']:.2f} CPU-s)")
    print(f"wrote {RESULT_PATH}")


if __name__ == "__main__":
    main()
