"""Checks of the numbers a user passes in, each raising a ValueError that names the value and the fix
(the last release's names are pplab.base.renames').

Pure Python (no torch), so that every floor can use the same checks. `bool` is an
`int` in Python, but `n_ranks=True` is surely a mistake, so no check accepts it.
"""

from __future__ import annotations

import math


def check_positive_int(name: str, value: object, example: int = 4) -> int:
    """Return `value` if it is a whole number >= 1, else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be a whole number, e.g. {name}={example}")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1, e.g. {name}={example}")
    return value


def check_positive_seconds(name: str, value: object) -> float:
    """Return `value` as a float if it is a finite number of seconds > 0, else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds, e.g. {name}=30")
    return float(value)

