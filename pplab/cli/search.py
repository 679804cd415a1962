"""`pplab search`: the fastest schedule for a cost model, and the CSV torch and torchtitan run."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from pplab.base.config import LabOptions, PipelineOptions
from pplab.cli.options import add_option_flag, number
from pplab.cli.simulate import add_cost_flags, costs_from_flags


def run(args: argparse.Namespace) -> int:
    """Search the schedules for these sizes and costs; print what was tried; write the found one's CSV."""
    from pplab.planning.search import search

    found = search(args.n_ranks, args.n_microbatches, costs_from_flags(args), memory_limit=args.memory_limit,
                   n_virtual=args.n_virtual, show=not args.quiet, exact=args.exact,
                   exact_seconds=args.exact_seconds)
    print(found.table())  # the candidates, fastest first, as --help says
    print(found)
    if args.csv:
        path = found.schedule.to_torch_csv(Path(args.csv))
        print(f"wrote {path}: torch's compute-only CSV of {found.schedule.name!r}. Run it with torch's "
              f"_PipelineScheduleRuntime._load_csv, torchtitan's pipeline_parallel_schedule_csv, or "
              f"`pplab train --schedule {path} --impl torch --n-ranks {args.n_ranks} --n-microbatches "
              f"{args.n_microbatches}`; simulate it with `pplab simulate {path}`")
    return 0


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_search = commands.add_parser(
        "search", help="the fastest schedule for a cost model, written as torch's CSV (no processes)",
        description="Try every built-in schedule, torch's plans and pplab's list schedules on a cost model, "
                    "under a memory limit; print them fastest first and, with --csv, write the fastest as "
                    "the CSV that torch's runtime and torchtitan load. Durations are in cost units, each one "
                    "number or one per stage separated by commas.")
    add_option_flag(run_search, LabOptions, "n_ranks", required=True)
    add_option_flag(run_search, PipelineOptions, "n_microbatches", required=True)
    add_option_flag(run_search, PipelineOptions, "n_virtual", default=None,
                    because="from the per-stage costs, else 1")
    add_cost_flags(run_search)
    run_search.add_argument("--memory-limit", type=functools.partial(number, positive=True), default=None,
                            help="per rank, in microbatches of the rank's activations (default: none)")
    run_search.add_argument("--csv", metavar="FILE", default=None,
                            help="write the schedule found as torch's compute-only CSV")
    run_search.add_argument("--exact", action="store_true",
                            help="also ask a solver for the fastest schedule and its proof (one stage per "
                                 "rank; needs OR-Tools: pip install 'pplab[solver]')")
    run_search.add_argument("--exact-seconds", type=functools.partial(number, positive=True), default=60.0,
                            metavar="S", help="with --exact: the solver's time limit (default 60)")
    run_search.add_argument("--quiet", action="store_true", help="no progress bar")
    run_search.set_defaults(handler=run)
    return run_search
