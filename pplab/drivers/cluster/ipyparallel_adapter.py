"""What the lab relies on in ipyparallel beyond what ipyparallel promises, each in one function.

Nothing else in pplab reads ipyparallel's private attributes or recognises its errors by
name. tests/test_adapters.py checks each function against the installed ipyparallel, so
an upgrade that changes what one relies on fails there, naming it, rather than deep
inside a call on the ranks.
"""

from __future__ import annotations


def results_per_engine(async_result) -> list:
    """One single-result AsyncResult per engine of `async_result`, in the order of its targets."""
    # AsyncResult.split() does this, except for a result of one engine: that it returns
    # unsplit, and its get() is a list of one (a 1-rank lab would get [[value]]). So the
    # results are built here the way split() builds them, from AsyncResult's private
    # _client, _fname, _children (one message future per engine) and _targets (the
    # engine ids): ipyparallel 9 documents none of them.
    from ipyparallel import AsyncResult

    return [AsyncResult(async_result._client, children=child, targets=[target],
                        fname=async_result._fname, owner=False)
            for child, target in zip(async_result._children, async_result._targets)]


def engine_died(error: BaseException) -> bool:
    """True for the error ipyparallel puts in place of the result of an engine that died mid-call."""
    # When an engine unregisters with work outstanding, the client makes an EngineError for
    # each stranded call, then turns it into a RemoteError like any error from an engine:
    # only the class name is left, and ipyparallel offers no typed alternative.
    from ipyparallel.error import EngineError, RemoteError

    if isinstance(error, RemoteError):
        return error.ename == EngineError.__name__
    return isinstance(error, EngineError)
