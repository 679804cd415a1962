"""Where the suite's CPU-seconds go: by kind of process, not by test file.

The suite's budget (tests/budget.py) says what each file costs. This says what kind of work the
cost is, so that a plan to cut it starts from the right place: the ranks' and engines' own work
(what the checks compute), or the start-ups around it (controllers, fork servers importing torch,
kernels, torchrun launchers, `pplab` commands), or the test workers themselves.

It runs pytest in this checkout (by default the README's whole suite) and looks at every process
descended from it twice a second: each one's own CPU-seconds, its kind read from its command line
when first seen, its last count kept when it ends. A process that starts and ends between two
looks (under half a second) is not seen; the total says how much of the machine's busy time the
looks account for.

Run: python bench/bench_suite_cpu.py [--out PATH] [-- pytest arguments]
Writes bench/results/suite_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_PATH = os.path.join(HERE, "results", "suite_cpu.json")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from budget import import_torch_cpu_seconds  # noqa: E402
from measuring import load  # noqa: E402
from pplab.base.machine import _machine_busy_seconds as machine_busy_seconds  # noqa: E402

LOOK_EVERY_SECONDS = 0.5

# A process's kind by its command line (the first match); a process forked from a fork server or a
# kernel zygote carries its parent's command line, and is told apart by its parent (`kind_of`).
COMMAND_KINDS = [
    ("pplab.drivers.cluster.forkserver", "fork servers (torch imported once)"),
    ("multiprocessing.forkserver", "fork servers (torch imported once)"),
    ("kernel_zygote", "notebook kernels"),
    ("ipykernel", "notebook kernels"),
    ("ipyparallel.controller", "lab controllers"),
    ("ipyparallel.engine", "ranks and engines at work"),
    ("pplab.session.on_rank", "ranks and engines at work"),
    ("torch.distributed.run", "torchrun launchers"),
    ("-m pplab", "pplab commands"),
    ("bin/pplab", "pplab commands"),
    ("exec(eval(sys.stdin", "the test workers themselves"),
    ("-m pytest", "the test workers themselves"),
    ("while True", "CPU burners (tests under load)"),
]
BROWSER_AND_HUB = ("chromium", "playwright", "jupyterhub", "configurable-http-proxy", "jupyter-server",
                   "jupyter_server", "node")
FORKED_WORKERS = {"fork servers (torch imported once)": "ranks and engines at work",
                  "notebook kernels": "notebook kernels"}


def kind_of(command_line: list[str], parent_kind: str | None) -> str:
    """The kind of a process with `command_line` whose parent is of `parent_kind` (None: not ours)."""
    joined = " ".join(command_line)
    kind = next((kind for key, kind in COMMAND_KINDS if key in joined), None)
    if kind is not None and kind == parent_kind and kind in FORKED_WORKERS:
        return FORKED_WORKERS[kind]  # forked by a server or a zygote: what it forked
    if kind is not None:
        return kind
    if any(name in joined for name in BROWSER_AND_HUB):
        return "browsers, hubs and servers"
    if parent_kind == "torchrun launchers":
        return "ranks and engines at work"  # a torchrun job's rank runs the job's script
    return "other processes (scripts, shells, tools)"


class Looks:
    """Every process descended from `root` (or from one seen before), with its own CPU-seconds."""

    def __init__(self, root: int):
        self.root = root
        self.seen: dict[tuple[int, float], dict] = {}  # (pid, start time): kind, cpu
        self.ours: set[int] = {root}

    def look(self) -> None:
        by_pid = {key[0]: record for key, record in self.seen.items()}
        for process in psutil.process_iter(["pid", "ppid", "create_time", "cmdline", "cpu_times"]):
            info = process.info
            if info["cpu_times"] is None or (info["pid"] not in self.ours and info["ppid"] not in self.ours):
                continue
            key = (info["pid"], info["create_time"])
            record = self.seen.get(key)
            if record is None:
                parent = by_pid.get(info["ppid"])
                record = self.seen[key] = {"kind": kind_of(info["cmdline"] or [], parent and parent["kind"])}
                self.ours.add(info["pid"])
            record["cpu"] = info["cpu_times"].user + info["cpu_times"].system

    def by_kind(self) -> dict[str, dict]:
        kinds: dict[str, dict] = {}
        for record in self.seen.values():
            row = kinds.setdefault(record["kind"], {"cpu_s": 0.0, "processes": 0})
            row["cpu_s"] += record.get("cpu", 0.0)
            row["processes"] += 1
        return dict(sorted(kinds.items(), key=lambda item: -item[1]["cpu_s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULT_PATH)
    parser.add_argument("pytest_args", nargs="*",
                        help="after --: what to pass pytest (default: the whole suite)")
    args = parser.parse_args()
    torch_import = import_torch_cpu_seconds()
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args.pytest_args]
    # pytest's output, shown as it comes and read for its summary lines
    handle, log_path = tempfile.mkstemp(prefix="pplab-suite-cpu-", suffix=".log")
    os.close(handle)
    busy, started = machine_busy_seconds(), time.perf_counter()
    with open(log_path, "w") as log, open(log_path) as shown:
        pytest = subprocess.Popen(command, cwd=os.path.join(HERE, ".."), stdout=log, stderr=subprocess.STDOUT)
        looks = Looks(pytest.pid)
        while pytest.poll() is None:
            looks.look()
            print(shown.read(), end="", flush=True)
            time.sleep(LOOK_EVERY_SECONDS)
        print(shown.read(), end="", flush=True)
    with open(log_path) as log:
        lines = log.read().splitlines()
    os.remove(log_path)
    wall, machine = time.perf_counter() - started, machine_busy_seconds() - busy
    kinds = looks.by_kind()
    seen = sum(row["cpu_s"] for row in kinds.values())
    summary = next((line.strip("= ") for line in reversed(lines)
                    if " passed" in line or " failed" in line), "")
    budget = next((line for line in lines if line.startswith(("suite CPU:", "CPU of this part"))), "")
    print(summary)
    print(budget)
    print(f"{seen:.0f} CPU-s seen in the suite's processes ({seen / machine:.0%} of the machine's "
          f"{machine:.0f} busy CPU-s while it ran); `import torch` here: {torch_import:.2f} CPU-s")
    for kind, row in kinds.items():
        print(f"{row['cpu_s']:8.1f} CPU-s {row['cpu_s'] / seen:5.1%} {row['processes']:5d} processes  {kind}")
    result = {"command": " ".join(command[1:]), "summary": summary, "budget_line": budget,
              "wall_s": round(wall, 1), "machine_busy_cpu_s": round(machine, 1), "seen_cpu_s": round(seen, 1),
              "import_torch_cpu_s": round(torch_import, 2),
              "by_kind": {kind: {"cpu_s": round(row["cpu_s"], 1), "share": round(row["cpu_s"] / seen, 3),
                                 "processes": row["processes"]} for kind, row in kinds.items()},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": load()}}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    print(f"wrote {args.out}")
    sys.exit(pytest.returncode)


if __name__ == "__main__":
    main()
