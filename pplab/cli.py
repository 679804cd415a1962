"""The `pplab` command: headless demos and reports, no Jupyter needed."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pplab
from pplab.schedules import SCHEDULE_NAMES, Kind, build, schedule_name, theory, validate
from pplab.schedules.names import TORCH_ONLY_NAMES
from pplab.simulator import Costs, simulate

DEMO_SCHEDULES = {  # per runtime: (schedule, stages per rank)
    "pplab": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)),
    "torch": (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv-zero-bubble", 2)),
}


def demo(args: argparse.Namespace) -> int:
    """Run every schedule on local ranks (CPU, gloo, embedded data): parity, bubble, pictures, report."""
    # torch and matplotlib only here: `pplab simulate` starts without them.
    import torch

    from pplab.views import viz
    from pplab.data import batches
    from pplab.drivers.torchrun import TorchrunRanks, under_torchrun
    from pplab.model import LlamaConfig, build_model
    from pplab.rank.rank_pipeline import PipelineSpec
    from pplab.rank.reference import reference_step
    from pplab.session import Pipeline, RankPool

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
        print(f"  {name:23s} loss {first.loss:.5f}  parity {'ok' if parity_ok else 'FAILED'} "
              f"(max |grad diff| {max(p.max_abs_diff for p in parities):.1e})  "
              f"gradient flow {'ok' if flow_ok else 'FAILED'}  "
              f"bubble {first.timeline.bubble_fraction():.3f} (theory {_figure(textbook.bubble_fraction)})  "
              f"peak in-flight rank 0: {first.timeline.peak_inflight(0)}")
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
    report = dict(command="pplab demo", passed=not failures, pplab_version=pplab.__version__,
                  torch_version=torch.__version__, arguments=_arguments(args), schedules=schedules)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("measured bubbles include each message's real cost (about a millisecond per hop here), "
          "which the theory leaves out")
    print(f"timelines (predicted vs measured) and Chrome traces (open in ui.perfetto.dev) in {out}/; "
          f"the numbers in {out / 'report.json'}")
    return 1 if failures else 0


def simulate_command(args: argparse.Namespace) -> int:
    """Predict a schedule's timeline on a cost model: picture, Chrome trace and numbers; no processes."""
    from pplab.views import viz  # matplotlib only when drawing

    name = schedule_name(args.schedule)
    interleaved = name == "interleaved-1f1b"
    n_virtual = args.n_virtual if args.n_virtual is not None else (2 if interleaved else 1)
    if interleaved and n_virtual < 2:
        raise ValueError(f"--n-virtual {n_virtual}: interleaved-1f1b runs 2 or more stages per rank; "
                         f"give --n-virtual 2 or more, or simulate 1f1b for one stage per rank")
    if name in SCHEDULE_NAMES and not interleaved and n_virtual != 1:
        raise ValueError(f"--n-virtual {n_virtual}: {name} runs one stage per rank; leave "
                         f"--n-virtual out, or simulate interleaved-1f1b for several stages per rank")
    schedule = build(name, args.n_ranks, args.n_microbatches, n_virtual)
    validate(schedule)
    costs = _costs(args, schedule)
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
        command="pplab simulate", pplab_version=pplab.__version__, arguments=_arguments(args),
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
    numbers.write_text(json.dumps(report, indent=2) + "\n")
    print(f"pplab simulate: {name} on a cost model ({sizes}; {_describe(costs, schedule)})")
    print(f"  step time {timeline.step_time():.4g} (cost units)  bubble {timeline.bubble_fraction():.3f} "
          f"(theory {_figure(textbook.bubble_fraction)})  peak in-flight per rank "
          f"{timeline.peak_inflight_per_rank()}")
    if textbook.bubble_fraction is None:
        print(f"  theory n/a: {textbook.conditions}")
    print(f"  wrote {picture}, {trace} (open in ui.perfetto.dev) and {numbers}")
    return 0


def _costs(args: argparse.Namespace, schedule) -> Costs:
    """The cost model the options describe; --weight only where the schedule runs W on its own."""
    if args.weight is not None and Kind.W not in _compute_kinds(schedule):
        raise ValueError(f"--weight given, but {schedule.name} runs the whole backward "
                         f"(B) in one pass, so there is no weight-gradient pass to time; leave --weight "
                         f"out, or simulate a zero-bubble schedule (zb-h1)")
    if args.bandwidth is not None and args.activation_bytes is None:
        raise ValueError(f"--bandwidth {args.bandwidth:g} needs the size of a message: give "
                         f"--activation-bytes (bytes per activation crossing a stage boundary)")
    for option in ("forward", "backward", "weight"):
        value = getattr(args, option)
        if isinstance(value, tuple) and len(value) != schedule.n_stages:
            raise ValueError(f"--{option} has {len(value)} values but {schedule.name} on "
                             f"{schedule.n_ranks} ranks has {schedule.n_stages} stages; give one value "
                             f"per stage or a single number")
    backward = args.backward if args.backward is not None else _times(2, args.forward)
    if args.weight is not None:
        for stage in range(schedule.n_stages):
            weight, whole = _stage_value(args.weight, stage), _stage_value(backward, stage)
            if weight > whole:
                raise ValueError(f"--weight {weight:g} exceeds the whole backward {whole:g} on stage "
                                 f"{stage} (--backward, default twice --forward): W is part of the "
                                 f"backward, the input-gradient pass I the rest; give a smaller --weight "
                                 f"or a larger --backward")
    return Costs(forward=args.forward, backward=backward, weight_grad=args.weight, latency=args.latency,
                 bandwidth=args.bandwidth, activation_bytes=args.activation_bytes)


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


def _arguments(args: argparse.Namespace) -> dict:
    """The command's arguments as JSON can hold them."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in vars(args).items() if key != "handler"}


def _figure(value: float | None) -> str:
    """A bubble fraction as the demo prints it, or "n/a" when theory has no closed form."""
    return "n/a" if value is None else f"{value:.3f}"


def train_command(args: argparse.Namespace) -> int:
    """Train on local ranks or under torchrun (the same loop as a lab pipeline's `train`): `run.train`."""
    from pplab.checkpoint_files import resume_path

    if args.resume is not None:  # found and its manifest read before torch loads or any rank starts
        resume_path(args.resume, args.checkpoint_dir)
    from pplab.drivers.torchrun import under_torchrun
    from pplab.session import run

    config = run_config(args)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    spec = config.pipeline_spec(world_size)  # bad options fail here, before any rank starts
    config.training().check(spec.schedule.n_microbatches, spec.config, spec.replicas)
    if os.environ.get("RANK", "0") == "0":
        where = "ranks started by torchrun" if under_torchrun() else "local ranks (gloo)"
        print(f"pplab train: {spec.schedule.name} ({config.impl}) on {spec.world_size} {where}, "
              f"{config.n_microbatches} microbatches, "
              + (f"{config.epochs} epochs" if config.epochs else f"{config.steps} steps")
              + (f", resuming from {config.resume}" if config.resume else ""), flush=True)
    started = time.perf_counter()
    history = run.train(config, timeout=args.timeout)
    if history is None:  # a torchrun process other than rank 0
        return 0
    records = history.records
    if records:
        evaluations = ", ".join(f"{step}: {loss:.3f}" for step, loss in history.eval_losses)
        print(f"done in {time.perf_counter() - started:.1f} s: loss {records[0].loss:.3f} (step "
              f"{records[0].step}) -> {records[-1].loss:.3f} (step {records[-1].step})"
              + (f"; held-out loss {evaluations}" if evaluations else ""))
    else:
        print(f"nothing to do: the checkpoint is at step {config.steps} already")
    saved = [r.checkpoint for r in records if r.checkpoint]
    if saved:
        print(f"last checkpoint: {saved[-1]}")
    if args.report:
        report = {"pplab": pplab.__version__, "arguments": _arguments(args),
                  "resumed_from": history.resumed_from,
                  "records": [dataclasses.asdict(r) for r in records]}
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1))
    return 0


def run_config(args: argparse.Namespace):
    """The run's `RunConfig` from the command line's flags (and --config's file, read into them)."""
    from pplab.drivers.torchrun import under_torchrun
    from pplab.session.run import RunConfig, stages_of

    n_ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.n_ranks
    pp = stages_of(n_ranks, args.dp, args.tp, said="--dp {dp} x --tp {tp}")
    same = {name: getattr(args, name) for name in RunConfig.names() if hasattr(args, name)}
    return RunConfig(**{**same, "pp": pp, "clip": args.clip or None})


def _betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give two numbers, e.g. 0.9,0.95")
    return tuple(_number(part) for part in parts)


# --- pplab train --config: a TOML file of the same options ---------------------------------------

def _with_config(parser: argparse.ArgumentParser, argv: list[str] | None, path: str) -> argparse.Namespace:
    """The arguments with a TOML file's values (a `RunConfig`'s fields) as defaults: a flag given on
    the command line wins. Keys are checked against RunConfig's fields, values as the flags check them."""
    import tomllib

    from pplab.session.run import ALIASES, RunConfig, flattened

    RunConfig.from_toml(path)  # unknown keys and unreadable files: one line naming the valid keys
    train = parser.train_parser
    actions = {a.dest: a for a in train._actions}
    values = {}
    for key, value in flattened(tomllib.loads(Path(path).read_text(encoding="utf-8"))).items():
        dest = key.replace("-", "_")
        dest = ALIASES.get(dest, dest)
        flag = actions.get("n_ranks" if dest == "pp" else dest)  # pp: the flag gives pp x dp x tp ranks
        values[dest] = _converted(flag, key, value, path) if flag else value  # a few have no flag (eval_batches)
    pp = values.pop("pp", None)
    train.set_defaults(**values)
    args = parser.parse_args(argv)
    if pp is not None and "--n-ranks" not in (argv if argv is not None else sys.argv[1:]):
        args.n_ranks = pp * args.dp * args.tp  # the ranks follow from the mesh, flags included
    return args


def _converted(action: argparse.Action, key: str, value, path: str):
    """A TOML value checked as the command line checks the flag's text."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path!r}: {key} = {value!r}: give true or false")
        return value
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    try:
        converted = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise ValueError(f"--config {path!r}: {key} = {value!r}: {error}") from None
    if action.choices and converted not in action.choices:
        raise ValueError(f"--config {path!r}: {key} = {value!r}: choose one of {', '.join(action.choices)}")
    return converted


def print_config(args: argparse.Namespace) -> None:
    """The run's resolved configuration (flags over --config over defaults), as a file --config reads."""
    print("# pplab train, resolved: flags over --config over defaults")
    print(run_config(args).to_toml(), end="")


def _balance(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(","))


def cleanup(args: argparse.Namespace) -> int:
    """Stop lab clusters left behind by killed kernels (all labs with --force)."""
    from pplab.drivers.cluster import cleanup as stop_orphans

    stopped = stop_orphans(force=args.force)
    print(f"pplab cleanup: {len(stopped)} lab(s) stopped" if stopped else "pplab cleanup: nothing to stop")
    return 0


def room_command(args: argparse.Namespace) -> int:
    """Serve the room (every attendee's lab and exercise verdicts, pplab.course.room) as a page on loopback."""
    import http.server
    import json as json_module

    from pplab.course import room
    from pplab.course.exercises import EXERCISES

    if args.drill is not None:
        return _drill(args.drill)
    if args.folder is None:
        raise ValueError("pplab room: give the room's FOLDER to serve, or --drill N to measure the room")
    try:
        room.make_room(args.folder)  # writable by every attendee, sticky (pplab.course.room.make_room)
    except OSError as error:
        raise ValueError(f"{args.folder}: cannot make the room there ({error.strerror}); give a folder "
                         f"you may create") from None

    class RoomPage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            try:
                seats = room.read_room(args.folder)
            except ValueError as error:  # the folder went away: say so on the page
                self.send_error(500, str(error))
                return
            if self.path == "/room.json":
                body, kind = json_module.dumps([vars(seat) for seat in seats]), "application/json"
            elif self.path == "/":
                body, kind = _room_page(seats, EXERCISES, args.folder, args.refresh), "text/html; charset=utf-8"
            else:
                self.send_error(404, "the room is at / (and /room.json)")
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):  # one line per reload would drown the terminal
            pass

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: give a port between 1 and 65535 (0: any free one)")
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), RoomPage)
    except OSError as error:
        raise ValueError(f"--port {args.port}: cannot listen there ({error.strerror}); give another "
                         f"port, or 0 for any free one") from None
    print(f"pplab room: {args.folder} at http://127.0.0.1:{server.server_address[1]}/ (loopback only; "
          f"from a laptop: ssh -L {server.server_address[1]}:127.0.0.1:{server.server_address[1]} this server). "
          f"Ctrl-C stops it.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _drill(seats: int) -> int:
    """One seat alone, then `seats` at once: every verdict right, and what the crowd costs a seat."""
    from pplab.machine import measure_load
    from pplab.course.drill import drill, drill_table

    print(f"pplab room --drill {seats}: on {measure_load().describe()}")
    results = []
    for count in dict.fromkeys((1, seats)):
        print(f"{count} seat(s) at once:", flush=True)
        results.append(drill(count))
    print(drill_table(results))
    return 0 if all(result.all_right for result in results) else 1


def _room_page(seats, exercises, folder, refresh: float) -> str:
    import html as html_module

    from pplab.course import room

    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            f"<noscript><meta http-equiv='refresh' content='{refresh:g}'></noscript>"
            f"<title>pplab room</title><style>body{{font-family:sans-serif;margin:20px}}</style>{room.TABLE_STYLE}"
            f"</head><body><h2>pplab room: {html_module.escape(str(folder))}</h2>"
            f"<main id='room'><p>{html_module.escape(room.room_summary(seats))} (re-read every {refresh:g} s)</p>"
            f"{room.room_table_html(seats, exercises)}</main><p id='trouble' style='color:#b00'></p>"
            f"<script>{_ROOM_RELOADER.replace('INTERVAL_MS', str(round(refresh * 1000)))}</script></body></html>")


# The page re-reads itself in place rather than by a meta refresh: a reload that fails (the server
# restarting, the network changing under the browser) would leave an error page that never reloads,
# where this keeps the last table, says what went wrong, and tries again.
_ROOM_RELOADER = """
async function reread() {
  const trouble = document.getElementById('trouble');
  try {
    const answer = await fetch(location.pathname, {cache: 'no-store'});
    if (!answer.ok) throw new Error('the server answered ' + answer.status);
    const page = new DOMParser().parseFromString(await answer.text(), 'text/html');
    document.getElementById('room').innerHTML = page.getElementById('room').innerHTML;
    trouble.textContent = '';
  } catch (error) {
    trouble.textContent = 'could not re-read the room at ' + new Date().toLocaleTimeString()
      + ' (' + error.message + '); the table above is the last one read; trying again';
  }
  setTimeout(reread, INTERVAL_MS);
}
setTimeout(reread, INTERVAL_MS);
"""


def _positive_int(text: str) -> int:
    """An option's whole number >= 1, or argparse's error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _number(text: str, positive: bool = False) -> float:
    """An option's finite number >= 0 (> 0 when `positive`), or argparse's error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number {'> 0' if positive else '>= 0'}")
    return value


def _per_stage(text: str) -> float | tuple[float, ...]:
    """One duration for every stage ("1.5"), or one per stage separated by commas ("1,1,2,1")."""
    parts = text.split(",")
    try:
        values = tuple(_number(part.strip()) for part in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration >= 0, nor one per stage "
                                         f"separated by commas (e.g. 1 or 1,1,2,1)") from None
    return values[0] if len(values) == 1 else values


def analyze_command(args: argparse.Namespace) -> int:
    """Read a profiled run's traces and explain its bubble: picture, Chrome trace, JSON and a report."""
    from pplab.bubble import explain, named_schedule
    from pplab.profiled import read_profiler_traces
    from pplab.views import viz  # matplotlib only when drawing

    run = read_profiler_traces(args.traces, step=args.step)
    n_ranks = run.timeline.n_ranks
    schedule = named_schedule(args.schedule, n_ranks, args.n_microbatches, args.n_virtual)
    # The trace's other steps weigh in the straggler's verdict: a busy machine slows an action
    # once, rarely every time.
    others = [read_profiler_traces(args.traces, step=index).timeline
              for index in range(run.steps_in_trace) if index != run.step]
    report = explain(run.timeline, schedule, run.outside, steps=others)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    picture, trace, numbers, text = (out / "timeline.png", out / "timeline.trace.json", out / "report.json",
                                     out / "report.txt")
    viz.save(viz.compare_timelines(run.timeline, report.simulated,
                                   titles=(f"measured: {schedule.name}, from {n_ranks} profiler traces",
                                           "simulated on the measured costs")), picture)
    run.timeline.to_chrome_trace(trace)
    said = run.summary().splitlines()[0] + "\n" + report.text()
    text.write_text(said + "\n")
    numbers.write_text(json.dumps(dict(
        command="pplab analyze", pplab_version=pplab.__version__, arguments=_arguments(args), files=run.files,
        step=run.step, steps_in_trace=run.steps_in_trace, labels=run.labels, one_host=run.one_host,
        alignment_error=run.alignment_error, **report.to_json(),
        outputs=dict(timeline=picture.name, trace=trace.name, report=text.name)), indent=2) + "\n")
    print(said)
    print(f"wrote {picture}, {trace}, {numbers} and {text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="pplab", description=__doc__)
    ranks_run = argparse.ArgumentParser(add_help=False)  # what every command that starts ranks takes
    ranks_run.add_argument("--verbose", action="store_true",
                           help="show a failing rank's whole traceback, not one line per rank")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="every schedule on local ranks, checked and drawn (CPU)",
                                   parents=[ranks_run])
    run_demo.add_argument("--n-ranks", type=_positive_int, default=4, metavar="N",
                          help="local ranks to start (default 4; torchrun decides its own)")
    run_demo.add_argument("--n-microbatches", type=_positive_int, default=8, metavar="N",
                          help="microbatches per step (default 8)")
    run_demo.add_argument("--microbatch-size", type=_positive_int, default=2)
    run_demo.add_argument("--seq-len", type=_positive_int, default=32)
    run_demo.add_argument("--forward", type=_number, default=0.05,
                          help="timing mode: seconds per forward (backward takes twice as long)")
    run_demo.add_argument("--steps", type=_positive_int, default=1,
                          help="steps of each schedule on the same ranks (no optimizer: each must "
                               "repeat the first)")
    run_demo.add_argument("--seed", type=int, default=0)
    run_demo.add_argument("--impl", choices=("pplab", "torch"), default="pplab",
                          help="the hand-written runtime, or torch.distributed.pipelining's schedules")
    run_demo.add_argument("--out", default="pplab-demo",
                          help="folder for pictures, traces and report.json")
    run_demo.set_defaults(handler=demo)
    run_simulate = commands.add_parser(
        "simulate", help="predict a schedule's timeline on a cost model (no processes)",
        description="Build a schedule, run it on a cost model and write the predicted timeline "
                    "(PNG), a Chrome trace and the numbers (JSON). Durations are in cost units: "
                    "give seconds to compare with a measured run. Each duration is one number, "
                    "or one per stage separated by commas.")
    run_simulate.add_argument("schedule", metavar="SCHEDULE", help=f"one of {', '.join(SCHEDULE_NAMES)} "
                                                                   f"(any case; '-', '_' or nothing between words)")
    run_simulate.add_argument("--n-ranks", type=_positive_int, required=True, metavar="N", help="ranks")
    run_simulate.add_argument("--n-microbatches", type=_positive_int, required=True, metavar="N",
                              help="microbatches per step")
    run_simulate.add_argument("--n-virtual", type=_positive_int, default=None, metavar="N",
                              help="stages per rank (interleaved-1f1b: default 2; others: 1)")
    run_simulate.add_argument("--forward", type=_per_stage, default=1.0,
                              help="forward F of one stage (an interleaved chunk is a stage; default 1)")
    run_simulate.add_argument("--backward", type=_per_stage, default=None,
                              help="whole backward B (default twice the forward)")
    run_simulate.add_argument("--weight", type=_per_stage, default=None,
                              help="zero-bubble schedules: the weight-gradient pass W, part of the "
                                   "backward (the input-gradient pass I is the rest; default half)")
    run_simulate.add_argument("--latency", type=_number, default=0.0,
                              help="time a message between ranks takes (default 0)")
    run_simulate.add_argument("--bandwidth", type=functools.partial(_number, positive=True), default=None,
                              help="bytes per cost unit of a link (needs --activation-bytes)")
    run_simulate.add_argument("--activation-bytes", type=_positive_int, default=None,
                              help="bytes of an activation (or its gradient) crossing a stage boundary")
    run_simulate.add_argument("--out", default="pplab-simulate",
                              help="folder for the picture, the trace and the JSON (default pplab-simulate)")
    run_simulate.set_defaults(handler=simulate_command)
    run_train = commands.add_parser(
        "train", help="train a model on the embedded corpus or your text, with checkpoints (local ranks or torchrun)",
        parents=[ranks_run],
        description="Train a LLaMA-style model (tiny by default) on the embedded corpus or on your text "
                    "with a character or byte-level BPE tokenizer: AdamW, warm-up then cosine, global-norm "
                    "clipping, held-out evaluation, distributed checkpoints; a mesh with --dp and --tp. "
                    "Runs --n-ranks local processes, or one rank per process under torchrun "
                    "(torchrun --standalone --nproc_per_node=N -m pplab train ...).")
    run_train.add_argument("--n-ranks", type=_positive_int, default=2, metavar="N",
                           help="local ranks to start (default 2; torchrun decides its own)")
    run_train.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULE_NAMES)}; with "
                           f"--impl torch also {', '.join(TORCH_ONLY_NAMES)} "
                           f"(any case; torch's class names work too)")
    run_train.add_argument("--impl", choices=("pplab", "torch"), default="pplab",
                           help="the hand-written runtime, or torch.distributed.pipelining's schedules")
    run_train.add_argument("--n-microbatches", type=_positive_int, default=4, metavar="N",
                           help="microbatches per step (default 4)")
    run_train.add_argument("--n-virtual", type=_positive_int, default=1, metavar="N",
                           help="stages per rank (default 1; interleaved and torch's multi-stage schedules: 2+)")
    run_train.add_argument("--steps", type=_positive_int, default=200,
                           help="training steps: the LR schedule's horizon (default 200)")
    run_train.add_argument("--batch-size", type=_positive_int, default=8,
                           help="sequences per step, cut into the microbatches (default 8)")
    run_train.add_argument("--seq-len", type=_positive_int, default=64)
    run_train.add_argument("--lr", type=functools.partial(_number, positive=True), default=3e-3)
    run_train.add_argument("--min-lr", type=_number, default=3e-4,
                           help="the LR at the end of the cosine (default 3e-4; 0 decays to zero)")
    run_train.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    run_train.add_argument("--weight-decay", type=_number, default=0.1, help="AdamW's, on matrices only")
    run_train.add_argument("--betas", type=_betas, default=(0.9, 0.95), help="AdamW's, e.g. 0.9,0.95")
    run_train.add_argument("--eps", type=functools.partial(_number, positive=True), default=1e-8)
    run_train.add_argument("--model", default="tiny",
                           help="tiny, small, or a config.json (pplab's fields, or a Hugging Face config)")
    run_train.add_argument("--data", default=None,
                           help="a text file, a directory of .txt files or a dataset saved with the datasets "
                                "library (default: the embedded corpus)")
    run_train.add_argument("--tokenizer", default="char",
                           help="char, bpe (byte-level, trained on --data, saved beside the checkpoints), "
                                "or a tokenizer.json")
    run_train.add_argument("--vocab-size", type=_positive_int, default=512, help="the BPE's vocabulary")
    run_train.add_argument("--epochs", type=_positive_int, default=None,
                           help="passes over --data's training text (instead of --steps)")
    run_train.add_argument("--dp", type=_positive_int, default=1, help="FSDP replicas (a mesh; --impl torch)")
    run_train.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (a mesh; --impl torch)")
    run_train.add_argument("--clip", type=_number, default=1.0, help="max global gradient norm (0: none)")
    run_train.add_argument("--seed", type=int, default=0, help="model initialisation")
    run_train.add_argument("--data-seed", type=int, default=0)
    run_train.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    run_train.add_argument("--checkpoint-dir", default=None)
    run_train.add_argument("--checkpoint-every", type=int, default=0, help="0: only at the end")
    run_train.add_argument("--keep", type=_positive_int, default=3, help="complete checkpoints kept")
    run_train.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    run_train.add_argument("--resume", default=None, help="'latest' (in --checkpoint-dir) or a checkpoint path")
    run_train.add_argument("--timeout", type=functools.partial(_number, positive=True), default=3600.0,
                           help="local ranks: seconds the whole training may take (default 3600)")
    run_train.add_argument("--report", default=None, help="write every step's record as JSON to this file")
    run_train.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                           help="the stages' weights and activations (bfloat16: a pipeline alone; the loss in fp32)")
    run_train.add_argument("--balance", type=_balance, default=None,
                           help="layers per stage, e.g. 3,5 (default: as even as possible)")
    run_train.add_argument("--config", default=None,
                           help="a TOML file of these options (names with _ instead of -; seed 003's pp, dp, "
                                "tp, schedule, virtual_stages, microbatches, balance read too); flags win")
    run_train.add_argument("--print-config", action="store_true",
                           help="print the resolved options as TOML and start nothing")
    run_train.set_defaults(handler=train_command)
    parser.train_parser = run_train  # where --config's values become defaults
    run_analyze = commands.add_parser(
        "analyze", help="explain a torch.profiler run's bubble: which rank, which microbatch, waiting on whom",
        description="Read one step of a pipeline run recorded with torch.profiler (one Kineto JSON per rank, "
                    "or their folder), and explain each rank's bubble: the schedule's own, waits for messages, "
                    "a straggler, time outside the pipeline; then predict what one change would gain.")
    run_analyze.add_argument("traces", metavar="TRACES", nargs="+", help="the ranks' trace files, or their folder")
    run_analyze.add_argument("--schedule", required=True, metavar="NAME",
                             help="the schedule the run used (pplab's or torch's name, any spelling)")
    run_analyze.add_argument("--n-microbatches", type=_positive_int, required=True, metavar="N",
                             help="microbatches per step")
    run_analyze.add_argument("--n-virtual", type=_positive_int, default=1, metavar="N", help="stages per rank")
    run_analyze.add_argument("--step", type=int, default=-1,
                             help="which of the traces' steps (0 = the first; default -1, the last)")
    run_analyze.add_argument("--out", default="pplab-analysis", help="folder for the picture, trace and report")
    run_analyze.set_defaults(handler=analyze_command)
    run_room = commands.add_parser(
        "room", help="an instructor's page of the room: every attendee's lab and exercise verdicts",
        description="Serve, on loopback, a page listing every attendee's lab (seat, device, GPUs, ranks, "
                    "running or dead, last activity) and exercise verdicts, from what the labs and checkers "
                    "write to the folder the attendees have as PPLAB_ROOM (docs/instructor.md).")
    run_room.add_argument("folder", nargs="?", help="the room's folder (the attendees' PPLAB_ROOM; made if missing)")
    run_room.add_argument("--drill", type=_positive_int, metavar="N",
                          help="instead: measure this machine's room, one seat alone then N seats at once, "
                               "each an attendee's lessons on a 2-rank lab (pplab.course.drill)")
    run_room.add_argument("--port", type=int, default=8765, help="loopback port (default 8765; 0: any free one)")
    run_room.add_argument("--refresh", type=functools.partial(_number, positive=True), default=3.0,
                          help="seconds between the page's reloads (default 3)")
    run_room.set_defaults(handler=room_command)
    run_cleanup = commands.add_parser("cleanup", help="stop lab clusters left by killed kernels")
    run_cleanup.add_argument("--force", action="store_true", help="also stop labs of running kernels")
    run_cleanup.set_defaults(handler=cleanup)
    return parser


# The last release's flags: they still work, for one release, with a DeprecationWarning.
RENAMED_FLAGS = {"--ranks": "--n-ranks", "--microbatches": "--n-microbatches", "--virtual": "--n-virtual"}


def with_renamed_flags(argv: list[str]) -> list[str]:
    """`argv` with the last release's flags (`--ranks 2`, `--microbatches=4`) under their new names,
    each one said on stderr as a DeprecationWarning naming the new flag."""
    renamed = []
    for argument in argv:
        flag, equals, value = argument.partition("=")
        if flag in RENAMED_FLAGS:
            message = f"{flag} is now {RENAMED_FLAGS[flag]}; {flag} works until the next release"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            print(f"pplab: DeprecationWarning: {message}", file=sys.stderr)
            argument = RENAMED_FLAGS[flag] + equals + value
        renamed.append(argument)
    return renamed


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pplab` command: 0 when all went well, 1 when a check failed, 2 for bad input."""
    parser = build_parser()
    argv = with_renamed_flags(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)  # argparse itself exits 2 on malformed options
    from pplab.rank.rank_context import RankError

    try:
        try:
            if getattr(args, "config", None):
                args = _with_config(parser, argv, args.config)
            if getattr(args, "print_config", False):
                print_config(args)
                return 0
            return args.handler(args)
        except ValueError as error:
            if isinstance(error.__cause__, RankError):  # the ranks refused it (a checkpoint): say each
                raise error.__cause__ from None
            raise
    except ValueError as error:  # what pplab raises for values it cannot use: one line, as argparse would
        print(f"pplab {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RankError as error:  # a rank failed: its cause, one line per rank (--verbose: the tracebacks)
        verbose = getattr(args, "verbose", False)
        print(f"pplab {args.command}: error: {error if verbose else error.summary}", file=sys.stderr)
        return 1
