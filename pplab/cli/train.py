"""`pplab train`: train on local ranks or under torchrun, the loop of `pplab.session.run.train`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

from pplab._version import __version__
from pplab.base.config import LabOptions
from pplab.cli.options import add_field_flags, add_option_flag, arguments_as_json, number
from pplab.session.run import RUN_TIMEOUT


def run(args: argparse.Namespace) -> int:
    """Train on local ranks or under torchrun (the same loop as a lab pipeline's `train`): `run.train`."""
    from pplab.base.checkpoint_files import resume_path

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
        report = {"pplab": __version__, "arguments": arguments_as_json(args),
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
    return RunConfig(**{**same, "pp": pp})  # --clip 0 is None already (its flag reads it so)



# --- pplab train --config: a TOML file of the same options ---------------------------------------

def with_config(parser: argparse.ArgumentParser, argv: list[str] | None, path: str) -> argparse.Namespace:
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
        flag = actions["n_ranks" if dest == "pp" else dest]  # every field has its flag; pp: --n-ranks's check
        values[dest] = _converted(flag, key, value, path)
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


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_train = commands.add_parser(
        "train", help="train a model on the embedded corpus or your text, with checkpoints "
                      "(local ranks or torchrun)",
        parents=[ranks_run],
        description="Train a LLaMA-style model (tiny by default) on the embedded corpus or on your text "
                    "with a character or byte-level BPE tokenizer: AdamW, warm-up then cosine, global-norm "
                    "clipping, held-out evaluation, distributed checkpoints; a mesh with --dp and --tp. "
                    "Runs --n-ranks local processes, or one rank per process under torchrun "
                    "(torchrun --standalone --nproc_per_node=N -m pplab train ...).")
    add_option_flag(run_train, LabOptions, "n_ranks", when="local ranks to start, pp = N / (dp x tp)")
    run_train.add_argument("--timeout", type=functools.partial(number, positive=True), default=RUN_TIMEOUT,
                           help=f"local ranks: seconds the whole training may take (default {RUN_TIMEOUT:g})")
    run_train.add_argument("--report", default=None, help="write every step's record as JSON to this file")
    run_train.add_argument("--config", default=None,
                           help="a TOML file of the options below (their names, with _ for -; in tables or "
                                "not; the older virtual_stages and microbatches read too); flags win")
    run_train.add_argument("--print-config", action="store_true",
                           help="print the resolved options as TOML and start nothing")
    from pplab.session.run import (
        RunConfig,  # its fields are the options: each one's flag, help, default, check
    )

    add_field_flags(run_train, RunConfig, skip=("pp",))  # pp follows from --n-ranks, --dp and --tp
    run_train.set_defaults(handler=run)
    return run_train
