"""`pplab simulate`: a schedule's predicted timeline on a cost model, with no processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pplab._version import __version__
from pplab.base.config import LabOptions, PipelineOptions
from pplab.cli.options import add_field_flags, add_option_flag, arguments_as_json, bubble_figure
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import SCHEDULE_NAMES, Kind, Schedule, build, schedule_name, theory, validate


def run(args: argparse.Namespace) -> int:
    """Predict a schedule's timeline on a cost model: picture, Chrome trace and numbers; no processes."""
    from pplab.views import viz  # matplotlib only when drawing

    job = None
    if args.torchtitan_config:
        job, schedule = schedule_of_job(args)
    elif args.schedule is None:
        raise ValueError("give a SCHEDULE (a name, or a torch CSV), or --torchtitan-config JOB.toml")
    else:
        schedule = schedule_of_csv(args) if args.schedule.endswith(".csv") else built(args)
    name = schedule.name
    validate(schedule)
    costs = costs_of(args, schedule, job)
    timeline = simulate(schedule, costs)
    textbook = theory(schedule, costs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    picture, trace, numbers = out / f"{name}.png", out / f"{name}.trace.json", out / f"{name}.json"
    sizes = f"p={schedule.n_ranks}, m={schedule.n_microbatches}" + (
        f", v={schedule.n_virtual}" if schedule.n_virtual > 1 else "")
    viz.save(viz.plot_timeline(timeline, title=f"{name} predicted ({sizes}; {_describe(costs, schedule)})"),
             picture)
    timeline.to_chrome_trace(trace)
    report = dict(
        command="pplab simulate", pplab_version=__version__, arguments=arguments_as_json(args),
        schedule=schedule.name, n_ranks=schedule.n_ranks, n_microbatches=schedule.n_microbatches,
        n_virtual=schedule.n_virtual, costs=dataclasses.asdict(costs),
        cost_per_stage={kind.value: [costs.compute_time(kind, s) for s in range(schedule.n_stages)]
                        for kind in _compute_kinds(schedule)},
        step_time=timeline.step_time(), bubble_fraction=timeline.bubble_fraction(),
        bubble_fraction_per_rank=[timeline.bubble_fraction(r) for r in range(schedule.n_ranks)],
        peak_inflight=timeline.peak_inflight_per_rank(),
        theory=dict(bubble_fraction=textbook.bubble_fraction, formula=textbook.bubble_formula,
                    conditions=textbook.conditions, peak_inflight=list(textbook.peak_inflight),
                    peak_inflight_formula=textbook.peak_inflight_formula),
        files=dict(timeline=picture.name, trace=trace.name),
    )
    if job is not None:
        report["torchtitan"] = dict(config=str(job.path), read=job.read, unmodeled=job.unmodeled,
                                    notes=job.notes)
    numbers.write_text(json.dumps(report, indent=2) + "\n")
    print(f"pplab simulate: {name} on a cost model ({sizes}; {_describe(costs, schedule)})")
    print(f"  step time {timeline.step_time():.4g} (cost units)  "
          f"bubble {bubble_figure(timeline.bubble_fraction())} "
          f"(theory {bubble_figure(textbook.bubble_fraction)})  "
          f"peak in-flight per rank {timeline.peak_inflight_per_rank()}")
    if textbook.bubble_fraction is None:
        print(f"  theory n/a: {textbook.conditions}")
    print(f"  wrote {picture}, {trace} (open in ui.perfetto.dev) and {numbers}")
    return 0


def built(args: argparse.Namespace) -> Schedule:
    """The named schedule, at the sizes the flags give."""
    name = schedule_name(args.schedule)
    for flag in ("n_ranks", "n_microbatches"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is needed for a named schedule ({name}); a "
                             "schedule read from torch's CSV (FILE.csv) brings its own sizes")
    interleaved = name == "interleaved-1f1b"
    n_virtual = args.n_virtual if args.n_virtual is not None else (2 if interleaved else 1)
    if interleaved and n_virtual < 2:
        raise ValueError(f"--n-virtual {n_virtual}: interleaved-1f1b runs 2 or more stages per rank; "
                         f"give --n-virtual 2 or more, or simulate 1f1b for one stage per rank")
    if name in SCHEDULE_NAMES and not interleaved and n_virtual != 1:
        raise ValueError(f"--n-virtual {n_virtual}: {name} runs one stage per rank; leave "
                         f"--n-virtual out, or simulate interleaved-1f1b for several stages per rank")
    return build(name, args.n_ranks, args.n_microbatches, n_virtual)


def schedule_of_csv(args: argparse.Namespace) -> Schedule:
    """The schedule of a torch CSV (either format); sizes given as flags must be the file's."""
    from pplab.schedules.torch_csv import read_either_csv

    path = Path(args.schedule)
    schedule = read_either_csv(path)
    for flag, value in (("n_ranks", schedule.n_ranks), ("n_microbatches", schedule.n_microbatches),
                        ("n_virtual", schedule.n_virtual)):
        given = getattr(args, flag)
        if given is not None and given != value:
            raise ValueError(f"--{flag.replace('_', '-')} {given}, but {path} holds {value}: leave the flag "
                             f"out (the file brings its sizes)")
    return schedule


def schedule_of_job(args: argparse.Namespace):
    """A torchtitan job's schedule at its sizes; what pplab read and left out is printed first."""
    from pplab.session.torchtitan import read_torchtitan

    if args.schedule is not None or args.n_ranks is not None or args.n_microbatches is not None:
        raise ValueError("--torchtitan-config brings the schedule and its sizes: leave SCHEDULE, --n-ranks "
                         "and --n-microbatches out")
    job = read_torchtitan(args.torchtitan_config)
    print(job.text())
    return job, job.schedule()


def costs_of(args: argparse.Namespace, schedule, job=None) -> Costs:
    """The cost model the options describe; --weight-grad only where the schedule runs W on its own. A
    torchtitan job's model, where pplab knows it, sets the forward: one unit per layer of a stage."""
    forward = args.forward
    if job is not None and job.model is not None and args.forward == 1.0:
        from pplab.models.partition import layer_ranges

        ranges = layer_ranges(job.model.num_hidden_layers, schedule.n_stages, allow_empty=True)
        forward = tuple(float(end - start) for start, end in ranges)
        print("  costs: the forward of one layer is 1 unit; the stages hold "
              f"{', '.join(str(end - start) for start, end in ranges)} of the "
              f"{job.model.num_hidden_layers} layers")
    halves = [flag for flag in ("input_grad", "weight_grad") if getattr(args, flag) is not None]
    if halves and Kind.W not in _compute_kinds(schedule):
        flag = "--" + halves[0].replace("_", "-")
        raise ValueError(f"{flag} given, but {schedule.name} runs the whole backward "
                         f"(B) in one pass, so there is no split of it to time; leave {flag} "
                         f"out, or simulate a zero-bubble schedule (zb-h1)")
    if args.bandwidth is not None and args.activation_bytes is None:
        raise ValueError(f"--bandwidth {args.bandwidth:g} needs the size of a message: give "
                         f"--activation-bytes (bytes per activation crossing a stage boundary)")
    for option in COST_FLAGS:
        value = forward if option == "forward" else getattr(args, option)
        if isinstance(value, tuple) and len(value) != schedule.n_stages:
            raise ValueError(f"--{option.replace('_', '-')} has {len(value)} values but {schedule.name} on "
                             f"{schedule.n_ranks} ranks has {schedule.n_stages} stages; give one value "
                             f"per stage or a single number")
    return costs_from_flags(args, forward_of_stages=forward)


# The cost model's options, each a flag (`add_cost_flags`): Costs' fields.
COST_FLAGS = [field.name for field in dataclasses.fields(Costs)]


def costs_from_flags(args: argparse.Namespace, forward_of_stages=None) -> Costs:
    """The cost model of the cost flags (`add_cost_flags`; `forward_of_stages` instead of --forward
    where given): the backward is twice the forward unless given (or both its halves are), and W,
    part of it, may not exceed it."""
    given = {name: getattr(args, name) for name in COST_FLAGS}
    if forward_of_stages is not None:
        given["forward"] = forward_of_stages
    if given["backward"] is None and None in (given["input_grad"], given["weight_grad"]):
        given["backward"] = _times(2, given["forward"])
    if given["weight_grad"] is not None and given["input_grad"] is None:
        per_stage = [len(v) for v in (given["forward"], given["backward"], given["weight_grad"])
                     if isinstance(v, tuple)]
        for stage in range(min(per_stage, default=1)):
            weight, whole = _stage_value(given["weight_grad"], stage), _stage_value(given["backward"], stage)
            if weight > whole:
                raise ValueError(f"--weight-grad {weight:g} exceeds the whole backward {whole:g} on stage "
                                 f"{stage} (--backward, default twice --forward): W is part of the "
                                 f"backward, the input-gradient pass I the rest; give a smaller "
                                 f"--weight-grad or a larger --backward")
    return Costs(**given)


def _times(factor: float, value):
    """factor * value, for one number or one per stage."""
    return tuple(factor * v for v in value) if isinstance(value, tuple) else factor * value


def _compute_kinds(schedule) -> list[Kind]:
    """The compute kinds (F, B or F, I, W) the schedule runs, in that order."""
    used = {a.kind for actions in schedule.actions for a in actions}
    return [kind for kind in (Kind.F, Kind.B, Kind.I, Kind.W) if kind in used]


def _stage_value(value, stage: int) -> float:
    """A duration option's value on one stage."""
    return value[stage] if isinstance(value, tuple) else value


def _describe(costs: Costs, schedule) -> str:
    """The costs in one short phrase, as the schedule uses them."""
    def show(value):
        return "/".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}"

    if Kind.W in _compute_kinds(schedule):
        halves = [costs.compute_time(kind, s) for s in range(schedule.n_stages) for kind in (Kind.I, Kind.W)]
        input_grad, weight_grad = halves[0::2], halves[1::2]
        backward = f"I={show(_one_or_all(input_grad))} W={show(_one_or_all(weight_grad))}"
    else:
        backward = f"B={show(costs.backward)}"
    link = f", latency {costs.latency:g}" if costs.latency else ""
    if costs.bandwidth is not None:
        link += f", bandwidth {costs.bandwidth:g} B/unit"
    return f"F={show(costs.forward)} {backward}{link}"


def _one_or_all(values: list[float]):
    """One number when every stage has the same, else a tuple."""
    return values[0] if len(set(values)) == 1 else tuple(values)


def add_cost_flags(parser: argparse.ArgumentParser) -> None:
    """The cost model's options (Costs' fields), as `pplab simulate` and `pplab search` take them:
    durations in cost units, or seconds to compare with a measured run."""
    add_field_flags(parser, Costs, title="the cost model (pplab.Costs)",
                    backward={"because": "twice --forward, or --input-grad + --weight-grad"})


# Why the sizes have no default here: a CSV and a torchtitan job bring their own.
SIZES_FROM_FILE = "a schedule's name needs it; a CSV or --torchtitan-config brings its own"


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_simulate = commands.add_parser(
        "simulate", help="predict a schedule's timeline on a cost model (no processes)",
        description="Build a schedule, run it on a cost model and write the predicted timeline "
                    "(PNG), a Chrome trace and the numbers (JSON). Durations are in cost units: "
                    "give seconds to compare with a measured run. Each duration is one number, "
                    "or one per stage separated by commas.")
    run_simulate.add_argument("schedule", metavar="SCHEDULE", nargs="?", default=None, help="one of "
                                                                   f"{', '.join(SCHEDULE_NAMES)} (any case; "
                                                                   "'-', '_' or nothing between words), or "
                                                                   "a torch compute-only CSV (FILE.csv, as "
                                                                   "Schedule.to_torch_csv writes it)")
    add_option_flag(run_simulate, LabOptions, "n_ranks", default=None, because=SIZES_FROM_FILE)
    add_option_flag(run_simulate, PipelineOptions, "n_microbatches", default=None, because=SIZES_FROM_FILE)
    add_option_flag(run_simulate, PipelineOptions, "n_virtual", default=None,
                    because="2 for interleaved-1f1b, else 1")
    add_cost_flags(run_simulate)
    run_simulate.add_argument("--torchtitan-config", metavar="JOB.toml", default=None,
                              help="a torchtitan job's TOML: its schedule (or schedule CSV), pipeline "
                                   "degree, microbatches and model, instead of SCHEDULE and the sizes; the "
                                   "fields pplab does not model are listed")
    run_simulate.add_argument("--out", default="pplab-simulate",
                              help="folder for the picture, the trace and the JSON (default pplab-simulate)")
    run_simulate.set_defaults(handler=run)
    return run_simulate
