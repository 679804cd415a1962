# EXERCISE: one forward and one backward across the boundary between rank 0 and rank 1
def forward_backward(stage, rank, tokens, targets):
    shape = (*tokens.shape, stage.config.hidden_size)
    if rank == 0:
        out = stage(tokens)
        dist.send(out.detach(), dst=1)
        grad = torch.empty(shape)
        dist.recv(grad, src=1)
        out.backward(grad)
        return None
    x = torch.empty(shape)
    dist.recv(x, src=0)
    x.requires_grad_()
    loss = loss_fn(stage(x), targets)
    loss.backward()
    dist.send(x.grad, dst=0)
    return loss
