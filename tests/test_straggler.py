"""The straggler's verdict on a busy machine: named when the evidence says so, undecided when it
cannot tell, never a wrong name. The load is made here as it comes on a shared core: some actions
run alone, others are stretched by a random share of their core taken by other processes, or
start late as a woken process waits for its core."""

from __future__ import annotations

import random

import pytest

from pplab.planning.bubble import named_schedule
from pplab.planning.simulator import Costs, simulate
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


def stretched_steps(costs: Costs, rng: random.Random, n_steps: int, stretch) -> list[Timeline]:
    """`n_steps` 1F1B steps on 2 ranks, every compute action's duration passed through `stretch`."""
    steps = []
    for _ in range(n_steps):
        step = simulate(named_schedule("1f1b", 2, 4), costs)
        steps.append(Timeline([Event(e.rank, e.kind, e.stage, e.microbatch, e.start,
                                     e.start + (stretch(e) if e.is_compute else e.duration))
                               for e in step.events], n_ranks=2))
    return steps


# the drill's timing mode: stage 1 four times slower
SLOW_STAGE = Costs(forward=(0.015, 0.06), backward=(0.03, 0.12))


def test_a_padded_slow_rank_is_named_when_its_peers_every_action_is_stretched():
    # Timing mode pads each action to its cost, so the slow rank's own load hides inside its pads,
    # while the fast rank's computation (20 ms of it, slowed up to 5 times by the other processes)
    # outgrows its 15 ms pads: its every run is long, its typical run nearly the slow rank's.
    rng = random.Random(2)
    padded = lambda event: max(event.duration, 0.02 * rng.uniform(1, 5)) + rng.expovariate(500)  # noqa: E731
    for trial in range(40):
        verdict = straggler_verdict(stretched_steps(SLOW_STAGE, rng, 3, padded), 2)
        assert verdict.rank == 1, (trial, verdict)
    # A woken process that waits for its core: 90 % of the actions start up to 50 ms late or more.
    late = lambda event: event.duration + (rng.expovariate(20) if rng.random() < 0.9 else 0.0)  # noqa: E731
    for trial in range(40):
        verdict = straggler_verdict(stretched_steps(SLOW_STAGE, rng, 3, late), 2)
        assert verdict.rank == 1, (trial, verdict)
        even = straggler_verdict(stretched_steps(Costs(forward=0.015, backward=0.03), rng, 3, late), 2)
        assert even.rank is None, (trial, even)


def test_a_rank_four_times_slower_is_named_however_loaded_its_peer():
    slow = Costs(forward=(0.004, 0.016), backward=(0.008, 0.032))
    rng = random.Random(0)
    for trial in range(50):
        # both ranks heavily loaded: the fast rank's total nearly catches up, its best does not
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
    assert (quiet.rank, quiet.decided, quiet.low, quiet.high, quiet.load_spread) == (None, True, 1.0,
                                                                                     1.0, 0.0)
    assert quiet.text().startswith("no straggler: rank")
    named = straggler_verdict([simulate(named_schedule("1f1b", 2, 4), slow)], 2)
    assert (named.rank, named.low) == (1, pytest.approx(1.5))
    assert straggler_verdict([simulate(named_schedule("1f1b", 1, 4), even)], 1) is None


def test_an_unbounded_ratio_reads_as_no_upper_bound():
    from pplab.planning.straggler import StragglerVerdict

    verdict = StragglerVerdict(1, True, 1, 1.49, float("inf"), 0.0, 3)
    assert "at least 1.49x (no upper bound" in verdict.text() and "inf" not in verdict.text()
