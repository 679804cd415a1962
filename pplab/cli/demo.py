"""`pplab demo`: every schedule on local ranks (or under torchrun), checked against one device and drawn."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pplab._version import __version__
from pplab.base.config import LabOptions, PipelineOptions, TrainOptions
from pplab.cli.options import add_option_flag, arguments_as_json, bubble_figure, positive_int
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import theory

DEMO_SCHEDULES = {  # per runtime: (schedule, stages per rank)
    "pplab": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)),
    "torch": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv-zero-bubble", 2)),
}


def run(args: argparse.Namespace) -> int:
    """Run every schedule on local ranks (CPU, gloo, embedded data): parity, bubble, pictures, report."""
    # torch and matplotlib only here: `pplab simulate` starts without them.
    import torch

    from pplab.data import batches
    from pplab.drivers.torchrun import TorchrunRanks, under_torchrun
    from pplab.models.llama import LlamaConfig, build_model
    from pplab.rank.rank_pipeline import PipelineSpec
    from pplab.rank.reference import reference_step
    from pplab.session import Pipeline, RankPool
    from pplab.views import viz

    config = LlamaConfig.tiny()
    if under_torchrun():  # torchrun decides the ranks; only rank 0 speaks
        args.n_ranks = int(os.environ["WORLD_SIZE"])
    speaker = os.environ.get("RANK", "0") == "0"
    if speaker:
        where = "ranks started by torchrun" if under_torchrun() else "local ranks (gloo)"
        print(f"pplab demo: tiny LLaMA ({sum(p.numel() for p in build_model(config).parameters()):,} "
              f"parameters, {config.num_hidden_layers} layers) on {args.n_ranks} {where}, "
              f"{args.n_microbatches} microbatches, {args.steps} step{'s' if args.steps != 1 else ''} "
              f"per schedule, timing mode F={args.forward}s B={2 * args.forward}s, "
              f"{'torch.distributed.pipelining' if args.impl == 'torch' else 'the hand-written runtime'}")
    batch = next(batches(args.microbatch_size * args.n_microbatches, args.seq_len, seed=args.seed))
    specs = []  # all checked before any rank starts
    for name, n_virtual in DEMO_SCHEDULES[args.impl]:
        # An interleaved chunk holds 1/v of a stage's layers, so it costs 1/v as much.
        costs = Costs(forward=args.forward / n_virtual, backward=2 * args.forward / n_virtual)
        specs.append(PipelineSpec.create(config, name, args.n_ranks, args.n_microbatches, n_virtual,
                                         impl=args.impl, seed=args.seed, timing=costs, op_timeout=300))
    out = Path(args.out)  # made only once the arguments are known to be good
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not under_torchrun():
        print(f"starting {args.n_ranks} ranks and running {len(specs)} schedules on them ...", flush=True)
    # No optimizer: every step must give the first step's loss and the reference's gradients;
    # a step that differs shows state left over from the one before (gradients not zeroed, ...).
    # Each step is the session's parity and gradient-flow check, against one reference step.
    reference = reference_step(config, batch, args.n_microbatches, seed=args.seed)
    with (TorchrunRanks() if under_torchrun() else RankPool(args.n_ranks)) as ranks:
        pipes = []
        for spec in specs:
            pipe, steps = Pipeline(ranks, spec), []
            for _ in range(args.steps):
                parity = pipe.check_parity(batch, reference=reference)
                steps.append((pipe.last, parity, pipe.check_gradient_flow()))
            pipes.append((pipe, steps))
            pipe.close()
    if not speaker:
        return 0
    print(f"done in {time.perf_counter() - started:.1f} s")
    failures, schedules = 0, []
    for pipe, steps in pipes:
        spec = pipe.spec
        name = f"torch-{spec.schedule.name}" if spec.impl == "torch" else spec.schedule.name
        costs = spec.timing
        results, parities, flows = (list(column) for column in zip(*steps))
        losses = [r.loss for r in results]
        repeatable = all(loss == losses[0] for loss in losses)
        parity_ok, flow_ok = all(p.passed for p in parities), all(f.passed for f in flows)
        failures += not (parity_ok and flow_ok and repeatable)
        first, textbook = results[0], theory(spec.schedule, costs)
        print(f"  {name:23s} loss {first.loss:.5f}  parity {'ok' if parity_ok else 'FAILED'} (max |grad "
              f"diff| {max(p.max_abs_diff for p in parities):.1e})  gradient flow "
              f"{'ok' if flow_ok else 'FAILED'}  bubble {bubble_figure(first.timeline.bubble_fraction())} "
              f"(theory {bubble_figure(textbook.bubble_fraction)})  peak in-flight rank 0: "
              f"{first.timeline.peak_inflight(0)}")
        if textbook.bubble_fraction is None:  # say why there is no textbook number
            print(f"  {'':23s} theory n/a: {textbook.conditions}")
        if args.steps > 1:
            off = [k + 1 for k, p in enumerate(parities) if not p.passed]
            print(f"  {'':23s} {args.steps} steps: losses {'all equal' if repeatable else 'DIFFER: FAILED'}"
                  f"{'' if repeatable else ' ' + str(losses)}, gradients "
                  f"{'as the reference on every step' if not off else f'FAILED on step(s) {off}'}, "
                  f"step times {', '.join(f'{r.timeline.step_time():.3f}' for r in results)} s")
        viz.save(viz.compare_timelines(simulate(spec.schedule, costs), first.timeline), out / f"{name}.png")
        first.timeline.to_chrome_trace(out / f"{name}.trace.json")
        schedules.append(dict(
            name=name, impl=spec.impl, n_ranks=spec.schedule.n_ranks, n_virtual=spec.schedule.n_virtual,
            n_microbatches=spec.schedule.n_microbatches,
            losses=losses, losses_equal=repeatable,
            parity=dict(passed=parity_ok, max_abs_grad_diff=max(p.max_abs_diff for p in parities),
                        max_abs_grad_diff_per_step=[p.max_abs_diff for p in parities],
                        reference_loss=reference.loss),
            gradient_flow=dict(passed=flow_ok),
            bubble_fraction=dict(measured=first.timeline.bubble_fraction(),
                                 measured_per_step=[r.timeline.bubble_fraction() for r in results],
                                 theory=textbook.bubble_fraction, theory_conditions=textbook.conditions),
            step_time_s=first.timeline.step_time(),
            step_time_s_per_step=[r.timeline.step_time() for r in results],
            peak_inflight=dict(measured=first.timeline.peak_inflight_per_rank(),
                               theory=list(textbook.peak_inflight)),
            files=dict(timeline=f"{name}.png", trace=f"{name}.trace.json"),
        ))
    report = dict(command="pplab demo", passed=not failures, pplab_version=__version__,
                  torch_version=torch.__version__, arguments=arguments_as_json(args), schedules=schedules)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("measured bubbles include each message's real cost (about a millisecond per hop here), "
          "which the theory leaves out")
    print(f"timelines (predicted vs measured) and Chrome traces (open in ui.perfetto.dev) in {out}/; "
          f"the numbers in {out / 'report.json'}")
    return 1 if failures else 0


# Why the demo starts 4 ranks with 8 microbatches where a run starts 2 with 4.
_EVERY_BUBBLE = "4 ranks, 8 microbatches (a run's: 2, 4), each schedule's bubble large enough to see"


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_demo = commands.add_parser("demo", help="every schedule on local ranks, checked and drawn (CPU)",
                                   parents=[ranks_run])
    add_option_flag(run_demo, LabOptions, "n_ranks", default=4, because=_EVERY_BUBBLE)
    add_option_flag(run_demo, PipelineOptions, "n_microbatches", default=8, because=_EVERY_BUBBLE)
    run_demo.add_argument("--microbatch-size", type=positive_int, default=2,
                          help="sequences per microbatch (default 2)")
    add_option_flag(run_demo, TrainOptions, "seq_len", default=32, because="short, quick on CPU")
    add_option_flag(run_demo, Costs, "forward", default=0.05,
                    because="timing mode, the seconds a forward takes on the ranks (a backward twice that)")
    run_demo.add_argument("--steps", type=positive_int, default=1,
                          help="steps of each schedule on the same ranks (no optimizer: each must "
                               "repeat the first)")
    add_option_flag(run_demo, PipelineOptions, "seed")
    add_option_flag(run_demo, PipelineOptions, "impl")
    run_demo.add_argument("--out", default="pplab-demo",
                          help="folder for pictures, traces and report.json")
    run_demo.set_defaults(handler=run)
    return run_demo
