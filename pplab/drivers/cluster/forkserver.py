"""Start engines fast: import torch and ipyparallel once, then fork one engine per rank.

Run as ``python -m pplab.drivers.cluster.forkserver COUNT [ipengine options...]``. Most of an
engine's start-up is importing torch and ipyparallel; doing it once and forking
shares that work between all ranks (Linux only: fork after import is unsafe on
macOS). It forks them when the lab asks (its controller's files are written by then), then
stays as the engines' supervisor: SIGTERM stops all of them, and it stops them by itself if
the kernel that started it goes away. A lab's restart asks it for new engines instead of
starting another one.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import time
import traceback

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

    for name in ENGINE_IMPORTS:
        importlib.import_module(name)


# What every engine's pipeline needs: its stages and its training loop. Not the rest of the pools'
# RANK_IMPORTS (torch._dynamo, checkpoints, torch's pipelining: 2 s of CPU here): imported here,
# before any engine forks, they made every lab start 3.5 s later (bench_lab_start, 2 ranks: 6.0 s
# against 2.6 s, torchrun 3.2 s), and only an engine that trains (an optimizer imports dynamo),
# checkpoints or runs torch's schedules needs them, importing them then, beside its peers.
ENGINE_IMPORTS = ["pplab.rank.rank_pipeline", "pplab.rank.train"]


def start_engine(index: int, engine_argv: list[str]) -> int:
    """Fork one engine that asks the controller for engine id `index`; return its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the lab's requests are the supervisor's to read
        from ipyparallel.engine.app import IPEngine

        IPEngine.launch_instance(argv=[*engine_argv, f"--IPEngine.id={index}"])
        code = 0
    except SystemExit as exit_request:
        code = exit_request.code if isinstance(exit_request.code, int) else 0
    except BaseException:  # into the log, which a failed start shows: os._exit below would lose it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never fall back into the supervisor's code


def stop_engines(children: dict[int, int], kill_after: float = GRACE_SECONDS) -> None:
    """SIGTERM every engine, give them `kill_after` s, then SIGKILL the rest and reap them all."""
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + kill_after
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


ENGINES_FOR = "pplab forkserver: engines for cluster"  # the log line that starts each set of engines
ENGINES_COMMAND = "engines"  # on stdin: "engines CLUSTER_ID" forks a set for that cluster (see main)


def fork_engines(count: int, engine_argv: list[str]) -> dict[int, int]:
    """Fork `count` engines of the cluster named in $IPP_CLUSTER_ID; {pid: engine index}."""
    print(f"{ENGINES_FOR} {os.environ.get('IPP_CLUSTER_ID', '')}", flush=True)
    return {start_engine(index, engine_argv): index for index in range(count)}


def read_command() -> str | None:
    """The next line on stdin if one is there within 0.2 s; "" at its end; None if none yet."""
    ready, _, _ = select.select([sys.stdin], [], [], 0.2)
    return sys.stdin.readline() if ready else None


def main(argv: list[str]) -> int:
    """Import, then fork COUNT engines at each `engines CLUSTER_ID` read on stdin and supervise them
    until stopped, or until the owner goes away.

    The lab sends the command once its controller's connection files are whole (an engine that
    read one half written exited). A restart sends it again: the engines are replaced by COUNT new
    ones of that cluster, forked from this process, whose imports are done (2 s of CPU saved)."""
    count, engine_argv = int(argv[0]), argv[1:]
    owner = os.getppid()
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    preload()
    children: dict[int, int] = {}
    listening = True
    while not stop_requested and os.getppid() == owner:
        reap(children)
        if not listening:
            time.sleep(0.2)
            continue
        command = read_command()
        if command == "":
            listening = False  # nobody will ask again (stdin closed, or never open)
        elif command and command.startswith(f"{ENGINES_COMMAND} "):
            stop_engines(children, kill_after=0)  # a restart: ranks may be stuck in a wait
            os.environ["IPP_CLUSTER_ID"] = command.split()[1]
            children = fork_engines(count, engine_argv)
    stop_engines(children)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # skip tearing down torch & co. at exit: it takes most of a second
