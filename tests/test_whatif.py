"""What-ifs from one run (pplab.planning.whatif): each change simulated on a model of the run.

The runs here are simulated timelines, so that every number the model reads is known: the
changes' predictions are checked against the simulator on the costs they must use. How close
they come to real runs is measured in bench/bench_whatif.py.
"""

import dataclasses

import pytest

from pplab.planning.bubble import explain, named_schedule
from pplab.planning.prediction import Profile, StageProfile
from pplab.planning.simulator import Costs, simulate
from pplab.trace.timeline import Timeline

pytestmark = pytest.mark.quick

UNEVEN = Costs(forward=[1.0, 3.0], backward=[2.0, 6.0])  # rank 1 has three times rank 0's work


def predicted(report, change: str) -> float:
    return next(s.predicted_step_time for s in report.suggestions if s.change == change)


def test_interleaving_keeps_each_ranks_work_on_that_rank():
    """Interleaved 1F1B puts stages r and r + p on rank r: each rank's work is split between its
    two stages, it does not move to the other rank (which would be a rebalance)."""
    run = named_schedule("1f1b", 2, 4)
    report = explain(simulate(run, UNEVEN), run)
    interleaved = named_schedule("interleaved-1f1b", 2, 4, 2)
    halves = Costs(forward=[0.5, 1.5, 0.5, 1.5], backward=[1.0, 3.0, 1.0, 3.0])
    assert predicted(report, "schedule interleaved-1f1b with 2 stages per rank") == pytest.approx(
        simulate(interleaved, halves).step_time())
    rebalanced = predicted(report, "stages rebalanced to equal work")
    assert rebalanced < predicted(report, "schedule interleaved-1f1b with 2 stages per rank")
    assert report.best.change == "stages rebalanced to equal work"


def test_the_runtimes_own_time_between_computes_is_paid_by_every_action_of_a_change():
    """A run whose computes leave 0.1 s between them where nothing was awaited: the model reads
    that 0.1 s, the run as it is comes out at its measured step, and twice the microbatches pay it
    twice as often (a gain the bubble's arithmetic alone overstates)."""
    run = named_schedule("1f1b", 2, 4)
    even = simulate(run, Costs(forward=1.0, backward=2.0))
    measured = Timeline([dataclasses.replace(e, end=e.end - 0.1) if e.is_compute else e for e in even.events],
                        label="measured")
    report = explain(measured, run)
    assert report.overhead_per_action == pytest.approx(0.1)
    assert report.predicted_as_is == pytest.approx(measured.step_time(), rel=0.01)
    halved = simulate(named_schedule("1f1b", 2, 8), Costs(forward=0.45 + 0.1, backward=0.95 + 0.1))
    assert predicted(report, "8 microbatches of half the size") == pytest.approx(halved.step_time())
    without = simulate(named_schedule("1f1b", 2, 8), Costs(forward=0.45, backward=0.95)).step_time()
    halved = predicted(report, "8 microbatches of half the size")
    assert without / report.predicted_as_is < halved / measured.step_time()


def test_a_split_backward_costs_what_a_profile_of_the_same_stages_says():
    run = named_schedule("1f1b", 2, 4)
    measured = simulate(run, UNEVEN)
    # One device measured I + W at 1.5 B on stage 1 (0.6 of it I), and all of it W on stage 0.
    profile = Profile((StageProfile(1.0, 2.0, 0.0, 2.0, 0, 0, 0), StageProfile(3.0, 6.0, 5.4, 3.6, 0, 0, 0)),
                      4, 64)
    assumed, profiled = explain(measured, run), explain(measured, run, profile=profile)
    zb = named_schedule("zb-h1", 2, 4)
    assert predicted(assumed, "schedule zb-h1") == pytest.approx(
        simulate(zb, Costs(forward=[1.0, 3.0], input_grad=[1.0, 3.0], weight_grad=[1.0, 3.0])).step_time())
    assert predicted(profiled, "schedule zb-h1") == pytest.approx(
        simulate(zb, Costs(forward=[1.0, 3.0], input_grad=[0.0, 5.4], weight_grad=[2.0, 3.6])).step_time())
    assert any("give explain a profile" in note for note in assumed.notes)
    assert not any("give explain a profile" in note for note in profiled.notes)
    with pytest.raises(ValueError,
                       match=r"profile has 1 stages and schedule '1f1b' 2: profile the run's stages"):
        explain(measured, run, profile=dataclasses.replace(profile, stages=profile.stages[:1]))


def test_each_gain_carries_the_runs_own_step_to_step_spread():
    run = named_schedule("1f1b", 2, 4)
    steps = [simulate(run, Costs(forward=[f, 3 * f], backward=[2 * f, 6 * f])) for f in (1.0, 1.1, 0.9)]
    report = explain(steps[0], run, steps=steps[1:])
    spread = (steps[1].step_time() - steps[2].step_time()) / 2 / steps[0].step_time()
    assert spread == pytest.approx(0.1)
    assert all(s.uncertainty == pytest.approx(spread) for s in report.suggestions if not s.assumed)
    assert all(s.uncertainty >= spread - 1e-9 for s in report.suggestions if s.assumed)
    assert "(-" in report.text() and "± 10%)" in report.text()
    one_step = explain(steps[0], run).suggestions  # one step: no spread to tell, only the assumptions'
    assert all(s.uncertainty == 0 for s in one_step if not s.assumed)


def test_a_change_resting_on_an_assumed_cost_is_as_wide_as_the_assumption_and_ranks_below_measured_ones():
    """Without a profile, zb-h1 (a split backward) and half microbatches rest on assumed costs: each
    is predicted at the assumption's optimistic end, its uncertainty is how far the gain moves to the
    far end (ASSUMED_RANGES), and it comes after every measured change, in the list and for `best`."""
    from pplab.planning.whatif import ASSUMED_RANGES

    run = named_schedule("1f1b", 2, 4)
    report = explain(simulate(run, Costs(forward=[1.0, 1.2], backward=[2.0, 2.4])), run)
    now = report.predicted_as_is
    zb = next(s for s in report.suggestions if s.change == "schedule zb-h1")
    low, high = ASSUMED_RANGES["split"]
    split_at = lambda ratio: Costs(forward=[1.0, 1.2], input_grad=[ratio, 1.2 * ratio],  # noqa: E731
                                   weight_grad=[ratio, 1.2 * ratio])
    zb_h1 = named_schedule("zb-h1", 2, 4)
    at = {ratio: simulate(zb_h1, split_at(ratio)).step_time() for ratio in (low, high)}
    assert zb.predicted_step_time == pytest.approx(at[low]) and zb.gain > 0
    assert zb.uncertainty == pytest.approx((at[high] - at[low]) / now)
    assert "I + W costs 1-1.8 x its B" in zb.assumed
    half = next(s for s in report.suggestions if "half the size" in s.change)
    assert half.assumed and half.uncertainty > 0
    kinds = [bool(s.assumed) for s in report.suggestions]
    assert kinds == sorted(kinds) and kinds.count(True) == 2  # measured ones first
    assert report.best is None or not report.best.assumed or report.best.gain > report.best.uncertainty
    assert "assumed: a split backward" in report.text()
    profiled = Profile((StageProfile(1.0, 2.0, 0.0, 2.0, 0, 0, 0), StageProfile(1.2, 2.4, 1.2, 1.2, 0, 0, 0)),
                       4, 64)
    as_run = simulate(run, Costs(forward=[1.0, 1.2], backward=[2.0, 2.4]))
    measured_split = explain(as_run, run, profile=profiled)
    assert not next(s for s in measured_split.suggestions if s.change == "schedule zb-h1").assumed


def test_half_a_microbatch_costs_what_profiles_at_both_sizes_say():
    run = named_schedule("1f1b", 2, 4)
    measured = simulate(run, UNEVEN)
    stage = lambda f, b: StageProfile(f, b, b / 2, b / 2, 0, 0, 0)  # noqa: E731
    whole = Profile((stage(1.0, 2.0), stage(3.0, 6.0)), 4, 64)
    half = Profile((stage(0.5, 1.0), stage(1.8, 3.9)), 2, 64)  # stage 1: 60 % and 65 % of a whole one
    report = explain(measured, run, profile=[half, whole])
    costs = Costs(forward=[0.5, 1.8], backward=[1.0, 3.9])
    expected = simulate(named_schedule("1f1b", 2, 8), costs).step_time()
    assert predicted(report, "8 microbatches of half the size") == pytest.approx(expected)
    assert not any("half as much each" in note for note in report.notes)
    assert any("half as much each" in note for note in explain(measured, run, profile=whole).notes)
