"""`pplab room`: the instructor's page of the room, served on loopback, or a drill that measures the room."""

from __future__ import annotations

import argparse
import functools

from pplab.base.config import LabOptions
from pplab.cli.options import add_option_flag, number, positive_int


def run(args: argparse.Namespace) -> int:
    """Serve the room (every attendee's lab and exercise verdicts,
    pplab.course.room) as a page on loopback."""
    from pplab.course import room

    if args.drill is not None:
        return _drill(args.drill)
    if args.plan is not None:
        return _plan(args)
    if args.folder is None:
        raise ValueError("pplab room: give the room's FOLDER to serve, or --drill N to measure the room")
    seats = [seat for seat in (args.seats or "").split(",") if seat] or None
    try:
        room.make_room(args.folder, seats)  # pplab.course.room.make_room: a trusted room, or one with seats
    except OSError as error:
        raise ValueError(f"{args.folder}: cannot make the room there ({error.strerror}); give a folder "
                         f"you may create") from None
    if args.export is not None:
        return _export(args.folder, args.export)
    if args.seats and args.port is None:
        print(f"pplab room: {args.folder} has seats {', '.join(room.seats_of(args.folder) or [])}")
        return 0
    return _serve(args.folder, 8765 if args.port is None else args.port, args.refresh)


def _serve(folder: str, port: int, refresh: float) -> int:
    """The room's page on loopback, until Ctrl-C."""
    import http.server

    from pplab.course.room import seats_of

    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: give a port between 1 and 65535 (0: any free one)")
    access = ("loopback only, no login: anyone with a terminal on this machine can open it "
              "(a workshop's hub serves it to its instructors alone: pplab workshop)")
    from pplab.course.room_page import room_response

    class RoomPage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, kind, body = room_response(folder, self.path.split("?")[0], refresh, access)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):  # one line per reload would drown the terminal
            pass

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), RoomPage)
    except OSError as error:
        raise ValueError(f"--port {port}: cannot listen there ({error.strerror}); give another "
                         f"port, or 0 for any free one") from None
    port = server.server_address[1]
    kind = ("seats checked by their accounts" if seats_of(folder) is not None
            else "verdicts trusted, not checked")
    print(f"pplab room: {folder} at http://127.0.0.1:{port}/ ({kind}; {access}; from a laptop: "
          f"ssh -L {port}:127.0.0.1:{port} this server). Ctrl-C stops it.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _export(folder: str, path: str) -> int:
    """Write the room's grades (pplab.course.grades) to `path`, '-' for standard output."""
    import sys

    from pplab.course.exercises import NOTEBOOK_OF_EXERCISE
    from pplab.course.grades import grades_csv
    from pplab.course.room import inspect_room

    reading = inspect_room(folder)
    text = grades_csv(reading.seats, NOTEBOOK_OF_EXERCISE)
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as file:
            file.write(text)
        rows = text.count("\n") - 1
        print(f"pplab room: {rows} row{'s' * (rows != 1)} ({len(reading.seats)} seat"
              f"{'s' * (len(reading.seats) != 1)} x exercises) written to {path}")
    for refusal in reading.refusals:
        print(f"pplab room: refused {refusal.where}: {refusal.reason}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Print which GPUs each seat takes and each rank's memory cap, and the line each attendee runs."""
    from pplab.drivers.cluster.plan import plan_room

    if args.gpus is None:
        raise ValueError("pplab room --plan N: give --gpus G, the server's GPUs (nvidia-smi -L lists them)")
    room = plan_room(args.plan, args.n_ranks, args.gpus, gpu_memory_gib=args.gpu_memory,
                     rank_memory_gib=args.rank_memory)
    print(room.describe())
    print(f"seat s: pplab.Lab(n_ranks={room.n_ranks}, gpus=pplab.drivers.cluster.plan_room({room.n_seats}, "
          f"{room.n_ranks}, {room.gpu_count}).gpus(s), gpu_memory_fraction={room.memory_fraction:.4g})")
    for seat in range(room.n_seats):
        print(f"  seat {seat}: gpus={room.gpus(seat)}")
    return 0


def _drill(seats: int) -> int:
    """One seat alone, then `seats` at once: every verdict right, and what the crowd costs a seat."""
    from pplab.base.machine import measure_load
    from pplab.course.drill import drill, drill_table

    print(f"pplab room --drill {seats}: on {measure_load().describe()}")
    results = []
    for count in dict.fromkeys((1, seats)):
        print(f"{count} seat(s) at once:", flush=True)
        results.append(drill(count))
    print(drill_table(results))
    return 0 if all(result.all_right for result in results) else 1


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_room = commands.add_parser(
        "room", help="an instructor's page of the room: every attendee's lab and exercise verdicts",
        description="Serve, on loopback, a page listing every attendee's lab (seat, device, GPUs, ranks, "
                    "running or dead, last activity) and exercise verdicts, from what the labs and checkers "
                    "write to the folder the attendees have as PPLAB_ROOM (docs/instructor.md).")
    run_room.add_argument("folder", nargs="?", help="the room's folder (the attendees' "
                                                    "PPLAB_ROOM; made if missing)")
    run_room.add_argument("--drill", type=positive_int, metavar="N",
                          help="instead: measure this machine's room, one seat alone then N seats at once, "
                               "each an attendee's lessons on a 2-rank lab (pplab.course.drill)")
    run_room.add_argument("--plan", type=positive_int, metavar="N",
                          help="instead: print a room of N seats dealt round the server's GPUs (--gpus), "
                               "each seat's GPUs and each rank's memory cap "
                               "(pplab.drivers.cluster.plan_room)")
    run_room.add_argument("--gpus", type=positive_int, metavar="G", help="with --plan: the server's GPUs")
    add_option_flag(run_room, LabOptions, "n_ranks", when="with --plan, of an attendee's lab")
    run_room.add_argument("--gpu-memory", type=functools.partial(number, positive=True), metavar="GIB",
                          help="with --plan: one GPU's memory, to refuse a room that does not fit")
    run_room.add_argument("--rank-memory", type=functools.partial(number, positive=True), metavar="GIB",
                          help="with --plan: what one rank needs, its CUDA context included (0.8 GiB for the "
                               "tiny model on an H200, bench/results/gpu.json)")
    run_room.add_argument("--seats", metavar="A,B,...",
                          help="make the room one with seats, these Unix accounts (as root): each seat's "
                               "folder owned by its account, so a verdict counts for whoever wrote it; "
                               "serves it with --port")
    run_room.add_argument("--export", metavar="CSV",
                          help="instead: write one row per seat and exercise (tries, first right, "
                               "time to right, last message; nbgrader's columns where they fit) to "
                               "CSV ('-': standard output)")
    run_room.add_argument("--port", type=int, help="loopback port (default 8765; 0: any free one)")
    run_room.add_argument("--refresh", type=functools.partial(number, positive=True), default=3.0,
                          help="seconds between the page's reloads (default 3)")
    run_room.set_defaults(handler=run)
    return run_room
