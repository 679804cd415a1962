"""What every checker returns and the few rules they share: a `Verdict`, the room it is reported
to, how a learner's number and a learner's error are read."""

from __future__ import annotations

import functools
import html
import math
import traceback
from dataclasses import dataclass

from pplab.course import room

NOT_WRITTEN = "not written yet: replace `raise NotImplementedError` in the exercise cell with your code"


@dataclass(frozen=True)
class Verdict:
    """What a checker found: right or not, and what to do about it."""

    exercise: str
    right: bool
    message: str

    def __bool__(self) -> bool:
        return self.right

    def __str__(self) -> str:
        return f"{'RIGHT' if self.right else 'NOT YET'} · {self.exercise}: {self.message}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour, mark = ("#1a7f37", "✔ right") if self.right else ("#c00000", "✘ not yet")
        lines = "<br>".join(html.escape(line) for line in self.message.splitlines())
        return (f"<div style='border-left:4px solid {colour};padding:4px 10px'>"
                f"<b style='color:{colour}'>{mark}</b> · {html.escape(self.exercise)}<br>{lines}</div>")


# The exercises in the course's order, by the names their verdicts carry, with their notebooks' ids
# (the room's columns).
NOTEBOOK_OF_EXERCISE = {"a stage's forward": "01b", "send and receive, with gradients": "02b",
                        "the 1F1B warm-up": "04b", "torch's API by hand": "07b",
                        "global-norm clipping": "08b",
                        "a mesh's groups": "09b", "a GPipe step's time": "10b", "a schedule by hand": "11b",
                        "a layout for your own model": "14b", "text packed into sequences": "15b",
                        "a rank's idle share from a trace": "16b"}
EXERCISES = list(NOTEBOOK_OF_EXERCISE)


def reported(check):
    """A checker whose verdict also goes to the instructor's room
    (`pplab.course.room`), where there is one."""
    @functools.wraps(check)
    def checked(*args, **kwargs) -> Verdict:
        verdict = check(*args, **kwargs)
        room.record_verdict(verdict.exercise, verdict.right, verdict.message)
        return verdict
    return checked


def as_number(given) -> float | None:
    """The learner's number as a float (numpy and 0-d torch scalars too); None for anything else,
    bools included (True is not a step time)."""
    if isinstance(given, (bool, str, bytes)):
        return None
    try:
        return float(given)
    except (TypeError, ValueError):
        return None


def close_to(given: float | None, expected: float) -> bool:
    """Equal to rounding (NaN is never close to anything)."""
    return given is not None and math.isclose(given, expected, rel_tol=1e-6, abs_tol=1e-9)


def needs_two_ranks(exercise: str, lab) -> Verdict:
    return Verdict(exercise, False, f"this exercise runs on 2 ranks; the lab has {lab.world_size}: start it "
                                    "with pplab.Lab(n_ranks=2)")


def learner_raised(exercise: str, error: BaseException, hint: str = "") -> Verdict:
    """A verdict for learner code that raised: where, what, and a hint if one fits."""
    if isinstance(error, NotImplementedError):
        return Verdict(exercise, False, NOT_WRITTEN)
    last = traceback.format_exception_only(type(error), error)[-1].strip()
    return Verdict(exercise, False, f"your code raised {last}" + (f"\n{hint}" if hint else ""))
