"""`pplab workshop`: a workshop on JupyterHub in one command (pplab.course.hub): init a folder, start
its hub."""

from __future__ import annotations

import argparse

from pplab.base.config import LabOptions
from pplab.cli.options import add_option_flag


def run(args: argparse.Namespace) -> int:
    """Write a workshop's folder, start its hub, or remove the accounts it made."""
    from pplab.course.hub import workshop

    if args.action == "init":
        made = workshop.init(args.folder, args.seats, instructors=args.instructor, gpus=args.gpus,
                             notebooks=args.notebooks, bind_url=args.bind_url, make_users=args.make_users,
                             prefix=args.prefix, ranks_per_seat=args.n_ranks, room_url=args.room_url)
        print(made.describe())
        print(f"pplab workshop: wrote {args.folder}/{workshop.CONFIG} and {workshop.README}"
              f"{' (accounts and passwords in seats.csv, root only)' if args.make_users else ''}; "
              f"start it with: sudo pplab workshop start {args.folder}")
        return 0
    if args.action == "start":
        workshop.start(args.folder)  # becomes the hub's process
        return 0
    removed = workshop.remove_users(args.folder)
    print(f"pplab workshop: removed {len(removed)} account(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


def _gpus(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give the server's GPUs to use (0 for none) or 'auto'")
    return int(text)


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    command = commands.add_parser(
        "workshop", help="a workshop on JupyterHub: a seat per account on the server's GPUs, the "
                         "room behind its login",
        description="Make a workshop's folder (the hub's jupyterhub_config.py, a README, the seats' "
                    "accounts), start its JupyterHub (as root), or remove the accounts it made. Needs "
                    "pplab[hub] and configurable-http-proxy (npm); docs/instructor.md.")
    actions = command.add_subparsers(dest="action", required=True)
    init = actions.add_parser("init", help="write a workshop's folder")
    init.add_argument("folder", help="the workshop's folder (made; its room folder goes inside)")
    init.add_argument("--seats", required=True,
                      help="how many seats (seat-01, seat-02, ...) or their accounts' names, comma-separated")
    init.add_argument("--instructor", action="append", required=True, metavar="ACCOUNT",
                      help="an account that may open the room's page (repeat for several)")
    init.add_argument("--gpus", type=_gpus, default="auto",
                      help="the server's GPUs to deal round the seats ('auto': all it has; 0: labs on CPU)")
    add_option_flag(init, LabOptions, "n_ranks", when="of a lesson's lab, for the plan of the GPUs")
    init.add_argument("--notebooks", help="the course to copy into each seat's home "
                                          "(default: pplab's notebooks/)")
    init.add_argument("--make-users", action="store_true",
                      help="make the accounts that do not exist, with fresh passwords in seats.csv (root)")
    init.add_argument("--prefix", default="seat-", help="with a number of seats: their "
                                                        "accounts' prefix (seat-)")
    init.add_argument("--bind-url", default="http://:8000",
                      help="where the attendees' browsers reach the hub (default "
                           "http://:8000, every interface)")
    init.add_argument("--room-url", default="http://127.0.0.1:8765",
                      help="where the room's service listens behind the hub (default http://127.0.0.1:8765)")
    start = actions.add_parser("start", help="run the workshop's hub (as root; Ctrl-C stops it "
                                             "and the seats' servers)")
    start.add_argument("folder")
    remove = actions.add_parser("remove-users", help="remove the accounts the workshop's init "
                                                     "made, with their homes")
    remove.add_argument("folder")
    command.set_defaults(handler=run)
    return command
