"""The suite's budget: each file's worker-seconds and CPU-seconds, printed at the end of a run.

On 2 cores the suite is bound by CPU more than by its waits: a file's CPU-seconds (its worker's,
and those of every process the worker started: ranks, controllers, kernels, burners) say what
it costs the files that run beside it, its worker-seconds how long it holds a worker.

conftest.py registers `SuiteBudget` as a plugin, so that it sees every file (a conftest's own
hooks see only the tests under its folder, not the notebooks).
"""

from __future__ import annotations

import psutil
import pytest

FILE_SHARE_SECONDS = 120.0  # one file's share of the suite (about a tenth of its worker-seconds)
SUITE_SECONDS = 540  # the suite's budget on 2 cores


def tree_cpu_seconds() -> float:
    """CPU-seconds of this process and of every live descendant, each with the children it reaped
    (a process that ended within a test is counted once its parent has reaped it)."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


class SuiteBudget:
    def __init__(self):
        self.per_file: dict[str, list[float]] = {}  # path: [worker-seconds, CPU-seconds]
        self.per_test: dict[str, list[float]] = {}  # node id: the same, all phases
        self._counted: float | None = None  # this worker's CPU-seconds at its last report

    def pytest_runtest_logstart(self, nodeid, location):
        """Where a worker's first test starts, its count starts."""
        if self._counted is None:
            self._counted = tree_cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """On a worker: a test's teardown report carries the CPU-seconds spent since the previous
        test's. (Once a test, not once a phase: each count reads every process's /proc entry,
        about 6 ms on a busy 2-core machine, 20 CPU-s over the suite's 3,200 phases.)"""
        outcome = yield
        if call.when != "teardown":
            return
        now = tree_cpu_seconds()
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
        """Each file's worker-seconds and CPU-seconds, the longest first; the files over their share.
        (`--budget-json PATH` also writes every test's, to find where a file's seconds go.)"""
        if not self.per_file or hasattr(terminalreporter.config, "workerinput"):
            return
        path = terminalreporter.config.getoption("budget_json")
        if path:
            import json

            with open(path, "w") as file:
                json.dump({"files": self.per_file, "tests": self.per_test}, file, indent=1)
        total, cpu = (sum(seconds[i] for seconds in self.per_file.values()) for i in (0, 1))
        write = terminalreporter.write_line
        terminalreporter.section(f"worker-seconds per file: {total:.0f} in all, {cpu:.0f} CPU-seconds")
        for path, (seconds, cpu) in sorted(self.per_file.items(), key=lambda item: -item[1][0]):
            over = "  OVER its share" if seconds > FILE_SHARE_SECONDS else ""
            write(f"{seconds:7.1f} s {cpu:7.1f} CPU-s  {path}{over}")
        over = [path for path, (seconds, _) in self.per_file.items() if seconds > FILE_SHARE_SECONDS]
        if over:
            write(f"{len(over)} file(s) over {FILE_SHARE_SECONDS:.0f} worker-seconds: split them or make "
                  f"them cheaper (the suite's budget is {SUITE_SECONDS} s on 2 cores)")
