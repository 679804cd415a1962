"""The course's exercises: each notebook, run with its solution filled in, is judged right; run
with a known-wrong answer, its checker says precisely what is wrong.

The notebooks run in a real kernel (nbclient), their labs on real ranks, as a learner runs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXERCISES = sorted(path.stem for path in NOTEBOOKS.glob("*exercise*.ipynb"))


def solution(stem: str) -> str:
    return (NOTEBOOKS / "solutions" / f"{stem}.py").read_text()


def mistaken(stem: str, right: str, wrong: str) -> str:
    """The solution with one classic mistake made in it."""
    assert right in solution(stem), (stem, right)
    return solution(stem).replace(right, wrong)


DETACHED_EMBEDDING = mistaken("01b_exercise_stage_forward", "stage.embed_tokens(x)", "stage.embed_tokens(x).detach()")
DETACHED_INPUT = mistaken("01b_exercise_stage_forward", "    if stage.is_first:", "    if not stage.is_first:\n"
                         "        x = x.detach()\n    if stage.is_first:")
NO_FINAL_NORM = mistaken("01b_exercise_stage_forward", "stage.lm_head(stage.norm(x))", "stage.lm_head(x)")
BOTH_RECEIVE_FIRST = """
def forward_backward(stage, rank, tokens, targets):
    buffer = torch.empty(*tokens.shape, stage.config.hidden_size)
    dist.recv(buffer, src=1 - rank)  # each waits for the other: nobody sends
    return None
"""
RECEIVED_WITHOUT_GRAD = mistaken("02b_exercise_send_recv", "    x.requires_grad_()\n", "")  # x.grad stays None
WARMUP_IGNORES_MICROBATCHES = """
def warmup_forwards(rank, n_ranks, n_microbatches):
    return n_ranks - 1 - rank
"""
ALWAYS_SCALED = mistaken("08b_exercise_global_clipping", "min(1.0, max_norm / (total + 1e-6))",
                         "max_norm / (total + 1e-6)")
PER_STAGE_CLIPPING = """
def clip_global_norm(parameters, max_norm):
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm).item()  # this stage's norm only
"""
GPIPE_BY_HAND = """
my_schedule = ["0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"]
"""
DEADLOCKED_BY_HAND = """
my_schedule = ["0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3", "1F1 1B1 1F0 1B0 1F2 1B2 1F3 1B3"]
"""

# (notebook, the exercise cell's code, what its checker must say)
WRONG_ANSWERS = [
    ("01b_exercise_stage_forward", DETACHED_EMBEDDING,
     r"NOT YET .* on the first stage, embed_tokens.weight got no gradient: something in your forward detached"),
    ("01b_exercise_stage_forward", DETACHED_INPUT,
     r"NOT YET .* the middle stage's input got no gradient: your forward detached it"),
    ("01b_exercise_stage_forward", NO_FINAL_NORM,
     r"NOT YET .* the last stage's output differs .*\n.*final norm, then lm_head"),
    ("02b_exercise_send_recv", BOTH_RECEIVE_FIRST,
     r"NOT YET · send and receive, with gradients: ranks? [01].* waited 5 s for a message that never came.*\n"
     r"If both ranks receive first, neither sends: a deadlock.*\n\(The lab was restarted for your next try.\)"),
    ("02b_exercise_send_recv", RECEIVED_WITHOUT_GRAD,
     r"NOT YET .*\n(.*\n)*Something was None: a received activation has no .grad unless it requires grad"),
    ("04b_exercise_1f1b_warmup", WARMUP_IGNORES_MICROBATCHES,
     r"NOT YET .* rank 0 of 3 with 1 microbatch: you said 2, it runs 1.\nwith 1 microbatch a rank cannot run"),
    ("08b_exercise_global_clipping", PER_STAGE_CLIPPING,
     r"NOT YET .* rank 0 returned the norm [\d.]+, but the norm of all stages' gradients is [\d.]+ \(the norm "
     r"of this rank's own gradients: sum the squares on every rank, all_reduce"),
    ("08b_exercise_global_clipping", ALWAYS_SCALED,
     r"NOT YET .* with max_norm=[\d.]+ above the global norm [\d.]+ nothing may change, but the gradients were "
     r"scaled rank 0 by 2.000, rank 1 by 2.000: scale by min\(1, max_norm / norm\)"),
    ("11b_exercise_schedule_by_hand", GPIPE_BY_HAND,
     r"NOT YET .* rank 0 holds the activations of 4 microbatches at once \(after 0F3\); the limit is 2"),
    ("11b_exercise_schedule_by_hand", DEADLOCKED_BY_HAND, r"NOT YET .*deadlock"),
]


def run_exercise(stem: str, answer: str | None) -> str:
    """Run the notebook with `answer` in its exercise cell (None: as shipped); return what its
    checker cell showed."""
    notebook = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    [index] = [i for i, cell in enumerate(notebook.cells) if "exercise" in cell.metadata.get("tags", [])]
    if answer is not None:
        notebook.cells[index].source = answer
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    checker = notebook.cells[index + 1]
    return "\n".join(output.get("data", {}).get("text/plain", "") for output in checker.outputs)


def test_there_are_at_least_five_exercises_each_with_its_solution_apart():
    assert len(EXERCISES) >= 5, EXERCISES
    for stem in EXERCISES:
        solution = NOTEBOOKS / "solutions" / f"{stem}.py"
        assert solution.exists(), f"{stem} has no solution in notebooks/solutions/"
        shipped = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
        assert solution.read_text().strip() not in "\n".join(cell.source for cell in shipped.cells)


@pytest.mark.parametrize("stem", EXERCISES)
def test_the_solution_is_judged_right(stem):
    said = run_exercise(stem, solution(stem))
    assert said.startswith("RIGHT"), said


@pytest.mark.parametrize("stem, answer, expected", WRONG_ANSWERS,
                         ids=[f"{stem}-{i}" for i, (stem, _, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_is_told_what_is_wrong(stem, answer, expected):
    said = run_exercise(stem, answer)
    assert re.search(expected, said), said


@pytest.mark.parametrize("stem", ["04b_exercise_1f1b_warmup", "02b_exercise_send_recv"])
def test_an_exercise_not_yet_written_says_so_and_the_notebook_still_runs(stem):
    said = run_exercise(stem, None)  # on the lab too: the ranks' NotImplementedError is read as such
    assert "NOT YET" in said and "not written yet: replace `raise NotImplementedError`" in said, said
    assert "restarted" not in said
