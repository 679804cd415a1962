"""Faults on purpose: a rank that stalls or dies at a chosen action of the next step.

To learn what a pipeline does when one rank misbehaves, arm a fault on a lab
pipeline and step it:

    pplab.rank.faults.stall(pipe, "1F3", seconds=30)  # rank of stage 1 sleeps inside forward 3
    pplab.rank.faults.die(pipe, "1B2")                # that rank's process is SIGKILLed at backward 2
    pipe.step()                                  # the peers' waits fail, naming rank, peer and action

A fault is armed, for one pipeline, on the rank that runs the action's stage, and fires once,
inside that action, the next time a step of that pipeline (or its training) starts it: the
timeline shows a forward that lasts. The process kills itself, so `die` works
on any host, not only this one. (A link cut is a
fault of the network, not of a rank: `NamespaceHosts.shape_link(loss_percent=100)`.)

The engine side is one dict per process, keyed by pipeline and action; the session marks which
pipeline a rank is stepping (`in_pipeline`), and the runtime asks `strike(action)` inside each
computation, which costs a dict lookup when nothing is armed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["stall", "die"]

FAULTS = ("stall", "die")

# on an engine: (pipeline id, action) -> (fault, seconds)
_armed: dict[tuple[str, str], tuple[str, float]] = {}
_current_pipeline: str | None = None  # the pipeline whose step this engine is running


# --- engine side ----------------------------------------------------------------------------

@contextlib.contextmanager
def in_pipeline(pipeline_id: str):
    """While this engine steps or trains the pipeline `pipeline_id` (the faults armed for it may fire)."""
    global _current_pipeline
    previous, _current_pipeline = _current_pipeline, pipeline_id
    try:
        yield
    finally:
        _current_pipeline = previous


def strike(action) -> None:
    """Called by the runtime as `action` starts: fire the fault armed for it, if any (once)."""
    if not _armed:
        return
    fault = _armed.pop((_current_pipeline, str(action)), None)
    if fault is None:
        return
    kind, seconds = fault
    if kind == "stall":
        time.sleep(seconds)
    else:  # "die": as abrupt as an out-of-memory kill, no cleanup, no goodbye to the peers
        os.kill(os.getpid(), signal.SIGKILL)


def arm_on_rank(pipeline_id: str, rank: int, action: str, kind: str, seconds: float) -> bool:
    """Arm `kind` for `action` of pipeline `pipeline_id` if this engine is `rank`; True where it was armed."""
    import torch.distributed as dist

    if dist.get_rank() != rank:
        return False
    _armed[(pipeline_id, action)] = (kind, seconds)
    return True


def disarm_on_rank(pipeline_id: str) -> int:
    """Forget the faults armed on this engine for pipeline `pipeline_id`; how many there were."""
    mine = [key for key in _armed if key[0] == pipeline_id]
    for key in mine:
        del _armed[key]
    return len(mine)


# --- client side ----------------------------------------------------------------------------

def stall(pipe, action: str, seconds: float) -> int:
    """Make the rank that runs `action` (e.g. "1F3") sleep `seconds` inside it, in the next step
    that reaches it. Returns that rank."""
    from pplab.base.arguments import check_positive_seconds

    return _arm(pipe, action, "stall", check_positive_seconds("seconds", seconds))


def die(pipe, action: str) -> int:
    """Make the process of the rank that runs `action` kill itself (SIGKILL) as it starts it.
    Returns that rank. Afterwards the lab needs `lab.restart()`."""
    return _arm(pipe, action, "die", 0.0)


def _arm(pipe, action: str, kind: str, seconds: float) -> int:
    """Check the fault against the pipeline's schedule (before any rank is asked), then arm it."""
    from pplab.schedules import Action

    if pipe.spec.impl != "pplab":
        raise ValueError(f"faults are armed in pplab's runtime, but this pipeline uses torch's "
                         f"{pipe.schedule.name}: build the pipeline with impl='pplab'")
    if pipe.spec.mesh is not None:
        raise ValueError("faults are armed on pipelines without a mesh; this one is on a "
                         f"pp={pipe.mesh.pp} x dp={pipe.mesh.dp} x tp={pipe.mesh.tp} mesh")
    try:
        parsed = Action.parse(action)
    except ValueError as error:
        raise ValueError(f"action={action!r} is not an action: give one like '1F3' "
                         f"(stage 1, forward, microbatch 3)") from error
    if parsed.is_comm:
        raise ValueError(f"action={action!r} is a message; a rank stalls or dies in a computation "
                         f"(F, B, I or W), e.g. '{parsed.stage}F{parsed.microbatch}'")
    schedule = pipe.schedule
    if not 0 <= parsed.stage < schedule.n_stages:
        raise ValueError(f"action={action!r}: schedule {schedule.name!r} has stages "
                         f"0..{schedule.n_stages - 1}")
    rank = schedule.stage_to_rank(parsed.stage)
    if parsed not in schedule.actions[rank]:
        there = " ".join(str(a) for a in schedule.actions[rank] if a.stage == parsed.stage and a.is_compute)
        raise ValueError(f"action={action!r} is not in schedule {schedule.name!r}; rank {rank} runs "
                         f"these computations of stage {parsed.stage}: {there}")
    armed = pipe.lab.run(arm_on_rank, pipe.pipeline_id, rank, str(parsed), kind, seconds)
    if armed.count(True) != 1:  # the lab's ranks are not the schedule's (it must run stage's rank once)
        raise RuntimeError(f"the fault for {action!r} was armed on {armed.count(True)} ranks, not 1")
    return rank
