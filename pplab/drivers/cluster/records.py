"""Records of running labs on disk, so that `pplab.cleanup()` can stop what a killed kernel left.

A lab's controller and engines run in their own sessions, so they survive the
kernel that started them if it is killed. Each lab writes a small JSON record
(its owner process and every process it started, with their start times so that
a recycled pid is never mistaken for ours) under ``<profile_dir>/pplab/``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import time

import psutil

PROFILE_NAME = "pplab"


def default_profile_dir() -> str:
    """The IPython profile directory pplab's local labs use: $IPYTHONDIR/profile_pplab."""
    # IPython's rule ($IPYTHONDIR, else ~/.ipython), without importing IPython (0.3 s)
    # before the engines can start.
    ipython_dir = os.environ.get("IPYTHONDIR") or os.path.join(os.path.expanduser("~"), ".ipython")
    return os.path.join(ipython_dir, f"profile_{PROFILE_NAME}")


def records_dir(profile_dir: str) -> str:
    """The folder holding lab records (and their rendezvous files) in a profile directory."""
    return os.path.join(profile_dir, "pplab")


def process_entry(pid: int, role: str) -> dict:
    """Identify a process by pid *and* start time, so that a reused pid is not mistaken for it."""
    return {"pid": pid, "started": started(pid), "role": role}


def started(pid: int) -> float:
    """When process `pid` started, as a number that never changes while it runs.

    On Linux, seconds since boot from /proc/PID/stat. Not psutil's create_time(): that adds the
    boot time, which Linux recomputes from the wall clock at each read, so an NTP adjustment moves
    it by a second and a live process would look like a new one: a live controller "exited"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # after the name, which may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return psutil.Process(pid).create_time()  # no procfs: the platform's own start time


def find_process(entry: dict) -> psutil.Process | None:
    """The live process an entry names, or None if it has exited (or its pid was reused)."""
    try:
        process = psutil.Process(entry["pid"])
        if entry.get("started") != started(entry["pid"]):  # none: a record of an older pplab
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except psutil.Error:
        return None


def write_record(profile_dir: str, cluster_id: str, processes: list[dict], kept: bool = False) -> str:
    """Write (or overwrite) the record of lab `cluster_id`, owned by this process; `kept`: its lab
    stopped, and its controller and fork server wait for this process's next lab (see kept.py)."""
    folder = records_dir(profile_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{cluster_id}.json")
    record = {"cluster_id": cluster_id, "owner": process_entry(os.getpid(), "owner"),
              "processes": processes, "written": time.time(), "kept": kept}
    with open(path + ".tmp", "w") as file:
        json.dump(record, file, indent=1)
    os.replace(path + ".tmp", path)  # never leave a half-written record behind
    return path


def with_descendants(entries: list[dict]) -> list[psutil.Process]:
    """The live processes among `entries`, and all their children (e.g. the controller's
    heartbeat process, which a SIGKILLed controller would leave behind)."""
    processes = [process for process in map(find_process, entries) if process is not None]
    for process in list(processes):
        try:
            processes.extend(child for child in process.children(recursive=True)
                             if child not in processes)
        except psutil.Error:
            pass
    return processes


def stop_processes(entries: list[dict], kill_after: float = 2.0) -> list[int]:
    """Stop the live processes among `entries` and their children: SIGTERM, SIGKILL after `kill_after` s."""
    processes = with_descendants(entries)
    for process in processes:
        _send(process, signal.SIGTERM)
    still_alive = wait_until_exited(processes, timeout=kill_after)
    for process in still_alive:
        _send(process, signal.SIGKILL)
    wait_until_exited(still_alive, timeout=5)
    return [process.pid for process in processes]


def kill_processes(entries: list[dict]) -> list[int]:
    """SIGKILL the live processes among `entries` and their children now (ranks stuck in a wait)."""
    processes = with_descendants(entries)
    for process in processes:
        _send(process, signal.SIGKILL)
    wait_until_exited(processes, timeout=5)
    return [process.pid for process in processes]


def wait_until_exited(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `processes` to exit; the ones still running.

    A zombie has exited. Our own children are reaped at once (psutil waits on them); an
    orphan's zombie waits for init to reap it, which on some machines (a VM's minimal init)
    takes a second or more: nothing is left to wait for."""
    ours = [process for process in processes if _parent_pid(process) == os.getpid()]
    _, alive = psutil.wait_procs(ours, timeout=timeout)
    deadline = time.monotonic() + timeout
    others = [process for process in processes if process not in ours]
    while True:
        others = [process for process in others if _running(process)]
        if not others or time.monotonic() >= deadline:
            return alive + others
        time.sleep(0.02)


def _parent_pid(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.Error:
        pass


def remove_lab_files(profile_dir: str, cluster_id: str) -> None:
    """Delete the record, rendezvous files, connection files and logs of lab `cluster_id`."""
    folder = records_dir(profile_dir)
    shutil.rmtree(os.path.join(folder, cluster_id), ignore_errors=True)
    patterns = [os.path.join(folder, f"{cluster_id}.json"),
                os.path.join(profile_dir, "security", f"cluster-{cluster_id}.json"),
                os.path.join(profile_dir, "security", f"ipcontroller-{cluster_id}-*.json"),
                os.path.join(profile_dir, "log", f"*{cluster_id}*")]
    for pattern in patterns:
        for path in glob.glob(pattern):
            try:
                os.remove(path)
            except OSError:
                pass


def read_records(profile_dir: str) -> list[dict]:
    """All lab records in a profile directory (unreadable ones are skipped)."""
    records = []
    for path in sorted(glob.glob(os.path.join(records_dir(profile_dir), "*.json"))):
        try:
            with open(path) as file:
                records.append(json.load(file))
        except (OSError, ValueError):
            continue
    return records


def cleanup(profile_dir: str | None = None, *, force: bool = False, verbose: bool = True,
            kept: bool = False) -> list[str]:
    """Stop labs whose kernel is gone (all labs with force=True), and with `kept` the controllers and
    fork servers running kernels keep for their next lab (pplab.drivers.cluster.kept); return
    their cluster ids."""
    profile_dir = profile_dir or default_profile_dir()
    stopped = []
    for record in read_records(profile_dir):
        owner_alive = find_process(record["owner"]) is not None
        running = [entry for entry in record["processes"] if find_process(entry) is not None]
        if owner_alive and running and not force and not (kept and record.get("kept")):
            continue  # a lab in use, or kept for its kernel's next lab
        stop_processes(running)
        remove_lab_files(profile_dir, record["cluster_id"])
        if running:
            stopped.append(record["cluster_id"])
            if verbose:
                whose = "a running kernel" if owner_alive else "a kernel that is gone"
                what = "the kept controller and fork server" if record.get("kept") else "lab"
                print(f"pplab cleanup: stopped {what} {record['cluster_id']} of {whose} "
                      f"({len(running)} process(es) were still running)")
    return stopped
