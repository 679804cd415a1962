"""What can go wrong on a lab, each error naming the rank and what to do next.

Messages are read in a notebook, where a long line wraps mid-word: they put what
happened, who waited on whom, and the fix on lines of their own.
"""

from __future__ import annotations

from pplab.rank import rank_context as common
from pplab.rank.rank_context import RankError

# The last line of every error after which only fresh engines help.
RESTART_HINT = "Call lab.restart() to get fresh ranks."


class LabError(RankError):
    """Something went wrong with the lab's engines or with a call running on them.

    The failures of a call are also the kinds every driver raises (`pplab.session.RankFailedError`,
    `RankDiedError`, `RankTimeoutError`): an `except` written for a RankPool catches them here too."""

    def __init__(self, message: str, *, summary: str | None = None):
        super().__init__(message)
        # Kept apart when the error is built, so that it is never cut out of the message's
        # text afterwards (where a rank's own message could hold anything).
        self._summary = (message if summary is None else summary).strip()

    @property
    def summary(self) -> str:
        """What happened and the fix, without the rank's traceback (for a status line)."""
        return self._summary


class LabStartError(LabError):
    """The controller or the engines did not come up."""


class RankFailedError(LabError, common.RankFailedError):
    """A rank raised an exception; carries its rank, exception type and remote traceback."""

    def __init__(self, message: str, *, summary: str, rank: int, ename: str, evalue: str,
                 traceback: str, still_running: list[int], raised: dict[int, tuple[str, str]] | None = None):
        super().__init__(message, summary=summary)
        self.rank = rank  # the first to raise, whose traceback the message holds
        self.raised = raised or {rank: (ename, evalue)}  # every rank that raised
        self.causes = {r: f"failed: {e}: {(v.splitlines() or [''])[0]}" for r, (e, v) in self.raised.items()}
        self.causes.update({r: "still running" for r in still_running})
        self.ranks = sorted(self.raised)
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback
        self.still_running = still_running

    def first_raised(self) -> tuple[str, str]:
        """(exception type, message) of the first rank that raised."""
        return self.ename, self.evalue


class RankDiedError(LabError, common.RankDiedError):
    """A rank's process ended while a call was running on it."""

    def __init__(self, message: str, *, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks
        self.causes = {rank: "died (its process ended)" for rank in ranks}


class RankTimeoutError(LabError, common.RankTimeoutError):
    """A call ran past its timeout; carries the ranks that were still running."""

    def __init__(self, message: str, *, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks
        self.causes = {rank: "still running past the call's timeout" for rank in ranks}


class LabNeedsRestartError(LabError):
    """An earlier failure left ranks busy or gone; only lab.restart() can recover."""
