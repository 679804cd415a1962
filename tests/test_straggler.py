"""The straggler's verdict on a busy machine: named when the evidence says so, undecided when it
cannot tell, never a wrong name. The load is made here as it comes on a shared core: some actions
run alone, others are stretched by a random share of their core taken by other processes."""

from __future__ import annotations

import random

import pytest

from pplab.simulator import Costs, simulate
from pplab.bubble import named_schedule
from pplab.planning.straggler import straggler_verdict
from pplab.trace.timeline import Event, Timeline

pytestmark = pytest.mark.quick


def loaded_step(costs: Costs, rng: random.Random, load: float, share_loaded: float = 0.5) -> Timeline:
    """A 1F1B step on 2 ranks whose actions are stretched, each with probability `share_loaded`,
    by up to `load` (a fraction of its cost) as other processes take the core."""
    step = simulate(named_schedule("1f1b", 2, 4), costs)
    events = []
    for event in step.events:
        stretch = rng.uniform(0, load) if event.is_compute and rng.random() < share_loaded else 0.0
        events.append(Event(event.rank, event.kind, event.stage, event.microbatch, event.start,
                            event.end + stretch * event.duration))
    return Timeline(events, n_ranks=2)


def test_a_rank_four_times_slower_is_named_however_loaded_its_peer():
    slow = Costs(forward=(0.004, 0.016), backward=(0.008, 0.032))
    rng = random.Random(0)
    for trial in range(50):
        # rank 0 bears far more load than rank 1: its total nearly catches up, its best does not
        steps = [loaded_step(slow, rng, load=3.0, share_loaded=0.6) for _ in range(2)]
        verdict = straggler_verdict(steps, 2)
        assert verdict.rank == 1 and verdict.decided, (trial, verdict)
        assert verdict.low > 1.25 and verdict.low <= verdict.high
    assert "straggler: rank 1, computing" in verdict.text()


def test_even_ranks_are_never_given_a_straggler_however_loaded():
    even = Costs(forward=0.004, backward=0.008)
    rng = random.Random(1)
    said = set()
    for trial in range(50):
        verdict = straggler_verdict([loaded_step(even, rng, load=2.0)], 2)
        assert verdict.rank is None, (trial, verdict)
        said.add(verdict.decided)
        if not verdict.decided:
            assert "undecided" in verdict.text() and "load varied" in verdict.text()
    assert said == {True, False}  # heavy load leaves some steps undecided, light load decides


def test_a_quiet_machine_decides_exactly():
    even, slow = Costs(forward=0.004, backward=0.008), Costs(forward=(0.004, 0.006), backward=(0.008, 0.012))
    quiet = straggler_verdict([simulate(named_schedule("1f1b", 2, 4), even)], 2)
    assert (quiet.rank, quiet.decided, quiet.low, quiet.high, quiet.load_spread) == (None, True, 1.0, 1.0, 0.0)
    assert quiet.text().startswith("no straggler: rank")
    named = straggler_verdict([simulate(named_schedule("1f1b", 2, 4), slow)], 2)
    assert (named.rank, named.low) == (1, pytest.approx(1.5))
    assert straggler_verdict([simulate(named_schedule("1f1b", 1, 4), even)], 1) is None
