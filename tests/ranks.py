"""Ranks for the tests: one RankPool per number of ranks, started once and kept for the whole session.

`run_ranks(n_ranks, fn, *args)` is `pplab.drivers.local.run_ranks` on the session's pool of that
size: torch is imported and the process group joined once per size, not once per call. A
call that fails ends the pool's processes and the next call starts fresh ones, so a test
that breaks its ranks leaves nothing to the next. conftest stops the pools at the end.
"""

from __future__ import annotations

from pplab.drivers import local
from pplab.session import RankPool

_pools: dict[int, RankPool] = {}


def pool(n_ranks: int) -> RankPool:
    """The session's pool of `n_ranks` ranks (started on first use); `pool(n).pipeline(...)` builds on it."""
    if n_ranks not in _pools or _pools[n_ranks].state == "stopped":
        _pools[n_ranks] = RankPool(n_ranks)
    return _pools[n_ranks]


def run_ranks(n_ranks: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on the session's pool of `n_ranks` ranks; results by rank.

    After a rank fails, the pool ends the others once their grace is over, whatever they wait for.
    """
    return local.run_ranks(n_ranks, fn, *args, timeout=timeout, pool=pool(n_ranks))


def stop_pools() -> None:
    """End every pool's processes."""
    for started in _pools.values():
        started.stop()
    _pools.clear()
