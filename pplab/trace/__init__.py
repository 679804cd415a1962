"""Floor 1, timelines: `timeline` (the event model: what every rank did and when, on one clock),
`profiled` (runs recorded with torch.profiler, read back), and here the reader of real runs:
one step recorded with torch.profiler, read into the event model.

    from pplab.trace import from_profiler

`pplab.Event` and `pplab.Timeline` (the event model, defined in `pplab.trace.timeline`) are the common
language of the simulator, the runtimes, the views and the pictures; `from_profiler` reads a
profiled run into a `Timeline`, `read_profiler_traces` into an `ImportedRun` (the ranks' traces, what
was read and how: `pplab.trace.profiled`, public as `pplab.profiled` until this release). `COMM_EVENT_KINDS`
are the kinds of an event
that communicates (a schedule's messages and the mesh's collectives), `COLLECTIVE_KINDS` the
collectives alone; `Now` marks what a rank is doing at the moment of a live view.
"""

from pplab.trace.flight_recorder import read_flight_recorder
from pplab.trace.profiled import ImportedRun, TraceImportError, from_profiler, read_profiler_traces
from pplab.trace.timeline import COLLECTIVE_KINDS, COMM_EVENT_KINDS, Now

__all__ = ["from_profiler", "read_profiler_traces", "TraceImportError", "read_flight_recorder"]

def __getattr__(name: str):
    """The last release's names (pplab.base.renames): Event and Timeline have one path now, the top
    level's; COMM_KINDS is COMM_EVENT_KINDS."""
    from pplab.base.renames import renamed_attribute

    row = renamed_attribute("pplab.trace", name)
    if row is None:
        raise AttributeError(f"module 'pplab.trace' has no attribute {name!r}")
    from pplab.trace import timeline

    return getattr(timeline, row.new.rsplit(".", 1)[1])
