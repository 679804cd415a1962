"""What-if: sliders over a schedule's sizes and costs; the simulated timeline and its bubble follow.

No ranks are needed: everything here is the simulator. Given a measured timeline,
the sliders start at the costs measured in it and the simulation is drawn above
the measurement, on one time axis.
"""

from __future__ import annotations

import ipywidgets as widgets

from pplab.base.config import LabOptions, PipelineOptions, takes_options
from pplab.planning.simulator import Costs, costs_from_timeline, simulate
from pplab.schedules import SCHEDULE_NAMES, Kind, Schedule, build, schedule_name, theory
from pplab.trace.timeline import Timeline
from pplab.views.widgets.render import RED, show_png, table

EVERY_STAGE = "every stage"
FREE_BANDWIDTH = 1e12
_SLIDER = dict(continuous_update=True, readout_format=".3g", style={"description_width": "170px"},
               layout=widgets.Layout(width="420px"))


# Why the panel starts at 4 ranks and 8 microbatches where a run starts at 2 and 4.
_SEEN = "4 ranks, 8 microbatches: a bubble large enough to see, and room for the sliders to shrink it"


class WhatIf(widgets.VBox):
    """Move the sliders; the simulated timeline and its bubble redraw (see the module docstring)."""

    @takes_options(Costs, differs={"activation_bytes": "1 MiB: a message the bandwidth slider can price"})
    @takes_options(LabOptions, differs={"n_ranks": _SEEN})
    @takes_options(PipelineOptions, differs={"n_microbatches": _SEEN,
                                             "n_virtual": "None: 2 for interleaved-1f1b, else 1"})
    def __init__(self, schedule: str | Schedule = PipelineOptions.schedule, n_ranks: int = 4,
                 n_microbatches: int = 8, n_virtual: int | None = None, costs: Costs | None = None,
                 measured: Timeline | None = None, activation_bytes: int = 1 << 20):
        self.custom = schedule if isinstance(schedule, Schedule) else None
        if self.custom is not None:
            n_ranks, n_microbatches, n_virtual = schedule.n_ranks, schedule.n_microbatches, schedule.n_virtual
            name = schedule.name
        else:
            name = schedule_name(schedule)
            if name not in SCHEDULE_NAMES:  # the sliders rebuild the schedule: pplab must build it
                raise ValueError(f"WhatIf's sliders build pplab's schedules ({', '.join(SCHEDULE_NAMES)}); "
                                 f"for {name}, pass its plan: WhatIf(from_torch({name!r}, n_ranks, ...))")
            n_virtual = n_virtual or (2 if name == "interleaved-1f1b" else 1)
        self.measured = measured
        self.activation_bytes = activation_bytes
        if costs is None and measured is not None:
            costs = costs_from_timeline(measured, n_ranks * n_virtual)
        self.unit = "s" if (costs is not None and measured is not None) else "cost units"
        self._per_stage = _per_stage_costs(costs or Costs(), n_ranks * n_virtual)
        biggest = max(max(self._per_stage["forward"]), max(self._per_stage["backward"]))

        # Each control is labelled with the keyword it sets (WhatIf's, build's, lab.pipeline's).
        self.schedule_name = widgets.Dropdown(options=[name] if self.custom else list(SCHEDULE_NAMES),
                                              value=name,
                                              description="schedule", disabled=self.custom is not None)
        self.n_ranks = widgets.IntSlider(n_ranks, min=1, max=8, description="n_ranks (p)",
                                         **_int_style(self.custom))
        self.n_microbatches = widgets.IntSlider(n_microbatches, min=1, max=32,
                                                description="n_microbatches (m)",
                                                **_int_style(self.custom))
        self.n_virtual = widgets.IntSlider(n_virtual, min=1, max=4, description="n_virtual (stages per rank)",
                                           **_int_style(self.custom))
        self.stage = widgets.Dropdown(description="costs of", style={"description_width": "170px"})
        self.forward = widgets.FloatSlider(min=0, max=4 * biggest, step=biggest / 100,
                                           description=f"F ({self.unit})", **_SLIDER)
        self.backward = widgets.FloatSlider(min=0, max=8 * biggest, step=biggest / 100,
                                            description=f"B = I + W ({self.unit})", **_SLIDER)
        self.weight_share = widgets.FloatSlider(min=0, max=1, step=0.01, description="W share of B",
                                                **_SLIDER)
        self.latency = widgets.FloatSlider(0.0, min=0, max=2 * biggest, step=biggest / 100,
                                           description=f"latency ({self.unit})", **_SLIDER)
        # At its top the bandwidth costs nothing: messages then take just the latency.
        self.bandwidth = widgets.FloatLogSlider(value=FREE_BANDWIDTH, base=10, min=3, max=12,
                                                description=f"bytes/{'s' if self.unit == 's' else 'unit'}",
                                                **_SLIDER)
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto"))
        self.numbers = widgets.HTML()
        self.timeline: Timeline | None = None
        self.bubble: float | None = None
        self.draws = 0
        sizes = widgets.VBox([self.schedule_name, self.n_ranks, self.n_microbatches, self.n_virtual])
        costs_box = widgets.VBox([self.stage, self.forward, self.backward, self.weight_share,
                                  self.latency, self.bandwidth])
        super().__init__([widgets.HBox([sizes, costs_box]), self.numbers, self.image])
        self._refresh_stage_choices()
        self._show_stage_costs()
        for control in (self.schedule_name, self.n_ranks, self.n_microbatches, self.n_virtual):
            control.observe(self._sizes_changed, names="value")
        self.stage.observe(lambda _: self._show_stage_costs(), names="value")
        for control in (self.forward, self.backward, self.weight_share):
            control.observe(self._stage_cost_changed, names="value")
        for control in (self.latency, self.bandwidth):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    # -- what the sliders describe -------------------------------------------------------------

    def schedule(self) -> Schedule:
        """The schedule the sliders describe (a ValueError names sizes it cannot take)."""
        if self.custom is not None:
            return self.custom
        return build(self.schedule_name.value, self.n_ranks.value, self.n_microbatches.value,
                     self.n_virtual.value)

    def costs(self) -> Costs:
        """The costs the sliders describe."""
        per_stage = self._per_stage
        weight = tuple(b * w for b, w in zip(per_stage["backward"], per_stage["weight_share"]))
        input_grad = tuple(b - w for b, w in zip(per_stage["backward"], weight))
        return Costs(forward=per_stage["forward"], input_grad=input_grad, weight_grad=weight,
                     latency=self.latency.value,
                     bandwidth=None if self.bandwidth.value >= FREE_BANDWIDTH else self.bandwidth.value,
                     activation_bytes=self.activation_bytes)

    def redraw(self) -> None:
        """Simulate and draw; a size the schedule cannot take is shown, not raised."""
        from pplab.views import viz

        try:
            schedule = self.schedule()
        except ValueError as error:
            self.numbers.value = f"<div style='{RED}'>{error}</div>"
            return
        # W's share matters only to a schedule that splits B into I and W (zb-h1, zbv, ...): shown there
        # alone.
        splits = any(action.kind == Kind.W for actions in schedule.actions for action in actions)
        self.weight_share.layout.display = None if splits else "none"
        costs = self.costs()
        self.timeline = simulate(schedule, costs)
        self.bubble = self.timeline.bubble_fraction()
        textbook = theory(schedule, costs)
        if self.measured is not None:
            fig = viz.compare_timelines(self.timeline, self.measured,
                                        ("simulated, from the sliders", "measured"))
        else:
            fig = viz.plot_timeline(self.timeline, title=schedule.name)
        show_png(self.image, fig)
        self.draws += 1
        rows = [(["simulated", f"{self.timeline.step_time():.4g} {self.unit}", f"{self.bubble:.1%}"], "")]
        theory_text = "n/a" if textbook.bubble_fraction is None else f"{textbook.bubble_fraction:.1%}"
        rows.append((["theory", "", theory_text], ""))
        if self.measured is not None:
            rows.append((["measured", f"{self.measured.step_time():.4g} s",
                          f"{self.measured.bubble_fraction():.1%}"], ""))
        why = "" if textbook.bubble_fraction is not None else \
            f"<div style='font-size:11px;color:#555'>theory n/a: {textbook.conditions}</div>"
        self.numbers.value = table(["", "step time", "bubble"], rows) + why

    # -- keeping per-stage costs in step with the sliders ------------------------------------------

    def _sizes_changed(self, _change) -> None:
        n_stages = self.n_ranks.value * self.n_virtual.value
        if len(self._per_stage["forward"]) != n_stages:
            # A new number of stages: every stage starts from the first stage's costs.
            self._per_stage = {key: [values[0]] * n_stages for key, values in self._per_stage.items()}
            self._refresh_stage_choices()
        self.redraw()

    def _refresh_stage_choices(self) -> None:
        n_stages = len(self._per_stage["forward"])
        self.stage.options = [EVERY_STAGE, *(f"stage {s}" for s in range(n_stages))]
        self.stage.value = EVERY_STAGE

    def _selected_stages(self) -> list[int]:
        n_stages = len(self._per_stage["forward"])
        if self.stage.value in (None, EVERY_STAGE):
            return list(range(n_stages))
        return [int(self.stage.value.split()[1])]

    def _show_stage_costs(self) -> None:
        first = self._selected_stages()[0]
        self._setting = True
        try:
            self.forward.value = self._per_stage["forward"][first]
            self.backward.value = self._per_stage["backward"][first]
            self.weight_share.value = self._per_stage["weight_share"][first]
        finally:
            self._setting = False

    def _stage_cost_changed(self, _change) -> None:
        if getattr(self, "_setting", False):
            return
        for s in self._selected_stages():
            self._per_stage["forward"][s] = self.forward.value
            self._per_stage["backward"][s] = self.backward.value
            self._per_stage["weight_share"][s] = self.weight_share.value
        self.redraw()


def _int_style(custom) -> dict:
    return dict(continuous_update=False, disabled=custom is not None, style={"description_width": "170px"})


def _per_stage_costs(costs: Costs, n_stages: int) -> dict[str, list[float]]:
    """Per stage: F, B (= I + W) and W's share of B, as lists the sliders edit."""
    forward = [costs.compute_time(Kind.F, s) for s in range(n_stages)]
    backward = [costs.compute_time(Kind.I, s) + costs.compute_time(Kind.W, s) for s in range(n_stages)]
    share = [costs.compute_time(Kind.W, s) / b if b > 0 else 0.5 for s, b in enumerate(backward)]
    return {"forward": forward, "backward": backward, "weight_share": share}
