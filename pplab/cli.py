"""The `pplab` command: headless demos and reports, no Jupyter needed."""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from pplab.data import batches
from pplab.model import LlamaConfig, build_model, loss_fn
from pplab.partition import build_stage, layer_ranges


def demo(args: argparse.Namespace) -> int:
    """Partition the tiny model, check the stages chain to the full model, and train it a little."""
    torch.set_num_threads(args.threads)
    config = LlamaConfig.tiny()
    model = build_model(config, seed=args.seed)
    print(f"tiny LLaMA: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{config.num_hidden_layers} layers")

    ranges = layer_ranges(config.num_hidden_layers, args.stages)
    stages = [build_stage(config, s, args.stages, seed=args.seed) for s in range(args.stages)]
    input_ids, _ = next(batches(args.batch_size, args.seq_len, seed=args.seed))
    hidden = input_ids
    for index, (stage, (start, end)) in enumerate(zip(stages, ranges)):
        shape_in = tuple(hidden.shape)
        hidden = stage(hidden)
        print(f"  stage {index}: layers {start}..{end - 1}  {shape_in} -> {tuple(hidden.shape)}")
    exact = torch.equal(hidden, model(input_ids))
    print(f"stages chained reproduce the full model's logits exactly: {exact}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start_time, losses = time.perf_counter(), []
    progress = tqdm(batches(args.batch_size, args.seq_len, seed=args.seed, steps=args.steps),
                    total=args.steps, desc="training (1 device)", unit="step")
    for input_ids, target_ids in progress:
        loss = loss_fn(model(input_ids), target_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{loss.item():.3f}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps "
          f"({time.perf_counter() - start_time:.1f} s)")
    return 0 if exact and losses[-1] < losses[0] else 1


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="pplab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="the main job on the embedded defaults (CPU)")
    run_demo.add_argument("--stages", type=int, default=4)
    run_demo.add_argument("--steps", type=int, default=200)
    run_demo.add_argument("--batch-size", type=int, default=8)
    run_demo.add_argument("--seq-len", type=int, default=64)
    run_demo.add_argument("--lr", type=float, default=3e-3)
    run_demo.add_argument("--seed", type=int, default=0)
    run_demo.add_argument("--threads", type=int, default=1)
    run_demo.set_defaults(handler=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pplab` command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
