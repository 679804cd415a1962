"""The Lab: ipyparallel engines as torch.distributed ranks, started, used and stopped from a notebook.

    lab = Lab(ranks=4)        # controller + 4 engines, ranks assigned, process group ready
    lab.status()              # rank, engine, host, pid, device, backend
    lab.run(fn, *args)        # fn on every rank, results ordered by rank
    lab.stop()                # or: with Lab(ranks=4) as lab: ...

How a local lab starts fast: the controller and a fork server start together;
the fork server imports torch once and forks one engine per rank while the
controller comes up; the engines register quickly because the controller's
heartbeat is short; then one round trip describes the engines and one more
joins them all (concurrently) to a fresh process group and does a barrier.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
import weakref
from dataclasses import replace
from typing import Callable, Iterator

from pplab.cluster import engine, records
from pplab.cluster.calls import RankCall, RankEvent
from pplab.cluster.errors import RESTART_HINT, LabError, LabNeedsRestartError, LabStartError
from pplab.cluster.lab_pipeline import PipelineRun
from pplab.cluster.plan import (RankSpec, assign_ranks, check_positive, check_ranks,
                                check_threads, choose_backend_device, local_ranks,
                                loopback_interface)
from pplab.cluster.status import RankInfo, RankTable

# The controller accepts an engine only after its heart beats: a 100 ms beat instead of
# 3 s saves seconds at start; 100 missed beats (10 s) before it declares an engine dead
# tolerates busy CPUs. Threads instead of processes for its schedulers: fewer processes.
CONTROLLER_ARGS = ["--usethreads", "--HeartMonitor.period=100",
                   "--HeartMonitor.max_heartmonitor_misses=100", "--log-level=ERROR"]
# No nanny process per engine (it costs a Python start-up per rank; the lab watches
# engine pids itself) and no shared IPython history database (ranks would contend for it).
ENGINE_ARGS = ["--IPEngine.enable_nanny=False", "--HistoryManager.enabled=False",
               "--log-level=WARN"]
TEARDOWN_SECONDS = 5.0

# ipyparallel reports a process it sees die (as our restart's SIGKILL) by dumping its log
# into the notebook; pplab reports what matters itself, so only its errors get through.
_ipyparallel_log = logging.getLogger("pplab.cluster.ipyparallel")
_ipyparallel_log.setLevel(logging.ERROR)

_running_labs: weakref.WeakSet = weakref.WeakSet()


def _stop_running_labs() -> None:
    """At interpreter exit, stop every lab still running so that no process outlives the kernel."""
    for lab in list(_running_labs):
        try:
            lab.stop()
        except Exception as error:  # keep stopping the others
            print(f"pplab: could not stop {lab!r}: {error}", file=sys.stderr)


atexit.register(_stop_running_labs)


class _Progress:
    """One status line that updates in place while the lab starts (plain print: works anywhere)."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.started = time.perf_counter()
        self._width = 0
        self._last_text = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def update(self, text: str) -> None:
        if text != self._last_text:  # called in polling loops: print changes only
            self._last_text = text
            self._print(f"pplab: {text} ({self.elapsed():.1f} s)", end="")

    def finish(self, text: str) -> None:
        self._print(f"pplab: {text} in {self.elapsed():.1f} s", end="\n")

    def _print(self, line: str, end: str) -> None:
        if self.verbose:
            print("\r" + line.ljust(self._width), end=end, flush=True)
            self._width = 0 if end == "\n" else len(line)


class Lab:
    """Engines of an ipyparallel cluster, one per torch.distributed rank, ready to run code."""

    def __init__(self, ranks: int = 2, *, backend: str = "auto", device: str = "auto",
                 timeout: float = 60.0, threads: int | None = 1, grace: float = 3.0,
                 start_timeout: float = 120.0, controller_ip: str = "127.0.0.1",
                 fork: bool | None = None, profile_dir: str | None = None,
                 activate: bool = True, verbose: bool = True):
        """Start a local lab: a controller and `ranks` engines joined in one process group.

        timeout: seconds before a rendezvous, collective or P2P op on a rank gives up.
        threads: torch threads per rank (None keeps torch's default).
        grace: seconds the other ranks get to finish after the first rank raises.
        controller_ip: the controller listens on loopback only unless you change this.
        fork: start engines by forking one process that imported torch (default on Linux).
        """
        self._configure(ranks=check_ranks(ranks), backend=backend, device=device,
                        timeout=timeout, threads=threads, grace=grace,
                        start_timeout=start_timeout, activate=activate, verbose=verbose)
        # Reject a forced backend/device this host cannot honour before starting anything.
        here = socket.gethostname()
        choose_backend_device(backend, device, {here: _local_gpu_count(backend, device)},
                              {here: ranks})
        self._owned = True
        self._controller_ip = controller_ip
        self._fork = sys.platform == "linux" if fork is None else bool(fork)
        self.profile_dir = os.path.abspath(profile_dir or records.default_profile_dir())
        self._start()

    @classmethod
    def connect(cls, profile: str | None = "default", cluster_id: str = "", *,
                profile_dir: str | None = None, ranks: int | None = None,
                backend: str = "auto", device: str = "auto", timeout: float = 60.0,
                threads: int | None = 1, grace: float = 3.0, start_timeout: float = 120.0,
                gloo_ifname: str | None = None, activate: bool = True,
                verbose: bool = True) -> "Lab":
        """Make ranks of the engines of a cluster you started (ipcluster, any launcher, many hosts)."""
        lab = cls.__new__(cls)
        lab._configure(ranks=None if ranks is None else check_ranks(ranks), backend=backend,
                       device=device, timeout=timeout, threads=threads, grace=grace,
                       start_timeout=start_timeout, activate=activate, verbose=verbose)
        lab._owned = False
        lab._profile = profile
        lab._gloo_ifname = gloo_ifname
        if profile_dir is None:  # where ipcluster keeps the profile (and we a rendezvous file)
            from IPython.paths import get_ipython_dir

            profile_dir = os.path.join(get_ipython_dir(), f"profile_{profile or 'default'}")
        lab.profile_dir = os.path.abspath(profile_dir)
        lab.cluster_id = cluster_id
        lab._start()
        return lab

    def _configure(self, *, ranks, backend, device, timeout, threads, grace, start_timeout,
                   activate, verbose) -> None:
        """Check and keep the options shared by Lab() and Lab.connect()."""
        self._requested = {"ranks": ranks, "backend": backend, "device": device}
        self.timeout = check_positive("timeout", timeout)
        self.grace = check_positive("grace", grace)
        self.start_timeout = check_positive("start_timeout", start_timeout)
        self.threads = check_threads(threads)
        self._activate = activate
        self._verbose = verbose
        self._gloo_ifname = None
        self._fork = False
        self.cluster_id = ""
        self._cluster = None
        self._fork_server: subprocess.Popen | None = None
        self._client = None
        self._view = None
        self._ranks: list[RankInfo] = []
        self._processes: dict[int, dict] = {}  # rank -> process entry, for ranks on this host
        self._launched: list[dict] = []  # controller and engine launchers we started
        self._broken: str | None = None
        self._last_call: RankCall | None = None
        self._stopped = True
        self.last_errors: dict = {}

    # -- starting ------------------------------------------------------------------------

    def _start(self) -> None:
        """Bring up engines (launch or connect), then make them ranks; on failure stop what started."""
        self._last_call = None  # a call of engines that are gone says nothing about new ones
        progress = _Progress(self._verbose)
        self._stopped = False
        self._broken = None
        _running_labs.add(self)
        try:
            if self._owned:
                self._launch_local_cluster(progress)
            else:
                self._connect_to_cluster(progress)
            self._make_ranks(progress)
        except BaseException:
            progress.finish("start failed")
            self._shutdown(kill=True)
            raise
        if self._activate:
            self.activate()
        progress.finish(f"lab ready: {self.world_size} ranks, {self.backend} on {self.device}")

    def _launch_local_cluster(self, progress: _Progress) -> None:
        """Start a controller and one engine per rank on this host, all listening on loopback."""
        records.cleanup(self.profile_dir, verbose=self._verbose)  # what killed kernels left
        for folder in ("security", "log"):
            os.makedirs(os.path.join(self.profile_dir, folder), exist_ok=True)
        ranks = self._requested["ranks"]
        self.cluster_id = _new_cluster_id()
        progress.update(f"starting a controller and {ranks} engines")
        if self._fork:
            # First of all, so that the engines import torch while everything else starts.
            self._fork_server = self._start_fork_server(ranks)
            # Recorded at once: if the rest of the start fails, shutdown and cleanup() find it.
            self._launched = [records.process_entry(self._fork_server.pid, "engine fork server")]
            records.write_record(self.profile_dir, self.cluster_id, self._launched)
        import ipyparallel as ipp

        self._cluster = ipp.Cluster(
            cluster_id=self.cluster_id, profile_dir=self.profile_dir, n=ranks,
            config=self._engine_launcher_config(), load_profile=False,
            controller_ip=self._controller_ip, controller_args=CONTROLLER_ARGS,
            # Engines read the controller's connection file themselves, so they need
            # not wait for the controller before they start.
            send_engines_connection_env=False, delay=0, log=_ipyparallel_log)
        self._cluster.start_controller_sync()
        if not self._fork:
            self._cluster.start_engines_sync(ranks)
        self._launched = self._launched_processes()
        records.write_record(self.profile_dir, self.cluster_id, self._launched)
        self._client = self._cluster.connect_client_sync()
        self._wait_for_engines(ranks, progress)

    def _start_fork_server(self, ranks: int) -> subprocess.Popen:
        """Start the process that imports torch once and forks the engines (see forkserver.py)."""
        environment = {**os.environ, **self._engine_environment(),
                       "IPP_CLUSTER_ID": self.cluster_id, "IPP_PROFILE_DIR": self.profile_dir}
        with open(self._fork_server_log(), "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "pplab.cluster.forkserver", str(ranks), *self._engine_args()],
                env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # like ipyparallel's: a notebook interrupt must not reach it

    def _fork_server_log(self) -> str:
        return os.path.join(self.profile_dir, "log", f"pplab-engines-{self.cluster_id}.log")

    def _engine_args(self) -> list[str]:
        return [*ENGINE_ARGS, f"--IPEngine.wait_for_url_file={self.start_timeout}"]

    def _engine_launcher_config(self):
        """Config for ipyparallel's one-process-per-engine launcher (used when not forking)."""
        from traitlets.config import Config

        config = Config()
        config.LocalEngineSetLauncher.engine_args = self._engine_args()
        config.LocalEngineSetLauncher.environment = self._engine_environment()
        config.LocalEngineSetLauncher.delay = 0.0
        return config

    def _engine_environment(self) -> dict:
        """Environment of the engines: thread counts set before torch is imported there."""
        environment = {"PYTHONUNBUFFERED": "1"}
        # The fork server must not start an OpenMP pool before it forks (a forked child
        # cannot use its parent's pool): one thread there; each rank sets its own count.
        threads = 1 if self._fork else self.threads
        if threads is not None:
            environment.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        return environment

    def _threads_per_rank(self) -> int | None:
        """What each rank passes to torch.set_num_threads (None: leave torch's default)."""
        if self.threads is None and self._owned and self._fork:
            return os.cpu_count()  # torch's default had the fork server not been held to one
        return self.threads

    def _launched_processes(self) -> list[dict]:
        """Process entries of the controller and of the engine launcher process(es)."""
        entries = [records.process_entry(self._cluster.controller.process.pid, "controller")]
        if self._fork_server is not None:
            entries.append(records.process_entry(self._fork_server.pid, "engine fork server"))
        for engine_set in self._cluster.engines.values():
            for launcher in engine_set.launchers.values():
                entries.append(records.process_entry(launcher.process.pid, "engine"))
        return entries

    def _wait_for_engines(self, count: int, progress: _Progress, exclude=()) -> list[int]:
        """Wait until `count` engines (other than `exclude`) have registered; fail fast if one died."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            ids = [engine_id for engine_id in self._client.ids if engine_id not in exclude]
            progress.update(f"engines up: {len(ids)}/{count}")
            if len(ids) >= count:
                return sorted(ids)[:count]
            gone = [entry for entry in self._launched if records.find_process(entry) is None]
            if gone:
                raise LabStartError(f"the {gone[0]['role']} (pid {gone[0]['pid']}) exited during "
                                    f"start-up.\n{self._launch_logs()}")
            exited = self._forked_engine_exit()
            if exited:
                raise LabStartError(f"{exited.removeprefix('pplab forkserver: ').strip()} during "
                                    f"start-up.\n{self._launch_logs()}")
            if time.monotonic() > deadline:
                raise LabStartError(f"only {len(ids)} of {count} engines registered within "
                                    f"start_timeout={self.start_timeout:g} s.\n{self._launch_logs()}")
            time.sleep(0.02)

    def _forked_engine_exit(self) -> str | None:
        """The fork server's log line about an engine that exited, if one did."""
        if self._fork_server is None or not os.path.exists(self._fork_server_log()):
            return None
        with open(self._fork_server_log(), errors="replace") as log:
            return next((line for line in log if "exited with status" in line), None)

    def _launch_logs(self) -> str:
        """The last lines the controller and engines wrote, for start-up error messages."""
        outputs = []
        if self._cluster is not None:
            launchers = [self._cluster.controller, *self._cluster.engines.values()]
            outputs = [launcher.get_output() for launcher in launchers if launcher is not None]
        if self._fork_server is not None and os.path.exists(self._fork_server_log()):
            with open(self._fork_server_log(), errors="replace") as log:
                outputs.append(log.read())
        tail = "\n".join(line for output in outputs for line in output.splitlines()[-15:])
        return f"Last lines of their logs:\n{tail}" if tail else ""

    def _connect_to_cluster(self, progress: _Progress) -> None:
        """Connect to a running cluster and wait for the requested number of engines."""
        import ipyparallel as ipp

        progress.update(f"connecting to cluster {self.cluster_id!r}")
        try:
            self._client = ipp.Client(profile=self._profile, profile_dir=self.profile_dir,
                                      cluster_id=self.cluster_id)
        except (OSError, ValueError) as error:
            raise LabStartError(
                f"no running cluster found for profile={self._profile!r}, "
                f"cluster_id={self.cluster_id!r} ({error}); start one first, e.g. "
                f"`ipcluster start -n 4 --profile={self._profile or 'default'}`") from error
        self._cluster = _load_cluster(self._profile, self.profile_dir, self.cluster_id)
        count = self._requested["ranks"] or max(1, len(self._client.ids))
        self._wait_for_engines(count, progress)

    def _make_ranks(self, progress: _Progress, count: int | None = None, exclude=()) -> None:
        """Describe the engines, assign ranks, then join all of them to a fresh process group."""
        count = count or self._requested["ranks"] or len(self._client.ids)
        engine_ids = sorted(engine_id for engine_id in self._client.ids
                            if engine_id not in exclude)[:count]
        progress.update("assigning ranks")
        described = self._client[engine_ids].apply_async(engine.describe).get(self.start_timeout)
        about = dict(zip(engine_ids, described))
        order = assign_ranks({engine_id: about[engine_id]["host"] for engine_id in engine_ids})
        hosts = [about[engine_id]["host"] for engine_id in order]
        ranks_per_host = {host: hosts.count(host) for host in hosts}
        gpus_per_host = {about[engine_id]["host"]: about[engine_id]["gpus"] for engine_id in order}
        # With the real hosts known, refuse a forced device they cannot honour: still
        # before any rank blocks.
        backend, device = choose_backend_device(self._requested["backend"],
                                                self._requested["device"], gpus_per_host,
                                                ranks_per_host)
        self._ranks = [RankInfo(rank, engine_id, host, about[engine_id]["pid"], local_rank,
                                device, backend, "idle")
                       for rank, (engine_id, host, (local_rank, _))
                       in enumerate(zip(order, hosts, local_ranks(hosts)))]
        self._remember_processes(order, about)
        progress.update(f"joining {len(order)} ranks to a {backend} process group")
        self._join_process_group(order, about, hosts)

    def _remember_processes(self, order: list[int], about: dict) -> None:
        """Keep the engines' processes (those on this host) to notice deaths; record them on disk."""
        here = socket.gethostname()
        self._processes = {rank: {"pid": about[engine_id]["pid"], "role": f"rank {rank}",
                                  "create_time": about[engine_id]["create_time"]}
                           for rank, engine_id in enumerate(order)
                           if about[engine_id]["host"] == here}
        if self._owned:
            # By now the controller has started its heartbeat process: record it too, so that
            # cleanup() finds it even if the controller itself is gone.
            self._launched += [records.process_entry(child.pid, "controller child")
                               for child in _children(self._launched[0])]
            records.write_record(self.profile_dir, self.cluster_id,
                                 self._launched + list(self._processes.values()))

    def _join_process_group(self, order: list[int], about: dict, hosts: list[str]) -> None:
        """Every rank enters init_process_group at the same time (async), then one barrier."""
        import ipyparallel as ipp

        on_one_host = len(set(hosts)) == 1
        rendezvous = self._new_rendezvous(order, about, on_one_host)
        gloo_ifname = self._gloo_ifname or (loopback_interface() if on_one_host else None)
        sys_path = tuple(sys.path)  # engines import what the notebook can (missing dirs are skipped)
        specs = [RankSpec(rank, len(order), local_rank, local_size, self.backend, self.device,
                          rendezvous, self.timeout, self._threads_per_rank(), gloo_ifname,
                          sys_path)
                 for rank, (local_rank, local_size) in enumerate(local_ranks(hosts))]
        joining = ipp.AsyncResult.join(*[self._client[engine_id].apply_async(engine.setup_rank, spec)
                                         for engine_id, spec in zip(order, specs)])
        self._view = self._client[order]  # a view in rank order: results come back by rank
        self._view.block = True  # what %%px cells use
        RankCall(self, joining, "setting up the process group", self.timeout + 10).result()

    def _new_rendezvous(self, order: list[int], about: dict, on_one_host: bool) -> str:
        """A fresh rendezvous for one init: a new file on one host (no listening socket), else TCP."""
        if on_one_host:  # owned or connected: on one host nothing needs to listen
            folder = os.path.join(records.records_dir(self.profile_dir), self.cluster_id or "connected")
            os.makedirs(folder, exist_ok=True)
            return f"file://{os.path.join(folder, f'rendezvous-{uuid.uuid4().hex}')}"
        rank0 = self._client[order[0]]
        port = rank0.apply_async(engine.free_tcp_port).get(self.start_timeout)
        return f"tcp://{about[order[0]]['address']}:{port}"

    # -- using ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """"running", "stopped", or "needs restart: <why>" after a hang, crash or left-over ranks."""
        if self._stopped:
            return "stopped"
        return f"needs restart: {self._broken}" if self._broken else "running"

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self._ranks)

    @property
    def backend(self) -> str:
        """The torch.distributed backend of the process group ("gloo" or "nccl")."""
        return self._ranks[0].backend if self._ranks else "?"

    @property
    def device(self) -> str:
        """The kind of device each rank computes on ("cpu" or "cuda")."""
        return self._ranks[0].device if self._ranks else "?"

    @property
    def view(self):
        """The ipyparallel DirectView over the ranks, in rank order (refreshed by restart)."""
        return self._view

    @property
    def client(self):
        """The ipyparallel Client connected to the lab's controller."""
        return self._client

    def status(self) -> RankTable:
        """One row per rank: engine id, host, pid, local rank, device, backend and state."""
        busy = set()
        if self._last_call is not None:
            busy = {rank for rank, result in enumerate(self._last_call._per_rank)
                    if not result.ready()}
        dead = set(self._dead_ranks(range(self.world_size))) if not self._stopped else set()

        def state(rank: int) -> str:
            if self._stopped:
                return "stopped"
            return "dead" if rank in dead else "busy" if rank in busy else "idle"

        return RankTable(replace(info, state=state(info.rank)) for info in self._ranks)

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results ordered by rank."""
        return self.run_async(fn, *args, timeout=timeout, **kwargs).result()

    def run_async(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> RankCall:
        """Start fn(*args, **kwargs) on every rank; the returned RankCall gives events and results."""
        self._check_usable()
        if timeout is not None:
            check_positive("timeout", timeout)
        name = f"{getattr(fn, '__name__', type(fn).__name__)}()"
        self._last_call = RankCall(self, self._view.apply_async(fn, *args, **kwargs), name, timeout)
        return self._last_call

    @property
    def rank_processes(self) -> tuple[tuple[str, int], ...]:
        """(host, pid) of each rank's engine, by rank: it changes when the engines are replaced."""
        return tuple((info.host, info.pid) for info in self._ranks)

    def pipeline(self, config, schedule="1f1b", microbatches: int | None = None, n_virtual: int = 1,
                 **options) -> PipelineRun:
        """Build a pipeline's stages on every rank (schedule validated first); step it with `.step()`."""
        self._check_usable()
        return PipelineRun(self, config, schedule, microbatches, n_virtual, **options)

    def stream(self, fn: Callable, *args, timeout: float | None = None,
               **kwargs) -> Iterator[RankEvent]:
        """Run fn on every rank and yield the events it publishes while it runs."""
        return self.run_async(fn, *args, timeout=timeout, **kwargs).events()

    def activate(self, suffix: str = "") -> None:
        """Make %%px cells run on this lab's ranks (done at start inside IPython)."""
        from IPython import get_ipython
        from ipyparallel.client.magics import ParallelMagics

        shell = get_ipython()
        if shell is None or self._view is None:
            return
        magics = ParallelMagics(shell, self._view, suffix)
        # Without a nanny the engines cannot be signalled: an interrupted %%px cell just
        # stops waiting (a rank blocked in gloo could not be interrupted anyway).
        magics.signal_on_interrupt = None
        shell.magics_manager.register(magics)

    def _check_usable(self) -> None:
        if self._stopped:
            raise LabError("this lab is stopped; call lab.restart() or start a new Lab")
        if self._broken:
            raise LabNeedsRestartError(f"the lab needs a restart: {self._broken}; {RESTART_HINT}.")

    def _needs_restart(self, reason: str) -> None:
        """Remember that ranks are busy or gone, so that the next call refuses to queue behind them."""
        self._broken = self._broken or reason

    def _dead_ranks(self, ranks) -> list[int]:
        """The ranks among `ranks` (on this host) whose engine process has ended."""
        return [rank for rank in ranks
                if rank in self._processes and records.find_process(self._processes[rank]) is None]

    def _describe_rank(self, rank: int) -> str:
        info = self._ranks[rank]
        return f"rank {rank} (engine {info.engine_id}, pid {info.pid} on {info.host})"

    # -- restarting and stopping -----------------------------------------------------------

    def restart(self) -> None:
        """Replace every engine by a fresh one, reassign ranks and re-initialise the process group."""
        if self._owned:
            self._shutdown(kill=True)  # a rank stuck in a gloo wait only leaves by SIGKILL
            self._start()
            return
        self._restart_connected_engines()

    def _restart_connected_engines(self) -> None:
        """Restart the engines of a cluster we connected to, through its own launcher."""
        if self._stopped:
            raise LabError("this lab was stopped, which closed its connection to the cluster: "
                           "connect again with pplab.Lab.connect(...)")
        if self._cluster is None or not self._cluster.engines:
            raise LabError("cannot restart engines of a cluster started elsewhere without its "
                           "cluster file; restart them with your launcher (e.g. `ipcluster "
                           "stop/start`) and call Lab.connect(...) again")
        progress = _Progress(self._verbose)
        progress.update("restarting engines")
        old_ids = set(self._client.ids)
        self._cluster.restart_engines_sync()
        self._broken = None
        self._stopped = False
        try:
            self._wait_for_engines(self.world_size, progress, exclude=old_ids)
            self._make_ranks(progress, count=self.world_size, exclude=old_ids)
        except BaseException:
            progress.finish("restart failed")
            raise
        if self._activate:
            self.activate()
        progress.finish(f"lab ready: {self.world_size} ranks, {self.backend} on {self.device}")

    def stop(self) -> None:
        """Leave the process group and stop the controller and engines (nothing is left running)."""
        if self._stopped:
            return
        if self._client is not None and self._view is not None and not self._broken:
            try:
                self.run(engine.teardown_rank, timeout=TEARDOWN_SECONDS)
            except Exception:
                pass  # the processes are stopped next anyway
        self._shutdown(kill=bool(self._broken))  # ranks stuck in a wait only leave by SIGKILL

    def _shutdown(self, kill: bool) -> None:
        """Close the client and end every process this lab started (SIGKILL if `kill`)."""
        self._stopped = True
        _running_labs.discard(self)
        if self._client is not None:
            self._client.close()
            self._client = None
        if not self._owned:
            return  # the cluster belongs to whoever started it
        ours = self._launched + list(self._processes.values())
        if kill:
            records.kill_processes(ours)
        if self._cluster is not None:
            try:
                self._cluster.stop_cluster_sync()
            except Exception:
                pass  # processes that are already gone; the sweep below makes sure
            self._cluster = None
        records.stop_processes(ours)
        if self._fork_server is not None:
            try:
                self._fork_server.wait(timeout=10)  # reap it: no zombie left behind
            except subprocess.TimeoutExpired:
                self._fork_server.kill()
                self._fork_server.wait(timeout=10)
            self._fork_server = None
        if self.cluster_id:
            records.remove_lab_files(self.profile_dir, self.cluster_id)

    def __del__(self) -> None:
        # A running lab nobody refers to any more (e.g. a start cell run twice) must not
        # leave its processes behind; a quick kill is all that can be done at this point.
        try:
            if not self._stopped:
                self._shutdown(kill=True)
        except Exception:
            pass

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<Lab {self.world_size} ranks, {self.backend} on {self.device}, "
                f"cluster {self.cluster_id!r}: {self.state}>")


def _local_gpu_count(backend: str, device: str) -> int:
    """GPUs on this host; 0 without asking CUDA when CPU is forced."""
    if device == "cpu" or (backend == "gloo" and device == "auto"):
        return 0
    import torch

    return torch.cuda.device_count()


def _children(entry: dict) -> list:
    """The child processes of a recorded process (none if it is gone)."""
    process = records.find_process(entry)
    return process.children(recursive=True) if process is not None else []


def _new_cluster_id() -> str:
    """A fresh cluster id, in ipyparallel's style: start time and a random suffix."""
    return f"{int(time.time())}-{uuid.uuid4().hex[:4]}"


def _load_cluster(profile: str | None, profile_dir: str | None, cluster_id: str):
    """The ipyparallel Cluster of a running cluster file (to restart its engines), or None."""
    import ipyparallel as ipp

    try:
        return ipp.Cluster.from_file(profile=profile, profile_dir=profile_dir,
                                     cluster_id=cluster_id)
    except Exception:
        return None
