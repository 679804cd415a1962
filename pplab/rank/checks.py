"""Checks that a pipeline computed what one device computes, and that gradients flow.

Each check returns a report with `passed`, the offending names when it fails,
a plain-text `__str__` for terminals and a `_repr_html_` table for notebooks.
`gradient_stats` (what `check_gradient_flow` reads) is here too, for stages run by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pplab.base.formatting import ShownAsText, html_table, text_table
from pplab.rank.gradients import gradient_stats
from pplab.rank.reference import ReferenceResult
from pplab.rank.runtime import Boundary

__all__ = ["check_gradient_flow", "compare_with_reference", "gradient_stats"]


# --- gradient flow -------------------------------------------------------------------------


@dataclass(repr=False)
class GradientFlowReport(ShownAsText):
    """Which parameters got a finite, not-all-zero gradient, and which did not (and why)."""

    failures: dict[str, str]
    checked: int
    norms: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every parameter's gradient is present, finite and not all zero."""
        return not self.failures and self.checked > 0

    def __str__(self) -> str:
        if self.passed:
            return f"gradient flow: all {self.checked} parameters have finite, non-zero gradients"
        lines = [f"gradient flow FAILED for {len(self.failures)} of {self.checked} parameters:"]
        lines += [f"  {name}: {why}" for name, why in sorted(self.failures.items())]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [[name, f"{self.norms.get(name, 0.0):.3e}", self.failures.get(name, "ok")]
                for name in sorted(self.norms)]
        return html_table(["parameter", "grad norm", "status"], rows, str(self).splitlines()[0])


def check_gradient_flow(grad_stats: dict[str, dict],
                        expected_names: Iterable[str] = ()) -> GradientFlowReport:
    """Every parameter (and every expected name, e.g. the full model's) has a usable gradient."""
    failures = {}
    for name in set(expected_names) - set(grad_stats):
        failures[name] = "no stage holds this parameter"
    for name, stat in grad_stats.items():
        if not stat["present"]:
            failures[name] = "no gradient (None): the graph did not reach it"
        elif not stat["finite"]:
            failures[name] = "gradient has NaN or Inf"
        elif not stat["nonzero"]:
            failures[name] = "gradient is all zero"
    norms = {name: stat["norm"] for name, stat in grad_stats.items()}
    return GradientFlowReport(failures, len(set(grad_stats) | set(expected_names)), norms)


# --- parity with the single-device reference -------------------------------------------------


@dataclass(repr=False)
class ParityReport(ShownAsText):
    """Loss and per-parameter gradient differences between a pipeline and the reference."""

    loss: float
    reference_loss: float
    grad_diffs: dict[str, tuple[float, float]]   # name -> (max abs diff, max rel diff)
    missing: list[str]
    loss_rtol: float
    grad_atol: float

    @property
    def loss_rel_diff(self) -> float:
        """|loss - reference| / |reference|."""
        return abs(self.loss - self.reference_loss) / max(abs(self.reference_loss), 1e-12)

    @property
    def max_abs_diff(self) -> float:
        """Largest absolute gradient difference over all parameters."""
        return max((abs_diff for abs_diff, _ in self.grad_diffs.values()), default=0.0)

    @property
    def failing(self) -> list[str]:
        """Parameters whose gradient differs by more than grad_atol."""
        return sorted(name for name, (abs_diff, _) in self.grad_diffs.items() if abs_diff > self.grad_atol)

    @property
    def passed(self) -> bool:
        """Loss within loss_rtol, every gradient within grad_atol, none missing."""
        return self.loss_rel_diff <= self.loss_rtol and not self.failing and not self.missing

    def _summary(self) -> list[str]:
        # Short lines, one fact each: a notebook wraps long ones mid-word.
        return [f"parity {'PASSED' if self.passed else 'FAILED'}",
                f"  loss {self.loss:.8f} vs reference {self.reference_loss:.8f} "
                f"(relative difference {self.loss_rel_diff:.1e}, tolerance {self.loss_rtol:.0e})",
                f"  gradients: largest |difference| {self.max_abs_diff:.1e} over "
                f"{len(self.grad_diffs)} parameters (tolerance {self.grad_atol:.0e})"]

    def __str__(self) -> str:
        lines = self._summary()
        lines += [f"  {name}: max abs diff {self.grad_diffs[name][0]:.2e}" for name in self.failing]
        lines += [f"  {name}: no gradient from the pipeline" for name in self.missing]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [[name, f"{a:.2e}", f"{r:.2e}", "FAIL" if a > self.grad_atol else "ok"]
                for name, (a, r) in sorted(self.grad_diffs.items())]
        rows += [[name, "", "", "no gradient from the pipeline"] for name in self.missing]
        return html_table(["parameter", "max abs diff", "max rel diff", ""], rows,
                           [line.strip() for line in self._summary()])


def compare_with_reference(loss: float, grads: dict[str, torch.Tensor], reference: ReferenceResult,
                           loss_rtol: float = 1e-6, grad_atol: float = 1e-5) -> ParityReport:
    """Compare a pipeline's loss and gradients with the single-device reference's."""
    diffs = {}
    for name, expected in reference.grads.items():
        if name in grads:
            difference = (grads[name].to(expected.device, expected.dtype) - expected).abs()
            scale = expected.abs().max().clamp_min(1e-12)
            diffs[name] = (float(difference.max()), float(difference.max() / scale))
    missing = sorted(set(reference.grads) - set(grads))
    return ParityReport(loss, reference.loss, diffs, missing, loss_rtol, grad_atol)


# --- boundary shapes ---------------------------------------------------------------------------


@dataclass(repr=False)
class BoundaryTable(ShownAsText):
    """What crossed each stage boundary, per microbatch."""

    boundaries: list[Boundary]

    def rows(self) -> list[list]:
        """One row per boundary and microbatch: 'stage s -> s+1', microbatch, shape, dtype, bytes."""
        return [[f"{b.source} -> {b.source + 1}", b.microbatch, tuple(b.shape), b.dtype, b.bytes]
                for b in sorted(self.boundaries, key=lambda b: (b.source, b.microbatch))]

    HEADER = ["boundary", "microbatch", "shape", "dtype", "bytes"]

    def __str__(self) -> str:
        return text_table(self.HEADER, self.rows())

    def _repr_html_(self) -> str:
        return html_table(self.HEADER, self.rows(), "activations that crossed each stage boundary")
