"""The room collected: one row per seat and exercise, for an instructor who grades or reviews.

The columns an nbgrader gradebook export has where they fit (`assignment` is the exercise's
notebook, `student_id` the seat, `score` of `max_score` 1 for an exercise right now), then what
only the room knows: how many tries, when the first right answer came and how long after the
first try, and the checker's last message.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Mapping, Sequence

from pplab.course.room import Seat

COLUMNS = ["assignment", "exercise", "student_id", "timestamp", "raw_score", "score", "max_score", "tries",
           "first_right", "seconds_to_right", "last_message"]


def grade_rows(seats: Sequence[Seat], exercises: Mapping[str, str] | Sequence[str] = ()) -> list[dict]:
    """A row per seat and exercise (`exercises`: every column to report, mapped to its notebook's id,
    as `room_table_html` takes them; an exercise someone tried is reported too)."""
    notebooks = dict(exercises) if isinstance(exercises, Mapping) else {name: name for name in exercises}
    names = list(dict.fromkeys([*notebooks, *(name for seat in seats for name in seat.attempts)]))
    rows = []
    for seat in seats:
        for name in names:
            tries = seat.attempts.get(name, [])
            first_right = next((verdict["time"] for verdict in tries if verdict["right"]), None)
            right_now = bool(tries) and tries[-1]["right"]
            rows.append({"assignment": notebooks.get(name, name), "exercise": name,
                         "student_id": seat.attendee,
                         "timestamp": _when(tries[-1]["time"]) if tries else "",
                         "raw_score": int(right_now), "score": int(right_now), "max_score": 1,
                         "tries": len(tries),
                         "first_right": _when(first_right),
                         "seconds_to_right": ("" if first_right is None
                                              else round(first_right - tries[0]["time"], 1)),
                         "last_message": tries[-1]["reason"] if tries else ""})
    return rows


def grades_csv(seats: Sequence[Seat], exercises: Mapping[str, str] | Sequence[str] = ()) -> str:
    """`grade_rows` as CSV text, with a header line."""
    text = io.StringIO()
    writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(grade_rows(seats, exercises))
    return text.getvalue()


def _when(seconds: float | None) -> str:
    """An ISO time in UTC ('2026-12-07 09:41:05 UTC'), as nbgrader writes its timestamps; '' for None."""
    return "" if seconds is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
