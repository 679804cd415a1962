"""Checks of the numbers a user passes in, each raising a ValueError that names the value and the fix;
and the keywords the last release named differently, still accepted for one release.

Pure Python (no torch), so that every floor can use the same checks. `bool` is an
`int` in Python, but `n_ranks=True` is surely a mistake, so no check accepts it.
"""

from __future__ import annotations

import functools
import math
import warnings

# Seconds ONE wait between ranks (joining the group, a collective, a P2P op) may take unless the
# user says otherwise: every driver, pipeline and runtime starts from this one number. Roomy, for
# a workshop server's busy cores; a fault demo passes a short one.
OP_TIMEOUT = 60.0


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


def renamed_keywords(**new_names: str):
    """Decorate a function whose keywords were renamed (`@renamed_keywords(ranks="n_ranks")`): the
    last release's name still works, for one release, with a DeprecationWarning naming the new one."""
    def decorate(function):
        @functools.wraps(function)
        def accepting_old_names(*args, **kwargs):
            for old, new in new_names.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{function.__qualname__}() got {old}= and {new}=: {old} is the last "
                                    f"release's name of {new}; pass {new}= alone")
                warnings.warn(f"{function.__qualname__}({old}=...) is now {new}=...; {old}= works until "
                              f"the next release", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return accepting_old_names
    return decorate


def warn_renamed(module: str, old: str, new: str) -> None:
    """Say that `module.old` is the last release's name of `module.new` (from a module's __getattr__)."""
    warnings.warn(f"{module}.{old} is now {module}.{new}; {old} works until the next release",
                  DeprecationWarning, stacklevel=3)


def warn_moved(old: str, new: str, why: str = "", stacklevel: int = 3) -> None:
    """Say that the public name `old` (a full path) is the last release's, and `new` the one to use
    now, elsewhere (from a module's __getattr__: `stacklevel` finds the user's line); `why` in a
    few words, if the move needs one."""
    warnings.warn(f"{old} is now {new}{f' ({why})' if why else ''}; {old} works until the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def moved_up(module: str, name: str, home: str, new: str):
    """`module.name`, a public name that moved to a higher floor (`home`; public as `new`): found there by
    name, so that the lower floor does not import the higher one, with a DeprecationWarning naming `new`."""
    import importlib

    warn_moved(f"{module}.{name}", new, stacklevel=4)  # the user's line, past the module's __getattr__
    return getattr(importlib.import_module(home), name)
