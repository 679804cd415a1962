"""The pipeline a notebook's lab builds: a session `Pipeline` with live views."""

from __future__ import annotations

from collections.abc import Sequence

from pplab.base.machine import MachineLoad
from pplab.data import Batch
from pplab.session.pipeline import Pipeline


class NotebookPipeline(Pipeline):
    """A pipeline on a lab's ranks, with live views: a dashboard, and training shown as it goes."""

    def dashboard(self, batch: Batch | Sequence[Batch] | None = None, stalled_after: float = 2.0,
                  load: MachineLoad | None = None):
        """A live dashboard of this pipeline (pplab.views.widgets.Dashboard): display it, then run steps.

        `batch`: the data of every step (default: the pipeline's); `stalled_after`: seconds a
        wait lasts before its rank shows red, on a quiet machine; `load`: the
        `pplab.base.machine.measure_load()` reading to stretch it by (default: one taken at each run).
        """
        from pplab.views.widgets import Dashboard

        return Dashboard(self, batch, stalled_after, load=load)

    def training_display(self, total_steps: int, first_step: int, show: bool):
        """In a notebook a `TrainingView` (progress, loss curves, the latest step); else the session's."""
        if not (show and _in_notebook()):
            return super().training_display(total_steps, first_step, show)
        from IPython.display import display

        from pplab.views.widgets.training import TrainingView

        view = TrainingView(total_steps, first_step, rank_labels=self.rank_labels if self.mesh else None)
        display(view)
        return _RedrawnAtTheEnd(view)


def _in_notebook() -> bool:
    """True in a Jupyter kernel (where widgets show)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class _RedrawnAtTheEnd:
    """A TrainingView fed step by step, drawn once more when the training ends."""

    def __init__(self, view):
        self.view = view

    def add(self, record, timeline) -> None:
        self.view.add(record, timeline)

    def close(self) -> None:
        self.view.redraw()
