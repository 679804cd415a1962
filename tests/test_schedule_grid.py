"""`simulate` and `validate` give, on the whole grid, exactly what they gave before they were
made fast: the same timelines (every float) and the same errors, word for word."""

import json

import pytest

from schedule_grid import GOLDEN, compute


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
