"""Notebook kernels forked from a process that imported torch once (the suite's, Linux only).

A notebook kernel spends most of its start importing torch, IPython's kernel and pplab (4.4 CPU-s
on a slow 2-core machine), and the suite starts some 30 kernels. Five kernels started one after
the other, each running one cell, took 22-25 CPU-s there, and 9-15 CPU-s forked. Like a
lab's engine fork server (pplab.drivers.cluster.forkserver), one process per pytest worker
imports them once, then forks a kernel each time the worker's kernel manager launches one:
the same command line, environment and folder a plain launch would give it. matplotlib is not
imported in advance: it reads MPLBACKEND when it is imported, which the kernel sets first.

`launch_kernel(provisioner, cmd, **kwargs)` is what conftest's kernel manager calls instead of
jupyter_client's own launch; `stop()` ends the zygote (conftest, at the end of a worker).
Anything it cannot launch as a plain launch would (another interpreter, no zygote) it leaves
to jupyter_client: it returns False.

The zygote runs as `python kernel_zygote.py REPLY_FD`. Each line on its stdin is a launch, as
JSON {"argv", "env", "cwd"}; on REPLY_FD it writes each kernel's pid, and "exit PID CODE" when
a kernel it forked ends. It exits when its stdin closes (its worker ended or stopped it). In `ps`
a forked kernel shows the zygote's command line (`kernel_zygote.py N`), not ipykernel_launcher's.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

PRELOAD = ["torch", "torch.distributed", "ipykernel.kernelapp", "ipykernel.ipkernel",
           "ipyparallel", "pplab", "pplab.drivers.cluster"]


# Variables torch, pplab or Python read when imported: a launch whose values differ from the
# zygote's (a test that changed one) is left to jupyter_client.
READ_AT_IMPORT = ("OMP_", "MKL_", "TORCH", "CUDA", "PPLAB", "PYTHON", "LD_")


def preload() -> None:
    import importlib

    # ipykernel reads its parent's pid when it is imported: the zygote is the parent of its kernels
    # (a kernel ends if its zygote does, as one ends if the process that launched it does).
    os.environ["JPY_PARENT_PID"] = str(os.getpid())
    for name in PRELOAD:
        importlib.import_module(name)


def reap(reply_fd: int) -> None:
    """Collect kernels that exited and tell the worker their exit codes."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(reply_fd, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def serve(reply_fd: int) -> dict:
    """Fork a kernel for each request; return only in a forked kernel, with its request."""
    preload()
    os.write(reply_fd, b"ready\n")
    while True:
        reap(reply_fd)
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:  # the worker closed our stdin: it is done with kernels
            os._exit(0)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(reply_fd)
            return request
        os.write(reply_fd, f"{pid}\n".encode())


def run_kernel(request: dict) -> None:
    """Become the kernel a plain launch would have started: own session (jupyter_client interrupts
    a kernel's process group), its folder, its environment, its command line."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], JPY_PARENT_PID=str(os.getppid()))  # see preload
    argv = request["argv"]
    if argv[1:3] != ["-m", "ipykernel_launcher"]:
        raise SystemExit(f"kernel zygote: not an IPython kernel's command line: {argv}")
    sys.argv = ["ipykernel_launcher", *argv[3:]]
    sys.path[0] = os.getcwd()  # as `python -m` puts it first (the zygote's script folder was)
    from ipykernel.kernelapp import launch_new_instance

    launch_new_instance()


# --- in the pytest worker ---------------------------------------------------------------------


class ForkedKernel:
    """What jupyter_client's LocalProvisioner keeps of a kernel process (a Popen, usually): here one
    the zygote forked, whose exit code the zygote reports."""

    stdin = stdout = stderr = None

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        self.zygote.read_exits()
        return self.zygote.exit_codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
            time.sleep(0.05)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The worker's end: start the zygote, ask it for kernels, collect what it says."""

    def __init__(self):
        self.env = dict(os.environ)  # what its imports saw
        reply_read, reply_write = os.pipe()
        self.process = subprocess.Popen([sys.executable, __file__, str(reply_write)], stdin=subprocess.PIPE,
                                        pass_fds=[reply_write], text=True)
        os.close(reply_write)
        self.replies = os.fdopen(reply_read, "r")
        self.exit_codes: dict[int, int] = {}
        if self.replies.readline().strip() != "ready":  # it failed to import: see its traceback above
            self.stop()
            raise RuntimeError("the kernel zygote did not start")

    def launch(self, argv: list[str], env: dict, cwd: str) -> int:
        self.process.stdin.write(json.dumps({"argv": argv, "env": dict(env), "cwd": str(cwd)}) + "\n")
        self.process.stdin.flush()
        while True:
            line = self.replies.readline()
            if not line:
                raise RuntimeError("the kernel zygote ended")
            if not self._exit(line):
                return int(line)

    def read_exits(self) -> None:
        while select.select([self.replies], [], [], 0)[0]:
            line = self.replies.readline()
            if not line or not self._exit(line):
                return

    def _exit(self, line: str) -> bool:
        if not line.startswith("exit "):
            return False
        _, pid, code = line.split()
        self.exit_codes[int(pid)] = int(code)
        return True

    def stop(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.replies.close()


_ZYGOTE: list[Zygote | None] = []  # this worker's, once asked for (None: it could not start)


def launch_kernel(provisioner, cmd: list[str], *, env: dict, cwd: str | None = None, **_) -> bool:
    """Launch the kernel as LocalProvisioner.launch_kernel would, forked from this worker's zygote;
    False (and nothing done) where the zygote cannot: another interpreter, not Linux, no zygote."""
    from jupyter_client.provisioning import LocalProvisioner

    python = shutil.which(cmd[0]) if cmd else None
    same_python = python is not None and os.path.realpath(python) == os.path.realpath(sys.executable)
    if not (sys.platform == "linux" and same_python and cmd[1:3] == ["-m", "ipykernel_launcher"]
            and type(provisioner) is LocalProvisioner):
        return False
    if not _ZYGOTE:
        try:
            _ZYGOTE.append(Zygote())
        except (OSError, RuntimeError):
            _ZYGOTE.append(None)
    if _ZYGOTE[0] is None or _read_at_import(env) != _read_at_import(_ZYGOTE[0].env):
        return False
    cwd = cwd or os.getcwd()
    pid = _ZYGOTE[0].launch(cmd, env, cwd)
    provisioner.process = ForkedKernel(_ZYGOTE[0], pid)
    provisioner.pid = provisioner.pgid = pid  # run_kernel gives it a session of its own
    provisioner.cwd = cwd
    return True


def _read_at_import(env: dict) -> dict:
    return {name: value for name, value in env.items() if name.startswith(READ_AT_IMPORT)}


def stop() -> None:
    """End this worker's zygote, if it started one (its kernels were shut down before)."""
    if _ZYGOTE and _ZYGOTE[0] is not None:
        _ZYGOTE[0].stop()
    _ZYGOTE.clear()


if __name__ == "__main__":
    run_kernel(serve(int(sys.argv[1])))
