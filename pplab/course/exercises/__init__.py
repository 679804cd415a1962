"""Checkers for the course's exercises (part of floor 6, course/): what is wrong, or that it is right.

Each exercise notebook (`notebooks/*exercise*.ipynb`) has a marked cell where the learner
writes one piece, and a checker cell that calls one function here. A checker never raises
for a wrong answer: it returns a `Verdict` that prints as a short report, so a notebook
with an unwritten exercise still runs top to bottom. Checkers that need ranks run the
code on a lab; a deadlock there ends within the lab's op_timeout, and the checker restarts
the lab for the next try.

    warmup_forwards(rank, n_ranks, n_microbatches)       -> check_warmup
    stage_forward(stage, x)                              -> check_stage_forward
    forward_backward(stage, rank, tokens, targets)       -> check_send_recv (on a 2-rank lab)
    train_step(module, rank, n_ranks, tokens, targets, n_microbatches)
                                                         -> check_torch_step (on a 2-rank lab)
    a schedule's text, one line per rank                 -> check_schedule (on a lab)
    clip_global_norm(parameters, max_norm)               -> check_clipping (on a 2-rank lab)
    gpipe_step_time(forward, backward, n_microbatches, latency) -> check_gpipe_time
    a pplab.models.hf.Layout for a Hugging Face family pplab does not know -> check_layout
    pack_documents(token_lists, seq_len, bos, eos)       -> check_packing
    idle_share(timeline, rank)                           -> check_idle_share
    mesh_groups(rank, pp, dp, tp)                        -> check_mesh_groups

`verdicts` holds what they share; `on_paper` the checkers that call the learner's function here,
`on_a_lab` those that run it on the ranks.
"""

from pplab.course.exercises.on_a_lab import check_clipping, check_schedule, check_send_recv, check_torch_step
from pplab.course.exercises.on_paper import (
    check_gpipe_time,
    check_idle_share,
    check_layout,
    check_mesh_groups,
    check_packing,
    check_stage_forward,
    check_warmup,
)

# (EXERCISES, NOT_WRITTEN, NOTEBOOK_OF_EXERCISE: the room's columns and the placeholder's words)
from pplab.course.exercises.verdicts import EXERCISES, NOT_WRITTEN, NOTEBOOK_OF_EXERCISE, Verdict

__all__ = ["check_stage_forward", "check_send_recv", "check_warmup", "check_torch_step", "check_clipping",
           "check_gpipe_time", "check_schedule", "check_mesh_groups", "check_layout", "check_packing",
           "check_idle_share"]
