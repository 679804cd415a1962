"""What a step left in the parameters' gradients: each one whole, and its health.

After a step every rank reports, per parameter, the gradient's norm and whether it is
present, finite and not all zero (what `pplab.rank.checks.check_gradient_flow` reads), and on
request the gradients themselves (what the parity check compares with one device's).
A sharded gradient (FSDP, TP) is gathered whole first, once for both. Floor 3.
"""

from __future__ import annotations

import torch

from pplab.rank.shards import full_tensor


def gradient_report(modules, return_grads: bool) -> tuple[dict[str, dict], dict[str, torch.Tensor] | None]:
    """(gradient_stats, gradients or None): a sharded gradient is gathered once for both."""
    grads = gradients(modules) if return_grads else None
    return gradient_stats(modules, grads), grads


def gradient_stats(modules, grads: dict[str, torch.Tensor] | None = None) -> dict[str, dict]:
    """Per parameter: gradient norm, whether it is finite, whether any entry is non-zero (of the
    whole gradient when it is sharded; pass `grads` from `gradients` not to gather it twice)."""
    stats = {}
    for module in modules:
        for name, param in module.named_parameters():
            grad = (None if param.grad is None
                    else grads[name] if grads is not None else full_tensor(param.grad))
            stats[name] = dict(present=grad is not None,
                               norm=float(grad.norm()) if grad is not None else 0.0,
                               finite=bool(torch.isfinite(grad).all()) if grad is not None else False,
                               nonzero=bool(grad.count_nonzero()) if grad is not None else False)
    return stats


def gradients(modules) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name, on the CPU (for parity checks)."""
    return {name: full_tensor(param.grad).detach().cpu().clone()
            for module in modules for name, param in module.named_parameters()
            if param.grad is not None}
