"""What can go wrong on a lab, each error naming the rank and what to do next.

Messages are read in a notebook, where a long line wraps mid-word: they put what
happened, who waited on whom, and the fix on lines of their own.
"""

from __future__ import annotations

from pplab.rank.rank_context import RankError

# The last line of every error after which only fresh engines help.
RESTART_HINT = "Call lab.restart() to get fresh ranks."


class LabError(RankError):
    """The lab itself cannot do what was asked: it is stopped, did not start, or needs a restart.

    A call's failures on the ranks are the kinds every driver raises (`pplab.session.RankFailedError`,
    `RankDiedError`, `RankTimeoutError`); `except pplab.session.RankError` catches those and these."""

    def __init__(self, message: str, *, summary: str | None = None):
        super().__init__(message, summary=message if summary is None else summary)


class LabStartError(LabError):
    """The controller or the engines did not come up."""


class LabNeedsRestartError(LabError):
    """An earlier failure left ranks busy or gone; only lab.restart() can recover."""

