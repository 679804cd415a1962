"""The course's exercises of lessons 10 on: each notebook, run with its solution filled in, is
judged right; run with a known-wrong answer, its checker says precisely what is wrong (see
exercise_cases.py; lessons 01-09 are in test_exercises_01_to_09.py)."""

import pytest

from exercise_cases import cases, check_the_checker, exercise_kernel  # noqa: F401 (a fixture)


@pytest.mark.parametrize(**cases(10, 99))
def test_the_checker_says_what_is_right_and_what_is_wrong(exercise_kernel, stem, answer, expected):
    check_the_checker(exercise_kernel, stem, answer, expected)
