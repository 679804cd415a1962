"""The live dashboard on a real 2-rank lab: it updates while steps run, shows stalls, obeys its controls."""

import asyncio
import re

import pytest

from timing import slack

pytest.importorskip("ipywidgets")

import pplab  # noqa: E402
from pplab.planning.simulator import Costs  # noqa: E402

CONFIG = pplab.LlamaConfig.tiny()
TIMING = Costs(forward=0.05, backward=0.1)  # a 1F1B step of 4 microbatches on 2 ranks: about 0.75 s


def test_a_multi_step_run_updates_the_panels_while_it_runs(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4, timing=TIMING)
    try:
        dashboard = pipe.dashboard()
        results = dashboard.run_steps(3)
        assert len(results) == 3 and dashboard.results == results
        # The live timeline was redrawn while steps ran, more than once per step.
        assert dashboard.timeline.live_draws > 3
        assert dashboard.timeline.draws >= 1  # and the finished steps drawn as a picture
        assert [row["overall"] for row in dashboard.bubbles.rows] == \
            [r.timeline.bubble_fraction() for r in results]
        assert dashboard.memory.losses == [r.loss for r in results]
        assert dashboard.memory.image.layout.display == "none"  # drawn when its tab opens
        dashboard.tabs.selected_index = 3
        assert dashboard.memory.image.layout.display is None
        assert bytes(dashboard.memory.image.value[:4]) == b"\x89PNG"
        assert dashboard.where.states == {0: "done", 1: "done"}
        assert dashboard.gradients.red == {} and dashboard.shapes.flagged == []
        # The feed is live: the ranks' events reached the panels while the steps ran (how soon is
        # bench/bench_dashboard.py's to measure: beside two burners one took 14 s).
        assert dashboard.latencies and all(latency >= 0 for latency in dashboard.latencies)
        assert dashboard.progress.value == 3 and "3 steps done" in dashboard.status.value
    finally:
        pipe.close()


def test_the_header_and_the_bubbles_tab_give_one_prediction_and_say_whose_costs(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)  # real mode: costs measured
    try:
        dashboard = pipe.dashboard()
        dashboard.run_steps(2)
        header = dashboard.timeline.caption.value
        predicted = re.search(r"predicted \(costs of step 1\): step [\d.]+ s, bubble ([\d.]+%)", header)
        assert predicted, header  # step 2, predicted from step 1's costs
        tab = dashboard.bubbles.table.value
        assert re.search(rf"simulation \(costs of step 1\).*?{re.escape(predicted[1])}", tab, re.DOTALL), tab
    finally:
        pipe.close()


def test_a_waiting_rank_shows_whom_it_waits_for_while_it_waits(lab2):
    # Stage 0's forwards are slow: rank 1 sits in its first receive, visibly, long before any timeout.
    # A stall is a wait of 0.6 s on a quiet machine, and the dashboard stretches that by the load
    # (a full run's other worker made it over 2 s): the forwards last 2.5 times the stretch. The
    # dashboard takes this test's reading (`load=`): two readings of a loaded machine differed by
    # more than 2.5 times in a full run, and the threshold outgrew the forwards.
    from pplab.base.machine import measure_load

    reading = measure_load()
    slow = min(max(2.0, 2.5 * reading.scale(0.6)), 0.75 * lab2.op_timeout)
    slow_start = Costs(forward=[slow, 0.01], backward=0.01)
    pipe = lab2.pipeline(CONFIG, schedule="gpipe", n_microbatches=2, timing=slow_start)
    try:
        dashboard = pipe.dashboard(stalled_after=0.6, load=reading)
        seen = []

        async def watch():
            task = dashboard.start(1)
            while not task.done():
                await asyncio.sleep(0.05)  # the kernel's loop stays free while the step runs
                seen.append((dict(dashboard.where.states), dashboard.where.html.value))
            await task

        asyncio.run(watch())
        stalled = [html for states, html in seen if states.get(1) == "stalled"]
        assert stalled, f"rank 1 was never shown stalled: {[s for s, _ in seen]}"
        assert "rank 0: send of the activation of microbatch 0 on stage 0" in stalled[0]
        # Kept after the step, for the record: rank 1 waited for each of stage 0's slow forwards. The
        # first wait lasts a whole forward; the second a forward less the first message's delivery,
        # which a loaded machine can make so long that the rest falls under the threshold: it is a
        # stall where rank 1's own clock (its receive in the timeline) says so, give or take the gap
        # between that event and the rank's notes of it.
        recorded = [(s["rank"], s["doing"]) for s in dashboard.where.stalls]
        assert recorded[:1] == [(1, "1RECV_F0")], recorded
        assert set(recorded) <= {(1, "1RECV_F0"), (1, "1RECV_F1")}, recorded
        second_wait = next(e.duration for e in dashboard.results[0].timeline.events
                           if e.rank == 1 and e.kind == "RECV_F" and e.microbatch == 1)
        threshold = dashboard.where.stalled_after
        if abs(second_wait - threshold) > 0.1 * threshold:
            assert ((1, "1RECV_F1") in recorded) == (second_wait > threshold), (second_wait, threshold,
                                                                                recorded)
        # A stall lasts from when the client saw the wait begin until it saw it end: the feed's latency on
        # a busy machine adds to the forward's own seconds.
        assert all(dashboard.where.stalled_after <= s["seconds"] < slow + slack(2.0)
                   for s in dashboard.where.stalls), \
            (slow, dashboard.where.stalled_after, dashboard.where.stalls)
        assert len(dashboard.results) == 1
    finally:
        pipe.close()


def test_stop_ends_a_background_run_after_the_current_step(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4, timing=TIMING)
    try:
        dashboard = pipe.dashboard()

        async def start_then_stop():
            task = dashboard.start(20)
            while not dashboard.results:
                await asyncio.sleep(0.05)
            dashboard.stop()
            await task

        asyncio.run(start_then_stop())
        assert 1 <= len(dashboard.results) <= 2
        assert "stopped after" in dashboard.status.value and not dashboard.running
    finally:
        pipe.close()


def test_changing_a_control_rebuilds_on_the_ranks_and_bad_sizes_are_said(lab2):
    built = dict(seed=3, balance=(5, 3), op_timeout=17.0, record=True, allow_empty=False,
                 param_dtype="float32")
    dashboard = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4, **built).dashboard()
    try:
        dashboard.run_steps(2)  # 1f1b's steps: the rebuild must forget them
        dashboard.schedule_name.value = "gpipe"
        assert dashboard.pipe.schedule.name == "gpipe" and dashboard.pipe.schedule.n_microbatches == 4
        # What no control sets is kept: the pipeline is the one it was, with the control's change only.
        assert {name: getattr(dashboard.pipe.spec, name) for name in built} == built
        assert "rebuilt: gpipe, 4 microbatches, 1 stage per rank, impl=pplab" in dashboard.status.value
        assert dashboard.timeline.history == [] and dashboard.bubbles.rows == []
        assert "costs of step" not in dashboard.bubbles.table.value  # not the old schedule's prediction
        assert "the new schedule, before its first step" in dashboard.timeline.caption.value
        (result,) = dashboard.run_steps(1)
        assert result.timeline.n_ranks == 2
        # One step of the new schedule: one in the step picker, one in the caption, one bubble row
        assert [label for label, _ in dashboard.timeline.picker.options] == ["1"]
        assert dashboard.timeline.caption.value.startswith("step 1") and len(dashboard.bubbles.rows) == 1
        before = dashboard.pipe
        dashboard.n_virtual.value = 2  # gpipe runs one stage per rank
        assert dashboard.pipe is before and "runs one stage per rank" in dashboard.status.value
    finally:
        dashboard.pipe.close()


def test_parity_differences_go_to_the_gradient_panel(lab2):
    dashboard = lab2.pipeline(CONFIG, schedule="zb-h1", n_microbatches=2).dashboard()
    try:
        report = dashboard.check_parity()
        assert report.passed and "matches one device" in dashboard.status.value
        assert "max |diff| vs one device" in dashboard.gradients.table.value and dashboard.gradients.red == {}
    finally:
        dashboard.pipe.close()


def test_an_error_is_raised_by_run_steps_and_shown_in_the_status_line(lab2):
    import torch

    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=2)
    try:
        too_big = torch.full((4, 8), CONFIG.vocab_size)  # token ids outside the vocabulary
        dashboard = pipe.dashboard(batch=(too_big, too_big))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            dashboard.run_steps(1)
        assert "outside the vocabulary" in dashboard.status.value and "#c00000" in dashboard.status.value
        assert not dashboard.running and not dashboard.step_button.disabled
    finally:
        pipe.close()


def test_the_impl_control_switches_to_torchs_schedules(lab2):
    dashboard = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4, timing=TIMING).dashboard()
    try:
        dashboard.impl.value = "torch"  # 1f1b exists in both: rebuilt under torch
        assert dashboard.pipe.spec.impl == "torch" and "zbv-zero-bubble" in dashboard.schedule_name.options
        (result,) = dashboard.run_steps(1)
        assert sorted({e.kind for e in result.timeline.compute_events()}) == ["B", "F"]  # torch ran it
        assert dashboard.timeline.live_draws >= 1 and dashboard.where.states == {0: "done", 1: "done"}
    finally:
        dashboard.pipe.close()
