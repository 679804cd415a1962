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


def catch_up_on_engines(client, timeout: float) -> list[int]:
    """Ask the hub which engines it has registered and add those `client` missed; their ids
    ([] too if the hub does not answer within `timeout` seconds: ask again later).

    A client learns of new engines from the hub's notifications, on a ZMQ subscription it opens
    just after the hub answered its connection request; an engine whose registration completes
    in between is announced before the subscription is in place, and the client never hears of
    it (ZMQ's "slow joiner"). A restart's engines, forked from a warm fork server, register that
    fast: a busy machine waited out a whole start_timeout with 0 of 2 engines, both registered.
    The hub's answer to a second connection request lists them, as the first did; Client has
    no public way to ask it (ipyparallel 9: _send on _query_stream, _update_engines)."""
    asked = client._send(client._query_stream, "connection_request")
    if not asked.wait(timeout):
        return []
    registered = {int(engine_id): uuid for engine_id, uuid in asked.result()["content"]["engines"].items()}
    missed = sorted(set(registered) - set(client.ids))
    client._update_engines({engine_id: registered[engine_id] for engine_id in missed})
    return missed
