"""What a stopped lab leaves for the next lab of the same process: its controller and fork server.

Most of a local lab's start is two Python start-ups: the controller's (ipyparallel) and the fork
server's (torch). Neither depends on the lab: a controller takes any engines that register, and the
fork server forks engines for whichever cluster it is asked. So a lab that stops cleanly stops its
engines and keeps the two, and the next `pplab.Lab()` of this process (or the same lab's
`restart()`) connects to the kept controller and has new engines forked: no Python start-up at all.

Kept per client process, one at a time: never shared with another user or kernel (the fork server
exits when its owner does, and the record names the owner), and given up, for a fresh start, when
anything the engines would inherit has changed since it started (`fingerprint`: the Python, the
versions of pplab, torch and ipyparallel, pplab's sources, the environment variables, the working
directory, the profile folder). It is written to disk like a lab's record, marked kept, so that
`pplab cleanup` stops it, and this process stops it at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pplab.drivers.cluster import records

# Environment variables that change while a process runs without mattering to its engines.
VOLATILE_VARIABLES = {"PYTEST_CURRENT_TEST", "COLUMNS", "LINES", "OLDPWD", "PWD", "_"}


@dataclass
class KeptCluster:
    """A controller and a fork server without engines, waiting for this process's next lab."""

    fingerprint: str
    cluster: object  # ipyparallel's Cluster: the controller's launcher and connection files
    cluster_id: str
    profile_dir: str
    fork_server: subprocess.Popen
    launched: list[dict]  # records' entries: the controller, its helpers, the fork server
    next_engine_id: int  # the controller's next free engine id
    since: float = field(default_factory=time.time)

    def alive(self) -> bool:
        """Every process still running (`pplab cleanup`, or a crash, may have ended one)."""
        return (self.fork_server.poll() is None
                and all(records.find_process(entry) is not None for entry in self.launched))

    def describe(self) -> str:
        return (f"controller pid {self.launched[0]['pid']} and engine fork server pid "
                f"{self.fork_server.pid}, kept for {time.time() - self.since:.0f} s")


_kept: KeptCluster | None = None


def fingerprint(profile_dir: str, controller_ip: str) -> str:
    """What engines forked now would inherit, hashed: a kept server with another is given up."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [sys.executable, profile_dir, controller_ip, os.getcwd(), _sources_changed()]
    for package in ("pplab", "torch", "ipyparallel"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} ?")
    parts += sorted(f"{name}={value}" for name, value in os.environ.items() if name not in VOLATILE_VARIABLES)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _sources_changed() -> str:
    """The newest modification time of pplab's own sources (an editable install changes them)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pplab/
    newest = 0.0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
    return repr(newest)


def take(wanted: str) -> KeptCluster | None:
    """The kept cluster, if it has fingerprint `wanted` and still runs (it is then no longer kept);
    any other is stopped."""
    global _kept
    kept, _kept = _kept, None
    if kept is None:
        return None
    if kept.fingerprint != wanted or not kept.alive():
        stop(kept)
        return None
    return kept


def keep(kept: KeptCluster) -> None:
    """Keep `kept` (its engines stopped) for this process's next lab; one kept before is stopped."""
    global _kept
    if _kept is not None:
        stop(_kept)
    _kept = kept
    records.write_record(kept.profile_dir, kept.cluster_id, kept.launched, kept=True)


def stop(kept: KeptCluster) -> None:
    """End a kept cluster's processes and remove its files."""
    try:
        kept.cluster.stop_cluster_sync()
    except Exception:  # noqa: BLE001 - whatever ipyparallel says, the processes go below
        pass
    records.stop_processes(kept.launched)
    try:
        kept.fork_server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        kept.fork_server.kill()
        kept.fork_server.wait(timeout=10)
    records.remove_lab_files(kept.profile_dir, kept.cluster_id)


def stop_kept() -> None:
    """Stop this process's kept cluster, if any (at exit, and for tests that count processes)."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        stop(kept)


def kept_now() -> KeptCluster | None:
    """This process's kept cluster (None: none)."""
    return _kept


atexit.register(stop_kept)  # after the running labs stop (registered later, run sooner), which keep theirs
