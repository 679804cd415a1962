"""The adapters: what the lab relies on in ipyparallel and gloo beyond their promises, checked for real.

pplab reads ipyparallel's private attributes, and recognises ipyparallel's and gloo's
errors by class name or text, in one place each (pplab/drivers/cluster/*_adapter.py).
Each test here gives its adapter the real thing (an AsyncResult of a real call, the error
of an engine that really died, gloo's own error of a receive that timed out), so an
upgrade that changes what an adapter relies on fails here, naming it.

Functions sent to the ranks are defined at module level (the engines import this module).
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch

from pplab.drivers.cluster import LabError
from pplab.drivers.cluster.gloo_adapter import gloo_transport_failed
from pplab.drivers.cluster.ipyparallel_adapter import catch_up_on_engines, engine_died, results_per_engine
from pplab.session import RankDiedError, RankFailedError

# -- functions that run on the ranks ------------------------------------------------------


def engine_pid():
    return os.getpid()


def raise_on_rank_0():
    """Rank 0 raises an ordinary error; rank 1 returns."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank 0 is alive and raising")


def what_gloo_transport_failed_says_of_a_receive_that_times_out():
    """Rank 1 waits for a message rank 0 never sends, until gloo's own timeout; the adapter's verdict."""
    import torch.distributed as dist

    if dist.get_rank() != 1:
        return None  # returns at once, its engine still running: the pair stays open
    try:
        dist.recv(torch.zeros(1), src=0)
    except Exception as error:
        return type(error).__name__, str(error), gloo_transport_failed(error)
    return "the receive returned"


def raise_a_message_that_looks_like_a_traceback():
    raise ValueError("first line\nRemote traceback (rank 9): only words in the message")


# -- ipyparallel ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_results_per_engine_are_what_split_gives_for_each_engine(lab2):
    import ipyparallel as ipp

    engines = lab2.view.targets  # in rank order
    call = lab2.view.apply_async(engine_pid)
    # What the adapter reads: AsyncResult's private attributes, of these types.
    assert isinstance(call._client, ipp.Client) and isinstance(call._fname, str)
    assert call._targets == engines and len(call._children) == len(engines)

    ours, split = results_per_engine(call), call.split()
    assert all(isinstance(result, concurrent.futures.Future) for result in ours)  # RankCall waits on them
    assert [result.get(20) for result in ours] == [result.get(20) for result in split] == call.get(20)
    assert [result.msg_ids for result in ours] == [result.msg_ids for result in split]
    assert [result.metadata["engine_id"] for result in ours] == engines
    assert all(isinstance(result.metadata["data"], dict) for result in ours)  # where events arrive

    # Why the adapter exists: a call on one engine, split() gives back unsplit (a list of one).
    lone = lab2.client[engines[1:]].apply_async(engine_pid)
    [alone] = results_per_engine(lone)
    assert alone.get(20) == call.get()[1]
    assert lone.split()[0].get() == [alone.get()], \
        "AsyncResult.split() now splits a lone result: results_per_engine could use it instead"


@pytest.mark.timeout(60)
def test_catch_up_on_engines_adds_the_registered_engines_a_client_missed(lab2):
    # A client that missed an engine's announcement (ZMQ's slow joiner) knows one engine fewer
    # than the hub; here a second client of lab2's controller is made to forget engine 1.
    import ipyparallel as ipp

    security = os.path.join(lab2.profile_dir, "security")
    client = ipp.Client(os.path.join(security, f"ipcontroller-{lab2.cluster_id}-client.json"))
    try:
        everyone = sorted(client.ids)
        forgotten = everyone[-1]
        client._ids.remove(forgotten)
        client._engines.pop(forgotten)
        assert catch_up_on_engines(client, timeout=20) == [forgotten]
        assert sorted(client.ids) == everyone
        assert client[forgotten].apply_sync(engine_pid) in {info.pid for info in lab2.status()}
        assert catch_up_on_engines(client, timeout=20) == []  # nothing missed any more
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_engine_died_recognises_what_ipyparallel_gives_for_an_engine_it_gave_up(fragile_lab):
    """Rank 1's process is stopped (SIGSTOP): alive, but silent. The controller misses its heartbeats
    (10 s on a quiet machine, more on a busy one: launchers.controller_args) and ipyparallel fails its task as
    it does a dead engine's,
    which the adapter recognises. The lab says what happened: the process still runs (beside two
    CPU burners a running rank was given up so, and was said to have died)."""
    import signal

    rank_1 = fragile_lab.status()[1]
    pid = rank_1.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # Only the adapter's verdict on ipyparallel's error makes this a RankDiedError: the process
        # is there, so without it the call would run into its 60 s timeout.
        with pytest.raises(RankDiedError) as caught:
            fragile_lab.run(engine_pid, timeout=60)
        assert caught.value.ranks == [1]
        said = str(caught.value)
        # (the engine's id is the controller's: on a kept controller, not the rank's number)
        assert said.startswith(f"rank 1 (engine {rank_1.engine_id}, pid {pid} on "), said
        assert "died" not in said.splitlines()[0], said
        assert ("stopped answering the controller's heartbeat while running engine_pid(), though its "
                "process still runs here, and the controller gave it up." in said), said
    finally:
        os.kill(pid, signal.SIGCONT)
        fragile_lab.restart()  # the controller no longer knows rank 1's engine
    with pytest.raises(RankFailedError):
        fragile_lab.run(raise_on_rank_0)
    assert not engine_died(fragile_lab.last_errors[0])  # an ordinary error of a live rank


# -- gloo -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_gloo_transport_failed_recognises_gloos_error_of_a_receive_that_timed_out(fragile_lab):
    try:
        verdicts = fragile_lab.run(what_gloo_transport_failed_says_of_a_receive_that_times_out,
                                   timeout=fragile_lab.op_timeout + 20)
        assert verdicts[0] is None and verdicts[1] != "the receive returned"
        ename, message, recognised = verdicts[1]
        assert recognised, f"gloo's error no longer reads as its transport's: {ename}: {message}"
    finally:
        fragile_lab.restart()  # the pair gloo closed is not to be used again
    with pytest.raises(RuntimeError) as other:  # torch's own RuntimeError, not gloo's
        torch.zeros(2) + torch.zeros(3)
    assert not gloo_transport_failed(other.value)


# -- summaries, kept apart when the error is built ------------------------------------------------


@pytest.mark.quick
def test_a_lab_error_without_a_traceback_is_its_own_summary():
    assert LabError("what happened\nthe fix\n").summary == "what happened\nthe fix"
    assert LabError("what happened\nlogs...", summary="what happened").summary == "what happened"


@pytest.mark.timeout(60)
def test_a_failed_calls_summary_is_what_precedes_the_traceback_whatever_the_rank_said(lab2, monkeypatch):
    # Both ranks raise; the second's report must arrive within the grace, which a crowded machine
    # outlasted (1 s, stretched to 3). What is tested here is the summary, so the grace is long.
    monkeypatch.setattr(lab2, "grace", 30.0)
    with pytest.raises(RankFailedError) as caught:
        lab2.run(raise_a_message_that_looks_like_a_traceback)
    error = caught.value
    assert error.summary == (f"rank {error.rank} raised ValueError in "
                             f"raise_a_message_that_looks_like_a_traceback():\nfirst line\n"
                             f"Remote traceback (rank 9): only words in the message\n"
                             f"Ranks [{1 - error.rank}] raised too (see lab.last_errors).")
    assert str(error).startswith(f"{error.summary}\n\nRemote traceback (rank {error.rank}):\n")
    assert lab2.state == "running"
