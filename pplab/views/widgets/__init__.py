"""Live views of a pipeline in a notebook (part of floor 7, views/): ipywidgets and matplotlib.

`Dashboard(pipe)` (or `pipe.dashboard()`) follows a lab pipeline while its ranks
work. Each panel also works alone, on static or simulated timelines:
`TimelineView`, `BubblesView`, `ShapesView`, `GradientsView`, `MemoryView`,
`WhereView`, `WhatIf`, the simulator under sliders, and `TrainingView`, a training run's
progress, loss curves and latest step. `RoomView(folder)` is an instructor's: every attendee's
lab and exercise verdicts (pplab.course.room).
"""

from pplab.views.widgets.dashboard import Dashboard
from pplab.views.widgets.panels import (
    BubblesView,
    GradientsView,
    MemoryView,
    ShapesView,
    TimelineView,
    WhereView,
)
from pplab.views.widgets.room import RoomView
from pplab.views.widgets.training import TrainingView
from pplab.views.widgets.whatif import WhatIf

__all__ = ["Dashboard", "WhatIf", "TimelineView", "RoomView"]
