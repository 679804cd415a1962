"""A call running on every rank: results ordered by rank, events streamed while it runs.

`Lab.run_async` returns a `RankCall`. Waiting on it (`result()`, `events()`)
never hangs silently: the first rank that raises wins (the others get `grace`
seconds to finish), a rank whose process dies is noticed within a fraction of
a second, and a call past its timeout names the ranks still running. What a
call learns about its ranks (busy, dead, broken) it reports to their
`RankGroup`, which is all it knows of the lab.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import time
from typing import Iterator

from pplab.base.machine import busy_note, measure_load
from pplab.drivers.cluster.engine import PROCESS_GROUP_BROKEN_KEY, event_key
from pplab.drivers.cluster.errors import RESTART_HINT
from pplab.drivers.cluster.ipyparallel_adapter import engine_died, results_per_engine
from pplab.drivers.cluster.status import RankGroup
from pplab.rank.rank_context import (
    RankDiedError,
    RankEvent,
    RankFailedError,
    RankTimeoutError,
    StillRunningError,
)

POLL_SECONDS = 0.1  # how often a waiting client looks for dead ranks and new events
GRACE_STRETCH_AT_MOST = 3.0  # how far a busy machine stretches the grace after a rank's failure
OUTPUT_DRAIN_SECONDS = 2.0  # events may trail a rank's result by a moment: wait this long for them
_ANSI_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")


def _remote_parts(error: BaseException) -> tuple[str, str, str]:
    """(exception type, message, traceback text) of an error raised on a rank."""
    if hasattr(error, "ename"):  # ipyparallel's RemoteError carries the rank's own exception
        return error.ename, str(error.evalue), _ANSI_ESCAPES.sub("", error.traceback or "")
    return type(error).__name__, str(error), ""


class RankCall:
    """A function running on every rank: its results ordered by rank, its events as they arrive."""

    def __init__(self, ranks: RankGroup, async_result, name: str, timeout: float | None,
                 grace: float):
        self._ranks = ranks
        self._per_rank = results_per_engine(async_result)  # the call's targets are in rank order
        self._name = name
        self._timeout = timeout
        self._grace = grace
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._data = [result.metadata["data"] for result in self._per_rank]  # filled as events arrive
        self._next_seq = [0] * len(self._per_rank)
        self._first_failure_at: float | None = None
        self._dead: set[int] = set()  # ranks whose process was found gone while waiting
        self._error: Exception | None = None

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<RankCall {self._name} on {len(self._per_rank)} ranks: {state}>"

    def done(self) -> bool:
        """True when every rank has finished (successfully or not)."""
        return all(result.ready() for result in self._per_rank)

    def running_ranks(self) -> list[int]:
        """The ranks that have not finished this call yet."""
        return [rank for rank, result in enumerate(self._per_rank) if not result.ready()]

    def result(self, timeout: float | None = None) -> list:
        """Wait for every rank; return their results ordered by rank, or raise naming the rank."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        with self._interruptible():
            while not self._finished():
                if wait_until is not None and time.monotonic() >= wait_until:
                    raise StillRunningError(f"{self._name} still running after result(timeout={timeout})"
                                       "; the call goes on, ask again later")
                self._wait_a_little(wait_until)
            return [result.get() for result in self._per_rank]

    def poll_events(self) -> list[RankEvent]:
        """The events that arrived since the last look, without waiting (for widget loops)."""
        events = []
        for rank, data in enumerate(self._data):
            while (key := event_key(self._next_seq[rank])) in data:
                events.append(RankEvent(rank, self._next_seq[rank], data[key]))
                self._next_seq[rank] += 1
        return events

    def events(self) -> Iterator[RankEvent]:
        """Yield events as ranks publish them, until the call ends (then raise if it failed)."""
        with self._interruptible():
            while True:
                yield from self.poll_events()
                try:
                    if self._finished():
                        break
                except Exception:
                    yield from self.poll_events()  # what arrived before the failure still counts
                    raise
                self._wait_a_little(None)
            self.wait_for_events()
        yield from self.poll_events()

    def wait_for_events(self, seconds: float = OUTPUT_DRAIN_SECONDS) -> None:
        """After the ranks finished: wait (at most `seconds`) for events that trail their results."""
        for result in self._per_rank:
            result.wait_for_output(seconds)

    # -- waiting, and turning what went wrong into one clear error ---------------------------

    @contextlib.contextmanager
    def _interruptible(self):
        """On a KeyboardInterrupt while waiting, make the lab ask for a restart if ranks still run."""
        try:
            yield
        except KeyboardInterrupt:
            # Ctrl-C can land anywhere in the waiting loop. The ranks go on running: a next
            # call would queue behind them, so only a restart helps.
            running = self.running_ranks()
            if running:
                self._ranks.needs_restart(f"{self._name} was interrupted while ranks {running} "
                                          f"were running")
            raise

    def _finished(self) -> bool:
        """True when every rank succeeded; raises the call's error if it failed."""
        finished = self.done()  # first: a rank that finishes while the errors are looked for waits a turn
        if self._error is None:
            self._error = self._find_error()
        if self._error is not None:
            raise self._error
        return finished

    def _wait_a_little(self, wait_until: float | None) -> None:
        """Block until a rank finishes or fails, or POLL_SECONDS pass; then look for dead ranks."""
        seconds = POLL_SECONDS
        if wait_until is not None:
            seconds = max(0.0, min(seconds, wait_until - time.monotonic()))
        done, _ = concurrent.futures.wait([self._per_rank[rank] for rank in self.running_ranks()],
                                          timeout=seconds,
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        if not done:  # only a call that takes a while pays for checking processes
            self._dead.update(self._ranks.dead_ranks(self.running_ranks()))

    def _find_error(self) -> Exception | None:
        """The error this call has come to (failed, died or timed out), or None while it is fine."""
        failed = [rank for rank, result in enumerate(self._per_rank)
                  if result.ready() and not result.successful()]
        running = self.running_ranks()
        died = self._dead | {rank for rank in failed
                             if engine_died(self._per_rank[rank].exception())}
        if died or failed:
            if self._first_failure_at is None:
                self._first_failure_at = time.monotonic()
                # The others' reports come at the machine's pace: the grace is a quiet machine's.
                # (At most three times: a rank stuck in a computation reports nothing however long.)
                self._grace = self._grace * min(GRACE_STRETCH_AT_MOST, measure_load().slowdown)
            waited = time.monotonic() - self._first_failure_at
            alive = [rank for rank in running if rank not in died]
            if alive and waited < self._grace and not self._past_deadline():
                return None  # the others get a bounded time to finish (and to say what they saw)
        if died:
            return self._died(sorted(died), [rank for rank in failed if rank not in died])
        if failed:
            return self._failed(failed, running)
        if running and self._past_deadline():
            return self._timed_out(running)
        return None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _failed(self, failed: list[int], running: list[int]) -> RankFailedError:
        """The first rank to raise wins; the message says what happened to the others."""
        first = min(failed, key=self._completion_time)
        ename, evalue, traceback = _remote_parts(self._per_rank[first].exception())
        lines = [f"rank {first} raised {ename} in {self._name}:", evalue]
        others = [rank for rank in failed if rank != first]
        if others:
            lines.append(f"Ranks {others} raised too (see lab.last_errors).")
        broken = {} if running else self._process_group_notes(failed)
        if running:
            lines += [f"Ranks {running} had not finished {self._grace:.3g} s later: waiting for rank "
                      f"{first}, stuck in a computation, or dead on another host (see lab.status() "
                      f"and the dashboard's 'where each rank is').", RESTART_HINT]
            self._ranks.needs_restart(f"ranks {running} were left running after rank {first} raised")
        elif broken:
            lines += [f"The process group is broken (by the errors of ranks {sorted(broken)}).",
                      RESTART_HINT]
            rank, note = next(iter(broken.items()))
            self._ranks.needs_restart(f"rank {rank}'s process group failed ({note})")
        summary = "\n".join(lines)
        self._ranks.record_errors({rank: self._per_rank[rank].exception() for rank in failed})
        raised = {rank: _remote_parts(self._per_rank[rank].exception())[:2] for rank in failed}
        causes = {rank: f"failed: {ename}: {(evalue.splitlines() or [''])[0]}"
                  for rank, (ename, evalue) in raised.items()}
        return RankFailedError(f"{summary}\n\nRemote traceback (rank {first}):\n{traceback}", causes, raised,
                               sorted(raised), summary=summary, first=first, traceback=traceback,
                               still_running=running)

    def _process_group_notes(self, failed: list[int]) -> dict[int, str]:
        """rank -> why, for the failed ranks that said their error broke the process group."""
        notes = {}
        for rank in failed:
            # A rank notes it (engine.call_on_rank) before its error reply; the call's output
            # is complete only after everything it published: wait for that, briefly.
            self._per_rank[rank].wait_for_output(OUTPUT_DRAIN_SECONDS)
            if PROCESS_GROUP_BROKEN_KEY in self._data[rank]:
                notes[rank] = self._data[rank][PROCESS_GROUP_BROKEN_KEY]
        return notes

    def _completion_time(self, rank: int) -> float:
        """When a finished rank's engine completed the call (for 'first exception wins')."""
        completed = self._per_rank[rank].metadata.get("completed")
        return completed.timestamp() if completed is not None else float("inf")

    def _died(self, died: list[int], failed: list[int]) -> RankDiedError:
        """A rank's death, with what its peers saw of it (e.g. the message to it they lost)."""
        who = ", ".join(self._ranks.describe(rank) for rank in died)
        # ipyparallel reports an engine dead once its controller misses its heartbeats: on a machine
        # busy enough, that of a process still running here.
        unheard = set(died) - self._dead - set(self._ranks.dead_ranks(died))
        note = ""
        if unheard == set(died):
            reason = (f"{who} stopped answering the controller's heartbeat while running {self._name}, "
                      f"though its process still runs here, and the controller gave it up")
            note = busy_note()
        else:
            how = self._ranks.how_it_ended(died[0])  # the first death's cause (several are one cause)
            reason = f"{who} died (its process ended{how}) while running {self._name}"
        self._ranks.needs_restart(reason)
        seen = [(evalue.splitlines() or [ename])[0] for ename, evalue, _ in
                (_remote_parts(self._per_rank[rank].exception()) for rank in failed)]
        self._ranks.record_errors({rank: self._per_rank[rank].exception() for rank in failed})
        lines = [f"{reason}.{note}", *(f"Then {line}" if line.startswith("rank ") else line for line in seen)]
        message = "\n".join([*lines, RESTART_HINT])
        return RankDiedError(message, dict.fromkeys(died, "died (its process ended)"), summary=message)

    def _timed_out(self, running: list[int]) -> RankTimeoutError:
        finished = [rank for rank in range(len(self._per_rank)) if rank not in running]
        self._ranks.needs_restart(f"{self._name} timed out after {self._timeout:g} s: "
                                  f"ranks {running} still running")
        who = f"Ranks {running} were still running"
        if finished:
            who += f" (ranks {finished} had finished)"
        lines = [f"{self._name} timed out after {self._timeout:g} s.", f"{who}.",
                 "A rank blocked in a collective or a recv cannot be interrupted.", RESTART_HINT]
        message = "\n".join(lines)
        return RankTimeoutError(message, dict.fromkeys(running, "still running past the call's timeout"),
                                summary=message)
