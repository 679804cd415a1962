"""Where a lab's engines come from: a cluster it starts here, or one somebody started elsewhere.

`Lab()` takes a `LocalCluster`, `Lab.connect()` a `ConnectedCluster`; from then
on the lab never asks which it has. Both offer the same small interface:

    client                      the ipyparallel Client (None before start and after stop)
    profile_dir, cluster_id     where the cluster's files are, and which cluster it is
    gloo_ifname                 the network interface the user chose for gloo/NCCL, or None
    start(progress)             bring engines up and connect; return engine ids not to use
    check_restart(stopped)      raise LabError if restart() cannot work, before anything changes
    restart(progress)           replace the engines; return the old engine ids not to use
    check_alive()               while engines register: raise LabStartError if ours exited
    launch_logs()               the last lines the controller and engines wrote
    threads_per_rank(threads)   what each rank passes to torch.set_num_threads
    record_ranks(processes)     the ranks' processes are known: note them for cleanup()
    stop(kill)                  close the client; end the processes this lab started

How a local lab starts fast: the controller and a fork server start together;
the fork server imports torch once and forks one engine per rank while the
controller comes up; the engines register quickly because the controller's
heartbeat is short. A lab that stops cleanly keeps both (pplab.drivers.cluster.kept): a restart,
and the next lab of the same process, connect to them and have new engines forked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from pplab.base.machine import busy_note, recent_load
from pplab.drivers.cluster import kept as kept_clusters
from pplab.drivers.cluster import records
from pplab.drivers.cluster.errors import LabError, LabStartError

# The controller accepts an engine only after its heart has answered a beat, seen at the next beat:
# a 150 ms beat instead of 3 s saves seconds at start, and it is most of a restart on a kept
# controller (2 ranks: 0.4-0.6 s at 200 ms, 0.40-0.47 s at 150 ms, 0.30 s at 100 ms). An idle 2-rank
# lab took 1.3 % of a core at 250 and 200 ms, 1.7-1.8 % at 150 ms, 2.5 % at 100 ms: labs wait idle
# most of their lives. Threads instead of processes for its schedulers: fewer processes.
HEARTBEAT_SECONDS = 0.15
# How long the controller goes without an engine's beat before it gives the engine up, on a quiet
# machine. What falls silent under load is the controller's own loop (an engine's heart is a zmq
# thread that needs no Python): a starved controller can miss a live engine's beats and give it up.
# So the lab stretches it by the slowdown it measured at its start, up to 4 times. A local rank
# that dies is seen by its pid at once, so only the silent wait grows.
HEARTBEAT_PATIENCE_SECONDS = 10.0
PATIENCE_STRETCH_AT_MOST = 4.0


def controller_args(patience: float, load=None) -> list[str]:
    """The options of every controller pplab starts: a beat every HEARTBEAT_SECONDS, and `patience`
    seconds of missed beats (stretched by `load`, a MachineLoad, at most PATIENCE_STRETCH_AT_MOST
    times) before an engine counts as dead."""
    stretch = 1.0 if load is None else min(PATIENCE_STRETCH_AT_MOST, load.slowdown)
    misses = math.ceil(patience * stretch / HEARTBEAT_SECONDS)
    return ["--usethreads", f"--HeartMonitor.period={round(HEARTBEAT_SECONDS * 1000)}",
            f"--HeartMonitor.max_heartmonitor_misses={misses}", "--log-level=ERROR"]


# No nanny process per engine (it costs a Python start-up per rank; the lab watches
# engine pids itself) and no shared IPython history database (ranks would contend for it).
ENGINE_ARGS = ["--IPEngine.enable_nanny=False", "--HistoryManager.enabled=False",
               "--log-level=WARN"]


def engine_args(start_timeout: float) -> list[str]:
    """The options of every engine pplab starts, here or in a namespace host. By default ipengine
    gives up, and exits, when the controller takes over 5 s to answer its registration, which a
    busy machine can take (a CI run saw one of a lab's two engines never register): an engine
    waits as long as the lab's start does."""
    return [*ENGINE_ARGS, f"--IPEngine.wait_for_url_file={start_timeout}",
            f"--IPEngine.timeout={start_timeout}"]


LOG_LINES = 15  # per log, in a start-up error message
CONTROLLER_BIND_SECONDS = 5  # after its files appear, for every scheduler thread to bind its port
CONTROLLER_TRIES = 3  # controllers started again when one lost a port to another process
CONNECT_SECONDS = 10  # for a connected cluster's controller to answer, on a quiet machine

# ipyparallel reports a process it sees die (as our restart's SIGKILL) by dumping its log
# into the notebook; pplab reports what matters itself, so only its errors get through.
_ipyparallel_log = logging.getLogger("pplab.drivers.cluster.ipyparallel")
_ipyparallel_log.setLevel(logging.ERROR)


class LocalCluster:
    """A controller and one engine per rank on this host, started by the lab and stopped with it."""

    gloo_ifname = None  # all ranks are on this host: the lab puts gloo on loopback

    def __init__(self, n_ranks: int, profile_dir: str, *, controller_ip: str, fork: bool,
                 threads: int | None, start_timeout: float, verbose: bool, machine_load=None):
        self.n_ranks = n_ranks
        self.machine_load = machine_load  # the lab's reading (None: read one when needed)
        self.profile_dir = profile_dir
        self.controller_ip = controller_ip
        self.fork = fork
        self.threads = threads
        self.start_timeout = start_timeout
        self.verbose = verbose
        self.client = None
        self.cluster_id = ""
        self._cluster = None  # ipyparallel's Cluster: the controller and, without fork, the engines
        self._fork_server: subprocess.Popen | None = None
        self._launched: list[dict] = []  # controller, fork server, engine launchers, helpers
        self._rank_processes: list[dict] = []
        self._lost_ports = 0  # controllers of the start under way that lost a port (_ports_not_taken)
        self._next_engine_id = 0  # the controller's next free engine id (a kept one had engines)
        self._first_engine_id = None  # of the engines this start asked the fork server for
        self.reused = ""  # what the last start reused (a kept controller and fork server), for the ready line

    def start(self, progress) -> set[int]:
        """Start a controller and the engines, all listening on loopback, and connect a client."""
        records.cleanup(self.profile_dir, verbose=self.verbose)  # what killed kernels left
        for folder in ("security", "log"):
            os.makedirs(os.path.join(self.profile_dir, folder), exist_ok=True)
        kept = kept_clusters.take(self._fingerprint()) if self.fork else None
        if kept is not None:
            return self._start_on(kept, progress)
        self.reused = ""
        self._next_engine_id, self._first_engine_id = 0, None
        self.cluster_id = new_cluster_id()
        progress.update(f"starting a controller and {self.n_ranks} engines")
        if self.fork:  # first of all, so that it imports torch while the controller starts
            self._fork_server = self._start_fork_server()
            # Recorded at once: if the rest of the start fails, stop() and cleanup() find it.
            self._launched = [records.process_entry(self._fork_server.pid, "engine fork server")]
            records.write_record(self.profile_dir, self.cluster_id, self._launched)
        import ipyparallel as ipp

        self._cluster = ipp.Cluster(
            cluster_id=self.cluster_id, profile_dir=self.profile_dir, n=self.n_ranks,
            config=self._engine_launcher_config(), load_profile=False,
            controller_ip=self.controller_ip,
            controller_args=controller_args(HEARTBEAT_PATIENCE_SECONDS, self.machine_load),
            # Engines read the controller's connection file themselves, so they need
            # not wait for the controller before they start.
            send_engines_connection_env=False, delay=0, log=_ipyparallel_log,
            shutdown_atexit=False)  # pplab's own handlers stop it: the lab's, and a kept one's (kept.py)
        self._cluster.start_controller_sync()
        if not self.fork:
            self._cluster.start_engines_sync(self.n_ranks)
        self._launched = self._launched_processes()
        records.write_record(self.profile_dir, self.cluster_id, self._launched)
        missing = self._ports_not_taken()
        if missing:  # engines would register, yet never get a request: start afresh, new ports
            return self._start_again(progress, missing)
        if self.fork:  # now, not sooner: an engine that found a connection file half written exited
            self._ask_for_new_engines()
        # ipyparallel gives the hub 10 s to answer; a controller just started on a busy
        # machine may need longer, so the client waits as long as the rest of the start does.
        try:
            self.client = self._cluster.connect_client_sync(timeout=self.start_timeout)
        except TimeoutError as error:
            raise LabStartError(f"the controller did not answer the client within "
                                f"{self.start_timeout:.0f} s (start_timeout at this machine's "
                                f"pace).{busy_note()}\n{self.launch_logs()}") from error
        self._lost_ports = 0  # the next start (a restart) has its own tries
        return set()

    def _start_on(self, kept, progress) -> set[int]:
        """Start on a kept controller and fork server: connect, and have this lab's engines forked.
        The controller's engines so far (gone, or going) are not to be used."""
        self.cluster_id, self._cluster, self._fork_server = kept.cluster_id, kept.cluster, kept.fork_server
        self._launched, self._next_engine_id = kept.launched, kept.next_engine_id
        self.reused = f"engines forked from this process's kept fork server (pid {kept.fork_server.pid})"
        records.write_record(self.profile_dir, self.cluster_id, self._launched)  # in use again
        progress.update(f"{self.n_ranks} engines from the kept controller and fork server")
        try:
            self.client = self._cluster.connect_client_sync(timeout=self.start_timeout)
        except TimeoutError as error:
            raise LabStartError(f"the kept controller did not answer the client within "
                                f"{self.start_timeout:.0f} s.{busy_note()}\n{self.launch_logs()}") from error
        old_engines = set(self.client.ids)
        self._ask_for_new_engines()
        return old_engines

    def _fingerprint(self) -> str:
        return kept_clusters.fingerprint(self.profile_dir, self.controller_ip)

    def _ports_not_taken(self) -> list[int]:
        """The ports of the controller's connection files that it does not listen on.

        ipyparallel picks free ports first and binds them later; on a busy machine another process
        can take one in between (three labs starting at once did). A scheduler thread that fails to
        bind dies alone: the controller lives, engines register, and every request to them is lost
        (a start then waited out its whole start_timeout in _describe). A controller that exited
        once its files were written (an attendee's lab in the room test, three starting at once,
        failed here with psutil's NoSuchProcess) starts afresh when its log says a port was taken,
        and is a LabStartError with that log otherwise."""
        import psutil

        wanted = self._ports_in_connection_files()
        deadline = time.monotonic() + (self.machine_load or recent_load()).scale(CONTROLLER_BIND_SECONDS)
        while True:
            try:
                controller = psutil.Process(self._cluster.controller.process.pid)
                processes = [controller, *controller.children(recursive=True)]
            except psutil.NoSuchProcess:  # the controller exited once its files were written
                if "Address already in use" in self.launch_logs():
                    return sorted(wanted)  # its main process lost a port the same way: start afresh
                self.check_alive()  # any other exit: a LabStartError with its last words
                raise
            listening = set()
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    listening |= {c.laddr.port for c in process.net_connections("tcp")
                                  if c.status == "LISTEN"}
            missing = sorted(wanted - listening)
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)

    def _ports_in_connection_files(self) -> set[int]:
        """Every port the controller's connection files name, once it has written them."""
        deadline = time.monotonic() + self.start_timeout
        paths = list(self._cluster.controller.connection_files.values())
        while True:
            self.check_alive()  # a controller that exited writes nothing
            try:
                about = [json.loads(open(path).read()) for path in paths]
                break
            except (OSError, ValueError):  # not there yet, or half written
                if time.monotonic() > deadline:
                    raise LabStartError("the controller wrote no connection files within "
                                        f"{self.start_timeout:.0f} s (start_timeout at this machine's "
                                        f"pace).{busy_note()}\n{self.launch_logs()}") from None
                time.sleep(0.05)
        return {port for found in about for value in found.values()
                for port in (value if isinstance(value, list) else [value])
                if isinstance(port, int) and not isinstance(port, bool)}

    def _start_again(self, progress, missing: list[int]) -> set[int]:
        """Stop the controller that lost a port (and its engines), then start afresh, a few times."""
        self._lost_ports += 1
        if self._lost_ports > CONTROLLER_TRIES:
            raise LabStartError(f"{CONTROLLER_TRIES + 1} controllers in a row could not take their ports "
                                f"(the last: {missing}): other processes on this machine take free ports "
                                f"as fast as they appear.\n{self.launch_logs()}")
        progress.update(f"port(s) {missing} were taken before the controller bound them: starting another")
        self.stop(kill=True, keep=False)
        return self.start(progress)

    def check_restart(self, stopped: bool) -> None:
        """A local lab can always start again, stopped or not."""

    def restart(self, progress) -> set[int]:
        """Stop the engines (SIGKILL: a rank stuck in a gloo wait leaves no other way) and keep the
        controller and fork server, whose imports are done; start again on them, with new engines
        forked (afresh if one of them has gone)."""
        progress.update("stopping the old engines")
        self.stop(kill=True, keep=True)
        return self.start(progress)

    def check_alive(self) -> None:
        """Raise LabStartError if a process this lab started has exited (e.g. a bad engine flag)."""
        gone = [entry for entry in self._launched if records.find_process(entry) is None]
        if gone:
            raise LabStartError(f"the {gone[0]['role']} (pid {gone[0]['pid']}) exited during "
                                f"start-up.\n{self.launch_logs()}")
        exited = self._forked_engine_exit()
        if exited:
            raise LabStartError(f"{exited.removeprefix('pplab forkserver: ').strip()} during "
                                f"start-up.\n{self.launch_logs()}")

    def engine_exit(self, pid: int) -> str | None:
        """How the engine of process `pid` ended, as its fork server logged it on reaping it
        ("killed by SIGKILL", "exit status 1"); None if it has not (yet)."""
        if self._fork_server is None or not os.path.exists(self._fork_server_log()):
            return None
        with open(self._fork_server_log(), errors="replace") as log:
            said = [line for line in log if f"(pid {pid}) exited with status " in line]
        if not said:
            return None
        code = int(said[-1].rsplit(" ", 1)[1])
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def launch_logs(self) -> str:
        """The last lines the controller and engines wrote, for start-up error messages."""
        outputs = _launcher_outputs(self._cluster)
        if self._fork_server is not None and os.path.exists(self._fork_server_log()):
            with open(self._fork_server_log(), errors="replace") as log:
                outputs.append(log.read())
        return _tail(outputs)

    def threads_per_rank(self, threads: int | None) -> int | None:
        """What each rank passes to torch.set_num_threads (None: leave torch's default)."""
        if threads is None and self.fork:
            return os.cpu_count()  # torch's default had the fork server not been held to one
        return threads

    def record_ranks(self, processes: list[dict]) -> None:
        """Record the ranks' processes, and the controller's helpers, on disk for cleanup()."""
        self._rank_processes = processes
        # By now the controller has started its heartbeat process: record it too, so that
        # cleanup() finds it even if the controller itself is gone.
        controller = records.find_process(self._launched[0])
        helpers = controller.children(recursive=True) if controller is not None else []
        self._launched += [records.process_entry(child.pid, "controller child") for child in helpers]
        records.write_record(self.profile_dir, self.cluster_id, self._launched + processes)

    def stop(self, kill: bool, keep: bool | None = None) -> None:
        """Close the client and end the engines (SIGKILL if `kill`); keep the controller and fork
        server for this process's next lab if `keep` (default: unless `kill`, where they run:
        see pplab.drivers.cluster.kept), else end them too."""
        if self.client is not None:
            self.client.close()
            self.client = None
        keep = (not kill) if keep is None else keep
        if keep and self._fork_server_running() and self._cluster is not None:
            return self._keep(kill)
        ours = self._launched + self._rank_processes
        if kill:
            records.kill_processes(ours)
        try:
            if self._cluster is not None:
                self._cluster.stop_cluster_sync()
        finally:  # should ipyparallel's stop fail, still end every process and say why after
            self._cluster = None
            records.stop_processes(ours)  # whatever ipyparallel's stop left, children included
            self._reap_fork_server()
            if self.cluster_id:
                records.remove_lab_files(self.profile_dir, self.cluster_id)
            self._launched, self._rank_processes = [], []

    def _keep(self, kill: bool) -> None:
        """End the engines only, and keep the controller and fork server (see stop)."""
        engines = self._rank_processes + [entry for entry in self._launched if entry["role"] == "engine"]
        if kill:
            records.kill_processes(engines)
        records.stop_processes(engines)
        kept = [entry for entry in self._launched if entry["role"] != "engine"]
        kept_clusters.keep(kept_clusters.KeptCluster(
            self._fingerprint(), self._cluster, self.cluster_id, self.profile_dir, self._fork_server, kept,
            self._next_engine_id))
        rendezvous = os.path.join(records.records_dir(self.profile_dir), self.cluster_id)
        shutil.rmtree(rendezvous, ignore_errors=True)  # the ranks' files: the next lab makes its own
        self._cluster, self._fork_server, self._launched, self._rank_processes = None, None, [], []

    # -- how the engines are started ----------------------------------------------------------

    def _start_fork_server(self) -> subprocess.Popen:
        """Start the process that imports torch once and forks the engines (see forkserver.py)."""
        environment = {**os.environ, **self._engine_environment(),
                       "IPP_CLUSTER_ID": self.cluster_id, "IPP_PROFILE_DIR": self.profile_dir}
        with open(self._fork_server_log(), "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "pplab.drivers.cluster.forkserver"],
                env=environment, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # like ipyparallel's: a notebook interrupt must not reach it

    def _ask_for_new_engines(self) -> None:
        """Have the fork server fork this lab's engines (see forkserver.main), with the controller's
        next free ids: a kept controller may still list the last lab's engines."""
        from pplab.drivers.cluster.forkserver import engines_command

        command = engines_command(self.cluster_id, self.profile_dir, self.n_ranks, self._next_engine_id,
                                  engine_args(self.start_timeout))
        self._first_engine_id = self._next_engine_id  # this start's set, in the fork server's log
        self._next_engine_id += self.n_ranks
        self._fork_server.stdin.write(command.encode())
        self._fork_server.stdin.flush()

    def _fork_server_running(self) -> bool:
        return self._fork_server is not None and self._fork_server.poll() is None

    def _reap_fork_server(self) -> None:
        """Wait for the stopped fork server (SIGKILL after 10 s), so that no zombie is left."""
        if self._fork_server is None:
            return
        self._fork_server.stdin.close()
        try:
            self._fork_server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._fork_server.kill()
            self._fork_server.wait(timeout=10)
        self._fork_server = None

    def _fork_server_log(self) -> str:
        return os.path.join(self.profile_dir, "log", f"pplab-engines-{self.cluster_id}.log")

    def _forked_engine_exit(self) -> str | None:
        """The fork server's log line about an engine of this cluster that exited, if one did."""
        # Imported here: `python -m` runs forkserver.py after this package is imported, and
        # warns (in every start-up error's log tail) if that already imported it as a module.
        from pplab.drivers.cluster.forkserver import engines_for

        if (self._fork_server is None or self._first_engine_id is None
                or not os.path.exists(self._fork_server_log())):
            return None
        with open(self._fork_server_log(), errors="replace") as log:
            lines = log.readlines()
        ours = engines_for(self.cluster_id, self._first_engine_id)  # earlier sets exited at their restart
        since = max((index for index, line in enumerate(lines) if line.strip() == ours), default=None)
        if since is None:  # the fork server has not forked this start's engines yet
            return None
        return next((line for line in lines[since:] if "exited with status" in line), None)


    def _engine_launcher_config(self):
        """Config for ipyparallel's one-process-per-engine launcher (used when not forking). (The
        controller's files are waited for by _ports_in_connection_files, for start_timeout.)"""
        from traitlets.config import Config

        config = Config()
        config.LocalEngineSetLauncher.engine_args = engine_args(self.start_timeout)
        config.LocalEngineSetLauncher.environment = self._engine_environment()
        config.LocalEngineSetLauncher.delay = 0.0
        return config

    def _engine_environment(self) -> dict:
        """Environment of the engines: thread counts set before torch is imported there."""
        environment = {"PYTHONUNBUFFERED": "1"}
        # The fork server must not start an OpenMP pool before it forks (a forked child
        # cannot use its parent's pool): one thread there; each rank sets its own count.
        threads = 1 if self.fork else self.threads
        if threads is not None:
            environment.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        return environment

    def _launched_processes(self) -> list[dict]:
        """Process entries of the controller and of the engine launcher process(es)."""
        entries = [records.process_entry(self._cluster.controller.process.pid, "controller")]
        if self._fork_server is not None:
            entries.append(records.process_entry(self._fork_server.pid, "engine fork server"))
        for engine_set in self._cluster.engines.values():
            for launcher in engine_set.launchers.values():
                entries.append(records.process_entry(launcher.process.pid, "engine"))
        return entries


class ConnectedCluster:
    """Engines of a cluster started elsewhere (ipcluster, any launcher, many hosts): used, never stopped."""

    def __init__(self, profile: str | None, profile_dir: str, cluster_id: str,
                 gloo_ifname: str | None, restart_engines=None, machine_load=None):
        self.profile = profile
        self.machine_load = machine_load  # the lab's reading: the wait to connect is stretched by it
        self.profile_dir = profile_dir
        self.cluster_id = cluster_id
        self.gloo_ifname = gloo_ifname
        self.restart_engines = restart_engines  # the user's way to replace the engines, or None
        self.client = None
        self._cluster = None  # ipyparallel's Cluster read from the cluster file, to restart engines
        self._why_no_restart = "the lab has not connected yet"

    def start(self, progress) -> set[int]:
        """Connect a client to the running cluster; read its cluster file, if any, for restart()."""
        import ipyparallel as ipp

        progress.update(f"connecting to cluster {self.cluster_id!r}")
        client_file = self._client_file()
        wait = self.machine_load.scale(CONNECT_SECONDS) if self.machine_load else CONNECT_SECONDS
        try:
            self.client = ipp.Client(client_file, timeout=wait)
        except (OSError, ValueError) as error:
            with open(client_file) as f:
                about = json.load(f)
            address = f"{about.get('interface', '?')}:{about.get('registration', '?')}"
            raise LabStartError(
                f"the controller of cluster {self.cluster_id!r} does not answer at {address} "
                f"(as {client_file} says) within {wait:.0f} s: it has stopped, or this "
                f"machine cannot reach that address ({error}).\nStart the cluster again, or check "
                f"the network between here and its controller") from error
        self._cluster, self._why_no_restart = self._load_cluster_file()
        return set()

    def _client_file(self) -> str:
        """The cluster's connection file for clients; a clear error, at once, where there is none."""
        security = os.path.join(self.profile_dir, "security")
        path = os.path.join(security, f"ipcontroller-{self.cluster_id}-client.json"
                            if self.cluster_id else "ipcontroller-client.json")
        if not os.path.exists(path):
            found = sorted(name[len("ipcontroller-"):-len("-client.json")] or "''"
                           for name in (os.listdir(security) if os.path.isdir(security) else [])
                           if name.startswith("ipcontroller-") and name.endswith("-client.json"))
            others = (f"clusters with files there: {', '.join(found)}" if found
                      else "no cluster has files there")
            raise LabStartError(
                f"no running cluster found for profile={self.profile!r}, cluster_id={self.cluster_id!r}: "
                f"{path} does not exist ({others}).\nStart one first, e.g. `ipcluster start -n 4 "
                f"--profile={self.profile or 'default'}`, or give the cluster_id it was started with")
        return path

    def _load_cluster_file(self):
        """(ipyparallel's Cluster from the cluster file, None) or (None, why it cannot restart engines)."""
        import ipyparallel as ipp

        try:
            cluster = ipp.Cluster.from_file(profile=self.profile, profile_dir=self.profile_dir,
                                            cluster_id=self.cluster_id)
        except Exception as error:  # any unreadable file: restart() explains with this reason
            return None, f"its cluster file could not be read ({type(error).__name__}: {error})"
        if not cluster.engines:
            return None, f"its cluster file {cluster.cluster_file} lists no engines it started"
        return cluster, None

    def check_restart(self, stopped: bool) -> None:
        """Restart needs the open connection and the cluster file; raise naming what is missing."""
        if stopped:
            raise LabError("this lab was stopped, which closed its connection to the cluster: "
                           "connect again with pplab.Lab.connect(...)")
        if self._cluster is None and self.restart_engines is None:
            raise LabError(f"cannot restart the engines of a cluster started elsewhere: "
                           f"{self._why_no_restart}.\nRestart them with your launcher (e.g. "
                           f"`ipcluster stop/start`) and call Lab.connect(...) again, or give "
                           f"Lab.connect(restart_engines=...) a function that does")

    def restart(self, progress) -> set[int]:
        """Restart the engines through the cluster's own launcher; the old ids are not to be used."""
        progress.update("restarting engines")
        old_engines = set(self.client.ids)
        if self.restart_engines is not None:
            self.restart_engines()
        else:
            self._cluster.restart_engines_sync()
        return old_engines

    def check_alive(self) -> None:
        """This lab started no process that could have exited."""

    def engine_exit(self, pid: int) -> str | None:
        """The engines were started elsewhere: how one ended is not known here."""
        return None

    def launch_logs(self) -> str:
        """The last lines the launchers in the cluster file wrote (none without a cluster file)."""
        return _tail(_launcher_outputs(self._cluster))

    def threads_per_rank(self, threads: int | None) -> int | None:
        """The engines were started elsewhere: each rank sets exactly what the lab asks."""
        return threads

    def record_ranks(self, processes: list[dict]) -> None:
        """Nothing to record: the cluster belongs to whoever started it, and so does its cleanup."""

    def stop(self, kill: bool) -> None:
        """Close the client; the controller and engines go on running for their owner."""
        if self.client is not None:
            self.client.close()
            self.client = None


def new_cluster_id() -> str:
    """A fresh cluster id, in ipyparallel's style: start time and a random suffix."""
    return f"{int(time.time())}-{uuid.uuid4().hex[:4]}"


def _launcher_outputs(cluster) -> list[str]:
    """What the controller and engine-set launchers of an ipyparallel Cluster wrote."""
    if cluster is None:
        return []
    launchers = [cluster.controller, *cluster.engines.values()]
    return [launcher.get_output() for launcher in launchers if launcher is not None]


def _tail(outputs: list[str]) -> str:
    """The last LOG_LINES lines of each output, under a heading (empty if there are none)."""
    tail = "\n".join(line for output in outputs for line in output.splitlines()[-LOG_LINES:])
    return f"Last lines of their logs:\n{tail}" if tail else ""
