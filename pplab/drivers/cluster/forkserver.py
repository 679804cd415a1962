"""Start engines fast: import torch and ipyparallel once, then fork one engine per rank.

Run as ``python -m pplab.drivers.cluster.forkserver``. Most of an engine's start-up is importing
torch and ipyparallel; doing it once and forking shares that work between all ranks (Linux only:
fork after import is unsafe on macOS). It forks a set of engines each time a lab asks (once its
controller's files are written), then stays as the engines' supervisor: SIGTERM stops all of them,
and it stops them by itself if the process that started it goes away. A lab's restart, and the
next lab of the same process, ask it for new engines instead of starting another one
(pplab.drivers.cluster.kept).
"""

from __future__ import annotations

import importlib
import json
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
    """Fork one engine that asks the controller for engine id `index` (the first free id of the
    controller, which may have had engines before: a kept one); return its pid."""
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
ENGINES_COMMAND = "engines"  # on stdin: "engines {JSON}" forks a set for a cluster (see engines_command)


def engines_for(cluster_id: str, first_id: int) -> str:
    """The log line that starts a set of engines: one set per cluster and first id."""
    return f"{ENGINES_FOR} {cluster_id} from id {first_id}"


def engines_command(cluster_id: str, profile_dir: str, count: int, first_id: int,
                    engine_argv: list[str]) -> str:
    """The line that asks a fork server for `count` engines of a cluster, ids from `first_id`."""
    asked = dict(cluster_id=cluster_id, profile_dir=profile_dir, count=count, first_id=first_id,
                 argv=engine_argv)
    return f"{ENGINES_COMMAND} {json.dumps(asked)}\n"


def fork_engines(asked: dict) -> dict[int, int]:
    """Fork the engines `asked` (an engines_command's JSON) describes; {pid: engine id}."""
    os.environ["IPP_CLUSTER_ID"], os.environ["IPP_PROFILE_DIR"] = asked["cluster_id"], asked["profile_dir"]
    print(engines_for(asked["cluster_id"], asked["first_id"]), flush=True)
    first = asked["first_id"]
    return {start_engine(index, asked["argv"]): index for index in range(first, first + asked["count"])}


def read_command() -> str | None:
    """The next line on stdin if one is there within 0.2 s; "" at its end; None if none yet."""
    ready, _, _ = select.select([sys.stdin], [], [], 0.2)
    return sys.stdin.readline() if ready else None


def main() -> int:
    """Import, then fork engines at each `engines {JSON}` read on stdin and supervise them until
    stopped, or until the owner goes away.

    A lab sends the command once its controller's connection files are whole (an engine that
    read one half written exited). A restart, or the owner's next lab, sends it again: the engines
    are replaced by new ones, forked from this process, whose imports are done (2 s of CPU saved)."""
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
            children = fork_engines(json.loads(command.split(" ", 1)[1]))
    stop_engines(children)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip tearing down torch & co. at exit: it takes most of a second
