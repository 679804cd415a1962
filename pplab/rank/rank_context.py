"""Who this process is among the ranks, and how it tells its client what happens while a call runs.

The driver that started the process (a lab engine, a process of a `RankPool`) sets the
context once the process has joined the process group, with a way to publish: code that
runs on a rank asks `rank_context()` for its rank and device and calls `publish(item)`
to stream an item to the client, whichever driver that is. Under torchrun, or in a plain
process, nobody listens: `publish` does nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class RankContext:
    """Who this process is in the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: Any  # torch.device (torch is not imported here)
    host_messages: bool = False  # messages copied through host memory (see pplab.rank.host_messages)


class RankError(RuntimeError):
    """A call on the ranks failed. Every driver raises the same three kinds (below), one class each,
    so that code written against one driver catches the others' failures too.

    `causes` holds one line per failing rank, without tracebacks; `raised` the exception type and
    message of each rank that raised (empty when none did); `summary`, what happened and the fix
    without tracebacks, is given by a driver that wrote one (the lab's say when only a restart helps)."""

    def __init__(self, message: str = "", causes: dict[int, str] | None = None,
                 raised: dict[int, tuple[str, str]] | None = None, ranks: list[int] | None = None,
                 *, summary: str | None = None):
        super().__init__(message)
        self.causes = dict(causes or {})  # rank -> what went wrong there, in one line
        self.raised = dict(raised or {})  # rank -> (exception type, message), for the ranks that raised
        self.ranks = sorted(self.causes if ranks is None else ranks)  # the ranks that failed, died or ran on
        # Kept apart when the error is built, so that it is never cut out of the message's text
        # afterwards (where a rank's own message could hold anything).
        self._summary = None if summary is None else summary.strip()

    def first_raised(self) -> tuple[str, str] | None:
        """(exception type, message) of the lowest rank that raised, or None when none raised."""
        return self.raised[min(self.raised)] if self.raised else None

    @property
    def summary(self) -> str:
        """What happened and the fix, without the ranks' tracebacks (for a status line)."""
        if self._summary is not None:
            return self._summary
        if not self.causes:
            return str(self).splitlines()[0] if str(self) else type(self).__name__
        return "\n".join(f"rank {rank} {cause}" for rank, cause in sorted(self.causes.items()))


class RankFailedError(RankError):
    """A rank raised an exception (others may have died or failed too: see `causes`).

    `rank` is the first rank that raised, `ename`/`evalue`/`traceback` its exception, and
    `still_running` the ranks that had not finished when the error was raised."""

    def __init__(self, message: str = "", causes: dict[int, str] | None = None,
                 raised: dict[int, tuple[str, str]] | None = None, ranks: list[int] | None = None,
                 *, summary: str | None = None, first: int | None = None, traceback: str = "",
                 still_running: list[int] = ()):
        super().__init__(message, causes, raised, ranks, summary=summary)
        self.still_running = list(still_running)
        self.causes.update({rank: "still running" for rank in self.still_running})
        self.rank = first if first is not None else (min(self.raised) if self.raised else None)
        self.ename, self.evalue = self.raised.get(self.rank, ("", ""))
        self.traceback = traceback

    def first_raised(self) -> tuple[str, str] | None:
        """(exception type, message) of the first rank that raised, or None when none raised."""
        return self.raised.get(self.rank)


class RankDiedError(RankError):
    """A rank's process ended (killed, crashed, out of memory) before it answered."""


class RankTimeoutError(RankError, TimeoutError):
    """A call, or the start of the ranks, ran past its bound; `ranks` were still running."""


class StillRunningError(TimeoutError):
    """`call.result(timeout=...)` returned before the ranks finished; the call goes on."""


class RankEvent(NamedTuple):
    """One item a rank published, as the client receives it: its rank, its number in the call, the item."""

    rank: int
    seq: int
    payload: Any


_context: RankContext | None = None
_publisher: Callable[[object], None] | None = None


def import_before_joining() -> None:
    """Import, before this process joins a process group, the torch module whose functions take
    `group=group.WORLD` as a default argument. Imported later (torch._dynamo imports it when the
    first optimizer is made), the default holds the group itself: the group then outlives
    `destroy_process_group`, its gloo threads keep running, and it is torn down while the
    interpreter shuts down, where gloo was seen to abort a rank at exit ("terminate called
    without an active exception")."""
    import torch.distributed.nn.functional  # noqa: F401 - 4 ms once torch is loaded


def rank_context() -> RankContext:
    """This process's rank, world size and device (raises outside a rank a pplab driver started)."""
    if _context is None:
        raise RuntimeError("rank_context() works on a rank that pplab started (a lab engine, or a "
                           "process of a RankPool), once its process group is up")
    return _context


def set_rank_context(context: RankContext | None, publisher: Callable[[object], None] | None = None) -> None:
    """For drivers: who this process is now, and how `publish` reaches the client (None: leave)."""
    global _context, _publisher
    _context, _publisher = context, publisher


def publish(payload: object) -> None:
    """Send one item (any picklable object) to the client while the current call runs.

    Items of one rank arrive in the order they were published, none lost or repeated.
    Where nobody listens (torchrun, a plain process) it does nothing.
    """
    if _publisher is not None:
        _publisher(payload)


class Feed:
    """Publishes what a call `put`s, in batches every `interval` seconds, from a helper thread.

    The rank's own thread only appends to a list (cheap, never blocks on the network);
    the helper publishes what gathered, each item with the time it was put, so a rank
    blocked in a wait still shows its latest note within `interval`. Used as a context
    manager: leaving it publishes what is left, before the call returns.
    """

    def __init__(self, interval: float):
        self.interval = interval
        self._items: list = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._publish_every_interval, daemon=True,
                                        name="pplab-feed")

    def put(self, item: object) -> None:
        """Queue `item` for the client (any picklable object)."""
        with self._lock:
            self._items.append((time.time(), item))

    def __enter__(self) -> "Feed":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()
        self._thread.join()
        self._flush()

    def _publish_every_interval(self) -> None:
        while not self._stopped.wait(self.interval):
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items:
            publish(items)
