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
from torch import nn

from pplab.base.config import PipelineOptions, takes_options
from pplab.data import Batch, split_microbatches
from pplab.models import dropout_streams
from pplab.models.llama import LlamaConfig, LlamaModel, loss_fn


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


@takes_options(PipelineOptions, differs={
    "n_microbatches": "None: the microbatches as given (a list of batches, or one batch whole)"})
def reference_step(model: LlamaModel | LlamaConfig, batch: Batch | Sequence[Batch],
                   n_microbatches: int | None = None,
                   seed: int = PipelineOptions.seed) -> ReferenceResult:
    """Loss and every parameter's gradient of one step on one device, microbatched like a pipeline.

    `model` is a built model (its gradients are overwritten; a `transformers` causal LM
    too) or a model description (a config, see `pplab.models.partition.as_model`; built from `seed`).
    A tied weight's gradient is listed under each of its names, as the stages hold it.
    """
    if not isinstance(model, nn.Module):
        from pplab.models.partition import as_model

        model = as_model(model).build_model(seed)
    microbatches = as_microbatches(batch, n_microbatches)
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    losses = []
    with dropout_streams.step(seed):  # a model that drops draws the masks a pipeline draws
        for index, (input_ids, target_ids) in enumerate(microbatches):
            with dropout_streams.microbatch(index):
                output = model(input_ids.to(device))
                loss = loss_fn(getattr(output, "logits", output), target_ids.to(device))
                (loss / len(microbatches)).backward()
            losses.append(loss.item())
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return ReferenceResult(sum(losses) / len(losses), losses, grads)
