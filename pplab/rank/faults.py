"""Faults on purpose: a rank that stalls or dies at a chosen action of the next step.

To learn what a pipeline does when one rank misbehaves, arm a fault on a lab
pipeline and step it:

    pplab.faults.stall(run, "1F3", seconds=30)   # rank of stage 1 sleeps inside forward 3
    pplab.faults.die(run, "1B2")                 # that rank's process is SIGKILLed at backward 2
    run.step()                                   # the peers' waits fail, naming rank, peer and action

A fault is armed, for one run, on the rank that runs the action's stage, and fires once,
inside that action, the next time a step of that run (or its training) starts it: the
timeline shows a forward that lasts. The process kills itself, so `die` works
on any host, not only this one. (A link cut is a
fault of the network, not of a rank: `NamespaceHosts.shape_link(loss_percent=100)`.)

The engine side is one dict per process, keyed by run and action; the lab marks which run
a rank is stepping (`in_run`), and the runtime asks `strike(action)` inside each
computation, which costs a dict lookup when nothing is armed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

FAULTS = ("stall", "die")

_armed: dict[tuple[str, str], tuple[str, float]] = {}  # on an engine: (run id, action) -> (fault, seconds)
_current_run: str | None = None  # the run whose step this engine is running


# --- engine side ----------------------------------------------------------------------------

@contextlib.contextmanager
def in_run(run_id: str):
    """While this engine steps or trains the run `run_id` (the faults armed for it may fire)."""
    global _current_run
    previous, _current_run = _current_run, run_id
    try:
        yield
    finally:
        _current_run = previous


def strike(action) -> None:
    """Called by the runtime as `action` starts: fire the fault armed for it, if any (once)."""
    if not _armed:
        return
    fault = _armed.pop((_current_run, str(action)), None)
    if fault is None:
        return
    kind, seconds = fault
    if kind == "stall":
        time.sleep(seconds)
    else:  # "die": as abrupt as an out-of-memory kill, no cleanup, no goodbye to the peers
        os.kill(os.getpid(), signal.SIGKILL)


def arm_on_rank(run_id: str, rank: int, action: str, kind: str, seconds: float) -> bool:
    """Arm `kind` for `action` of run `run_id` if this engine is `rank`; True where it was armed."""
    import torch.distributed as dist

    if dist.get_rank() != rank:
        return False
    _armed[(run_id, action)] = (kind, seconds)
    return True


def disarm_on_rank(run_id: str) -> int:
    """Forget the faults armed on this engine for run `run_id`; how many there were."""
    mine = [key for key in _armed if key[0] == run_id]
    for key in mine:
        del _armed[key]
    return len(mine)


# --- client side ----------------------------------------------------------------------------

def stall(run, action: str, seconds: float) -> int:
    """Make the rank that runs `action` (e.g. "1F3") sleep `seconds` inside it, in the next step
    that reaches it. Returns that rank."""
    from pplab.arguments import check_positive_seconds

    return _arm(run, action, "stall", check_positive_seconds("seconds", seconds))


def die(run, action: str) -> int:
    """Make the process of the rank that runs `action` kill itself (SIGKILL) as it starts it.
    Returns that rank. Afterwards the lab needs `lab.restart()`."""
    return _arm(run, action, "die", 0.0)


def _arm(run, action: str, kind: str, seconds: float) -> int:
    """Check the fault against the run's schedule (before any rank is asked), then arm it."""
    from pplab.schedules import Action

    if run.spec.impl != "pplab":
        raise ValueError(f"faults are armed in pplab's runtime, but this run uses torch's "
                         f"{run.schedule.name}: build the run with impl='pplab'")
    if run.spec.mesh is not None:
        raise ValueError("faults are armed on pipeline-only runs; this one is on a "
                         f"pp={run.mesh.pp} x dp={run.mesh.dp} x tp={run.mesh.tp} mesh")
    try:
        parsed = Action.parse(action)
    except ValueError as error:
        raise ValueError(f"action={action!r} is not an action: give one like '1F3' "
                         f"(stage 1, forward, microbatch 3)") from error
    if parsed.is_comm:
        raise ValueError(f"action={action!r} is a message; a rank stalls or dies in a computation "
                         f"(F, B, I or W), e.g. '{parsed.stage}F{parsed.microbatch}'")
    schedule = run.schedule
    if not 0 <= parsed.stage < schedule.n_stages:
        raise ValueError(f"action={action!r}: schedule {schedule.name!r} has stages 0..{schedule.n_stages - 1}")
    rank = schedule.stage_to_rank(parsed.stage)
    if parsed not in schedule.actions[rank]:
        there = " ".join(str(a) for a in schedule.actions[rank] if a.stage == parsed.stage and a.is_compute)
        raise ValueError(f"action={action!r} is not in schedule {schedule.name!r}; rank {rank} runs "
                         f"these computations of stage {parsed.stage}: {there}")
    armed = run.lab.run(arm_on_rank, run.run_id, rank, str(parsed), kind, seconds)
    if armed.count(True) != 1:  # the lab's ranks are not the schedule's (it must run stage's rank once)
        raise RuntimeError(f"the fault for {action!r} was armed on {armed.count(True)} ranks, not 1")
    return rank
