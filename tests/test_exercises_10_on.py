"""The course's exercises of lessons 10 on: each notebook, run with its solution filled in, is
judged right; run with a known-wrong answer, its checker says precisely what is wrong (see
exercise_cases.py; lessons 01-09 are in test_exercises_01_to_09.py)."""

import pytest

from exercise_cases import cases, check_the_checker, exercise_kernel  # noqa: F401 (a fixture)


@pytest.mark.parametrize(**cases(10, 99))
def test_the_checker_says_what_is_right_and_what_is_wrong(exercise_kernel, stem, answer, expected):
    check_the_checker(exercise_kernel, stem, answer, expected)


def test_a_check_run_after_the_notebooks_last_cell_stopped_its_lab_says_which_cell_to_re_run(lab_factory):
    from pplab.course import exercises

    lab = lab_factory(2)
    lab.stop()  # as every lab exercise's last cell does: a learner then re-runs a check after Run All

    def forward_backward(stage, rank, tokens, targets):
        return None

    verdict = exercises.check_send_recv(lab, forward_backward)
    assert not verdict.right and "re-run the cell that starts it" in verdict.message, verdict
    assert lab.state == "stopped"  # not started behind the learner's back
