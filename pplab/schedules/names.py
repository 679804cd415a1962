"""Schedule names: one canonical name per schedule, and every spelling of it a user may type.

The canonical names are kebab-case: pplab builds "gpipe", "1f1b", "interleaved-1f1b" and
"zb-h1"; torch.distributed.pipelining also runs "looped-bfs", "interleaved-zero-bubble",
"zbv-zero-bubble" and "dualpipev". `schedule_name` reads any case, with "-", "_" or nothing
between the words and an optional "Schedule" prefix, so torch's class names
("ScheduleInterleaved1F1B", "ZBVZeroBubble") and seed-style names ("interleaved_1f1b") all
name the same schedule. Every entry point (`build`, `from_torch`, a pipeline's `schedule=`,
the command line, the widgets, the search) reads a name through it and shows the canonical one.
"""

from __future__ import annotations

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")  # pplab's builders make these
TORCH_ONLY_NAMES = ("looped-bfs", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")
ALL_SCHEDULE_NAMES = SCHEDULE_NAMES + TORCH_ONLY_NAMES  # in the order listings show them


def _squashed(spelling: str) -> str:
    """The spelling without case, separators or torch's class prefix: what every spelling shares."""
    squashed = spelling.lower().replace("-", "").replace("_", "")
    return squashed.removeprefix("schedule")


_CANONICAL = {_squashed(name): name for name in ALL_SCHEDULE_NAMES}


def schedule_name(spelling: str) -> str:
    """The canonical name of the schedule `spelling` names ("Interleaved1F1B" -> "interleaved-1f1b")."""
    if not isinstance(spelling, str) or _squashed(spelling) not in _CANONICAL:
        raise ValueError(f"unknown schedule {spelling!r}: known schedules are "
                         f"{', '.join(ALL_SCHEDULE_NAMES)} (any case; '-', '_' or nothing between words)")
    return _CANONICAL[_squashed(spelling)]
