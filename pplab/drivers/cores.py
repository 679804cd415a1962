"""Local ranks pinned to cores: opt-in, one core per rank (`RankPool(..., cores=[0, 1])`, `Lab` too).

A rank is more than its main thread: the backend's transport threads (gloo's) receive its
messages. Left free, the kernel may wake a waiting rank's transport thread on the core where
the sending rank computes, and it waits there for a time slice while the rank's own core is
idle: in timing mode on 2 cores, about one message in two reached a waiting rank 2-3 ms late
(strace: the payload read 2.4 ms after its header, the thread runnable, not running). With
each rank's threads kept on a core of its own, 1F1B's step came 3-4 % closer to the
prediction (bench/bench_predict.py runs both). Pinning only helps where every rank can have a
core nobody else uses, so it is never the default: two labs pinned to the same cores would
share them.
"""

from __future__ import annotations

import os


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity), in order."""
    return sorted(os.sched_getaffinity(0))


def check_cores(cores: object, n_ranks: int) -> tuple[int, ...] | None:
    """`cores` as a tuple, one distinct core per rank among those this process may use (None: no pinning)."""
    if cores is None:
        return None
    allowed = allowed_cores()
    example = f"cores={allowed[:n_ranks]}" if len(allowed) >= n_ranks else "cores=None"
    if isinstance(cores, (str, bytes)) or not hasattr(cores, "__iter__"):
        raise ValueError(f"cores={cores!r}: give one core number per rank, e.g. {example}")
    cores = tuple(cores)
    if not all(isinstance(core, int) and not isinstance(core, bool) for core in cores) \
            or len(set(cores)) != len(cores):
        raise ValueError(f"cores={list(cores)!r}: give distinct core numbers, one per rank, e.g. {example}")
    if len(cores) != n_ranks:
        raise ValueError(f"cores={list(cores)!r} names {len(cores)} core(s) for {n_ranks} ranks: give one "
                         f"per rank, e.g. {example}")
    missing = [core for core in cores if core not in allowed]
    if missing:
        raise ValueError(f"cores={list(cores)!r}: this process may run on cores {allowed}, not on {missing}; "
                         f"e.g. {example}, or cores=None (no pinning)")
    return cores


def pin_this_process(core: int) -> None:
    """Keep every thread of this process, and those it starts later, on `core`."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), {core})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
