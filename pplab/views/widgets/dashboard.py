"""The live dashboard: one widget that runs a lab pipeline and shows every rank while it works.

While a step runs, each rank publishes what it starts and every event as it ends
(batched every `LIVE_INTERVAL` seconds by a helper thread on the engine); the
dashboard polls for them on the kernel's main thread (a plain loop in `run_steps`,
an asyncio task in `start`, so the kernel stays free for other cells) and redraws
the live timeline as SVG a few times per second. Finished steps go to the bubble,
shape, gradient, memory and loss panels; the matplotlib pictures are drawn when a
series of steps ends, so that rendering does not take the CPU the ranks need.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import html
import time

import ipywidgets as widgets

from pplab.base.config import IMPLEMENTATIONS
from pplab.base.machine import MachineLoad, crowding_note, measure_load
from pplab.planning.simulator import Costs, costs_from_timeline, simulate
from pplab.schedules import SCHEDULE_NAMES, TORCH_SCHEDULES, theory
from pplab.trace.timeline import Timeline
from pplab.views.widgets.panels import (
    BubblesView,
    GradientsView,
    MemoryView,
    ShapesView,
    TimelineView,
    WhereView,
)
from pplab.views.widgets.render import RED, Throttle

POLL_SECONDS = 0.05  # how often the dashboard looks for what the ranks published
LIVE_INTERVAL = 0.05  # how often a rank publishes what it has done
LIVE_REDRAW_SECONDS = 0.2  # the live timeline's redraws, at most
TIMING_COSTS = Costs(forward=0.05, backward=0.1)  # timing mode: the shape of a schedule, in seconds


class Dashboard(widgets.VBox):
    """Controls, where each rank is, the timeline, and panels for bubbles, shapes, gradients and memory."""

    def __init__(self, pipe, batch=None, stalled_after: float = 2.0, load: MachineLoad | None = None):
        """`pipe` is a lab pipeline (`lab.pipeline(...)`); `batch` the data of every step (default: the
        pipeline's); `stalled_after`: seconds a wait lasts before its rank shows red, on a quiet
        machine (a busy one's waits are longer: each run stretches it by the slowdown it reads, or by
        that of `load`, a `measure_load()` reading the caller took, e.g. to size its own waits by)."""
        self.pipe, self.batch, self.stalled_after, self.load = pipe, batch, stalled_after, load
        self.results = []  # every finished step's StepResult
        self._predicted_with = None  # (costs, label) the last step shown was predicted with
        self.latencies: list[float] = []  # seconds from a rank's note to its place in the widget state
        self.running = False
        self._stop_requested = False
        self._task: asyncio.Task | None = None
        self._build_controls()
        self.where = WhereView(pipe.spec.world_size, stalled_after, self._labels())
        self.timeline = TimelineView(rank_labels=self._labels(), pictures=False)  # one size, live or done
        self.bubbles = BubblesView()
        self.shapes = ShapesView()
        self.gradients = GradientsView()
        self.memory = MemoryView()
        self.tabs = widgets.Tab(children=[self.bubbles, self.shapes, self.gradients, self.memory],
                                titles=["bubbles", "activation shapes", "gradient flow", "memory and loss"])
        self._memory_stale = False  # its pictures wait until someone opens its tab
        self._finished = None  # (result, predicted) of a step whose panels are not filled yet
        self.tabs.observe(lambda _: self._draw_memory_if_shown(), names="selected_index")
        super().__init__([self.controls, widgets.HBox([self.progress, self.status]), self.where,
                          self.timeline, self.tabs])
        self._set_references()

    # -- running steps -----------------------------------------------------------------------

    def run_steps(self, steps: int = 1) -> list:
        """Run `steps` steps now, updating every panel while they run; return their results."""
        self._check_steps(steps)
        done = len(self.results)
        for live in self._steps(steps, raise_errors=True):
            live.wait(POLL_SECONDS)  # wakes as soon as the step ends
        return self.results[done:]

    def start(self, steps: int = 1) -> asyncio.Task:
        """Run `steps` steps in the background on the kernel's event loop; `stop()` ends it after a step."""
        self._check_steps(steps)

        async def run_in_background():  # nobody to raise to: errors show in the status line
            for _ in self._steps(steps, raise_errors=False):
                await asyncio.sleep(POLL_SECONDS)

        self._task = asyncio.get_event_loop().create_task(run_in_background())
        self.running = True  # at once: a second click must not start another run
        return self._task

    def stop(self) -> None:
        """Stop the series of steps after the one in progress."""
        if self.running:
            self._stop_requested = True
            self._say("stopping after this step")

    def check_parity(self):
        """One more step, compared with one device: loss and every gradient;
        differences go to the gradient panel."""
        from pplab.rank.rank_context import RankError

        if self.running:
            raise RuntimeError("the dashboard is running steps: call stop() first")
        self._say("checking parity with one device")
        try:
            report = self.pipe.check_parity(self.batch)
        except (RankError, ValueError) as error:
            self._say_error(error)
            return None
        self.gradients.show(self.pipe.last.grad_stats, report, self._stage_of())
        verdict = "matches one device" if report.passed else "DIFFERS from one device"
        self._say(f"parity: {verdict} (loss {report.loss:.6f} vs {report.reference_loss:.6f}, "
                  f"largest gradient difference {report.max_abs_diff:.1e})", error=not report.passed)
        return report

    def _check_steps(self, steps: int) -> None:
        from pplab.base.arguments import check_positive_int

        check_positive_int("steps", steps, example=5)
        if self.running and self._task is None:
            raise RuntimeError("the dashboard is already running steps: call stop() first")
        if self._task is not None and not self._task.done():
            raise RuntimeError("the dashboard is already running steps in the background: call stop() "
                               "and wait for it")

    def _steps(self, steps: int, raise_errors: bool):
        """Run the steps, yielding whenever there is time to wait (the caller sleeps or awaits)."""
        from pplab.rank.rank_context import RankError

        self.running, self._stop_requested = True, False
        self._enable_controls(False)
        self.progress.max, self.progress.value = steps, 0
        # Before the ranks work: what else keeps this machine busy (or the caller's reading of it).
        machine = measure_load() if self.load is None else self.load
        # A busy machine's waits are longer, but a wait that lasts half the timeout is a stall anyway.
        self.where.stalled_after = min(self.stalled_after * machine.slowdown,
                                       max(self.stalled_after, self.pipe.spec.op_timeout / 2))
        try:
            for index in range(steps):
                if self._stop_requested:
                    self._say(f"stopped after {index} of {steps} steps")
                    break
                yield from self._one_step(index, steps)
                self.progress.value = index + 1
            else:
                crowded = crowding_note(self.pipe.spec.world_size, machine)
                self._say(f"{steps} step{'s' if steps > 1 else ''} "
                          "done" + (f" · {crowded}" if crowded else ""))
        except (RankError, ValueError) as error:
            self._say_error(error)
            if raise_errors:
                raise
        finally:
            self.running = False
            self._enable_controls(True)
            self._show_finished()  # the last step's panels: no next step to fill them during
            # Theory and simulation for the costs measured last: once per run, not per step.
            self._set_references(picture=False)
            self._draw_pictures()

    def _one_step(self, index: int, steps: int):
        number = len(self.results) + 1
        self._say(f"step {number} running ({index + 1} of {steps})")
        live = self.pipe.start_step(self.batch, live_interval=LIVE_INTERVAL)
        # While the ranks start: the panels of the step before (the client's work between
        # steps would otherwise add to every step) and this step's prediction.
        try:
            self._show_finished()
            predicted = self._predicted()
        except BaseException:
            with contextlib.suppress(Exception):
                live.result()  # no step is left running with nobody to collect it
            raise
        redraw = Throttle(LIVE_REDRAW_SECONDS)
        while not live.finished():
            self._take(live.poll())
            if redraw.ready():
                self.timeline.show_live(live.timeline(f"step {number} (running)"), predicted)
            yield live  # the caller waits on it (blocking) or sleeps (on the event loop)
        result = live.result()
        self._take(live.poll())
        self.results.append(result)
        self._finished = (result, predicted)

    def _show_finished(self) -> None:
        """Put the last finished step, if not shown yet, into the timeline, bubble, shape,
        gradient and loss panels."""
        if self._finished is None:
            return
        (result, predicted), self._finished = self._finished, None
        # Not drawn: the next step's live view, or the run's closing picture, replaces it at once.
        self.timeline.add_step(result.timeline, predicted, show=False)
        self.bubbles.add(result.timeline, picture=False)
        self.shapes.show(result.boundary_shapes)
        self.gradients.show(result.grad_stats, stage_of=self._stage_of())
        self.memory.add_loss(result.loss, picture=False)

    def _take(self, items) -> None:
        """Put what the ranks published into the 'where each rank is' panel, and redraw it
        (also with nothing new: how long a rank has waited keeps growing)."""
        from pplab.trace.timeline import Now

        for _, item in items:
            if isinstance(item, Now):
                self.where.update(item)
        self.where.render()
        applied = time.time()
        self.latencies.extend(applied - put_at for put_at, _ in items)

    def _draw_pictures(self) -> None:
        """The matplotlib pictures of the last step, drawn once a run is over (each takes
        about 0.1-0.3 s of CPU the ranks would want during a run); the memory tab's only
        when it is open."""
        if not self.results:
            return
        self.timeline.show(*self.timeline.history[-1], note=f"step {len(self.results)}")
        self.bubbles.draw_plot()
        self._memory_stale = True
        self._draw_memory_if_shown()

    def _draw_memory_if_shown(self) -> None:
        if self._memory_stale and self.tabs.selected_index == self.tabs.children.index(self.memory) \
                and not self.running:
            self.memory.show(self.results[-1].timeline)
            self.memory.draw_losses()
            self._memory_stale = False

    # -- predictions ---------------------------------------------------------------------------

    def _costs(self) -> tuple[Costs | None, str]:
        """The costs to predict with: timing mode's, else those measured in the last step."""
        if self.pipe.spec.timing is not None:
            return self.pipe.spec.timing, "predicted (timing costs)"
        if self.results:
            return (costs_from_timeline(self.results[-1].timeline, self.pipe.schedule.n_stages),
                    f"predicted (costs of step {len(self.results)})")
        return None, ""

    def _labels(self) -> list[str] | None:
        """Row names: on a mesh each rank's coordinates ('rank 3 · pp1 dp1'), else None (rank numbers)."""
        return self.pipe.rank_labels if self.pipe.spec.mesh else None

    def _predicted(self) -> Timeline | None:
        costs, label = self._costs()
        self._predicted_with = costs, label  # the bubbles tab compares with the same prediction
        if costs is None or self.pipe.spec.world_size != self.pipe.schedule.n_ranks:
            return None  # the simulator runs one pipeline; a mesh with dp or tp has more ranks than that
        predicted = simulate(self.pipe.schedule, costs)
        return Timeline(predicted.events, predicted.n_ranks, label=label)

    def _set_references(self, picture: bool = True) -> None:
        """Theory and simulation in the bubbles tab, from the costs the last step shown was predicted
        with (so that its header and the tab give one prediction), else the costs there are now."""
        costs, label = self._predicted_with or self._costs()
        textbook = theory(self.pipe.schedule, costs)
        simulated = simulate(self.pipe.schedule, costs).bubble_fraction()
        self.bubbles.set_reference(textbook.bubble_fraction, simulated,
                                   "" if textbook.bubble_fraction is not None else textbook.conditions,
                                   picture=picture, simulated_label=label.removeprefix("predicted ") or None)

    def _stage_of(self):
        from pplab.models.partition import layer_ranges, stage_of_parameter

        spec = self.pipe.spec
        ranges = layer_ranges(spec.config.num_hidden_layers, spec.schedule.n_stages, spec.balance,
                              spec.allow_empty)
        return lambda name: stage_of_parameter(name, ranges, spec.config)

    # -- controls ------------------------------------------------------------------------------

    def _build_controls(self) -> None:
        schedule, impl = self.pipe.schedule, self.pipe.spec.impl
        current = schedule.name
        names = _schedule_names(impl)
        names = names if current in names else [current, *names]
        short, labelled = widgets.Layout(width="190px"), {"description_width": "initial"}
        self.schedule_name = widgets.Dropdown(options=names, value=current, description="schedule")
        # Each control is labelled with the keyword of lab.pipeline(...) it sets.
        self.n_microbatches = widgets.BoundedIntText(schedule.n_microbatches, min=1, max=256,
                                                     description="n_microbatches", layout=short,
                                                     style=labelled)
        self.n_virtual = widgets.BoundedIntText(schedule.n_virtual, min=1, max=8,
                                                description="n_virtual (stages per rank)",
                                                layout=widgets.Layout(width="250px"), style=labelled)
        self.impl = widgets.Dropdown(options=IMPLEMENTATIONS, value=impl, description="impl",
                                     layout=widgets.Layout(width="180px"))
        self.timing = widgets.Checkbox(self.pipe.spec.timing is not None, description="timing mode",
                                       indent=False, layout=widgets.Layout(width="110px"))
        self.step_count = widgets.BoundedIntText(5, min=1, max=10_000, description="steps", layout=short,
                                                 style=labelled)
        self.step_button = widgets.Button(description="run 1 step", icon="play")
        self.run_button = widgets.Button(description="run N steps", icon="forward")
        self.stop_button = widgets.Button(description="stop", icon="stop", disabled=True)
        self.parity_button = widgets.Button(description="check parity", icon="check",
                                            tooltip="one step, every gradient compared with one device")
        self.progress = widgets.IntProgress(0, min=0, max=1, layout=widgets.Layout(width="220px"))
        self.status = widgets.HTML()
        self.controls = widgets.VBox([
            widgets.HBox([self.schedule_name, self.n_microbatches, self.n_virtual, self.impl, self.timing]),
            widgets.HBox([self.step_button, self.step_count, self.run_button, self.stop_button,
                          self.parity_button])])
        self.step_button.on_click(lambda _: self.start(1))
        self.run_button.on_click(lambda _: self.start(self.step_count.value))
        self.stop_button.on_click(lambda _: self.stop())
        self.parity_button.on_click(lambda _: self.check_parity())
        for control in (self.schedule_name, self.n_microbatches, self.n_virtual, self.timing):
            control.observe(lambda _: self.rebuild(), names="value")
        self.impl.observe(lambda _: self._impl_changed(), names="value")

    def _impl_changed(self) -> None:
        """Another implementation knows other schedules: offer them (keeping the schedule if it has it)."""
        names = _schedule_names(self.impl.value)
        if self.schedule_name.value in names:
            self.schedule_name.options = names  # keeps the value: rebuild below
            self.rebuild()
        else:
            self.schedule_name.options = names  # sets the first name, which rebuilds

    def rebuild(self) -> None:
        """Build the pipeline the controls describe on the ranks (the old one is freed)."""
        if self.running:
            return
        lab, config, spec = self.pipe.lab, self.pipe.config, self.pipe.spec
        # Every keyword the pipeline was built with, but those the controls set (a spec's fields are
        # lab.pipeline's keywords): a rebuild that dropped one would change more than the control did.
        kept = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)
                if field.name not in ("config", "schedule", "timing", "impl")}
        try:
            new = lab.pipeline(config, schedule=self.schedule_name.value,
                               n_microbatches=self.n_microbatches.value,
                               n_virtual=self.n_virtual.value,
                               timing=TIMING_COSTS if self.timing.value else None,
                               impl=self.impl.value, **kept)
        except ValueError as error:  # sizes the schedule cannot take: say so, keep the old pipeline
            self._say_error(error)
            return
        self.pipe.close()
        # A fresh history: steps, timelines and bubbles of the old schedule would be read as the new one's.
        self.pipe, self.results, self._finished, self._predicted_with = new, [], None, None
        self.where.reset(new.spec.world_size, self._labels())
        self.timeline.reset(self._labels())
        self.bubbles.reset()
        self._set_references()
        # the simulator runs one pipeline, not a mesh's dp or tp
        if new.spec.world_size == new.schedule.n_ranks:
            costs, label = self._costs()
            plan = simulate(new.schedule, costs)
            self.timeline.show(None, Timeline(plan.events, plan.n_ranks, label=label or "simulated"),
                               note="the new schedule, before its first step")
        schedule = new.schedule
        self._say(html.escape(f"rebuilt: {schedule.name}, {schedule.n_microbatches} microbatches, "
                              f"{schedule.n_virtual} stage{'s' if schedule.n_virtual > 1 else ''} per rank, "
                              f"impl={new.spec.impl}{', timing mode' if new.spec.timing else ''}; "
                              f"a fresh history of steps"))

    def _enable_controls(self, enabled: bool) -> None:
        for control in (self.schedule_name, self.n_microbatches, self.n_virtual, self.timing,
                        self.step_button, self.run_button, self.step_count, self.parity_button):
            control.disabled = not enabled
        self.stop_button.disabled = enabled

    def _say(self, text: str, error: bool = False) -> None:
        self.status.value = f"<span style='{RED if error else ''}'>{text}</span>"

    def _say_error(self, error: Exception) -> None:
        """The error's message, line by line, without the remote traceback (it would push the
        panels off the screen; the raised error, or `lab.last_errors`, still has it)."""
        from pplab.rank.rank_context import RankError

        message = error.summary if isinstance(error, RankError) else str(error)
        self._say("<br>".join(html.escape(line) for line in message.splitlines()), error=True)


def _schedule_names(impl: str) -> list[str]:
    """The schedules an implementation runs (impl="pplab" or "torch")."""
    if impl == "torch":
        return list(TORCH_SCHEDULES)
    return list(SCHEDULE_NAMES)
