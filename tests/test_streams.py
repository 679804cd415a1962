"""Messages on a transport's streams (pplab.planning.streams): holds, the cascade, deadlocks named."""

import math

import pytest

from pplab.planning.simulator import Costs
from pplab.planning.streams import Hold, simulate_streams
from pplab.schedules import Action, DeadlockError, add_communication, build, from_text, lowered_by_torch

pytestmark = pytest.mark.quick

# Rank 0 posts the receive of microbatch 0's gradient before it sends microbatch 1's activation: on a
# stream per pair of ranks the send waits behind the receive.
EARLY_RECEIVE = ["0F0 0F1 0SEND_F0 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1",
                 "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"]


def test_a_receive_holds_the_send_behind_it_on_its_stream_and_the_times_are_the_rules():
    run = simulate_streams(from_text(EARLY_RECEIVE), Costs(forward=1, backward=2), "pair")
    # rank 0: F0 0-1, F1 1-2; its send of F0 starts at 2, rank 1 computes F0 2-3 and B0 3-5, sends its
    # gradient at 5; rank 0's receive of it, posted at 2, holds the send of F1 until 5; F1 then reaches
    # rank 1 at 5 (F1 5-6, B1 6-8); rank 0's B0 5-7, its last receive 8, B1 8-10.
    ends = {(e.rank, e.kind, e.stage, e.microbatch): (e.start, e.end) for e in run.timeline.events}
    assert ends[(0, "SEND_F", 0, 1)] == (5, 5) and ends[(1, "F", 1, 1)] == (5, 6)
    assert ends[(0, "B", 0, 1)] == (8, 10) and run.step_time() == 10
    assert run.holds == [Hold(0, 1, Action.parse("0RECV_B0"), Action.parse("0SEND_F1"), 3.0)]
    # Messages in no order (gloo): the send leaves when F1 ends; rank 1 is busy anyway, the step is the same.
    free = simulate_streams(from_text(EARLY_RECEIVE), Costs(forward=1, backward=2), "none")
    assert free.holds == [] and free.step_time() == 10


def test_torchs_early_receives_cascade_on_one_stream_per_rank_not_on_one_per_pair():
    compute, costs = build("interleaved-1f1b", 4, 8, 2).compute_only(), Costs(latency=0.1)
    early = lowered_by_torch(compute)
    bound = 58.4  # the compute order, messages never holding anything up (pplab.simulate)
    steps = {streams: simulate_streams(early, costs, streams).step_time()
             for streams in ("rank", "pair", "none")}
    assert steps["rank"] == pytest.approx(73.7) and steps["pair"] == pytest.approx(bound)
    assert steps["none"] == pytest.approx(bound)


def test_a_cycle_of_waits_is_named_and_a_small_message_does_not_wait_for_its_receive():
    dead = from_text(["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    for streams in ("pair", "rank"):
        with pytest.raises(DeadlockError, match=r"rank 0's 0RECV_B0 waits for rank 1 to reach 1SEND_B0;.*"
                                                r"rank 0's 0SEND_F0 is queued behind 0RECV_B0 on its stream"):
            simulate_streams(dead, None, streams)
    assert simulate_streams(dead, None, "none").step_time() == 6
    # pplab's 1F1B order sends F3 before it receives B0 while rank 1 sends B0 before it receives F3: two
    # sends that each wait for a receive queued behind the other's. A message NCCL buffers runs.
    own = add_communication(build("1f1b", 4, 8).compute_only())
    with pytest.raises(DeadlockError, match="2SEND_F1 waits for rank 3 to reach 3RECV_F1"):
        simulate_streams(own, Costs(latency=0.1), "pair")
    small = Costs(latency=0.1, bandwidth=1e9, activation_bytes=4096)
    assert simulate_streams(own, small, "pair", buffered_bytes=1 << 20).step_time() > 0
    assert simulate_streams(own, Costs(latency=0.1), "pair", buffered_bytes=math.inf).step_time() > 0


def test_bad_streams_and_a_compute_order_are_refused_by_name():
    with pytest.raises(ValueError, match=r"streams='ring': give one of 'pair', 'rank', 'none'"):
        simulate_streams(build("1f1b", 2, 4), None, "ring")
    with pytest.raises(ValueError, match="has no sends and receives to put on streams"):
        simulate_streams(build("1f1b", 2, 4).compute_only())
