"""Faults on purpose on a real 2-rank lab: a rank that stalls inside a forward, a rank that dies.

Each ends within the lab's timeout in an error naming the rank, its peer and the action;
the dashboard shows who waited on whom; a restart gives a lab that matches one device.
"""

import re

import pytest

import pplab
from pplab.rank import faults
from pplab.session import RankDiedError, RankFailedError
from timing import SLACK, slack, within

CONFIG = pplab.LlamaConfig.tiny()


def matches_one_device_after_a_restart(lab, schedule: str) -> bool:
    """A restart gives ranks that match one device. Not a fault's wait, so bounded at this machine's
    pace now: the lab's short one was read at the test's start, and a run beside two burners met a
    23x slowdown later in the same test."""
    lab.restart()
    with lab.pipeline(CONFIG, schedule=schedule, n_microbatches=4, op_timeout=slack(3)) as pipe:
        return pipe.check_parity().passed


def test_a_fault_that_cannot_fire_is_refused_before_any_rank_is_asked(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)
    try:
        with pytest.raises(ValueError, match=r"action='1X3' is not an action: give one like '1F3'"):
            faults.stall(pipe, "1X3", seconds=1)
        with pytest.raises(ValueError, match=r"'1SEND_B2' is a message; .* e.g. '1F2'"):
            faults.die(pipe, "1SEND_B2")
        with pytest.raises(ValueError, match=r"'1F9' is not in schedule '1f1b'; rank 1 runs these "
                                             r"computations of stage 1: 1F0 1B0 1F1"):
            faults.stall(pipe, "1F9", seconds=1)
        with pytest.raises(ValueError, match=r"schedule '1f1b' has stages 0..1"):
            faults.die(pipe, "5F0")
        with pytest.raises(ValueError, match=r"seconds=0 must be a positive number of seconds"):
            faults.stall(pipe, "1F0", seconds=0)
        assert lab2.state == "running" and pipe.step().loss > 0  # nothing was armed
    finally:
        pipe.close()


def test_a_rank_stalled_inside_a_forward_is_named_by_the_rank_that_waits_for_it(fragile_lab, monkeypatch):
    """Rank 1 sleeps in its forward of microbatch 1 far longer than the lab's timeout: rank 0 gives up
    after the lab's seconds on the gradient it needs, and the dashboard shows rank 0 stalled on
    rank 1, and rank 1 in 1F1."""
    # Rank 1 says nothing until it wakes, so the lab waits its whole grace (stretched by the load)
    # for it: a short one, as nothing here reads what a second rank reports.
    monkeypatch.setattr(fragile_lab, "grace", 1.0)
    pipe = fragile_lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)
    timeout = fragile_lab.op_timeout  # 3 s, unless the machine is busy (see the fixture)
    assert pipe.spec.op_timeout == timeout  # the lab's bound, not a default of its own
    pipe.step()
    dashboard = pipe.dashboard(stalled_after=1.0)
    assert faults.stall(pipe, "1F1", seconds=timeout + 60) == 1
    with within(SLACK + fragile_lab.grace, plus=timeout), pytest.raises(
            RankFailedError,
            match=rf"rank 0 waited {timeout:g} s for the gradient of microbatch 1 from rank 1 "
                  rf"\(action 0RECV_B1\)"):
        dashboard.run_steps(1)
    assert dashboard.where.states == {0: "stalled", 1: "running"}
    assert dashboard.where.latest[1].doing == "1F1"
    assert "rank 1: send of the gradient of microbatch 1 on stage 1" in dashboard.where.html.value
    assert f"rank 0 waited {timeout:g} s for the gradient of microbatch 1" in dashboard.status.value
    assert fragile_lab.state.startswith("needs restart")
    assert matches_one_device_after_a_restart(fragile_lab, "1f1b")


def test_a_rank_that_dies_at_an_action_is_named_by_its_peer(fragile_lab):
    # The pipeline waits the lab's own seconds, so that rank 0's report of what it lost (or waited for)
    # comes within the lab's grace after rank 1's death: a wait stretched past it left the death reported
    # alone (a burner run).
    pipe = fragile_lab.pipeline(CONFIG, schedule="gpipe", n_microbatches=4)
    pid = fragile_lab.status()[1].pid
    # A first step on the pipeline before the fault.
    pipe.step()
    assert faults.die(pipe, "1B2") == 1
    with pytest.raises(RankDiedError) as failure:
        pipe.step()
    message = str(failure.value)
    # The death, then what its peer saw of it: a message it lost (of microbatch 2, or 1 if
    # rank 1 died before its send of the gradient of microbatch 1 was through), or, where the
    # machine kept rank 0 off a core past its timeout, the same message it waited for in vain.
    assert message.startswith("rank 1 (engine "), message
    assert f"pid {pid} on " in message
    assert re.search(r"\nThen rank 0 (lost|waited [\d.]+ s for) the (send of the )?gradient of microbatch "
                     r"(?P<mb>[12]) (to|from) rank 1 \(action 0(SEND|RECV)_B(?P=mb)\)", message), message
    assert fragile_lab.status()[1].state == "dead"
    assert matches_one_device_after_a_restart(fragile_lab, "gpipe")


def test_a_fault_fires_only_in_its_own_run_and_closing_the_run_forgets_it(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=2)
    other = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=2)
    try:
        faults.die(pipe, "1F1")
        assert other.step().loss > 0 and lab2.state == "running"  # another pipeline: nothing fires
        pipe.close()  # closing a pipeline forgets its faults: none is left on any rank
        assert lab2.run(faults.disarm_on_rank, pipe.pipeline_id) == [0, 0]
        assert other.step().loss > 0 and lab2.state == "running"
    finally:
        other.close()
