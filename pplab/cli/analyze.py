"""`pplab analyze`: read a profiled run's traces and explain its bubble."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pplab._version import __version__
from pplab.base.config import PipelineOptions
from pplab.cli.options import add_option_flag, arguments_as_json


def run(args: argparse.Namespace) -> int:
    """Read a profiled run's traces and explain its bubble: picture, Chrome trace, JSON and a report."""
    if args.flight_recorder:  # a hung job: where each rank stands, from torch's flight recorder
        from pplab.trace import read_flight_recorder

        if args.traces:
            raise ValueError("--flight-recorder reads a hung job's records alone: leave TRACES out")
        print(read_flight_recorder(args.flight_recorder).text())
        return 0
    if not args.traces:
        raise ValueError("give the ranks' TRACES (files or their folder), or --flight-recorder DIR")
    from pplab.planning.bubble import explain
    from pplab.trace.profiled import read_profiler_traces
    from pplab.views import viz  # matplotlib only when drawing

    run = read_profiler_traces(args.traces, step=args.step)
    n_ranks = run.timeline.n_ranks
    schedule, job = _schedule(args, n_ranks)
    # The trace's other steps weigh in the straggler's verdict: a busy machine slows an action
    # once, rarely every time.
    report = explain(run.timeline, schedule, run.outside, steps=run.other_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    picture, trace, numbers, text = (out / "timeline.png", out / "timeline.trace.json", out / "report.json",
                                     out / "report.txt")
    viz.save(viz.compare_timelines(run.timeline, report.simulated,
                                   titles=(f"measured: {schedule.name}, from {n_ranks} profiler traces",
                                           "simulated on the measured costs")), picture)
    run.timeline.to_chrome_trace(trace)
    said = run.summary().splitlines()[0] + "\n" + report.text()
    if job is not None:
        said += "\n" + _for_torchtitan(report, schedule, out)
    text.write_text(said + "\n")
    numbers.write_text(json.dumps(dict(
        command="pplab analyze", pplab_version=__version__, arguments=arguments_as_json(args),
        files=run.files,
        step=run.step, steps_in_trace=run.steps_in_trace, labels=run.labels, one_host=run.one_host,
        alignment_error=run.alignment_error, **report.to_json(),
        outputs=dict(timeline=picture.name, trace=trace.name, report=text.name)), indent=2) + "\n")
    print(said)
    print(f"wrote {picture}, {trace}, {numbers} and {text}")
    return 0


def _schedule(args: argparse.Namespace, n_ranks: int):
    """The schedule the run used: from the flags, or from a torchtitan job's TOML."""
    from pplab.planning.bubble import named_schedule

    if not args.torchtitan_config:
        if args.schedule is None or args.n_microbatches is None:
            raise ValueError("give --schedule and --n-microbatches, or --torchtitan-config JOB.toml")
        return named_schedule(args.schedule, n_ranks, args.n_microbatches, args.n_virtual), None
    if args.schedule is not None or args.n_microbatches is not None:
        raise ValueError("--torchtitan-config brings the schedule and its microbatches: leave --schedule and "
                         "--n-microbatches out")
    from pplab.session.torchtitan import read_torchtitan

    job = read_torchtitan(args.torchtitan_config)
    print(job.text())
    c = job.config
    if c.pp != n_ranks:
        raise ValueError(f"{args.torchtitan_config}: pipeline_parallel_degree = {c.pp}, but the traces hold "
                         f"{n_ranks} ranks: give the traces of one pipeline")
    return job.schedule(), job


def _for_torchtitan(report, schedule, out: Path) -> str:
    """The report's schedule changes as a torchtitan job takes them: a torch schedule class, or, for a
    schedule torch has no class for, a CSV written beside the report for torch's runtime to run."""
    from pplab.planning.bubble import named_schedule
    from pplab.planning.whatif import ranked
    from pplab.schedules import TORCH_SCHEDULES

    lines = ["in the torchtitan job ([parallelism]):"]
    for suggestion in ranked(report.suggestions):
        words = suggestion.change.split()
        if words[0] != "schedule":
            continue
        name, n_virtual = words[1], 2 if "2 stages per rank" in suggestion.change else 1
        plan = TORCH_SCHEDULES.get(name)
        if plan is not None:
            how = f'pipeline_parallel_schedule = "{plan.torch_name}"'
        else:
            changed = named_schedule(name, schedule.n_ranks, schedule.n_microbatches, n_virtual)
            path = changed.to_torch_csv(out / f"{name}.csv")
            how = (f'pipeline_parallel_schedule = "_PipelineScheduleRuntime", '
                   f'pipeline_parallel_schedule_csv = "{path}" (torch has no class for {name}; the CSV was '
                   f'written for it)')
        assumed = f", assumed: {suggestion.assumed}" if suggestion.assumed else ""
        lines.append(f"  {suggestion.change} ({-suggestion.gain:+.0%}{assumed}): {how}")
    return "\n".join(lines)


# Why the run's schedule and microbatches have no default: they are the run's, or its job file's.
_THE_RUNS = "needed, unless --torchtitan-config brings it"


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_analyze = commands.add_parser(
        "analyze", help="explain a torch.profiler run's bubble: which rank, which "
                        "microbatch, waiting on whom",
        description="Read one step of a pipeline run recorded with torch.profiler (one Kineto JSON "
                    "per rank, or their folder), and explain each rank's bubble: the schedule's "
                    "own, waits for messages, a straggler, time outside the pipeline; then predict "
                    "what one change would gain.")
    run_analyze.add_argument("traces", metavar="TRACES", nargs="*",
                             help="the ranks' trace files, or their folder")
    run_analyze.add_argument("--flight-recorder", metavar="DIR", default=None,
                             help="instead: a hung job's flight recorder files (rank<r>.json, as "
                                  "pplab.trace.flight_recorder.dump_on_hang writes them): where each rank "
                                  "stands, and who never came")
    add_option_flag(run_analyze, PipelineOptions, "schedule", default=None, because=_THE_RUNS,
                    when="the run's")
    add_option_flag(run_analyze, PipelineOptions, "n_microbatches", default=None, because=_THE_RUNS,
                    when="the run's")
    add_option_flag(run_analyze, PipelineOptions, "n_virtual", when="the run's")
    run_analyze.add_argument("--torchtitan-config", metavar="JOB.toml", default=None,
                             help="the torchtitan job's TOML the run came from: its schedule (or schedule "
                                  "CSV) and microbatches, instead of --schedule and --n-microbatches")
    run_analyze.add_argument("--step", type=int, default=-1,
                             help="which of the traces' steps (0 = the first; default -1, the last)")
    run_analyze.add_argument("--out", default="pplab-analysis", help="folder for the picture, "
                                                                     "trace and report")
    run_analyze.set_defaults(handler=run)
    return run_analyze
