"""The Lab: ipyparallel engines as torch.distributed ranks, started, used and stopped from a notebook.

    lab = Lab(n_ranks=4)      # controller + 4 engines, ranks assigned, process group ready
    lab.status()              # rank, engine, host, pid, device, backend
    lab.run(fn, *args)        # fn on every rank, results ordered by rank
    lab.stop()                # or: with Lab(n_ranks=4) as lab: ...

Where the engines come from is the launcher's business (launchers.py): a local
cluster for `Lab()`, a running one for `Lab.connect()`. Once engines have
registered, the lab does the same for both: one round trip describes the engines,
ranks are assigned, and one more joins them all (concurrently) to a fresh process
group and does a barrier.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Iterator

from pplab.base.arguments import check_positive_int, check_positive_seconds
from pplab.base.config import LabOptions, keywords_help, takes_options
from pplab.base.machine import busy_note, recent_load
from pplab.base.renames import renamed_keywords
from pplab.drivers.cluster import engine, records
from pplab.drivers.cluster.calls import RankCall
from pplab.drivers.cluster.errors import RESTART_HINT, LabError, LabNeedsRestartError, LabStartError
from pplab.drivers.cluster.ipyparallel_adapter import catch_up_on_engines
from pplab.drivers.cluster.kept import kept_now
from pplab.drivers.cluster.launchers import ConnectedCluster, LocalCluster
from pplab.drivers.cluster.plan import (
    RankSpec,
    assign_ranks,
    check_gpus,
    check_memory_fraction,
    check_threads,
    choose_backend_device,
    describe_placement,
    local_ranks,
    loopback_interface,
    seat_memory_fraction,
)
from pplab.drivers.cluster.progress import Progress
from pplab.drivers.cluster.status import RankGroup, RankInfo, RankTable
from pplab.drivers.contract import arguments_by_rank, call_name
from pplab.drivers.cores import check_cores
from pplab.rank.rank_context import RankError, RankEvent

TEARDOWN_SECONDS = 5.0
DESCRIBE_ASK_AGAIN_SECONDS = 10.0  # see Lab._describe
JOIN_SECONDS = 30.0  # joining the process group at a quiet pace (ranks come apart on a busy machine)
# while engines register, how often the hub is asked which it has (see _wait_for_engines)
ASK_HUB_SECONDS = 1.0
KEPT_LOAD_AGE = 60.0  # seconds: how old a load reading a start on a kept controller may use

_running_labs: weakref.WeakSet = weakref.WeakSet()


def _stop_running_labs() -> None:
    """At interpreter exit, stop every lab still running so that no process outlives the kernel."""
    for lab in list(_running_labs):
        try:
            lab.stop()
        except Exception as error:  # keep stopping the others
            print(f"pplab: could not stop {lab!r}: {error}", file=sys.stderr)


atexit.register(_stop_running_labs)


class Lab:
    """Engines of an ipyparallel cluster, one per torch.distributed rank, ready to run code."""

    _stopped = True  # until a start begins (also for __del__ of a lab whose arguments failed)

    @renamed_keywords
    @takes_options(LabOptions, every=True)
    def __init__(self, n_ranks: int = LabOptions.n_ranks, *, backend: str = LabOptions.backend,
                 device: str = LabOptions.device, op_timeout: float = LabOptions.op_timeout,
                 threads: int | None = LabOptions.threads, grace: float = LabOptions.grace,
                 start_timeout: float = LabOptions.start_timeout, controller_ip: str = "127.0.0.1",
                 fork: bool | None = None, profile_dir: str | None = None,
                 gpus: Sequence[int] | None = LabOptions.gpus, cores: Sequence[int] | None = LabOptions.cores,
                 host_messages: bool | None = LabOptions.host_messages,
                 gpu_memory_fraction: float | None = LabOptions.gpu_memory_fraction,
                 activate: bool = True, verbose: bool = True):
        # The docstring is made below the class: the options' help is their fields' (LabOptions).
        check_positive_int("n_ranks", n_ranks, example=2)
        # A start on what this process's last lab kept takes half a second: a reading of the load
        # from the last minute stretches its waits (measuring afresh would add 0.2 s of spinning).
        load = recent_load(max_age=KEPT_LOAD_AGE) if kept_now() is not None else None
        self._configure(n_ranks=n_ranks, backend=backend, device=device, op_timeout=op_timeout,
                        threads=threads, grace=grace, start_timeout=start_timeout,
                        activate=activate, verbose=verbose, host_messages=host_messages, load=load)
        gpu_count = None
        if gpus is not None:
            import torch

            self._gpus = check_gpus(gpus, n_ranks, device, torch.cuda.device_count())
            self._requested["device"] = device = "cuda"
            gpu_count = len(set(self._gpus))  # a device named twice is shared
        self._cores = check_cores(cores, n_ranks)
        self._memory_fraction = check_memory_fraction(gpu_memory_fraction)
        if self._memory_fraction is None and device != "cpu":  # a workshop seat's cap, where its hub set one
            self._memory_fraction = seat_memory_fraction()
        elif self._memory_fraction is not None and device == "cpu":
            raise ValueError(f"gpu_memory_fraction={gpu_memory_fraction!r} with device='cpu': it caps GPU "
                             "memory; leave it out, or use device='cuda'")
        # Reject a forced backend/device this host cannot honour before starting anything.
        here = socket.gethostname()
        choose_backend_device(backend, device, {here: gpu_count or _local_gpu_count(backend, device)},
                              {here: n_ranks}, host_messages)
        self._launcher = LocalCluster(
            n_ranks, os.path.abspath(profile_dir or records.default_profile_dir()),
            controller_ip=controller_ip, fork=sys.platform == "linux" if fork is None else bool(fork),
            threads=self.threads, start_timeout=self._start_wait(), verbose=verbose,
            machine_load=self.machine_load)
        self._bring_up(self._launcher.start, "start")

    @classmethod
    @renamed_keywords
    @takes_options(LabOptions, differs={"n_ranks": "None: every engine of the cluster"})
    def connect(cls, profile: str | None = "default", cluster_id: str = "", *,
                profile_dir: str | None = None, n_ranks: int | None = None,
                backend: str = LabOptions.backend, device: str = LabOptions.device,
                op_timeout: float = LabOptions.op_timeout, threads: int | None = LabOptions.threads,
                grace: float = LabOptions.grace, start_timeout: float = LabOptions.start_timeout,
                gloo_ifname: str | None = None, host_messages: bool | None = LabOptions.host_messages,
                activate: bool = True,
                verbose: bool = True, restart_engines: Callable[[], None] | None = None) -> "Lab":
        """Make ranks of the engines of a cluster you started (ipcluster, any launcher, many hosts).

        `lab.restart()` replaces the engines through the cluster's file (ipcluster's), or by
        calling `restart_engines()`: your launcher's way to kill the engines and start new ones.
        """
        if n_ranks is not None:
            check_positive_int("n_ranks", n_ranks, example=2)
        lab = cls.__new__(cls)
        lab._configure(n_ranks=n_ranks, backend=backend, device=device, op_timeout=op_timeout,
                       threads=threads, grace=grace, start_timeout=start_timeout,
                       activate=activate, verbose=verbose, host_messages=host_messages)
        if profile_dir is None:  # where ipcluster keeps the profile (and we a rendezvous file)
            from IPython.paths import get_ipython_dir

            profile_dir = os.path.join(get_ipython_dir(), f"profile_{profile or 'default'}")
        lab._launcher = ConnectedCluster(profile, os.path.abspath(profile_dir), cluster_id,
                                         gloo_ifname, restart_engines,
                                         machine_load=lab.machine_load)
        lab._bring_up(lab._launcher.start, "start")
        return lab

    def _configure(self, *, n_ranks, backend, device, op_timeout, threads, grace, start_timeout,
                   activate, verbose, host_messages=None, load=None) -> None:
        """Check and keep the options shared by Lab() and Lab.connect()."""
        self._requested = {"n_ranks": n_ranks, "backend": backend, "device": device,
                           "host_messages": host_messages}
        self._op_timeout = check_positive_seconds("op_timeout", op_timeout)
        self.grace = check_positive_seconds("grace", grace)
        self.start_timeout = check_positive_seconds("start_timeout", start_timeout)
        # A start's waits are start_timeout at a quiet machine's pace, stretched by this one's load.
        self.machine_load = recent_load(max_age=0) if load is None else load  # measured now, and kept
        self.threads = check_threads(threads)
        self._activate = activate
        self._verbose = verbose
        self._gpus: tuple[int, ...] | None = None  # the ranks' CUDA devices, if named
        self._rank_gpus: list[int] = []  # each rank's CUDA device once started ([] on CPU)
        self._host_messages = False  # do the ranks' messages go through host memory?
        self._memory_fraction: float | None = None  # each rank's share of its GPU's memory, if capped
        self._cores: tuple[int, ...] | None = None  # the ranks' cores, if pinned
        self._view = None
        self._ranks = RankGroup([], {})
        self._last_call: RankCall | None = None

    # -- starting ------------------------------------------------------------------------

    def _bring_up(self, launch: Callable, what: str) -> None:
        """Get engines from the launcher, then make them ranks; on failure stop what started."""
        self._last_call = None  # a call of engines that are gone says nothing about new ones
        expected_ranks = self._requested["n_ranks"] or self.world_size or 1
        progress = Progress(self._verbose, phases=expected_ranks + 5)
        self._stopped = False
        _running_labs.add(self)
        try:
            old_engines = launch(progress)  # engine ids of a connected cluster's old engines
            wanted = (self._requested["n_ranks"] or self.world_size
                      or max(1, len(self.client.ids)))
            engine_ids = self._wait_for_engines(wanted, progress, exclude=old_engines)
            self._make_ranks(engine_ids, progress)
        except BaseException:
            progress.finish(f"{what} failed")
            self._shutdown(kill=True)
            raise
        if self._activate:
            self.activate()
        self._changed("running")
        reused = getattr(self._launcher, "reused", "")  # a local lab's kept controller and fork server
        progress.finish(f"lab ready: {self.world_size} ranks, {self.placement}"
                        + (f"; {reused}" if reused else ""))

    def _start_wait(self) -> float:
        """Seconds a start's wait may take: start_timeout at this machine's measured pace."""
        return self.machine_load.scale(self.start_timeout)

    def _start_wait_said(self) -> str:
        wait = self._start_wait()
        return (f"start_timeout={self.start_timeout:g} s" if wait == self.start_timeout else
                f"start_timeout={self.start_timeout:g} s, {wait:.0f} s at this machine's pace "
                f"({self.machine_load.describe()})")

    def _wait_for_engines(self, count: int, progress: Progress, exclude=()) -> list[int]:
        """Wait until `count` engines (other than `exclude`) have registered; fail fast if one died."""
        deadline = time.monotonic() + self._start_wait()
        ask_hub_at = time.monotonic() + ASK_HUB_SECONDS
        while True:
            ids = [engine_id for engine_id in self.client.ids if engine_id not in exclude]
            progress.update(f"engines up: {len(ids)}/{count}")
            if len(ids) >= count:
                return sorted(ids)[:count]
            self._launcher.check_alive()
            if time.monotonic() > ask_hub_at:  # an engine's announcement may have been missed
                catch_up_on_engines(self.client, timeout=self.machine_load.scale(ASK_HUB_SECONDS))
                ask_hub_at = time.monotonic() + ASK_HUB_SECONDS
            if time.monotonic() > deadline:
                raise LabStartError(f"only {len(ids)} of {count} engines registered within "
                                    f"{self._start_wait_said()}.{busy_note()}\n"
                                    f"{self._launcher.launch_logs()}")
            time.sleep(0.02)

    def _make_ranks(self, engine_ids: list[int], progress: Progress) -> None:
        """Describe the engines, assign ranks, then join all of them to a fresh process group."""
        progress.update("assigning ranks")
        about = self._describe(engine_ids)
        order = assign_ranks({engine_id: about[engine_id]["host"] for engine_id in engine_ids})
        hosts = [about[engine_id]["host"] for engine_id in order]
        ranks_per_host = {host: hosts.count(host) for host in hosts}
        gpus_per_host = {about[engine_id]["host"]: about[engine_id]["gpus"] for engine_id in order}
        # With the real hosts known, refuse a forced device they cannot honour: still
        # before any rank blocks.
        if self._gpus:  # named GPUs: a device named twice is shared
            gpus_per_host[socket.gethostname()] = len(set(self._gpus))
        backend, device, self._host_messages = choose_backend_device(
            self._requested["backend"], self._requested["device"], gpus_per_host, ranks_per_host,
            self._requested["host_messages"])
        # Rank r of a host on its GPU r % (the host's GPUs): ranks share a GPU only when they must.
        self._rank_gpus = ([] if device != "cuda" else list(self._gpus) if self._gpus else
                           [local_rank % gpus_per_host[host]
                            for host, (local_rank, _) in zip(hosts, local_ranks(hosts))])
        infos = [RankInfo(rank, engine_id, host, about[engine_id]["pid"], local_rank,
                          device, backend, "idle")
                 for rank, (engine_id, host, (local_rank, _))
                 in enumerate(zip(order, hosts, local_ranks(hosts)))]
        # The engines' processes on this host: to notice deaths, and for cleanup().
        here = socket.gethostname()
        processes = {rank: {"pid": about[engine_id]["pid"], "role": f"rank {rank}",
                            "started": about[engine_id]["started"]}
                     for rank, engine_id in enumerate(order) if about[engine_id]["host"] == here}
        self._ranks = RankGroup(infos, processes, registered=lambda: self.client.ids,
                                exited=self._launcher.engine_exit)
        self._launcher.record_ranks(list(processes.values()))
        progress.update(f"joining {len(order)} ranks to a {backend} process group")
        self._join_process_group(order, about, hosts)

    def _describe(self, engine_ids: list[int]) -> dict[int, dict]:
        """Each engine's `describe()`, asking again those that have not answered after a while.

        An engine counts as registered once its heartbeat reached the hub, which can be before
        its shell socket's connection reached the scheduler; a request routed to it in that moment
        is dropped by ZMQ without a word (a busy CI machine lost one: three labs starting at once).
        Asking again is safe: describe() only reads."""
        about: dict[int, dict] = {}
        asked: dict[int, list] = {engine_id: [] for engine_id in engine_ids}
        deadline = time.monotonic() + self._start_wait()
        while len(about) < len(engine_ids):
            for engine_id in engine_ids:
                if engine_id not in about:
                    asked[engine_id].append(self.client[engine_id].apply_async(engine.describe))
            next_ask = min(deadline, time.monotonic() + self.machine_load.scale(DESCRIBE_ASK_AGAIN_SECONDS))
            while len(about) < len(engine_ids) and time.monotonic() < next_ask:
                for engine_id, requests in asked.items():
                    done = next((request for request in requests if request.ready()), None)
                    if engine_id not in about and done is not None:
                        about[engine_id] = done.get()
                self._launcher.check_alive()
                time.sleep(0.02)
            if len(about) < len(engine_ids) and time.monotonic() >= deadline:
                silent = sorted(set(engine_ids) - set(about))
                raise LabStartError(f"engines {silent} registered but did not answer within "
                                    f"{self._start_wait_said()}.{busy_note()}\n"
                                    f"{self._launcher.launch_logs()}")
        return about

    def _join_process_group(self, order: list[int], about: dict, hosts: list[str]) -> None:
        """Every rank enters init_process_group at the same time (async), then one barrier."""
        import ipyparallel as ipp

        on_one_host = len(set(hosts)) == 1
        rendezvous = self._new_rendezvous(order, about, on_one_host)
        gloo_ifname = self._launcher.gloo_ifname or (loopback_interface() if on_one_host else None)
        sys_path = tuple(sys.path)  # engines import what the notebook can (missing dirs are skipped)
        join_timeout = max(self.op_timeout, self.machine_load.scale(JOIN_SECONDS))
        specs = [RankSpec(rank, len(order), local_rank, local_size, self.backend, self.device,
                          rendezvous, self.op_timeout, self._launcher.threads_per_rank(self.threads),
                          gloo_ifname, sys_path, self._rank_gpus[rank] if self._rank_gpus else None,
                          self._cores[rank] if self._cores else None, self._host_messages,
                          self._memory_fraction if self._rank_gpus else None, join_timeout)
                 for rank, (local_rank, local_size) in enumerate(local_ranks(hosts))]
        joining = ipp.AsyncResult.join(*[self.client[engine_id].apply_async(engine.setup_rank, spec)
                                         for engine_id, spec in zip(order, specs)])
        self._view = self.client[order]  # a view in rank order: results come back by rank
        self._view.block = True  # what %%px cells use
        RankCall(self._ranks, joining, "setting up the process group", join_timeout + 10, self.grace).result()

    def _new_rendezvous(self, order: list[int], about: dict, on_one_host: bool) -> str:
        """A fresh rendezvous for one init: a new file on one host (no listening socket), else TCP."""
        if on_one_host:  # local or connected: on one host nothing needs to listen
            folder = os.path.join(records.records_dir(self.profile_dir), self.cluster_id or "connected")
            os.makedirs(folder, exist_ok=True)
            return f"file://{os.path.join(folder, f'rendezvous-{uuid.uuid4().hex}')}"
        rank0 = self.client[order[0]]
        port = rank0.apply_async(engine.free_tcp_port).get(self._start_wait())
        return f"tcp://{about[order[0]]['address']}:{port}"

    # -- using ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """"running", "stopped", or "needs restart: <why>" after a hang, crash or left-over ranks."""
        if self._stopped:
            return "stopped"
        return f"needs restart: {self._ranks.broken}" if self._ranks.broken else "running"

    @property
    def op_timeout(self) -> float:
        """Seconds ONE wait between ranks may take. Set on a running lab, the ranks' process group takes
        the new bound at once for its collectives, and a pipeline built after for its own waits (one
        built before keeps its bound). gloo's raw `dist.send`/`dist.recv` keep the bound the group was
        made with until `lab.restart()`, which makes the group with this one."""
        return self._op_timeout

    @op_timeout.setter
    def op_timeout(self, seconds: float) -> None:
        seconds = check_positive_seconds("op_timeout", seconds)
        if self.state == "running" and seconds != self._op_timeout:
            self.run(engine.set_op_timeout, seconds, timeout=TEARDOWN_SECONDS)
        self._op_timeout = seconds

    @property
    def world_size(self) -> int:
        """The number of ranks (torch.distributed's word for it: `n_ranks` is what started them)."""
        return len(self._ranks.infos)

    @property
    def backend(self) -> str:
        """The torch.distributed backend of the process group ("gloo" or "nccl")."""
        return self._ranks.infos[0].backend if self._ranks.infos else "?"

    @property
    def device(self) -> str:
        """The kind of device each rank computes on ("cpu" or "cuda")."""
        return self._ranks.infos[0].device if self._ranks.infos else "?"

    @property
    def profile_dir(self) -> str:
        """The IPython profile directory of the cluster (connection files, logs, lab records)."""
        return self._launcher.profile_dir

    @property
    def cluster_id(self) -> str:
        """The ipyparallel cluster id (a local lab gets a new one at each restart)."""
        return self._launcher.cluster_id

    @property
    def view(self):
        """The ipyparallel DirectView over the ranks, in rank order (refreshed by restart)."""
        return self._view

    @property
    def client(self):
        """The ipyparallel Client connected to the lab's controller."""
        return self._launcher.client

    @property
    def last_errors(self) -> dict:
        """rank -> remote error, for the ranks that raised in the last failed call."""
        return self._ranks.last_errors

    def status(self) -> RankTable:
        """One row per rank: engine id, host, pid, local rank, device, backend and state."""
        busy = set(self._last_call.running_ranks()) if self._last_call is not None else set()
        dead = set(self._ranks.dead_ranks(range(self.world_size))) if not self._stopped else set()

        def state(rank: int) -> str:
            if self._stopped:
                return "stopped"
            return "dead" if rank in dead else "busy" if rank in busy else "idle"

        return RankTable(replace(info, state=state(info.rank)) for info in self._ranks.infos)

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results ordered by rank."""
        return self.run_async(fn, *args, timeout=timeout, **kwargs).result()

    def run_async(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> RankCall:
        """Start fn(*args, **kwargs) on every rank; the returned RankCall gives events and results."""
        self._check_usable()
        if timeout is not None:
            check_positive_seconds("timeout", timeout)
        by_rank = arguments_by_rank(fn, args, kwargs, self.world_size)
        # Through engine.call_on_rank: it tells the client when fn's error broke the process group.
        if by_rank is None:
            running = self._view.apply_async(engine.call_on_rank, fn, *args, **kwargs)
        else:  # each engine is sent its own rank's arguments (the view's engines are in rank order)
            import ipyparallel as ipp

            running = ipp.AsyncResult.join(*[
                self.client[engine_id].apply_async(engine.call_on_rank, fn, *rank_args, **rank_kwargs)
                for engine_id, (rank_args, rank_kwargs) in zip(self._view.targets, by_rank)])
        self._last_call = RankCall(self._ranks, running, call_name(fn), timeout, self.grace)
        self._changed("called")
        return self._last_call

    def _changed(self, state: str) -> None:
        """The lab's life, for the floors above to follow: "running" (started or restarted), "called"
        (a call started), "restarting", "stopped". The driver itself does nothing with it (the
        notebook's Lab, pplab.Lab, writes its record in the instructor's room)."""

    @property
    def gpus(self) -> list[int]:
        """The CUDA devices of the ranks ([] on CPU)."""
        return list(self._rank_gpus)

    @property
    def gpu_memory_fraction(self) -> float | None:
        """The share of its GPU's memory each rank may take (None: not capped, or on CPU)."""
        return self._memory_fraction if self._rank_gpus else None

    @property
    def host_messages(self) -> bool:
        """Whether the ranks' messages go through host memory (over gloo):
        ranks sharing a GPU, or asked for."""
        return self._host_messages

    @property
    def placement(self) -> str:
        """Where the ranks compute and how they talk, in words: 'gloo on cuda (GPU 0 shared by ranks 0-3;
        messages through host memory)'."""
        return describe_placement(self.backend, self.device, self._rank_gpus, self._memory_fraction,
                                  self._host_messages)

    @property
    def rank_processes(self) -> tuple[tuple[str, int], ...]:
        """(host, pid) of each rank's engine, by rank: it changes when the engines are replaced."""
        return tuple((info.host, info.pid) for info in self._ranks.infos)

    def stream(self, fn: Callable, *args, timeout: float | None = None,
               **kwargs) -> Iterator[RankEvent]:
        """Run fn on every rank and yield the events it publishes while it runs."""
        return self.run_async(fn, *args, timeout=timeout, **kwargs).events()

    def activate(self, suffix: str = "") -> None:
        """Make %%px cells run on this lab's ranks (done at start inside IPython)."""
        from ipyparallel.client.magics import ParallelMagics
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or self._view is None:
            return
        magics = ParallelMagics(shell, self._view, suffix)
        # Without a nanny the engines cannot be signalled: an interrupted %%px cell just
        # stops waiting (a rank blocked in gloo could not be interrupted anyway).
        magics.signal_on_interrupt = None
        # What ranks print is shown when the cell ends, in rank order ([stdout:0] first);
        # `%%px --stream` shows it as it arrives instead (in the order it arrives).
        magics.stream_output = False
        shell.magics_manager.register(magics)

    def _check_usable(self) -> None:
        if self._stopped:
            raise LabError("this lab is stopped; call lab.restart() or start a new Lab")
        if self._ranks.broken:
            raise LabNeedsRestartError(f"the lab needs a restart, because\n{self._ranks.broken}.\n"
                                       f"{RESTART_HINT}")

    # -- restarting and stopping -----------------------------------------------------------

    def restart(self) -> None:
        """Replace every engine by a fresh one, reassign ranks and re-initialise the process group."""
        self._launcher.check_restart(stopped=self._stopped)  # refuses before anything changes
        self._changed("restarting")  # its processes are about to go: not dead
        self._bring_up(self._launcher.restart, "restart")

    def stop(self) -> None:
        """Leave the process group and stop the engines. A local lab keeps its controller and fork
        server for this process's next lab (pplab.drivers.cluster.kept: stopped at exit and by
        `pplab cleanup`); a connected one leaves its cluster to whoever started it."""
        if self._stopped:
            return
        from ipyparallel.error import NoEnginesRegistered

        try:
            if self.client is not None and self._view is not None and not self._ranks.broken:
                self.run(engine.teardown_rank, timeout=TEARDOWN_SECONDS)
        except RankError as error:  # the call marked the ranks broken: the shutdown kills them
            if self._verbose:
                first_line = str(error).splitlines()[0]
                print(f"pplab: the ranks did not leave their process group ({first_line})")
        except NoEnginesRegistered:  # every engine died and the controller noticed: nothing to leave
            pass
        finally:  # whatever went wrong above, nothing is left running
            self._shutdown(kill=bool(self._ranks.broken))  # a rank stuck in a wait leaves by SIGKILL

    def _shutdown(self, kill: bool) -> None:
        """Close the client and end every process this lab started (SIGKILL if `kill`)."""
        was_running, self._stopped = not self._stopped, True
        _running_labs.discard(self)
        self._launcher.stop(kill)
        if was_running:
            self._changed("stopped")

    def __del__(self) -> None:
        # A running lab nobody refers to any more (e.g. a start cell run twice) must not
        # leave its processes behind; a quick kill is all that can be done at this point.
        # (Python prints, and then ignores, whatever this raises.)
        if not self._stopped:
            self._shutdown(kill=True)

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<Lab {self.world_size} ranks, {self.backend} on {self.device}, "
                f"cluster {self.cluster_id!r}: {self.state}>")


Lab.__init__.__doc__ = (
    "Start a local lab: a controller and `n_ranks` engines joined in one process group.\n\n"
    + keywords_help(Lab.__init__, LabOptions, {
        "controller_ip": "the controller listens on loopback only unless you change this",
        "fork": "start engines by forking one process that imported torch (default on Linux)",
        "profile_dir": "the ipyparallel profile's folder (default: one of pplab's own)",
        "activate": "make %%px cells run on this lab's engines",
        "verbose": "print the start's progress and the ready line"}) + "\n")


def _local_gpu_count(backend: str, device: str) -> int:
    """GPUs on this host; 0 without asking CUDA when CPU is forced, or when the host has no GPU's
    device files (asking imports torch, 1-2 s of a fresh kernel, before the engines could start)."""
    if device == "cpu" or (backend == "gloo" and device == "auto") or not _gpu_device_files():
        return 0
    import torch

    return torch.cuda.device_count()


def _gpu_device_files() -> bool:
    """True where a GPU may be visible: an NVIDIA (/dev/nvidiaN), ROCm (/dev/kfd) or WSL2 (/dev/dxg)
    device file, or an OS other than Linux (where CUDA is asked)."""
    if not sys.platform.startswith("linux"):
        return True
    return (os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")
            or any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev")))
