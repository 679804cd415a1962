"""The single-device reference every pipeline is compared against.

It runs the whole model on the microbatches a pipeline would see and averages
their losses, so its loss and gradients are what a correct pipeline must
reproduce: each microbatch's loss is divided by the number of microbatches
before its backward, exactly as the last stage of a pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pplab.data import Batch, split_microbatches
from pplab.model import LlamaConfig, LlamaModel, build_model, loss_fn


@dataclass
class ReferenceResult:
    """Loss of a step (mean over microbatches), each microbatch's loss, and gradients by name."""

    loss: float
    microbatch_losses: list[float]
    grads: dict[str, torch.Tensor]


def as_microbatches(batch: Batch | Sequence[Batch], n_microbatches: int | None) -> list[Batch]:
    """A batch split into `n_microbatches`, or a list of microbatches taken as they are."""
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return split_microbatches(batch, n_microbatches or 1)
    microbatches = list(batch)
    if n_microbatches not in (None, len(microbatches)):
        raise ValueError(f"n_microbatches={n_microbatches} but {len(microbatches)} microbatches "
                         f"were given; pass n_microbatches=None with a list of microbatches")
    if not microbatches:
        raise ValueError("no microbatches given")
    return microbatches


def reference_step(model: LlamaModel | LlamaConfig, batch: Batch | Sequence[Batch],
                   n_microbatches: int | None = None, seed: int = 0) -> ReferenceResult:
    """Loss and every parameter's gradient of one step on one device, microbatched like a pipeline.

    `model` is a built model (its gradients are overwritten) or a config (built from `seed`).
    """
    if isinstance(model, LlamaConfig):
        model = build_model(model, seed)
    microbatches = as_microbatches(batch, n_microbatches)
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    losses = []
    for input_ids, target_ids in microbatches:
        loss = loss_fn(model(input_ids.to(device)), target_ids.to(device))
        (loss / len(microbatches)).backward()
        losses.append(loss.item())
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return ReferenceResult(sum(losses) / len(losses), losses, grads)
