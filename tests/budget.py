"""The suite's budget: each file's worker-seconds and CPU-seconds, printed at the end of a run.

On 2 cores the suite is bound by CPU more than by its waits: a file's CPU-seconds (its worker's,
and those of every process the worker started: ranks, controllers, kernels, burners) say what
it costs the files that run beside it, its worker-seconds how long it holds a worker.

The suite's CPU-seconds are also given in units of this machine's `import torch` (its CPU-seconds,
the faster of two, measured at the start in processes of their own): a number to compare across
machines, whose cores differ in speed.

conftest.py registers `SuiteBudget` as a plugin, so that it sees every file (a conftest's own
hooks see only the tests under its folder, not the notebooks).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import psutil
import pytest

from pplab.drivers.cluster import records

FILE_SHARE_SECONDS = 120.0  # one file's share of the suite (about a tenth of its worker-seconds)
SUITE_CPU_SECONDS = 1450  # the suite's budget, on the 2-core class CI runs on (issue 66)


class ProcessTree:
    """CPU-seconds of a process and everything it started, never going back.

    A process's CPU time goes to its parent's children counts when the parent reaps it. One whose
    parent left the tree first (a fork server's engine, reparented to init) takes its CPU time with
    it when it ends: each such process's last count is remembered instead."""

    def __init__(self):
        self.root = psutil.Process()
        # (pid, start time): (CPU-seconds with its reaped children, its parent's key) at the last look
        self.seen: dict[tuple[int, float], tuple[float, tuple[int, float] | None]] = {}
        self.lost = 0.0  # the last counts of processes that ended outside the tree

    def cpu_seconds(self) -> float:
        now: dict[tuple[int, float], tuple[float, tuple[int, float] | None]] = {}
        ended = set()  # zombies: ended, not yet reaped (their children have left them already)
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                with process.oneshot():
                    key = (process.pid, records.started(process.pid))  # create_time() moves with the clock
                    zombie = process.status() == psutil.STATUS_ZOMBIE
                    times, parent = process.cpu_times(), process.ppid()
                parent_key = None if process == self.root else (parent, records.started(parent))
            except psutil.Error:
                continue
            if zombie:  # ended, not yet reaped: its times may read as nothing; its last count stands
                ended.add(key)
                if key in self.seen:
                    now[key] = self.seen[key]
                continue
            now[key] = (times.user + times.system + times.children_user + times.children_system, parent_key)
        for key, (count, parent_key) in self.seen.items():
            if key not in now and (parent_key not in now or parent_key in ended):
                self.lost += count  # ended, or left the tree, with no parent of ours to count it
        self.seen = now
        return sum(count for count, _ in now.values()) + self.lost


def import_torch_cpu_seconds() -> float:
    """CPU-seconds an `import torch` takes here, in a fresh process: the faster of two (the first
    may read the files from disk)."""
    def once() -> float:
        before = psutil.Process().cpu_times()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        after = psutil.Process().cpu_times()
        return (after.children_user + after.children_system) - (before.children_user + before.children_system)

    return min(once(), once())


def whole_suite(config) -> bool:
    """Whether this run is the whole suite: pyproject's testpaths, no -m, no -k."""
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr
            and not config.option.keyword)


class SuiteBudget:
    def __init__(self):
        self.per_file: dict[str, list[float]] = {}  # path: [worker-seconds, CPU-seconds]
        self.per_test: dict[str, list[float]] = {}  # node id: the same, all phases
        self._tree: ProcessTree | None = None  # this worker's processes
        self._counted: float | None = None  # this worker's CPU-seconds at its last report
        self._torch_import: list[float] = []  # measured beside the suite's start, on the controller
        self._measuring: threading.Thread | None = None

    def pytest_sessionstart(self, session):
        """On the controller (or a run without workers): time `import torch` beside the first tests."""
        if hasattr(session.config, "workerinput") or not whole_suite(session.config):
            return  # a worker, or a part of the suite: the budget line is the whole suite's
        measure = lambda: self._torch_import.append(import_torch_cpu_seconds())  # noqa: E731
        if not getattr(session.config.option, "numprocesses", None):
            measure()  # the tests run in this process: before they are counted
            return
        self._measuring = threading.Thread(target=measure, daemon=True)  # workers count their own
        self._measuring.start()

    def pytest_runtest_logstart(self, nodeid, location):
        """Where a worker's first test starts, its count starts."""
        if self._counted is None:
            self._tree = ProcessTree()
            self._counted = self._tree.cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """On a worker: a test's teardown report carries the CPU-seconds spent since the previous
        test's. (Once a test, not once a phase: each count reads every process's /proc entry,
        about 6 ms on a busy 2-core machine, 20 CPU-s over the suite's 3,200 phases.)"""
        outcome = yield
        if call.when != "teardown":
            return
        now = self._tree.cpu_seconds()
        spent, self._counted = now - self._counted, now
        outcome.get_result().user_properties.append(("cpu_seconds", spent))

    def pytest_runtest_logreport(self, report):
        """On the controller, from every worker: add up each file's time and CPU, all phases."""
        seconds = self.per_file.setdefault(report.nodeid.split("::")[0], [0.0, 0.0])
        cpu = dict(report.user_properties).get("cpu_seconds", 0.0)
        for seconds in (seconds, self.per_test.setdefault(report.nodeid, [0.0, 0.0])):
            seconds[0] += report.duration
            seconds[1] += cpu

    def pytest_terminal_summary(self, terminalreporter):
        """Each file's worker-seconds and CPU-seconds, the longest first; the files over their share;
        the suite's CPU in `import torch` units against its budget. (`--budget-json PATH` also writes
        every test's, to find where a file's seconds go.)"""
        if not self.per_file or hasattr(terminalreporter.config, "workerinput"):
            return
        total, cpu = (sum(seconds[i] for seconds in self.per_file.values()) for i in (0, 1))
        if self._measuring is not None:
            self._measuring.join(timeout=60)
        torch_import = self._torch_import[0] if self._torch_import else None
        path = terminalreporter.config.getoption("budget_json")
        if path:
            import json

            with open(path, "w") as file:
                json.dump({"files": self.per_file, "tests": self.per_test,
                           "import_torch_cpu_seconds": torch_import}, file, indent=1)
        write = terminalreporter.write_line
        terminalreporter.section(f"worker-seconds per file: {total:.0f} in all, {cpu:.0f} CPU-seconds")
        for path, (seconds, cpu_seconds) in sorted(self.per_file.items(), key=lambda item: -item[1][0]):
            over = "  OVER its share" if seconds > FILE_SHARE_SECONDS else ""
            write(f"{seconds:7.1f} s {cpu_seconds:7.1f} CPU-s  {path}{over}")
        over = [path for path, (seconds, _) in self.per_file.items() if seconds > FILE_SHARE_SECONDS]
        if over:
            write(f"{len(over)} file(s) over {FILE_SHARE_SECONDS:.0f} worker-seconds: split them or make "
                  "them cheaper")
        if not whole_suite(terminalreporter.config):
            write(f"CPU of this part of the suite: {cpu:.0f} CPU-s (the budget of {SUITE_CPU_SECONDS} CPU-s "
                  "is the whole suite's)")
            return
        verdict = "within" if cpu <= SUITE_CPU_SECONDS else "OVER"
        units = (f" = {cpu / torch_import:.0f} x this machine's `import torch` ({torch_import:.2f} CPU-s, "
                 "the faster of two)" if torch_import else "")
        write(f"suite CPU: {cpu:.0f} CPU-s{units}; {verdict} the budget of {SUITE_CPU_SECONDS} CPU-s "
              "(the 2-core class CI runs on)")
