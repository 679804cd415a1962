"""The single-device training loop the pipelines are held to: written here, clipped with torch's
own clip_grad_norm_, so that a pipeline's training can be compared step by step."""

import torch

from pplab.data import batches, split_microbatches
from pplab.models.llama import LlamaConfig, build_model, loss_fn
from pplab.models.partition import layer_ranges, stage_of_parameter
from pplab.rank.train import TrainOptions, make_optimizer


def single_device_training(options: TrainOptions, n_microbatches: int, per_stage: int = 0,
                           config: LlamaConfig = LlamaConfig.tiny()) -> tuple[list[float], list[float]]:
    """(loss, global gradient norm before clipping) of each step of the same training on one device.

    With `per_stage` > 0, the parameters of each of that many stages are clipped by
    their own norm: what per-stage clipping on a pipeline does (the norms are then the last stage's).
    """
    model = build_model(config, 0)
    clip_groups = [list(model.parameters())]
    if per_stage:
        ranges = layer_ranges(config.num_hidden_layers, per_stage)
        clip_groups = [[p for name, p in model.named_parameters() if stage_of_parameter(name, ranges) == s]
                       for s in range(per_stage)]
    optimizer, scheduler = make_optimizer(model.named_parameters(), options)
    losses, norms = [], []
    for step in range(options.steps):
        batch = next(batches(options.batch_size, options.seq_len, options.data_seed, split="train",
                             start=step))
        model.zero_grad(set_to_none=True)
        microbatch_losses = []
        for input_ids, target_ids in split_microbatches(batch, n_microbatches):
            loss = loss_fn(model(input_ids), target_ids)
            (loss / n_microbatches).backward()
            microbatch_losses.append(loss.item())
        for group in clip_groups:
            norm = torch.nn.utils.clip_grad_norm_(group, options.clip)
        optimizer.step()
        scheduler.step()
        losses.append(sum(microbatch_losses) / n_microbatches)
        norms.append(float(norm))
    return losses, norms
