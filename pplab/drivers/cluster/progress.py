"""A lab's start as its user sees it (part of floor 4, drivers/): a progress bar in a notebook, one
line updated in place elsewhere, and the final line that stays."""

from __future__ import annotations

import sys
import time


class Progress:
    """The start's progress: a bar with a status line in a notebook, one line updated in place elsewhere.

    Either way the final line ("lab ready: ...") stays, once: in a notebook it replaces
    the bar, as plain text, so saved notebooks keep it too.
    """

    def __init__(self, verbose: bool, phases: int = 0):
        self.verbose = verbose
        self.started = time.perf_counter()
        self._width = 0
        self._last_text = None
        # The bar advances one notch per distinct status (starting, each engine up, ranks,
        # process group), so `phases` is roughly how many of those a start goes through.
        self._bar, self._display = _notebook_progress_bar(phases) if verbose and phases else (None, None)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def update(self, text: str) -> None:
        if text != self._last_text:  # called in polling loops: show changes only
            self._last_text = text
            line = f"pplab: {text} ({self.elapsed():.1f} s)"
            if self._bar is not None:
                bar, label = self._bar.children
                bar.value = min(bar.value + 1, bar.max - 1)
                label.value = line
            else:
                self._print(line, end="")

    def finish(self, text: str) -> None:
        line = f"pplab: {text} in {self.elapsed():.1f} s"
        if self._bar is not None:  # the bar's place takes the final line, as plain text
            from IPython.display import Pretty

            self._display.update(Pretty(line))
            self._bar.close()
        else:
            self._print(line, end="\n")

    def _print(self, line: str, end: str) -> None:
        if self.verbose:
            print("\r" + line.ljust(self._width), end=end, flush=True)
            self._width = 0 if end == "\n" else len(line)


def _notebook_progress_bar(phases: int):
    """(progress bar and label, their display handle) when running in a Jupyter kernel, else (None, None)."""
    if "ipykernel" not in sys.modules:  # not in a kernel: no widget front end to show it
        return None, None
    from ipykernel.zmqshell import ZMQInteractiveShell
    from IPython import get_ipython

    if not isinstance(get_ipython(), ZMQInteractiveShell):
        return None, None
    import ipywidgets as widgets
    from IPython.display import display

    box = widgets.HBox([widgets.IntProgress(0, min=0, max=phases), widgets.Label()])
    return box, display(box, display_id=True)
