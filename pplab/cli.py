"""The `pplab` command: headless demos and reports, no Jupyter needed."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pplab.checks import check_gradient_flow, compare_with_reference
from pplab.data import batches
from pplab.launch import run_as_torchrun_rank, run_ranks, under_torchrun
from pplab.model import LlamaConfig, build_model
from pplab.rank_pipeline import PipelineSpec, merge_steps, run_jobs_on_rank, split_for_ranks
from pplab.reference import reference_step
from pplab.schedules import theory
from pplab.simulator import Costs, simulate

DEMO_SCHEDULES = {  # per runtime: (schedule, stages per rank)
    "pplab": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)),
    "torch": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("ZBVZeroBubble", 2)),
}


def demo(args: argparse.Namespace) -> int:
    """Run every schedule on local ranks (CPU, gloo, embedded data): parity, bubble, pictures."""
    from pplab import viz  # matplotlib only when drawing

    config = LlamaConfig.tiny()
    if under_torchrun():  # torchrun decides the ranks; only rank 0 speaks
        args.ranks = int(os.environ["WORLD_SIZE"])
    if os.environ.get("RANK", "0") == "0":
        where = "ranks started by torchrun" if under_torchrun() else "local ranks (gloo)"
        print(f"pplab demo: tiny LLaMA ({sum(p.numel() for p in build_model(config).parameters()):,} "
              f"parameters, {config.num_hidden_layers} layers) on {args.ranks} {where}, "
              f"{args.microbatches} microbatches, timing mode F={args.forward}s B={2 * args.forward}s, "
              f"{'torch.distributed.pipelining' if args.impl == 'torch' else 'the hand-written runtime'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch = next(batches(args.microbatch_size * args.microbatches, args.seq_len, seed=args.seed))
    jobs = []
    for name, n_virtual in DEMO_SCHEDULES[args.impl]:
        # An interleaved chunk holds 1/v of a stage's layers, so it costs 1/v as much.
        costs = Costs(forward=args.forward / n_virtual, backward=2 * args.forward / n_virtual)
        spec = PipelineSpec.create(config, name, args.ranks, args.microbatches, n_virtual,
                                   impl=args.impl, seed=args.seed, timing=costs)
        jobs.append((spec, split_for_ranks(spec, batch)))
    started = time.perf_counter()
    if under_torchrun():  # every process is one rank; rank 0 reports
        rank_steps = run_as_torchrun_rank(run_jobs_on_rank, jobs)
        if rank_steps is None:
            return 0
    else:
        print(f"starting {args.ranks} ranks and running {len(jobs)} schedules on them ...", flush=True)
        rank_steps = run_ranks(args.ranks, run_jobs_on_rank, jobs, timeout=600)
    print(f"done in {time.perf_counter() - started:.1f} s")
    reference = reference_step(config, batch, args.microbatches, seed=args.seed)
    failures = 0
    for index, (spec, _) in enumerate(jobs):
        name, costs = (f"torch-{spec.torch_name}" if spec.impl == "torch" else spec.schedule.name), spec.timing
        result = merge_steps([steps[index] for steps in rank_steps])
        parity = compare_with_reference(result.loss, result.grads, reference)
        flow = check_gradient_flow(result.grad_stats, reference.grads)
        failures += not (parity.passed and flow.passed)
        textbook = theory(spec.schedule, costs)
        print(f"  {name:23s} loss {result.loss:.5f}  parity {'ok' if parity.passed else 'FAILED'} "
              f"(max |grad diff| {parity.max_abs_diff:.1e})  gradient flow {'ok' if flow.passed else 'FAILED'}  "
              f"bubble {result.timeline.bubble_fraction():.3f} (theory {_figure(textbook.bubble_fraction)})  "
              f"peak in-flight rank 0: {result.timeline.peak_inflight(0)}")
        if textbook.bubble_fraction is None:  # say why there is no textbook number
            print(f"  {'':23s} theory n/a: {textbook.conditions}")
        viz.save(viz.compare_timelines(simulate(spec.schedule, costs), result.timeline), out / f"{name}.png")
        result.timeline.to_chrome_trace(out / f"{name}.trace.json")
    print("measured bubbles include each message's real cost (about a millisecond per hop here), "
          "which the theory leaves out")
    print(f"timelines (predicted vs measured) and Chrome traces (open in ui.perfetto.dev) in {out}/")
    return 1 if failures else 0


def _figure(value: float | None) -> str:
    """A bubble fraction as the demo prints it, or "n/a" when theory has no closed form."""
    return "n/a" if value is None else f"{value:.3f}"


def cleanup(args: argparse.Namespace) -> int:
    """Stop lab clusters left behind by killed kernels (all labs with --force)."""
    from pplab.cluster import cleanup as stop_orphans

    stopped = stop_orphans(force=args.force)
    print(f"pplab cleanup: {len(stopped)} lab(s) stopped" if stopped else "pplab cleanup: nothing to stop")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="pplab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="every schedule on local ranks, checked and drawn (CPU)")
    run_demo.add_argument("--ranks", type=int, default=4)
    run_demo.add_argument("--microbatches", type=int, default=8)
    run_demo.add_argument("--microbatch-size", type=int, default=2)
    run_demo.add_argument("--seq-len", type=int, default=32)
    run_demo.add_argument("--forward", type=float, default=0.05,
                          help="timing mode: seconds per forward (backward takes twice as long)")
    run_demo.add_argument("--seed", type=int, default=0)
    run_demo.add_argument("--impl", choices=("pplab", "torch"), default="pplab",
                          help="the hand-written runtime, or torch.distributed.pipelining's schedules")
    run_demo.add_argument("--out", default="pplab-demo", help="folder for pictures and traces")
    run_demo.set_defaults(handler=demo)
    run_cleanup = commands.add_parser("cleanup", help="stop lab clusters left by killed kernels")
    run_cleanup.add_argument("--force", action="store_true", help="also stop labs of running kernels")
    run_cleanup.set_defaults(handler=cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pplab` command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
