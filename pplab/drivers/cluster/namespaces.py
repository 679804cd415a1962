"""Several hosts on one machine: Linux network namespaces on bridges, each a "host" with its
own name, addresses and interfaces, an ipyparallel controller on the first and engines on each.

What a lab then does across them is what it does across real machines: `Lab.connect` reaches
the controller over the bridge; ranks are grouped by host name; the rendezvous is TCP on the
first host's address; gloo talks over each host's own interface, not loopback. As on many
clusters, the hosts have two networks: a control network (`pplab0`: ipyparallel, the
rendezvous) and a data network (`pplab1`: gloo, `gloo_ifname`). `shape_link` gives the data
network a bandwidth (tbf), a latency or losses (netem, where the kernel has it), or cuts it,
while the control network, and with it every report to the notebook, stays up. Needs root (`ip netns`, `tc`);
`NamespaceHosts.why_not()` says what is missing where it cannot run.

    with NamespaceHosts(n_hosts=2, engines_per_host=2) as hosts:
        lab = pplab.Lab.connect(**hosts.connect_options(), n_ranks=4)
        hosts.shape_link(delay_ms=5, rate_mbit=100)

The addresses (two free /24s of 10.77.0.0/16: the first NamespaceHosts gets 10.77.0 and
10.77.1) exist only on the bridges and in the namespaces, with no route out of them.
Everything made is undone by `stop()`: processes, namespaces, bridges and the hosts files
under /etc/netns.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from pplab.base.arguments import check_positive_int
from pplab.base.config import LabOptions, takes_options
from pplab.base.machine import recent_load
from pplab.base.renames import renamed_keywords
from pplab.drivers.cluster.launchers import controller_args, engine_args  # as a local lab's

CONTROL, DATA = "pplab0", "pplab1"  # each host's interfaces, the same names on every host
INTERFACE = DATA  # what gloo uses (gloo_ifname)
SUBNET_LOCK = os.path.join(tempfile.gettempdir(), "pplab-namespace-subnets.lock")
# An engine that died on another host counts as dead once the controller missed 5 s of its
# beats (launchers.controller_args: stretched by this machine's load, whose starved controller
# is what falls silent; a live engine answers from a thread of zmq's that needs no Python).
HEARTBEAT_PATIENCE_SECONDS = 5.0


class NamespaceHosts:
    """`n_hosts` network namespaces joined by a bridge, a controller on the first, engines on each."""

    @renamed_keywords
    @takes_options(LabOptions)
    def __init__(self, n_hosts: int = 2, engines_per_host: int = 2, subnets: tuple[str, str] | None = None,
                 start_timeout: float = LabOptions.start_timeout):
        check_positive_int("n_hosts", n_hosts, example=2)
        check_positive_int("engines_per_host", engines_per_host, example=2)
        self.tag = uuid.uuid4().hex[:6]
        self.names = [f"pplab-{self.tag}-h{i}" for i in range(n_hosts)]
        self.subnets, self.addresses = subnets, []  # chosen when started (the control network's)
        self.bridges = [f"pplbr{self.tag}{n}" for n in range(2)]
        self.engines_per_host, self.start_timeout = engines_per_host, start_timeout
        self.profile_dir = tempfile.mkdtemp(prefix="pplab-hosts-")
        self.cluster_id = f"hosts-{self.tag}"
        self.processes: list[subprocess.Popen] = []
        self._netem: bool | None = None
        self._made: list[tuple[str, ...]] = []  # what stop() undoes, in reverse

    @staticmethod
    def why_not() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if sys.platform != "linux":
            return "network namespaces are a Linux feature"
        if os.geteuid() != 0:
            return "making network namespaces needs root"
        missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
        if missing:
            return f"missing {', '.join(missing)} (apt-get install iproute2 util-linux)"
        return None

    # -- up and down ---------------------------------------------------------------------------

    def start(self) -> "NamespaceHosts":
        """Make the network, start the controller and the engines; undo all of it on failure."""
        why = self.why_not()
        if why:
            raise RuntimeError(f"cannot make namespace hosts: {why}")
        atexit.register(self.stop)  # a kernel that exits without stop() still leaves nothing
        try:
            self._make_network()
            self._start_cluster()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End every process, then remove the namespaces, the bridges and the files made (again: nothing)."""
        for process in self.processes:
            _kill_group(process)
        self.processes = []
        for undo in reversed(self._made):
            subprocess.run(undo, capture_output=True)
        self._made = []
        for name in self.names:
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        shutil.rmtree(self.profile_dir, ignore_errors=True)

    def __enter__(self) -> "NamespaceHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def connect_options(self) -> dict:
        """What `pplab.Lab.connect(...)` needs to use these hosts' engines (and to restart them)."""
        return dict(profile=None, profile_dir=self.profile_dir, cluster_id=self.cluster_id,
                    gloo_ifname=DATA, restart_engines=self.restart_engines)

    def restart_engines(self) -> None:
        """Kill every engine and start new ones on the same hosts (the controller stays)."""
        controller, engines = self.processes[0], self.processes[1:]
        for process in engines:
            _kill_group(process)
        self.processes = [controller]
        self._start_engines()

    # -- the link --------------------------------------------------------------------------------

    def shape_link(self, delay_ms: float | None = None, rate_mbit: float | None = None,
                   loss_percent: float | None = None) -> None:
        """Shape every host's data interface; no argument: a clean link again.

        A rate alone is a token bucket (tbf, in every kernel with traffic control). A delay (one
        way) or a partial loss needs netem (`has_netem()`), which some kernels leave out.
        `loss_percent=100` cuts the link: the data interfaces go down, the control network stays.
        """
        if loss_percent == 100:  # at once, shaping left as it is
            for name in self.names:
                self._in(name, ["ip", "link", "set", DATA, "down"])
            return
        for name in self.names:
            self._in(name, ["tc", "qdisc", "del", "dev", DATA, "root"], check=False)
            self._in(name, ["ip", "link", "set", DATA, "up"])
        if delay_ms or loss_percent:
            if not self.has_netem():
                raise RuntimeError("this kernel has no netem (CONFIG_NET_SCH_NETEM), so a link cannot be "
                                   "given a delay or a partial loss here; a rate (tbf) and a cut "
                                   "(loss_percent=100) still work")
            options = ["delay", f"{delay_ms}ms"] if delay_ms else []
            options += ["rate", f"{rate_mbit}mbit"] if rate_mbit else []
            options += ["loss", f"{loss_percent}%"] if loss_percent else []
            shaping = ["netem", *options]
        elif rate_mbit:
            # A queue long enough for a whole message: a drop would cost a TCP retransmission.
            shaping = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "32kbit", "latency", "1s"]
        else:
            return
        for name in self.names:
            self._in(name, ["tc", "qdisc", "add", "dev", DATA, "root", *shaping])

    def has_netem(self) -> bool:
        """Whether this kernel has netem (a delay, a partial loss): tried on host 0's loopback."""
        if self._netem is None:
            added = subprocess.run(["ip", "netns", "exec", self.names[0], "tc", "qdisc", "add", "dev", "lo",
                                    "root", "netem", "delay", "1ms"], capture_output=True)
            self._netem = added.returncode == 0
            if self._netem:
                self._in(self.names[0], ["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return self._netem

    # -- inside ----------------------------------------------------------------------------------

    def _make_network(self) -> None:
        # Choosing free subnets and taking them is one step under a lock: two NamespaceHosts
        # started at once (two notebooks, two test workers) would otherwise pick the same ones.
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnets = self.subnets or _free_subnets()
            for bridge, subnet in zip(self.bridges, self.subnets):
                self._run(["ip", "link", "add", bridge, "type", "bridge"])
                self._made.append(("ip", "link", "del", bridge))
                # this machine: the client
                self._run(["ip", "addr", "add", f"{subnet}.254/24", "dev", bridge])
                self._run(["ip", "link", "set", bridge, "up"])
        self.addresses = [f"{self.subnets[0]}.{i + 1}" for i in range(len(self.names))]
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in zip(self.names, self.addresses))
        for index, name in enumerate(self.names):
            self._run(["ip", "netns", "add", name])
            self._made.append(("ip", "netns", "del", name))
            self._in(name, ["ip", "link", "set", "lo", "up"])
            # Keep TCP's window open between messages, as clusters tune it: after an idle gap
            # Linux would restart it small, and a message on a slow link would wait for ACKs.
            self._in(name, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], check=False)
            for network, (bridge, subnet, inside) in enumerate(zip(self.bridges, self.subnets,
                                                                   (CONTROL, DATA))):
                outside = f"ppl{self.tag}{index}{network}"
                self._run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside,
                           "netns", name])
                self._made.append(("ip", "link", "del", outside))
                self._run(["ip", "link", "set", outside, "master", bridge])
                self._run(["ip", "link", "set", outside, "up"])
                self._in(name, ["ip", "addr", "add", f"{subnet}.{index + 1}/24", "dev", inside])
                self._in(name, ["ip", "link", "set", inside, "up"])
            # `ip netns exec` shows /etc/netns/NAME/hosts as /etc/hosts: each host's name resolves
            # to its own control address there, as on a real cluster.
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(hosts_file)

    def _start_cluster(self) -> None:
        os.makedirs(os.path.join(self.profile_dir, "security"), exist_ok=True)
        self.processes.append(self._spawn(0, [sys.executable, "-m", "ipyparallel.controller",
                                              f"--profile-dir={self.profile_dir}",
                                              f"--cluster-id={self.cluster_id}",
                                              f"--ip={self.addresses[0]}",
                                              *controller_args(HEARTBEAT_PATIENCE_SECONDS, recent_load())],
                                             "controller"))
        engine_file = os.path.join(self.profile_dir, "security",
                                   f"ipcontroller-{self.cluster_id}-engine.json")
        deadline = time.monotonic() + self.start_timeout
        while not _written(engine_file):  # whole: the engines read it at once
            if self.processes[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the controller in {self.names[0]} did not "
                                   f"start:\n{self._log('controller')}")
            time.sleep(0.1)
        self._start_engines()

    def _start_engines(self) -> None:
        for index in range(len(self.names)):
            for engine in range(self.engines_per_host):
                self.processes.append(self._spawn(index, [sys.executable, "-m", "ipyparallel.engine",
                                                          f"--profile-dir={self.profile_dir}",
                                                          f"--cluster-id={self.cluster_id}",
                                                          *engine_args(self.start_timeout)],
                                                  f"engine-{index}-{engine}"))

    def _spawn(self, index: int, command: list[str], role: str) -> subprocess.Popen:
        """Start `command` in host `index`'s namespace, under that host's name, in its own group."""
        name = self.names[index]
        inner = f"hostname {name} && exec " + shlex.join(command)
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(self.profile_dir, f"{role}.log"), "w")
        return subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", inner],
                                stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True)

    def _log(self, role: str) -> str:
        try:
            with open(os.path.join(self.profile_dir, f"{role}.log")) as f:
                return "".join(f.readlines()[-15:])
        except OSError:
            return "(no log)"

    def _in(self, name: str, command: list[str], check: bool = True) -> None:
        self._run(["ip", "netns", "exec", name, *command], check)

    @staticmethod
    def _run(command, check: bool = True) -> None:
        result = subprocess.run(command, capture_output=True, text=True)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def _written(connection_file: str) -> bool:
    """True once the controller has written `connection_file` whole. It opens the file, then
    writes it: an engine started between the two read an empty file, failed, and never
    registered (seen on a busy machine)."""
    try:
        with open(connection_file) as f:
            return "interface" in json.load(f)
    except (OSError, ValueError):
        return False


def _free_subnets() -> tuple[str, str]:
    """Two /24s of 10.77.0.0/16 that no interface here uses (other NamespaceHosts may be up)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for third in range(0, 256, 2):
        pair = (f"10.77.{third}", f"10.77.{third + 1}")
        if not any(f" {subnet}." in used for subnet in pair):
            return pair
    raise RuntimeError("every subnet of 10.77.0.0/16 is in use here: stop other NamespaceHosts first")


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and its whole group (it started its own session), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
