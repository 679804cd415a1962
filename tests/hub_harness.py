"""A workshop's hub on loopback, for the hub's test and bench/bench_hub.py: throwaway seat accounts
with passwords, the folders they must reach opened for the while, the hub started as
`pplab workshop start` starts it, and nothing left behind (processes, accounts, ports, folders)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPOSITORY = Path(__file__).resolve().parents[1]


def missing_for_a_hub() -> list[str]:
    """What this machine lacks to run a workshop's hub (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (the hub runs each seat's server as the seat's account)")
    if shutil.which("configurable-http-proxy") is None:
        missing.append("configurable-http-proxy (apt-get install nodejs npm; npm install -g "
                       "configurable-http-proxy)")
    if shutil.which("useradd") is None:
        missing.append("useradd (Debian's passwd package)")
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        missing.append("jupyterhub (pip install 'pplab[hub]')")
    return missing


@contextlib.contextmanager
def opened_for_seats(paths):
    """Open (o+x) every folder on the way to `paths` that other accounts cannot pass, for the while:
    the seats' servers run Python and pplab from where this machine keeps them (here under /root);
    a real workshop installs them where everyone can read (docs/instructor.md)."""
    opened = {}
    for path in paths:
        for folder in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
            if folder.is_dir() and folder not in opened and not folder.stat().st_mode & stat.S_IXOTH:
                opened[folder] = stat.S_IMODE(folder.stat().st_mode)
                folder.chmod(opened[folder] | stat.S_IXOTH)
    try:
        yield
    finally:
        for folder, mode in opened.items():
            folder.chmod(mode)


@dataclass
class Hub:
    """A running workshop hub: its URL, folder, seats and their passwords."""

    url: str
    folder: Path
    seats: list[str]
    instructor: str
    passwords: dict[str, str]
    process: subprocess.Popen
    ports: list[int] = field(default_factory=list)
    left_behind: list[str] = field(default_factory=list)  # after the hub stopped: processes, listening ports
    final_log: str = ""  # the hub's log, kept when its folder goes

    @property
    def room(self) -> Path:
        return self.folder / "room"

    def log(self) -> str:
        """The hub's log (what JupyterHub, the proxy and the room's service said)."""
        return self.final_log or (self.folder / "hub.log").read_text(errors="replace")


def _wait_for(url: str, seconds: float, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the hub exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the hub did not answer at {url} within {seconds:.0f} s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def workshop_hub(n_seats: int, extra_config: str = "", start_seconds: float = 120.0):
    """A hub of `n_seats` seats made for this run (and an instructor), on free loopback ports."""
    import csv

    from pplab.base.machine import recent_load
    from pplab.course.hub import workshop
    from pplab.drivers.local import free_port

    folder = Path(tempfile.mkdtemp(prefix="pplab-hub-", dir="/tmp"))
    prefix = f"pp{uuid.uuid4().hex[:4]}"
    ports = [free_port() for _ in range(4)]
    made: list[str] = []
    process = hub = None
    try:
        made = [f"{prefix}s{number:02d}" for number in range(1, n_seats + 1)] + [f"{prefix}t"]
        workshop.init(folder, n_seats, instructors=[f"{prefix}t"], gpus=0, make_users=True,
                      prefix=f"{prefix}s",
                      bind_url=f"http://127.0.0.1:{ports[0]}", room_url=f"http://127.0.0.1:{ports[1]}")
        with open(folder / workshop.SEATS) as file:
            passwords = {row["account"]: row["password"] for row in csv.DictReader(file)}
        with open(folder / workshop.CONFIG, "a") as config:
            config.write(f"c.JupyterHub.hub_bind_url = 'http://127.0.0.1:{ports[2]}'\n"
                         f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{ports[3]}'\n"
                         f"c.Spawner.start_timeout = c.Spawner.http_timeout = 300\n{extra_config}\n")
        with opened_for_seats([sys.executable, REPOSITORY / "pplab", folder]):
            log = folder / "hub.log"
            process = subprocess.Popen([sys.executable, "-m", "pplab", "workshop", "start", str(folder)],
                                       stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                       start_new_session=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            url = f"http://127.0.0.1:{ports[0]}"
            _wait_for(f"{url}/hub/api/", recent_load(max_age=30).scale(start_seconds), process, log)
            hub = Hub(url, folder, made[:-1], made[-1], passwords, process, ports)
            yield hub
    finally:
        try:
            if process is not None:
                _stop(process)
                if hub is not None:
                    hub.final_log = hub.log()
                    hub.left_behind = [_described(process) for process in processes_of(made)]
                    hub.left_behind += [f"port {port} still listening" for port in ports if _listening(port)]
        finally:  # the accounts and the folder go even where looking at what was left failed
            if made and (folder / workshop.SEATS).exists():
                workshop.remove_users(folder)
            shutil.rmtree(folder, ignore_errors=True)


def _stop(process: subprocess.Popen) -> None:
    """Stop the hub as Ctrl-C would (it stops every seat's server, the proxy and the room's service),
    then whatever of its session is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _listening(port: int) -> bool:
    return any(connection.laddr and connection.laddr.port == port and connection.status == psutil.CONN_LISTEN
               for connection in psutil.net_connections("tcp"))


def processes_of(accounts: list[str]) -> list[psutil.Process]:
    """The processes that run as these accounts."""
    import pwd

    uids = set()
    for account in accounts:
        with contextlib.suppress(KeyError):
            uids.add(pwd.getpwnam(account).pw_uid)
    found = []
    for process in psutil.process_iter(["uids", "status"]):
        with contextlib.suppress(psutil.Error):  # a zombie has ended: only its parent's wait is left
            alive = process.info["status"] != psutil.STATUS_ZOMBIE
            if process.info["uids"] and process.info["uids"].real in uids and alive:
                found.append(process)
    return found


def _described(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline())[:120]}"
    except psutil.Error:
        return f"{process.pid} (ended while looked at)"
