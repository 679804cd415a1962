# EXERCISE: clip this rank's gradients by the norm of every rank's gradients
def clip_global_norm(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(squares)
    total = squares.sqrt().item()
    scale = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(scale)
    return total
