"""The zero-bubble split of a stage's backward: I, the input gradient, then W, the weights'.

I is what the previous stage waits for; W is what nobody waits for, so a schedule can
put it where a rank would otherwise idle. Both use torch's own functions, so nothing of
the input-gradient chain is computed twice. The runtime runs them for I and W actions,
the profiler times them. Floor 3.
"""

from __future__ import annotations

import torch


def input_gradient(output: torch.Tensor, output_grad: torch.Tensor | None, x: torch.Tensor,
                   weights: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """The zero-bubble split's I: the gradient of the stage input `x`, and what W needs.

    torch's `stage_backward_input` runs autograd from the output to the input, with hooks on
    the graph nodes where the weights' branches leave that path: they keep the gradient that
    arrives there (e.g. a linear layer's output gradient). `weight_gradients` then starts from
    those nodes and runs only the weights' branches, so nothing of the input-gradient chain
    is computed twice. (The output's graph is released here: W does not need it.)
    """
    stage_backward_input, _ = torch_split_backward()
    input_grads, weight_work = stage_backward_input(
        [output], None if output_grad is None else [output_grad], [x], weights)
    return input_grads[0], weight_work


def weight_gradients(weights: list[torch.Tensor], weight_work: list) -> None:
    """The zero-bubble split's W: accumulate the weights' gradients from what I kept."""
    _, stage_backward_weight = torch_split_backward()
    stage_backward_weight(weights, weight_work)


def torch_split_backward():
    """torch's (stage_backward_input, stage_backward_weight), imported on first use: the import
    of torch's pipelining package is slow, and only zero-bubble schedules need them."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    return stage_backward_input, stage_backward_weight
