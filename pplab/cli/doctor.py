"""`pplab doctor`: what torch's runtime will run for a schedule, its stalls, and a better order."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pplab._version import __version__
from pplab.base.config import LabOptions, PipelineOptions
from pplab.cli import simulate
from pplab.cli.options import add_option_flag, arguments_as_json
from pplab.planning.doctor import TRANSPORTS


def run(args: argparse.Namespace) -> int:
    """Diagnose a schedule as torch will run it: 0 when it runs, 1 when it cannot or deadlocks."""
    from pplab.planning.doctor import Diagnosis, doctor
    from pplab.views import viz  # matplotlib only when drawing

    job = None
    try:
        if args.torchtitan_config:
            job, schedule = simulate.schedule_of_job(args)
        elif args.schedule is None:
            raise ValueError("give a SCHEDULE (a name, or a torch CSV), or --torchtitan-config JOB.toml")
        elif args.schedule.endswith(".csv"):
            schedule = simulate.schedule_of_csv(args)
        else:
            schedule = _named(args)
    except _TorchRefuses as refusal:  # a job torch cannot run: said before anything starts
        print(f"doctor: {args.schedule} on {args.n_ranks} ranks, {args.n_microbatches} microbatches\n"
              f"  torch's runtime cannot run it: {refusal}")
        return 1
    costs = simulate.costs_of(args, schedule, job)
    diagnosis: Diagnosis = doctor(schedule, costs, args.transport)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(command="pplab doctor", pplab_version=__version__, arguments=arguments_as_json(args),
                  schedule=schedule.name, runs=diagnosis.runs, refused=diagnosis.refused,
                  deadlock=diagnosis.deadlock, step=diagnosis.step, bound=diagnosis.bound,
                  peak_activations=diagnosis.peak,
                  transport=args.transport,
                  stalls=[dict(rank=s.rank, stream_to=s.peer, waits_at=s.waits_at, holding_up=s.blocked,
                               seconds=s.seconds) for s in diagnosis.stalls],
                  tried=diagnosis.tried, fix=None)
    print(diagnosis)
    if diagnosis.runs:
        picture = out / "timelines.png"
        if diagnosis.fix is not None:
            path = diagnosis.write_fix(out / "fix.csv")
            report["fix"] = dict(name=diagnosis.fix.name, step=diagnosis.fix_step, csv=path.name)
            ours, fixed = diagnosis.timelines["torch's order"], diagnosis.timelines["the fix"]
            viz.save(viz.compare_timelines(ours, fixed, titles=(f"torch's order: step {diagnosis.step:.4g}",
                                                                f"the fix: step {diagnosis.fix_step:.4g}")),
                     picture)
            print(f"  wrote {path}: run it with torch's runtime (_load_csv(path, format=\"compute_comms\")), "
                  f"or `pplab train --schedule {path} --impl torch`")
        else:
            viz.save(viz.plot_timeline(diagnosis.timelines["torch's order"], title="torch's order"), picture)
        print(f"  wrote {picture} and {out / 'report.json'}")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if diagnosis.runs else 1


class _TorchRefuses(ValueError):
    """torch cannot plan the named schedule at these sizes."""


def _named(args: argparse.Namespace):
    """The named schedule at the flags' sizes: pplab's build, or torch's plan (whose refusal is the
    diagnosis: a job torch cannot run)."""
    from pplab.schedules import SCHEDULE_NAMES, TORCH_SCHEDULES, from_torch, schedule_name

    name = schedule_name(args.schedule)
    for flag in ("n_ranks", "n_microbatches"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is needed for a named schedule ({name}); a "
                             "schedule read from torch's CSV (FILE.csv) brings its own sizes")
    plan = TORCH_SCHEDULES.get(name)
    n_virtual = args.n_virtual or (2 if plan is not None and plan.multi_stage else 1)
    if plan is not None:  # torch's class for it must take these sizes (a job names the class)
        try:
            planned = from_torch(name, args.n_ranks, args.n_microbatches, n_virtual)
        except ValueError as error:
            raise _TorchRefuses(str(error)) from None
        if name not in SCHEDULE_NAMES:
            return planned
    return simulate.built(args)


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_doctor = commands.add_parser(
        "doctor", help="what torch's runtime will run for a schedule: deadlocks, stalls, a better order",
        description="Ask torch's own lowering what its runtime will run for a schedule (its sends and "
                    "receives, posted as early as they can be), and report before anything starts: a job "
                    "it cannot run, an order that deadlocks, the stalls (an operation that waited for its "
                    "peer while something ready waited behind it) and their cost in the simulator's model "
                    "of the transport, the "
                    "activations each rank holds; where an order of the messages removes stalls without "
                    "a deadlock, it is written as torch's compute+comms CSV (fix.csv).")
    run_doctor.add_argument("schedule", metavar="SCHEDULE", nargs="?", default=None,
                            help="a schedule's name (pplab's or torch's), or a torch CSV (FILE.csv, either "
                                 "format)")
    from_file = simulate.SIZES_FROM_FILE  # (the sizes, as simulate takes them)
    add_option_flag(run_doctor, LabOptions, "n_ranks", default=None, because=from_file)
    add_option_flag(run_doctor, PipelineOptions, "n_microbatches", default=None, because=from_file)
    add_option_flag(run_doctor, PipelineOptions, "n_virtual", default=None,
                    because="2 for the schedules with several stages per rank, else 1")
    run_doctor.add_argument("--torchtitan-config", metavar="JOB.toml", default=None,
                            help="a torchtitan job's TOML: its schedule and sizes, instead of SCHEDULE")
    run_doctor.add_argument("--transport", choices=tuple(TRANSPORTS), default="nccl",
                            help="how the job's messages run: " + "; ".join(
                                f"{name}: {transport.said}" for name, transport in TRANSPORTS.items())
                            + " (default nccl, a GPU job's)")
    simulate.add_cost_flags(run_doctor)
    run_doctor.add_argument("--out", default="pplab-doctor",
                            help="folder for the fix, its picture and the report (default pplab-doctor)")
    run_doctor.set_defaults(handler=run)
    return run_doctor
