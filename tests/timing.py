"""How long "at once" may take in a test: bounds that hold on a busy machine.

A test that times pplab (a refusal comes within seconds, a stalled rank is named within its
timeout) asserts a behaviour: that nothing waited for a timeout it should not have. What the
work itself takes depends on what else runs (the suite shares 2 cores, beside other work), so
the bound is a quiet machine's, stretched by the slowdown `pplab.base.machine` reads before, during and
after the block (the largest). SLACK is what "at once" may take on a quiet machine: well below every
length it tells apart (a lab's start, a call's own timeout, a wait that never ends).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pplab.base.machine import LoadWatch, measure_load

SLACK = 5.0


def slack(seconds: float = SLACK) -> float:
    """`seconds` at a quiet machine's pace, stretched by the slowdown read now (after the work
    it bounds: a machine busy during it is usually busy still)."""
    return measure_load().scale(seconds)


@contextmanager
def within(seconds: float = SLACK, *, plus: float = 0.0):
    """Assert that the block took under `plus` + `seconds` at this machine's pace: `plus` is a
    timeout's or a grace's own seconds, which pass the same at any load."""
    before = measure_load()
    started = time.monotonic()
    with LoadWatch() as during:
        yield
    elapsed = time.monotonic() - started
    after = measure_load()
    slowdown = max(before.slowdown, during.slowdown, after.slowdown)
    assert elapsed < plus + seconds * slowdown, (
        f"took {elapsed:.1f} s, over {plus:g} + {seconds:g} s x {slowdown:.1f} (this machine's slowdown; "
        f"now {after.describe()})")
