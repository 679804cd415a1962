"""`pplab cleanup`: stop the labs that killed kernels left behind."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """Stop lab clusters left behind by killed kernels (all labs with --force)."""
    from pplab.drivers.cluster import cleanup as stop_orphans

    stopped = stop_orphans(force=args.force, kept=True)  # what kernels keep for their next lab too
    print(f"pplab cleanup: {len(stopped)} lab(s) stopped" if stopped else "pplab cleanup: nothing to stop")
    return 0


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_cleanup = commands.add_parser("cleanup", help="stop lab clusters left by killed kernels, and "
                                                      "the controllers and fork servers kept for a next lab")
    run_cleanup.add_argument("--force", action="store_true", help="also stop labs of running kernels")
    run_cleanup.set_defaults(handler=run)
    return run_cleanup
