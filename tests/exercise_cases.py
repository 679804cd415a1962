"""The course's exercises as the tests work them: the known-wrong answers and what each checker
must say, the solutions, and a kernel per notebook (`exercise_kernel`).

The notebooks run in a real kernel (nbclient), their labs on real ranks, as a learner runs them.
Two test files share the exercises (test_exercises_01_to_09.py, test_exercises_10_on.py), so
that each stays within its share of the suite and the two can run on two workers at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import UnixSocketKernelManager

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXERCISES = sorted(path.stem for path in NOTEBOOKS.glob("*exercise*.ipynb"))


def solution(stem: str) -> str:
    return (NOTEBOOKS / "solutions" / f"{stem}.py").read_text()


def mistaken(stem: str, right: str, wrong: str) -> str:
    """The solution with one classic mistake made in it."""
    assert right in solution(stem), (stem, right)
    return solution(stem).replace(right, wrong)


DETACHED_EMBEDDING = mistaken("01b_exercise_stage_forward", "stage.embed_tokens(x)",
                              "stage.embed_tokens(x).detach()")
DETACHED_INPUT = mistaken("01b_exercise_stage_forward", "    if stage.is_first:", "    if not "
                         "stage.is_first:\n        x = x.detach()\n    if stage.is_first:")
NO_FINAL_NORM = mistaken("01b_exercise_stage_forward", "stage.lm_head(stage.norm(x))", "stage.lm_head(x)")
BOTH_RECEIVE_FIRST = """
def forward_backward(stage, rank, tokens, targets):
    buffer = torch.empty(*tokens.shape, stage.config.hidden_size)
    dist.recv(buffer, src=1 - rank)  # each waits for the other: nobody sends
    return None
"""
# x.grad stays None
RECEIVED_WITHOUT_GRAD = mistaken("02b_exercise_send_recv", "    x.requires_grad_()\n", "")
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
TARGETS_ON_THE_FIRST_RANK = mistaken("07b_exercise_torch_api_by_hand", "schedule.step(tokens)\n",
                                     "schedule.step(tokens, target=targets)\n").replace(
    "schedule.step(target=targets, losses=losses)", "schedule.step(losses=losses)")
LOSSES_NOT_COLLECTED = mistaken("07b_exercise_torch_api_by_hand", "return losses", "return None")
BATCH_NOT_CHECKED = mistaken("07b_exercise_torch_api_by_hand", "    if tokens.shape[0] % n_microbatches:",
                             "    if False:")
PP_FASTEST = mistaken("09b_exercise_mesh_groups", 'stride = {"pp": dp * tp, "dp": tp, "tp": 1}',
                      'stride = {"pp": 1, "dp": pp, "tp": pp * dp}')
PIPELINE_STRIDE_WITHOUT_TP = mistaken("09b_exercise_mesh_groups", '"pp": dp * tp,', '"pp": dp,')
GROUPS_WITHOUT_ITSELF = mistaken("09b_exercise_mesh_groups", "for i in range(size[dim])]",
                                 "for i in range(size[dim]) if first + i * stride[dim] != rank]")
EVEN_STAGES_FORMULA = """
def gpipe_step_time(forward, backward, n_microbatches, latency):
    return (n_microbatches + len(forward) - 1) * (forward[0] + backward[0])
"""
LATENCY_ONE_WAY = mistaken("10b_exercise_predict_gpipe", "hops = 2 * (len(forward) - 1) * latency",
                           "hops = (len(forward) - 1) * latency")
NO_ROTARY = mistaken("14b_exercise_layout_of_your_model", '    rotary="model.rotary_emb",', "")
LLAMA_NORM = mistaken("14b_exercise_layout_of_your_model", 'norm="model.final_layernorm",',
                      'norm="model.norm",')
NO_DROPOUT = mistaken("14b_exercise_layout_of_your_model", '    dropout="model.embed_dropout",', "")
ROTARY_AS_POSITIONS = mistaken("14b_exercise_layout_of_your_model", 'rotary="model.rotary_emb",',
                               'positions="model.rotary_emb",')
TARGETS_NOT_SHIFTED = mistaken("15b_exercise_pack_text", "[w[1:] for w in windows]",
                               "[w[:-1] for w in windows]")
NO_MARKERS = mistaken("15b_exercise_pack_text", "for token in (bos, *ids, eos)", "for token in ids")
WINDOWS_APART = mistaken("15b_exercise_pack_text", "stream[i * seq_len:i * seq_len + seq_len + "
                                                   "1] for i in range(rows)",
                         "stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in "
                         "range(len(stream) // (seq_len + 1))")
KEEPS_THE_TAIL = mistaken("15b_exercise_pack_text", "rows = (len(stream) - 1) // seq_len",
                          "rows = len(stream) // seq_len")
WAITS_COUNTED_BUSY = mistaken("16b_exercise_idle_from_a_trace", "if e.rank == rank and e.is_compute",
                              "if e.rank == rank")
OWN_SPAN = mistaken("16b_exercise_idle_from_a_trace", "for event in timeline.events)  # over every rank",
                    "for event in timeline.events if event.rank == rank and event.is_compute)").replace(
    "max(event.end for event in timeline.events)",
    "max(event.end for event in timeline.events if event.rank == rank and event.is_compute)")
DEADLOCKED_BY_HAND = """
my_schedule = ["0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3", "1F1 1B1 1F0 1B0 1F2 1B2 1F3 1B3"]
"""

# (notebook, the exercise cell's code, what its checker must say)
WRONG_ANSWERS = [
    ("01b_exercise_stage_forward", DETACHED_EMBEDDING,
     r"NOT YET .* on the first stage, embed_tokens.weight got no gradient: something in "
     r"your forward detached"),
    ("01b_exercise_stage_forward", DETACHED_INPUT,
     r"NOT YET .* the middle stage's input got no gradient: your forward detached it"),
    ("01b_exercise_stage_forward", NO_FINAL_NORM,
     r"NOT YET .* the last stage's output differs .*\n.*final norm, then lm_head"),
    ("02b_exercise_send_recv", BOTH_RECEIVE_FIRST,
     r"NOT YET · send and receive, with gradients: a wait gave up after the lab's op_timeout of 5 s:\n"
     r"rank 0 sent nothing, and was waiting in dist.recv\(src=1\) of a \[2, 16, 64\] tensor.*\n"
     r"rank 1 sent nothing, and was waiting in dist.recv\(src=0\) of a \[2, 16, 64\] tensor.*\n"
     r"If both ranks receive first, neither sends: a deadlock.*\n"
     r"\(The lab was restarted for your next try.\)"),
    ("02b_exercise_send_recv", RECEIVED_WITHOUT_GRAD,
     r"NOT YET .*\n(.*\n)*Something was None: a received activation has no .grad unless it requires grad"),
    ("04b_exercise_1f1b_warmup", WARMUP_IGNORES_MICROBATCHES,
     r"NOT YET .* rank 0 of 3 with 1 microbatch: you said 2, it runs 1.\n"
     r"with 1 microbatch a rank cannot run"),
    ("07b_exercise_torch_api_by_hand", TARGETS_ON_THE_FIRST_RANK,
     r"NOT YET .* the last rank stepped without its targets: torch's last stage computes the loss, so it "
     r"takes step\(target=targets, losses=losses\)"),
    ("07b_exercise_torch_api_by_hand", LOSSES_NOT_COLLECTED,
     r"NOT YET .* the last rank returned None: torch puts each microbatch's loss into the list"),
    ("07b_exercise_torch_api_by_hand", BATCH_NOT_CHECKED,
     r"NOT YET .* with n_microbatches=3 and a batch of 8, torch splits the batch 3, 3, 2 "
     r".*raise a ValueError"),
    ("08b_exercise_global_clipping", PER_STAGE_CLIPPING,
     r"NOT YET .* rank 0 returned the norm [\d.]+, but the norm of all stages' gradients is [\d.]+ \(the "
     r"norm of this rank's own gradients: sum the squares on every rank, all_reduce"),
    ("08b_exercise_global_clipping", ALWAYS_SCALED,
     r"NOT YET .* with max_norm=[\d.]+ above the global norm [\d.]+ nothing may change, but the gradients "
     r"were scaled rank 0 by 2.000, rank 1 by 2.000: scale by min\(1, max_norm / norm\)"),
    ("09b_exercise_mesh_groups", PP_FASTEST,
     r"NOT YET .* rank 0 of a mesh pp=2 x dp=2 x tp=2: .*\n"
     r"the layout is row-major over \(pp, dp, tp\): tp varies fastest"),
    ("09b_exercise_mesh_groups", PIPELINE_STRIDE_WITHOUT_TP,
     r"NOT YET .*\n"
     r"your pp group is off. Along each dimension the ranks of a group are a fixed stride apart: 4 for pp"),
    ("09b_exercise_mesh_groups", GROUPS_WITHOUT_ITSELF, r"NOT YET .*\na group includes the rank itself"),
    ("10b_exercise_predict_gpipe", EVEN_STAGES_FORMULA,
     r"NOT YET .* you said [\d.]+, the simulator [\d.]+\.\n"
     r"\(m \+ p - 1\)\(F \+ B\) holds for even stages only"),
    ("10b_exercise_predict_gpipe", LATENCY_ONE_WAY,
     r"NOT YET .* latency=0.5: .*\nthe latency is paid going forward and coming back: 2 \(p - 1\) hops"),
    ("14b_exercise_layout_of_your_model", NO_ROTARY,
     r"NOT YET .* model.rotary_emb \(PhiRotaryEmbedding\) is in no part of your layout, so no stage would "
     r"run it.*rotary position embeddings: `rotary=`"),
    ("14b_exercise_layout_of_your_model", LLAMA_NORM,
     r"NOT YET .* pplab refused it: layout norm='model.norm': 'phi' has no module there. Its modules: .*"
     r"model.final_layernorm \(LayerNorm\)"),
    ("14b_exercise_layout_of_your_model", NO_DROPOUT,
     r"NOT YET .* model.embed_dropout \(Dropout\) is in no part of your layout.*`dropout=`"),
    ("14b_exercise_layout_of_your_model", ROTARY_AS_POSITIONS,
     r"NOT YET .*\n`positions=` is for learned position embeddings added once, on the first stage"),
    ("15b_exercise_pack_text", TARGETS_NOT_SHIFTED,
     r"NOT YET .*\nthe targets are the inputs themselves: each position must predict the NEXT token"),
    ("15b_exercise_pack_text", NO_MARKERS,
     r"NOT YET .*\nthe documents run into each other: join each as <bos> ids <eos>"),
    ("15b_exercise_pack_text", WINDOWS_APART,
     r"NOT YET .*\nyour windows do not overlap: each window is seq_len \+ 1"),
    ("15b_exercise_pack_text", KEEPS_THE_TAIL,
     r"NOT YET .*\n"
     r"every row must be seq_len = \d+ tokens long; yours are \[\d+, \d+\] long \(keep whole windows only"),
    ("16b_exercise_idle_from_a_trace", WAITS_COUNTED_BUSY,
     r"NOT YET .* your timeline 1, rank \d: you said [\d.]+, it is [\d.]+\.\n"
     r"a rank waiting in a receive is idle"),
    ("16b_exercise_idle_from_a_trace", OWN_SPAN,
     r"NOT YET .* rank \d: you said [\d.]+, it is [\d.]+\.\nmeasure against the whole step"),
    ("11b_exercise_schedule_by_hand", GPIPE_BY_HAND,
     r"NOT YET .* rank 0 holds the activations of 4 microbatches at once \(after 0F3\); the limit is 2"),
    ("11b_exercise_schedule_by_hand", DEADLOCKED_BY_HAND, r"NOT YET .*deadlock"),
]


class ExerciseKernel:
    """One exercise notebook in one kernel, as a learner works it: the cells up to the exercise
    run once, then each answer goes into the exercise cell and its checker runs again."""

    def __init__(self, stem: str):
        self.stem = stem
        self.notebook = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
        [self.index] = [i for i, cell in enumerate(self.notebook.cells)
                        if "exercise" in cell.metadata.get("tags", [])]
        self.client = NotebookClient(self.notebook, timeout=300, kernel_name="python3",
                                     kernel_manager_class=UnixSocketKernelManager,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})

    def run_cells(self, cells: range) -> None:
        for index in cells:
            self.client.execute_cell(self.notebook.cells[index], index)

    def answer(self, code: str) -> str:
        """Put `code` in the exercise cell, run it and its checker; return what the checker showed."""
        self.notebook.cells[self.index].source = code
        self.run_cells(range(self.index, self.index + 2))
        checker = self.notebook.cells[self.index + 1]
        return "\n".join(output.get("data", {}).get("text/plain", "") for output in checker.outputs)

    def __enter__(self) -> "ExerciseKernel":
        self._kernel = self.client.setup_kernel()
        self._kernel.__enter__()
        try:
            self.run_cells(range(self.index))
            self.shipped = self.answer(self.notebook.cells[self.index].source)  # the cell as shipped
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, *failure) -> None:
        try:
            if failure[0] is None:  # the notebook's last cells stop its lab
                self.run_cells(range(self.index + 2, len(self.notebook.cells)))
        finally:
            self._kernel.__exit__(*failure)  # shuts the kernel down


@pytest.fixture(scope="module")
def exercise_kernel():
    """`exercise_kernel(stem)`: that notebook's kernel, run up to its exercise. One is open at a
    time: asking for another notebook finishes the previous one (its last cells stop its lab)."""
    current: list[ExerciseKernel] = []

    def kernel_for(stem: str) -> ExerciseKernel:
        if current and current[0].stem != stem:
            current.pop().__exit__(None, None, None)
        if not current:
            current.append(ExerciseKernel(stem).__enter__())
        return current[0]

    yield kernel_for
    if current:
        current.pop().__exit__(None, None, None)


# What each checker must say, in the order a learner meets it in one kernel: the cell as shipped
# (for some), the wrong answers (a deadlock among them restarts the lab), then the solution.
NOT_YET = r"NOT YET(.*\n)*.*not written yet: replace `raise NotImplementedError`"
CASES = [(stem, f"{stem}-as-shipped", None, NOT_YET.replace("`raise NotImplementedError`", shipped))
         for stem, shipped in (("02b_exercise_send_recv", "`raise NotImplementedError`"),
                               ("04b_exercise_1f1b_warmup", "`raise NotImplementedError`"),
                               ("14b_exercise_layout_of_your_model", "each `...`"))]
CASES += [(stem, f"{stem}-wrong-{i}", answer, expected)
          for i, (stem, answer, expected) in enumerate(WRONG_ANSWERS)]
CASES += [(stem, f"{stem}-solution", solution(stem), r"^RIGHT") for stem in EXERCISES]
# Run All after a wrong answer runs the cells below the check too (a cleanup among them): a check
# run again afterwards must still find what it needs.
RUN_ALL = "run all first"
CASES += [(stem, f"{stem}-solution-after-run-all", (RUN_ALL, solution(stem)), r"^RIGHT")
          for stem in ("14b_exercise_layout_of_your_model",)]
CASES.sort(key=lambda case: case[0])  # stable: each notebook's cases together, in the order above


def cases(first_lesson: int, last_lesson: int) -> dict:
    """`pytest.mark.parametrize`'s arguments for the cases of the lessons' exercises in [first, last]."""
    chosen = [case for case in CASES if first_lesson <= int(case[0][:2]) <= last_lesson]
    return {"argnames": "stem, answer, expected", "argvalues": [case[:1] + case[2:] for case in chosen],
            "ids": [case[1] for case in chosen]}


def check_the_checker(exercise_kernel, stem, answer, expected) -> None:
    """The checker of `stem`'s exercise, given `answer` (None: the cell as shipped), says `expected`."""
    exercise = exercise_kernel(stem)
    if isinstance(answer, tuple):  # (RUN_ALL, answer): the notebook's last cells run before the answer
        exercise.run_cells(range(exercise.index + 2, len(exercise.notebook.cells)))
        answer = answer[1]
    said = exercise.shipped if answer is None else exercise.answer(answer)
    assert re.search(expected, said), said
    assert "_on_rank" not in said, said  # the checker's own functions are not the learner's business
    if answer is None:  # on the lab too: the ranks' NotImplementedError is read as such, no restart
        assert "restarted" not in said, said
