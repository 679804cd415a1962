"""Figures to PNG bytes for `ipywidgets.Image`, and small HTML tables, shared by the panels.

A PNG in an Image widget shows in JupyterLab with no frontend extension, under
nbmake, and in exported HTML with saved widget state. Rendering is the slow part
of a live view (tens of milliseconds), so live panels redraw at most a few times
per second (`Throttle`).
"""

from __future__ import annotations

import io
import time
from typing import Iterable

from pplab.base.formatting import html_table

PNG_DPI = 90


def show_png(image, fig, dpi: int = PNG_DPI) -> None:
    """Put `fig` into an `ipywidgets.Image` at its own pixel width (front ends
    stretch it otherwise) and show it."""
    image.value = png(fig, dpi)
    image.width = str(round(fig.get_figwidth() * dpi))
    image.layout.display = None


def png(fig, dpi: int = PNG_DPI) -> bytes:
    """The figure as PNG bytes (object-API figures: nothing to close in pyplot)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def table(header: list[str], rows: Iterable[tuple[list, str]], caption: str = "") -> str:
    """A panel's HTML table; each row is (cells, CSS style of the row, e.g. 'color:#c00')."""
    rows = list(rows)
    return html_table(header, [cells for cells, _ in rows], caption, row_styles=[style for _, style in rows],
                      compact=True)


RED = "color:#c00000;font-weight:bold"
AMBER = "color:#b06000"


class Throttle:
    """Says yes at most once per `seconds` (the first time always), so redraws keep up with events.

    With a `share`, also rarely enough that drawing takes at most that share of a core: a draw that
    cost d CPU-seconds (`drawn()` is called after it) waits d / share from its start. Drawing a
    training view's pictures every second would take a large share of a core from the ranks it is
    showing (bench/bench_dashboard.py measures it).
    """

    def __init__(self, seconds: float, share: float | None = None):
        self.seconds, self.share = seconds, share
        self._last = float("-inf")
        self._draw_started = self._cost = 0.0

    def ready(self) -> bool:
        now = time.monotonic()
        wait = self.seconds if self.share is None else max(self.seconds, self._cost / self.share)
        if now - self._last >= wait:
            self._last, self._draw_started = now, time.thread_time()
            return True
        return False

    def drawn(self) -> None:
        """The draw that `ready()` allowed is done: what it cost sets the next wait (with a share)."""
        self._cost = time.thread_time() - self._draw_started
