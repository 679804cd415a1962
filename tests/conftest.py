"""Shared fixtures: a sandboxed IPYTHONDIR, one lab for the session, labs on demand, no leaks.

* `ipython_dir` (session, automatic): a temporary IPYTHONDIR, so tests never touch
  the user's profiles; at the end of the run it FAILS the run if any controller,
  engine or engine fork server started under it is still alive (and kills it).
* `lab2`: a 2-rank CPU/gloo lab shared by the whole session (restarted first if an
  earlier test left it needing a restart). Use it for anything that does not
  break or reconfigure the lab.
* `lab_factory`: `lab_factory(n_ranks=4, op_timeout=3, ...)` starts a lab of your own;
  every lab it started is stopped after the test, passed or failed. A lab that stops cleanly
  keeps its controller and fork server for the worker's next lab (pplab.drivers.cluster.kept),
  which so starts in about a second; `fresh_start` gives a test a start from nothing.
* Notebook kernels (nbmake's, the exercises') talk to their client over Unix sockets
  (`UnixSocketKernelManager`), not TCP ports: no port for another process to take first.
  (This conftest is loaded when tests/ is collected; `pytest notebooks/` alone uses TCP.)
  Each is forked from its worker's kernel zygote, which imported torch and pplab once
  (kernel_zygote.py; as jupyter_client launches it where that cannot be done).

Under pytest-xdist (on by default, see pyproject) each worker is a session of its own: its
own IPYTHONDIR, session lab and pools.

Plain-process ranks come from `tests/ranks.py`: one RankPool per number of ranks, stopped
with the session.

The quick tier (`pytest -m quick`, the inner loop) is the tests marked `quick`: they
start no process, and this conftest makes sure of it (starting one fails the test).
"""

from __future__ import annotations

import math
import os

import psutil
import pytest
from jupyter_client.manager import AsyncKernelManager

from budget import SuiteBudget

# This process, and the notebook kernels nbmake starts, share the cores with the ranks: one
# torch thread each, as every rank has (pplab.Lab's threads=1). Two OpenMP threads spinning
# against busy ranks made a one-device reference step several times slower. (Read by torch when it loads.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

LAB_PROCESS_MARKERS = ("ipyparallel.controller", "ipyparallel.engine", "ipcontroller",
                       "ipengine", "pplab.drivers.cluster.forkserver")


def lab_processes(ipython_dir: str) -> list[psutil.Process]:
    """Live controller, engine and fork-server processes started under `ipython_dir`."""
    found = []
    for process in psutil.process_iter(["cmdline", "environ", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if not any(marker in command for marker in LAB_PROCESS_MARKERS):
            continue
        environment = process.info["environ"] or {}
        started_here = (environment.get("IPYTHONDIR", "").startswith(ipython_dir)
                        or environment.get("IPP_PROFILE_DIR", "").startswith(ipython_dir)
                        or ipython_dir in command)
        if started_here:
            found.append(process)
    return found


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core (cpu_count, not xdist's count of physical cores).

    Not one more on a quiet machine (364d25e to 8243342): a third worker on 2 cores loaded the
    crowded-room test (three attendees' labs and two burners) past what it is about, and one
    attendee's three straggler verdicts came out undecided in a quiet fresh-clone run; nor was
    it faster where it counts (CI's machine: 712 s of pytest with three, 626 s with two)."""
    return os.cpu_count() or 1


# --- notebook kernels on Unix sockets ---------------------------------------------------------

_KERNEL_SOCKETS: list[str] = []  # the folder the kernels' sockets go in (made in pytest_configure)


class UnixSocketKernelManager(AsyncKernelManager):
    """A kernel reached over Unix sockets, each kernel's in a folder of its own.

    Over TCP the client picks five free ports and the kernel binds them a second or two later,
    when it has started; meanwhile another process of a busy run (a rank, a gloo connection)
    may take one, and the kernel dies with "Address already in use". A socket file in a
    fresh folder cannot be taken."""

    def __init__(self, **kwargs):
        import tempfile

        kwargs.setdefault("transport", "ipc")
        kwargs.setdefault("ip", os.path.join(tempfile.mkdtemp(dir=_KERNEL_SOCKETS[0]), "kernel"))
        super().__init__(**kwargs)

    async def _async_launch_kernel(self, kernel_cmd, **kwargs):
        """Fork the kernel from this worker's zygote, whose torch is imported (kernel_zygote.py),
        where it can; else launch it as jupyter_client does."""
        import kernel_zygote

        if not kernel_zygote.launch_kernel(self.provisioner, kernel_cmd, **kwargs):
            return await super()._async_launch_kernel(kernel_cmd, **kwargs)
        self._reconcile_connection_info(self.provisioner.connection_info)


def pytest_addoption(parser):
    parser.addoption("--budget-json", metavar="PATH", help="write each file's and each test's worker-seconds "
                     "and CPU-seconds to PATH (JSON), besides the table printed at the end")


def pytest_configure(config):
    """nbmake's notebook runs start their kernels through `UnixSocketKernelManager` too; the
    suite's budget (budget.py) counts every file's seconds, the notebooks' too."""
    import tempfile

    import nbmake.nb_run
    from nbclient.client import NotebookClient
    from traitlets import default

    if getattr(nbmake.nb_run, "NotebookClient", None) is not NotebookClient:
        raise pytest.UsageError("nbmake no longer runs notebooks through nbclient's NotebookClient: "
                                "give its kernels Unix sockets some other way (tests/conftest.py)")

    class UnixSocketNotebookClient(NotebookClient):
        @default("kernel_manager_class")
        def _unix_socket_kernels(self):
            return UnixSocketKernelManager

    nbmake.nb_run.NotebookClient = UnixSocketNotebookClient
    _KERNEL_SOCKETS.append(tempfile.mkdtemp(prefix="pplab-kernel-sockets-"))
    # A plugin, not hooks of this conftest: those would see the tests under tests/ only.
    config.pluginmanager.register(SuiteBudget(), "pplab-suite-budget")


def pytest_unconfigure(config):
    import shutil

    import kernel_zygote

    kernel_zygote.stop()

    for folder in _KERNEL_SOCKETS:
        shutil.rmtree(folder, ignore_errors=True)


# The files that take a minute or more on 2 cores start first, so that no worker is left running
# a long one alone at the end. (pyproject's --no-loadscope-reorder keeps this order: without it
# pytest-xdist 3.6+ silently reorders the files by their number of tests.)
LONGEST_FIRST = ["test_crowded_room.py", "test_exercises_01_to_09.py", "test_cluster.py",
                 "12_multi_host_and_faults.ipynb",
                 "test_cli.py", "test_hosts.py", "test_browser.py", "08_training_and_checkpoints.ipynb",
                 "test_mesh.py",
                 "15_train_on_a_mesh_with_real_text.ipynb", "17_pp_vs_data_parallel.ipynb",
                 "14_your_own_model.ipynb",
                 "16_explain_a_real_run.ipynb", "test_mesh_training.py", "10_predict_before_you_run.ipynb",
                 "test_exercises_10_on.py"]


def pytest_collection_modifyitems(config, items):
    """The longest files go first. (Under xdist, `--dist loadfile` in pyproject keeps a file's
    tests on one worker, so that its module-scoped labs and kernels start once. Not `loadgroup`
    with a group per file: on pytest 9.2 its groups are silently dropped, pytest-xdist#1386.)

    An exercise notebook runs once: where the test_exercises files' cases of it are collected, its
    kernel runs every cell of the notebook (as shipped, then each answer), so nbmake's run of it
    is left out."""
    worked = {item.callspec.params["stem"] for item in items
              if item.path.name.startswith("test_exercises") and hasattr(item, "callspec")}
    again = [item for item in items if item.path.suffix == ".ipynb" and item.path.stem in worked]
    if again:
        config.hook.pytest_deselected(items=again)
        items[:] = [item for item in items if item not in again]
    # Then the other notebooks (a lab, a kernel and half a minute each), then the other test files:
    # a worker that ends on a short file leaves no long tail for the others to wait out.
    first = {name: index for index, name in enumerate(LONGEST_FIRST)}
    # stable
    items.sort(key=lambda item: first.get(item.path.name, len(first) + (item.path.suffix != ".ipynb")))


@pytest.fixture(scope="session", autouse=True)
def ipython_dir(tmp_path_factory):
    """A temporary IPYTHONDIR for the session; fails the run if a lab process outlives it."""
    path = str(tmp_path_factory.mktemp("ipython"))
    previous = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = path
    yield path
    from pplab.drivers.cluster.kept import stop_kept
    from ranks import stop_pools

    stop_pools()  # the RankPools of tests/ranks.py
    stop_kept()  # the controller and fork server the last lab kept for a next one
    if previous is None:
        os.environ.pop("IPYTHONDIR", None)
    else:
        os.environ["IPYTHONDIR"] = previous
    # Give processes that are on their way out (e.g. ipyparallel's nannies) a moment.
    _, leaked = psutil.wait_procs(lab_processes(path), timeout=5)
    described = [f"pid {process.pid}: {' '.join(process.cmdline())[:120]}" for process in leaked]
    for process in leaked:
        process.kill()  # never leave them to the next CI job
    if leaked:
        pytest.fail(f"{len(leaked)} lab process(es) outlived the tests:\n" + "\n".join(described),
                    pytrace=False)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test's own `@pytest.mark.timeout(s)` (a bound against a hang, set on a quiet machine) is
    stretched by the machine's slowdown when the test starts, as pplab stretches its own waits:
    beside two burners a lab's restart took 36 s instead of 4 and tests hit bounds of 60 and 90 s.
    (Before pytest-timeout's own wrapper, which reads the mark.)"""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args and marker.args[0]:
        from pplab.base.machine import recent_load

        seconds = marker.args[0]
        # pyproject's --timeout: never past it
        every_test = float(item.config.getoption("timeout") or seconds)
        # A reading up to half a minute old: each fresh one spins a core for 0.2 s, and a bound
        # against a hang need not follow the load to the second.
        stretched = min(recent_load(max_age=30).scale(seconds), max(seconds, every_test))
        item.add_marker(pytest.mark.timeout(stretched, *marker.args[1:], **marker.kwargs), append=False)
    yield


@pytest.fixture(autouse=True)
def _quick_tests_start_no_process(request, monkeypatch):
    """A test marked `quick` fails if it starts a process (subprocess, multiprocessing, fork)."""
    if request.node.get_closest_marker("quick") is None:
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError("a test marked quick started a process: take the mark off, or the process out")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


def _reusable_lab(op_timeout: float, grace: float):
    """A 2-rank CPU lab kept across tests; stopped when its fixture's scope ends."""
    import pplab

    lab = pplab.Lab(n_ranks=2, device="cpu", op_timeout=op_timeout, grace=grace, verbose=False)
    yield lab
    lab.stop()


def _ready(lab):
    """The lab, restarted first if an earlier test left it needing a restart."""
    if lab.state != "running":
        lab.restart()
    return lab


@pytest.fixture(scope="session")
def _session_lab(ipython_dir):
    yield from _reusable_lab(op_timeout=20, grace=1)


def _fragile_op_timeout() -> int:
    """Waits of 3 s, so that the tests that break the fragile lab end soon; longer where the machine
    is so busy that a plain step's waits (under 0.6 s at a quiet pace) come near it: beside two
    burners (19x) one outlasted 3 s. The stretch allows 2 s at a quiet pace, not 0.6: the reading is
    of a moment, and beside two burners a fresh lab's first step met a load that kept rank 0 more
    than 3 s from its first send although the reading had not stretched the 3 s."""
    from timing import slack

    return max(3, math.ceil(slack(2.0)))


@pytest.fixture(scope="module")
def _fragile_lab(ipython_dir):
    # A peer's report of a failure (its own timeout, a lost message) can take more than a second to
    # arrive on a loaded machine: the tests that break this lab read those (grace 3 s).
    yield from _reusable_lab(op_timeout=_fragile_op_timeout(), grace=3)


@pytest.fixture
def lab2(_session_lab):
    """The session's 2-rank lab (20 s per operation), running."""
    return _ready(_session_lab)


@pytest.fixture
def fragile_lab(_fragile_lab):
    """A 2-rank lab with short timeouts (3 s per op, more on a busy machine; 3 s grace) that tests
    may break, running. Its pipelines wait as long as the load at each test's start says, or
    longer if an earlier test of the file met more: a file's later test ran at 20x, where a plain
    step outlasted the 3 s read at the file's start."""
    lab = _ready(_fragile_lab)
    # Never shorter than before: a restart made the ranks' process group with the lab's seconds
    # then, and a test that waits for that group's own timeout bounds it by the lab's seconds now.
    lab.op_timeout = max(lab.op_timeout, _fragile_op_timeout())
    return lab


@pytest.fixture
def fresh_start(ipython_dir):
    """No kept controller or fork server in this worker (pplab.drivers.cluster.kept), before the
    test or after it: its labs start both afresh, as a fresh kernel's first lab does."""
    from pplab.drivers.cluster.kept import stop_kept

    stop_kept()
    yield
    stop_kept()


@pytest.fixture
def lab_factory(ipython_dir):
    """Start labs with any options; every lab started is stopped after the test, pass or fail."""
    import pplab

    labs = []

    def start(n_ranks: int = 2, **options):
        options.setdefault("verbose", False)
        options.setdefault("device", "cpu")  # the tests are about gloo on CPU, GPUs or not
        lab = pplab.Lab(n_ranks=n_ranks, **options)
        labs.append(lab)
        return lab

    yield start
    for lab in labs:
        lab.stop()
