"""The lab as a notebook uses it: its pipelines show their training live and open a dashboard.

`pplab.Lab` is this `Lab`: the session's lab (pplab.session), whose `pipeline(...)` builds a
`NotebookPipeline`, a `Pipeline` with the views of this floor.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from pplab.course import room
from pplab.data import Batch
from pplab.session.drivers import Lab as _SessionLab
from pplab.session.pipeline import Pipeline


class NotebookPipeline(Pipeline):
    """A pipeline on a lab's ranks, with live views: a dashboard, and training shown as it goes."""

    def dashboard(self, batch: Batch | Sequence[Batch] | None = None, stalled_after: float = 2.0):
        """A live dashboard of this pipeline (pplab.widgets.Dashboard): display it, then run steps.

        `batch`: the data of every step (default: the pipeline's); `stalled_after`: seconds a
        wait lasts before its rank shows red.
        """
        from pplab.views.widgets import Dashboard

        return Dashboard(self, batch, stalled_after)

    def training_display(self, total_steps: int, first_step: int, show: bool):
        """In a notebook a `TrainingView` (progress, loss curves, the latest step); else the session's."""
        if not (show and _in_notebook()):
            return super().training_display(total_steps, first_step, show)
        from IPython.display import display

        from pplab.views.widgets.training import TrainingView

        view = TrainingView(total_steps, first_step, rank_labels=self.rank_labels if self.mesh else None)
        display(view)
        return _RedrawnAtTheEnd(view)


class Lab(_SessionLab):
    __doc__ = _SessionLab.__doc__
    pipeline_class = NotebookPipeline
    _told_the_room = 0.0  # when this lab last wrote its record in the room (monotonic seconds)

    def _changed(self, state: str) -> None:
        """Where an instructor set PPLAB_ROOM: this lab's record in the room (pplab.course.room),
        written as it starts, restarts and stops, and while the attendee works (a call at most
        every ACTIVITY_EVERY seconds). One record per lab object, across its restarts."""
        if state == "called" and time.monotonic() - self._told_the_room <= room.ACTIVITY_EVERY:
            return
        self._told_the_room = time.monotonic()
        if room.room_folder() is None:
            return
        here = socket.gethostname()
        room.record_lab(f"{os.getpid()}-{id(self):x}", state="running" if state == "called" else state,
                        device=self.device, n_ranks=self.world_size, gpus=self.gpus,
                        pids=[pid for host, pid in self.rank_processes if host == here])


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
