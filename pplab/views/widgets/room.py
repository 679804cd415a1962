"""The instructor's view of the room in a notebook: every attendee's lab and exercise verdicts, kept fresh.

What it shows is what the attendees' labs and checkers wrote to the room's folder (`pplab.course.room`);
`pplab room FOLDER` serves the same table as a page on loopback.
"""

from __future__ import annotations

import asyncio
import html

import ipywidgets as widgets

from pplab.course import room


class RoomView(widgets.VBox):
    """A table of the room (`folder`: the PPLAB_ROOM the attendees have), re-read every `refresh` seconds."""

    def __init__(self, folder, refresh: float = 2.0, exercises: list[str] | dict[str, str] | None = None):
        """`exercises`: the columns (names, or names mapped to headings; default: the course's, headed by
        their notebooks' ids)."""
        from pplab.base.arguments import check_positive_seconds
        from pplab.course.exercises import NOTEBOOK_OF_EXERCISE

        self.folder, self.refresh_seconds = folder, check_positive_seconds("refresh", refresh)
        self.exercises = NOTEBOOK_OF_EXERCISE if exercises is None else exercises
        self.seats: list[room.Seat] = []
        self.table = widgets.HTML()
        self.summary = widgets.HTML()
        super().__init__([self.summary, self.table])
        self.refresh()  # a folder that does not exist is said here, at once
        try:  # in a notebook the kernel's loop runs: follow the room on it, leaving the kernel free
            self._task = asyncio.get_running_loop().create_task(self._follow())
        except RuntimeError:  # a plain script: call refresh() to look again
            self._task = None

    def refresh(self) -> None:
        """Read the room's folder again and redraw."""
        from pplab.course.room_page import room_notes_html

        reading = room.inspect_room(self.folder)
        self.seats = reading.seats
        self.table.value = (room.TABLE_STYLE + room.room_table_html(self.seats, self.exercises)
                            + room_notes_html(reading))
        columns = self.exercises if isinstance(self.exercises, dict) else None
        attendees, rest = room.room_summary(self.seats, columns=columns).split(":", 1)
        self.summary.value = f"<b>{attendees}</b>:{rest}"

    def stop(self) -> None:
        """Stop re-reading the folder."""
        if self._task is not None:
            self._task.cancel()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                self.refresh()
            except Exception as error:  # noqa: BLE001 - say it and keep following: the room goes on
                self.summary.value = f"<span style='color:#c00000'>{html.escape(str(error))}</span>"

