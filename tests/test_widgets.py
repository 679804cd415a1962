"""The dashboard's panels without a browser and without a cluster: state read from the widgets."""

import pytest

pytest.importorskip("ipywidgets")

from pplab.planning.simulator import Costs, costs_from_timeline, simulate  # noqa: E402
from pplab.rank.runtime import Boundary  # noqa: E402
from pplab.schedules import build, theory  # noqa: E402
from pplab.trace import Now  # noqa: E402
from pplab.views.widgets import (  # noqa: E402
    BubblesView,
    GradientsView,
    MemoryView,
    ShapesView,
    TimelineView,
    WhatIf,
    WhereView,
)

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

PNG_MAGIC = b"\x89PNG"


def is_png(image) -> bool:
    return bytes(image.value[:4]) == PNG_MAGIC


def good_stats(*names):
    return {name: dict(present=True, norm=1.0, finite=True, nonzero=True) for name in names}


def test_timeline_view_draws_a_static_or_simulated_timeline_and_keeps_past_steps():
    first, second = simulate(build("gpipe", 2, 4)), simulate(build("1f1b", 2, 4))
    view = TimelineView(first)
    assert is_png(view.image) and view.shown is first
    view.add_step(first)
    view.add_step(second)
    assert list(view.picker.options) == [("1", 0), ("2", 1)] and view.shown is second
    view.picker.value = 0  # pick a past step: it is drawn again
    assert view.shown is first and "step 1" in view.caption.value


def test_bubbles_panel_numbers_are_the_timelines_own():
    schedule = build("1f1b", 3, 4)
    simulated = simulate(schedule)
    panel = BubblesView(theory(schedule).bubble_fraction, simulated.bubble_fraction())
    slow = simulate(schedule, Costs(forward=[1.0, 2.0, 1.0]))
    row = panel.add(slow)
    assert row["overall"] == slow.bubble_fraction()
    assert row["per_rank"] == [slow.bubble_fraction(r) for r in range(3)]
    assert f"{slow.bubble_fraction():.1%}" in panel.table.value
    assert f"{theory(schedule).bubble_fraction:.1%}" in panel.table.value
    assert is_png(panel.image)


def test_a_shape_change_is_flagged():
    step = [Boundary(0, mb, (2, 16, 64), "float32", 8192) for mb in range(3)]
    panel = ShapesView(step)
    assert panel.flagged == [] and "stage 0 → 1" in panel.table.value
    changed = [Boundary(0, 0, (2, 16, 64), "float32", 8192), Boundary(0, 1, (2, 24, 64), "float32", 12288)]
    panel.show(changed)
    assert panel.flagged == [(0, 1)] and "shape changed (was (2, 16, 64))" in panel.table.value


def test_missing_zero_and_non_finite_gradients_turn_red():
    stats = good_stats("embed.weight", "layers.0.w", "lm_head.weight", "norm.weight")
    stats["layers.0.w"].update(nonzero=False, norm=0.0)
    stats["lm_head.weight"].update(present=False)
    stats["norm.weight"].update(finite=False)
    panel = GradientsView(stats, stage_of=lambda name: 0 if name.startswith(("embed", "layers")) else 1)
    assert set(panel.red) == {"layers.0.w", "lm_head.weight", "norm.weight"}
    assert "all zero" in panel.red["layers.0.w"] and "NaN or Inf" in panel.red["norm.weight"]
    assert panel.table.value.count("color:#c00000") == 3
    panel.show(good_stats("embed.weight"))
    assert panel.red == {} and "color:#c00000" not in panel.table.value


def test_where_view_shows_whom_a_rank_waits_for_and_marks_a_stall():
    panel = WhereView(n_ranks=2, stalled_after=1.0)
    panel.update(Now(0, "0F1", 0.1), seen_at=100.0)
    panel.update(Now(1, "1RECV_F1", 0.1, waits_for=((0, "0SEND_F1"),)), seen_at=100.0)
    panel.render(at=100.5)
    assert panel.states == {0: "running", 1: "waiting"}
    assert "rank 0: send of the activation of microbatch 1 on stage 0" in panel.html.value
    panel.render(at=101.5)
    assert panel.states[1] == "stalled"
    panel.render(at=102.0)
    assert [(s["rank"], s["doing"], s["seconds"]) for s in panel.stalls] == [(1, "1RECV_F1", 2.0)]


def test_a_stall_is_judged_on_the_ranks_clock_once_the_wait_ends():
    """A busy client hears late: what it saw as long waits were short on the rank, and the
    reverse. The rank's next `Now` settles each."""
    panel = WhereView(n_ranks=1, stalled_after=1.0)
    panel.update(Now(0, "0RECV_B0", 0.10, waits_for=((1, "1SEND_B0"),)), seen_at=100.0)
    panel.render(at=101.5)  # the client got round to drawing 1.5 s later: red
    assert panel.states[0] == "stalled" and len(panel.stalls) == 1
    panel.update(Now(0, "0B0", 0.15), seen_at=101.6)  # on the rank, the wait lasted 50 ms
    assert panel.stalls == []
    panel.update(Now(0, "0RECV_B1", 0.20, waits_for=((1, "1SEND_B1"),)), seen_at=101.7)
    panel.update(Now(0, "0B1", 2.70), seen_at=101.8)  # 2.5 s on the rank, never drawn as a stall
    assert [(s["doing"], s["seconds"]) for s in panel.stalls] == [("0RECV_B1", pytest.approx(2.5))]
    assert "rank 1: send of the gradient of microbatch 1" in panel.stalls[0]["waits_for"]


def test_memory_view_draws_every_rank_and_the_loss_curve():
    panel = MemoryView(simulate(build("gpipe", 2, 3)))
    panel.add_loss(4.0)
    panel.add_loss(3.5)
    assert is_png(panel.image) and is_png(panel.loss_image)
    assert panel.losses == [4.0, 3.5]


def test_what_if_sliders_redraw_the_simulation():
    panel = WhatIf("zb-h1", n_ranks=4, n_microbatches=8)
    assert panel.bubble == pytest.approx(simulate(build("zb-h1", 4, 8)).bubble_fraction())
    assert panel.weight_share.layout.display is None  # zb-h1 splits B: W's share is a lever
    draws = panel.draws
    panel.stage.value = "stage 3"
    panel.forward.value = 3.0  # a slow last stage
    assert panel.draws > draws and panel.costs().forward == (1.0, 1.0, 1.0, 3.0)
    assert panel.bubble == pytest.approx(simulate(build("zb-h1", 4, 8), panel.costs()).bubble_fraction())
    panel.n_virtual.value = 2  # zb-h1 takes one stage per rank: said, not raised
    assert "runs one stage per rank" in panel.numbers.value
    panel.schedule_name.value = "interleaved-1f1b"
    assert panel.timeline.n_ranks == 4 and "simulated" in panel.numbers.value
    assert panel.weight_share.layout.display == "none"  # a whole B: the slider would change nothing


def test_what_if_starts_from_the_costs_a_measured_run_shows():
    measured = simulate(build("1f1b", 2, 4), Costs(forward=[0.01, 0.03], backward=[0.02, 0.06]))
    costs = costs_from_timeline(measured)
    assert costs.forward == pytest.approx((0.01, 0.03)) and costs.backward == pytest.approx((0.02, 0.06))
    panel = WhatIf("1f1b", n_ranks=2, n_microbatches=4, measured=measured)
    assert panel.unit == "s" and panel.timeline.step_time() == pytest.approx(measured.step_time())


def test_training_view_follows_the_records_and_shows_the_latest_step():
    from pplab.rank.train import TrainRecord
    from pplab.views.widgets import TrainingView

    view = TrainingView(total_steps=10, redraw_seconds=3600)  # only the first add redraws by itself
    timeline = simulate(build("1f1b", 2, 4), Costs(forward=1, backward=2))
    for step in range(1, 5):
        view.add(TrainRecord(step, 5.0 - step, 1e-3, 1.5, 0.02, eval_loss=4.2 if step == 4 else None),
                 timeline)
    assert view.progress.value == 4 and view.draws == 1
    assert "step 4/10" in view.status.value  # the numbers follow every step, between pictures
    view.redraw()
    assert view.draws == 2 and "step 4/10" in view.status.value and "held-out 4.200" in view.status.value
    assert view.curves.value and view.steps.shown is timeline


def test_a_throttle_with_a_share_waits_until_its_draws_cost_that_share_of_a_core(monkeypatch):
    from types import SimpleNamespace

    from pplab.views.widgets import render

    clock = SimpleNamespace(wall=100.0, cpu=5.0)
    monkeypatch.setattr(render, "time",
                        SimpleNamespace(monotonic=lambda: clock.wall, thread_time=lambda: clock.cpu))
    # Times in eighths of a second: exact in binary, so each wait's edge is tested exactly.
    throttle = render.Throttle(1.0, share=0.25)
    assert throttle.ready()
    clock.cpu += 0.5  # a draw of 0.5 CPU-seconds: the next may start 2 s after it started
    throttle.drawn()
    clock.wall += 1.875
    assert not throttle.ready()
    clock.wall += 0.125
    assert throttle.ready()
    clock.cpu += 0.125  # a cheap draw (0.5 s at that share): back to once per `seconds`
    throttle.drawn()
    clock.wall += 0.875
    assert not throttle.ready()
    clock.wall += 0.125
    assert throttle.ready()
    plain = render.Throttle(1.0)  # no share: once per second, whatever a draw costs
    assert plain.ready()
    clock.cpu += 5.0
    plain.drawn()
    clock.wall += 1.0
    assert plain.ready()
