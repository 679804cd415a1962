"""The lab as a notebook uses it: its pipelines show their training live and open a dashboard.

`pplab.Lab` is this `Lab`: the session's lab (pplab.session), whose `pipeline(...)` builds a
`NotebookPipeline` (pplab.views.notebook_pipeline), a `Pipeline` with the views of this floor.
"""

from __future__ import annotations

import os
import socket
import time

from pplab.course import room
from pplab.session.drivers import ImportedOnUse
from pplab.session.drivers import Lab as _SessionLab


class Lab(_SessionLab):
    __doc__ = _SessionLab.__doc__
    # Imported when the first pipeline is built, with torch: a fresh kernel's lab starts without it.
    pipeline_class = ImportedOnUse("pplab.views.notebook_pipeline:NotebookPipeline")
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
                        gpu_memory_fraction=self.gpu_memory_fraction,
                        pids=[pid for host, pid in self.rank_processes if host == here])


def __getattr__(name: str):
    """`NotebookPipeline`, where it was defined until it moved to its own module (this one imports no
    torch, so that `pplab.Lab(...)` starts without the client importing torch): one more release."""
    from pplab.base.renames import renamed_attribute

    if renamed_attribute("pplab.views.lab", name) is None:
        raise AttributeError(f"module 'pplab.views.lab' has no attribute {name!r}")
    from pplab.views.notebook_pipeline import NotebookPipeline

    return NotebookPipeline
