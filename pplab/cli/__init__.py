"""Floor 8, the `pplab` command: headless demos and reports, no Jupyter needed. One module per subcommand
(its flags and what it runs); this one assembles them and turns errors into one line each."""

from __future__ import annotations

import argparse
import sys
import warnings

from pplab.cli import analyze, cleanup, demo, doctor, room, search, simulate, train, workshop

# in the order `pplab --help` lists them
COMMANDS = (demo, simulate, search, doctor, train, analyze, room, workshop, cleanup)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="pplab", description="The `pplab` command: headless demos and reports, no Jupyter needed.")
    ranks_run = argparse.ArgumentParser(add_help=False)  # what every command that starts ranks takes
    ranks_run.add_argument("--verbose", action="store_true",
                           help="show a failing rank's whole traceback, not one line per rank")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        added = command.add_to(commands, ranks_run)
        if command is train:
            parser.train_parser = added  # where --config's values become defaults
    return parser




def with_renamed_flags(argv: list[str]) -> list[str]:
    """`argv` with the last release's flags (`--ranks 2`, `--microbatches=4`) under their new names,
    each one said on stderr as a DeprecationWarning naming the new flag."""
    from pplab.base.renames import rows, said

    renamed, old_flags = [], rows("flag")
    for argument in argv:
        flag, equals, value = argument.partition("=")
        if flag in old_flags:
            row = old_flags[flag]
            warnings.warn(said(row), DeprecationWarning, stacklevel=2)
            print(f"pplab: DeprecationWarning: {said(row)}", file=sys.stderr)
            argument = row.new + equals + value
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
                args = train.with_config(parser, argv, args.config)
            if getattr(args, "print_config", False):
                train.print_config(args)
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
