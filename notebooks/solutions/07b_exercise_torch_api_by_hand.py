# EXERCISE: torch's PipelineStage and ScheduleGPipe, and each rank's step
import torch
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from pplab.models.llama import loss_fn

def train_step(module, rank, n_ranks, tokens, targets, n_microbatches):
    if tokens.shape[0] % n_microbatches:  # every rank, before any step: nobody is left waiting
        raise ValueError(f"n_microbatches={n_microbatches} does not divide the batch of {tokens.shape[0]} "
                         f"sequences: give a divisor of it")
    stage = PipelineStage(module, rank, n_ranks, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(tokens)
        return None
    if rank == n_ranks - 1:
        losses = []
        schedule.step(target=targets, losses=losses)
        return losses
    schedule.step()
    return None
