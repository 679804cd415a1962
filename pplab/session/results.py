"""What a pipeline's calls bring back, put together on the client: one step's result from the
ranks' reports (`merge_steps`), and the table of what each rank holds (`MemoryTable`).

The ranks send a `RankStep` each (pplab.rank.runtime); nothing here runs on a rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pplab.base.formatting import ShownAsText, format_bytes, html_table, text_table
from pplab.rank.runtime import Boundary, RankStep
from pplab.trace.timeline import Timeline

__all__ = ["StepResult", "merge_steps", "MemoryTable"]


@dataclass
class StepResult:
    """One pipeline step seen from the client: loss, timeline, boundary shapes, gradients."""

    loss: float
    microbatch_losses: list[float]  # by microbatch index
    timeline: Timeline
    boundary_shapes: list[Boundary]  # what crossed each stage boundary, by (boundary, microbatch)
    grad_stats: dict[str, dict]
    grads: dict[str, torch.Tensor] | None = None
    rank_steps: list[RankStep] = field(default_factory=list, repr=False)

    @property
    def timed_on(self) -> str:
        """"device" when every rank's events are the GPU's own times (real mode on CUDA), else "host"."""
        on = {step.timed_on for step in self.rank_steps}
        return "device" if on == {"device"} else "host"

    @property
    def device_memory(self) -> dict[int, dict[str, int]] | None:
        """On GPUs, per rank: the step's peak of allocated bytes and the bytes reserved (None on CPU)."""
        held = {step.rank: step.device_memory for step in self.rank_steps if step.device_memory is not None}
        return held or None


def merge_steps(rank_steps: Sequence[RankStep], label: str = "measured") -> StepResult:
    """Combine the ranks' reports (ordered by rank) into one StepResult."""
    losses = {}
    for rank_step in rank_steps:
        losses.update(rank_step.losses_by_microbatch)
    ordered = [losses[mb] for mb in sorted(losses)]
    grad_stats, grads = {}, {}
    for rank_step in rank_steps:
        grad_stats.update(rank_step.grad_stats)
        grads.update(rank_step.grads or {})
    if rank_steps and all(step.timed_on == "device" for step in rank_steps):
        label = f"{label} (device times)"
    timeline = Timeline([e for r in rank_steps for e in r.events], n_ranks=len(rank_steps), label=label)
    # On a mesh, the TP ranks of a stage send the same activations: each boundary counts once.
    unique = {(b.source, b.microbatch): b for r in rank_steps for b in r.boundary_shapes}
    boundary_shapes = [unique[key] for key in sorted(unique)]
    return StepResult(sum(ordered) / len(ordered), ordered, timeline, boundary_shapes, grad_stats,
                      grads or None, list(rank_steps))


class MemoryTable(ShownAsText):
    """Per rank: what it holds (parameters, gradients, AdamW state) against the same stage unsharded."""

    def __init__(self, rows: list[dict], labels: list[str]):
        self.rows, self.labels = rows, labels

    def held(self, rank: int) -> int:
        """Bytes of parameters, gradients and optimizer state rank `rank` holds."""
        row = self.rows[rank]
        return row["parameters"] + row["gradients"] + row["optimizer"]

    def unsharded(self, rank: int) -> int:
        """What the rank would hold with its stages unsharded: parameters and gradients, and
        AdamW's two moments per parameter (all as large as the parameters)."""
        return 4 * self.rows[rank]["unsharded_parameters"]

    def table(self) -> list[list[str]]:
        """One row of text per rank."""
        return [[self.labels[r], *map(format_bytes, (row["parameters"], row["gradients"], row["optimizer"],
                                                      self.held(r), self.unsharded(r))),
                 f"{self.held(r) / self.unsharded(r):.0%}" if self.unsharded(r) else "-"]
                for r, row in enumerate(self.rows)]

    HEADER = ["rank", "parameters", "gradients", "optimizer", "held", "unsharded", "held / unsharded"]

    def __str__(self) -> str:
        return text_table(self.HEADER, self.table(), right=True)

    def _repr_html_(self) -> str:
        return html_table(self.HEADER, self.table(), "bytes each rank holds for its stages (parameters, "
                          "gradients, AdamW state) vs the same stages unsharded")
