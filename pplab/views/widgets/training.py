"""A training run, live: progress, loss curves and the latest step's timeline on every rank
(on a mesh, every rank of every pipeline, labelled with its coordinates, collectives included).

`TrainingView` is what `Pipeline.train(...)` displays in a notebook. It takes the
records the ranks publish while they train (`add`), keeps them in plain attributes
(`records`, `timeline`), and redraws its pictures at most once per `redraw_seconds`, and rarely
enough that drawing takes at most a tenth of a core (DRAW_SHARE); the progress bar and the
numbers follow every step.
"""

from __future__ import annotations

import ipywidgets as widgets

from pplab.trace.timeline import Timeline
from pplab.views.widgets.panels import TimelineView, _image
from pplab.views.widgets.render import Throttle, show_png

DRAW_SHARE = 0.1  # of a core, at most, for the pictures: the ranks being shown need the cores


class TrainingView(widgets.VBox):
    """Progress bar, loss and held-out loss over steps, and the timeline of the latest step."""

    def __init__(self, total_steps: int, first_step: int = 0, redraw_seconds: float = 1.0,
                 rank_labels: list[str] | None = None):
        """`rank_labels`: the rows' names (on a mesh, each rank's coordinates: pipe.rank_labels)."""
        self.progress = widgets.IntProgress(value=first_step, min=0, max=total_steps, description="training",
                                            layout=widgets.Layout(width="40%"))
        self.status = widgets.HTML()
        self.curves = _image()
        self.steps = TimelineView(rank_labels=rank_labels)
        self.records: list = []
        self.timeline: Timeline | None = None
        self.draws = 0
        self._throttle = Throttle(redraw_seconds, share=DRAW_SHARE)
        super().__init__([widgets.HBox([self.progress, self.status]), self.curves, self.steps])

    def add(self, record, timeline: Timeline | None = None) -> None:
        """One finished step (a TrainRecord) and, when the ranks sent it, that step's timeline."""
        self.records.append(record)
        if timeline is not None:
            self.timeline = timeline
        self.progress.value = record.step
        if self._throttle.ready():
            self.redraw()
            self._throttle.drawn()
        else:
            self._show_numbers()

    def redraw(self) -> None:
        """Draw what has arrived (also called once at the end, so the last step is shown)."""
        if not self.records:
            return
        from pplab.views import viz

        self._show_numbers()
        show_png(self.curves, viz.plot_training(self.records))
        if self.timeline is not None:
            self.steps.show(self.timeline)
        self.draws += 1

    def _show_numbers(self) -> None:
        """The line beside the progress bar: cheap, so it follows every step."""
        last = self.records[-1]
        held_out = [r.eval_loss for r in self.records if r.eval_loss is not None]
        self.status.value = (f"step {last.step}/{self.progress.max} · loss {last.loss:.3f}"
                             + (f" · held-out {held_out[-1]:.3f}" if held_out else "")
                             + f" · lr {last.lr:.1e} · grad norm {last.grad_norm:.2f} · "
                             f"{last.seconds * 1000:.0f} ms/step")
