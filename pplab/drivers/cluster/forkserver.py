"""Start engines fast: import torch and ipyparallel once, then fork one engine per rank.

Run as ``python -m pplab.drivers.cluster.forkserver COUNT [ipengine options...]``. Most of an
engine's start-up is importing torch and ipyparallel; doing it once and forking
shares that work between all ranks (Linux only: fork after import is unsafe on
macOS). This process then stays as the engines' supervisor: SIGTERM stops all of
them, and it stops them by itself if the kernel that started it goes away.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

GRACE_SECONDS = 2.0  # engines get this long to exit after SIGTERM, then SIGKILL


def preload() -> None:
    """Import what every engine needs, before forking, so that it is imported only once."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    # Engines cannot be debugged (ipyparallel gives them no debugger channel), yet each
    # kernel imports debugpy to find out: 0.4 s. Hide it while ipykernel looks, then let
    # user code import it normally.
    sys.modules["debugpy"] = None
    import ipykernel.debugger  # noqa: F401
    del sys.modules["debugpy"]
    import ipykernel.ipkernel  # noqa: F401
    import ipyparallel.engine.app  # noqa: F401

    import pplab.drivers.cluster.engine  # noqa: F401
    from pplab.drivers.local import RANK_IMPORTS

    for name in RANK_IMPORTS:  # what pipelines run on a rank: 0.7 s each engine would import again
        importlib.import_module(name)


def start_engine(index: int, engine_argv: list[str]) -> int:
    """Fork one engine that asks the controller for engine id `index`; return its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from ipyparallel.engine.app import IPEngine

        IPEngine.launch_instance(argv=[*engine_argv, f"--IPEngine.id={index}"])
        code = 0
    except SystemExit as exit_request:
        code = exit_request.code if isinstance(exit_request.code, int) else 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never fall back into the supervisor's code


def stop_engines(children: dict[int, int]) -> None:
    """SIGTERM every engine, give them GRACE_SECONDS, then SIGKILL the rest and reap them all."""
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while children and time.monotonic() < deadline:
        reap(children)
        time.sleep(0.05)
    for pid in children:
        _signal(pid, signal.SIGKILL)
    while children:
        pid, _ = os.waitpid(-1, 0)
        children.pop(pid, None)


def reap(children: dict[int, int]) -> None:
    """Collect engines that have exited, and say so in the log."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        index = children.pop(pid, None)
        print(f"pplab forkserver: engine {index} (pid {pid}) exited with status "
              f"{os.waitstatus_to_exitcode(status)}", flush=True)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """Fork COUNT engines and supervise them until stopped, or until the owner goes away."""
    count, engine_argv = int(argv[0]), argv[1:]
    owner = os.getppid()
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    preload()
    if stop_requested:
        return 0  # stopped while importing: no engine to start
    children = {start_engine(index, engine_argv): index for index in range(count)}
    while children:
        reap(children)
        if stop_requested or os.getppid() != owner:
            stop_engines(children)
            break
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # skip tearing down torch & co. at exit: it takes most of a second
