"""Timelines: the event model (`pplab.timeline`), and one step of a run recorded with torch.profiler.

    from pplab.trace import Event, Timeline, from_profiler

`Event` and `Timeline` are the common language of the simulator, the runtimes, the views and the
pictures (`pplab.timeline`); `from_profiler` reads a profiled run into one (`pplab.profiled`).
"""

from pplab.profiled import from_profiler
from pplab.timeline import COLLECTIVE_KINDS, COMM_KINDS, Event, Now, Timeline

__all__ = ["Event", "Now", "Timeline", "COMM_KINDS", "COLLECTIVE_KINDS", "from_profiler"]
