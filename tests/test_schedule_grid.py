"""`simulate` and `validate` give, on the whole grid, exactly what they gave before they were
made fast: the same timelines (every float) and the same errors, word for word."""

import json

import pytest

from schedule_grid import GOLDEN, compute

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)


@pytest.fixture(scope="module")
def now():
    return compute()


@pytest.fixture(scope="module")
def before():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("part", ["simulate", "validate"])
def test_same_results_as_before_on_the_whole_grid(now, before, part):
    assert now[part].keys() == before[part].keys()
    differ = [key for key in before[part] if now[part][key] != before[part][key]]
    assert not differ, f"{len(differ)} of {len(before[part])} differ, e.g. {differ[:3]}: " \
                       f"{[(now[part][k], before[part][k]) for k in differ[:2]]}"


def test_the_fast_verdict_is_the_readable_one_on_every_grid_schedule():
    """`validate` trusts its integer-form verdict (`_sound`) when it says sound: it must say so
    for every sound schedule that has an integer form and for no broken one. (Schedules that
    mix B and I/W on a stage, as DualPipeV does, have none and take the readable path.)"""
    from pplab.schedules.compiled import compile_schedule
    from pplab.schedules.validation import _sound
    from schedule_grid import broken_variants, schedules, verdict

    checked = 0
    for _, schedule in schedules():
        for variant in (schedule, schedule.compute_only(), *(b for _, b in broken_variants(schedule))):
            compiled = compile_schedule(variant)
            if compiled is not None:
                assert _sound(compiled) == (verdict(variant) == "valid"), variant
                checked += 1
    assert checked > 3000
