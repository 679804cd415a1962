"""The course's exercises of lessons 01-09: each notebook, run with its solution filled in, is
judged right; run with a known-wrong answer, its checker says precisely what is wrong (see
exercise_cases.py; lessons 10 on are in test_exercises_10_on.py)."""

import nbformat
import pytest

from exercise_cases import EXERCISES, NOTEBOOKS, cases, check_the_checker, exercise_kernel  # noqa: F401 (a fixture)


def test_there_are_at_least_eight_exercises_each_with_its_solution_apart():
    assert len(EXERCISES) >= 8, EXERCISES
    for stem in EXERCISES:
        solution = NOTEBOOKS / "solutions" / f"{stem}.py"
        assert solution.exists(), f"{stem} has no solution in notebooks/solutions/"
        shipped = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
        assert solution.read_text().strip() not in "\n".join(cell.source for cell in shipped.cells)


@pytest.mark.parametrize(**cases(0, 9))
def test_the_checker_says_what_is_right_and_what_is_wrong(exercise_kernel, stem, answer, expected):
    check_the_checker(exercise_kernel, stem, answer, expected)
