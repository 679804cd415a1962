"""The contract of a driver of ranks: what a session (a pipeline, the dashboard, the faults) may
ask of the ranks, whichever driver started them.

Three drivers keep it: the lab (`pplab.drivers.cluster.lab.Lab`, ipyparallel engines; `pplab.Lab` adds
pipelines), the pool of local
processes (`pplab.drivers.local.RankPool`) and torchrun's processes (`TorchrunRanks`); a new
driver (a batch scheduler's job, a remote pool) is usable by every session once it keeps it.
`tests/test_contract.py` checks the three against it.

An argument whose value differs by rank is wrapped in `PerRank`: each rank is given its own item,
and a driver sends each rank only that item (a step's batch, split by rank, is not sent whole to
every rank).

A call that fails raises the same errors from every driver, from `pplab.rank.rank_context`
(re-exported by `pplab.session`): `RankFailedError` (a rank raised), `RankDiedError` (a rank's
process ended), `RankTimeoutError` (past its bound), each a `RankError` with `.ranks`, `.causes`
(one line per failing rank) and `.summary`. A driver may raise subclasses that say more.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pplab.rank.rank_context import RankEvent


class PerRank(tuple):
    """An argument of `run` / `run_async` with one value per rank: rank r is given the r-th item, and
    is sent only that one."""

    def __new__(cls, values: Sequence):
        return super().__new__(cls, values)

    def __repr__(self) -> str:
        return f"PerRank({list(self)!r})"


def call_name(fn) -> str:
    """How a call is named in its errors and its repr: "step_on_rank()"."""
    return f"{getattr(fn, '__name__', type(fn).__name__)}()"


def arguments_by_rank(fn, args: tuple, kwargs: dict, world_size: int) -> list[tuple[tuple, dict]] | None:
    """Each rank's (args, kwargs), every `PerRank` replaced by that rank's item; None when no argument
    is a PerRank (every rank is then given the same). A PerRank without exactly one value per rank is
    refused here, before any rank is asked."""
    per_rank = [(position, value) for position, value in [*enumerate(args), *kwargs.items()]
                if isinstance(value, PerRank)]
    if not per_rank:
        return None
    for position, value in per_rank:
        if len(value) != world_size:
            raise ValueError(f"{call_name(fn)}: argument {position!r} is a PerRank of {len(value)} values "
                             f"for {world_size} ranks: give exactly one value per rank")

    def own(value, rank: int):
        return value[rank] if isinstance(value, PerRank) else value

    return [(tuple(own(value, rank) for value in args),
             {key: own(value, rank) for key, value in kwargs.items()})
            for rank in range(world_size)]


@runtime_checkable
class RankCall(Protocol):
    """A call running on every rank, as `run_async` returns it."""

    def done(self) -> bool:
        """True once every rank has finished, successfully or not."""

    def running_ranks(self) -> list[int]:
        """The ranks that have not finished yet."""

    def poll_events(self) -> list[RankEvent]:
        """What the ranks published since the last look, without waiting."""

    def wait_for_events(self, seconds: float = 0.0) -> None:
        """Give events already on their way up to `seconds` to arrive (after the call ended)."""

    def result(self, timeout: float | None = None) -> list:
        """Every rank's result, by rank; a RankError naming the ranks when the call failed;
        `StillRunningError` when `timeout` passed first (the call goes on)."""


@runtime_checkable
class Ranks(Protocol):
    """A driver of ranks: a fixed number of processes in one process group, running one call at a time."""

    world_size: int  # the number of ranks
    op_timeout: float  # the seconds one wait between ranks may take: a pipeline's default

    @property
    def state(self) -> str:
        """"running", "needs restart" (a driver that can restart) or "stopped"."""

    @property
    def rank_processes(self) -> tuple[tuple[str, int], ...]:
        """(host, pid) of each rank's process: a pipeline built on other processes is gone."""

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank (a `PerRank` argument: each rank its own item); the
        results by rank, or a RankError."""

    def run_async(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> RankCall:
        """Start fn(*args, **kwargs) on every rank (as `run`) and return at once."""

    def stop(self) -> None:
        """End the ranks; nothing is left running."""


def error_report(error: BaseException) -> tuple[str, str, str]:
    """(exception type, message, traceback text) of an error raised on a rank:
    what every driver sends back."""
    return type(error).__name__, str(error), traceback.format_exc()


def one_line(ename: str, evalue: str) -> str:
    """An error as one line: its type and the first line of its message."""
    return f"{ename}: {evalue}".splitlines()[0]
