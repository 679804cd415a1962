"""`pplab room`: the instructor's page of the room, served on loopback, or a drill that measures the room."""

from __future__ import annotations

import argparse
import functools

from pplab.cli.options import number, positive_int


def run(args: argparse.Namespace) -> int:
    """Serve the room (every attendee's lab and exercise verdicts, pplab.course.room) as a page on loopback."""
    import http.server
    import json as json_module

    from pplab.course import room
    from pplab.course.exercises import NOTEBOOK_OF_EXERCISE

    if args.drill is not None:
        return _drill(args.drill)
    if args.plan is not None:
        return _plan(args)
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
                body = json_module.dumps([{**vars(seat), "verdicts": seat.verdicts} for seat in seats])
                kind = "application/json"
            elif self.path == "/":
                body = _room_page(seats, NOTEBOOK_OF_EXERCISE, args.folder, args.refresh)
                kind = "text/html; charset=utf-8"
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


def _plan(args: argparse.Namespace) -> int:
    """Print which GPUs each seat takes and each rank's memory cap, and the line each attendee runs."""
    from pplab.drivers.cluster.plan import plan_room

    if args.gpus is None:
        raise ValueError("pplab room --plan N: give --gpus G, the server's GPUs (nvidia-smi -L lists them)")
    room = plan_room(args.plan, args.n_ranks, args.gpus, gpu_memory_gib=args.gpu_memory,
                     rank_memory_gib=args.rank_memory)
    print(room.describe())
    print(f"seat s: pplab.Lab(n_ranks={room.n_ranks}, gpus=pplab.cluster.plan_room({room.n_seats}, "
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


def _room_page(seats, exercises, folder, refresh: float) -> str:
    import html as html_module

    from pplab.course import room

    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            f"<noscript><meta http-equiv='refresh' content='{refresh:g}'></noscript>"
            f"<title>pplab room</title><style>body{{font-family:sans-serif;margin:20px}}</style>{room.TABLE_STYLE}"
            f"</head><body><h2>pplab room: {html_module.escape(str(folder))}</h2>"
            f"<main id='room'><p>{html_module.escape(room.room_summary(seats, columns=exercises))} (re-read every {refresh:g} s)</p>"
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


def add_to(commands, ranks_run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This command's flags, on the `pplab` parser's subcommands."""
    run_room = commands.add_parser(
        "room", help="an instructor's page of the room: every attendee's lab and exercise verdicts",
        description="Serve, on loopback, a page listing every attendee's lab (seat, device, GPUs, ranks, "
                    "running or dead, last activity) and exercise verdicts, from what the labs and checkers "
                    "write to the folder the attendees have as PPLAB_ROOM (docs/instructor.md).")
    run_room.add_argument("folder", nargs="?", help="the room's folder (the attendees' PPLAB_ROOM; made if missing)")
    run_room.add_argument("--drill", type=positive_int, metavar="N",
                          help="instead: measure this machine's room, one seat alone then N seats at once, "
                               "each an attendee's lessons on a 2-rank lab (pplab.course.drill)")
    run_room.add_argument("--plan", type=positive_int, metavar="N",
                          help="instead: print a room of N seats dealt round the server's GPUs (--gpus), "
                               "each seat's GPUs and each rank's memory cap (pplab.cluster.plan_room)")
    run_room.add_argument("--gpus", type=positive_int, metavar="G", help="with --plan: the server's GPUs")
    run_room.add_argument("--n-ranks", type=positive_int, default=2, metavar="R",
                          help="with --plan: ranks per attendee's lab (default 2)")
    run_room.add_argument("--gpu-memory", type=functools.partial(number, positive=True), metavar="GIB",
                          help="with --plan: one GPU's memory, to refuse a room that does not fit")
    run_room.add_argument("--rank-memory", type=functools.partial(number, positive=True), metavar="GIB",
                          help="with --plan: what one rank needs, its CUDA context included (0.8 GiB for the "
                               "tiny model on an H200, bench/results/gpu.json)")
    run_room.add_argument("--port", type=int, default=8765, help="loopback port (default 8765; 0: any free one)")
    run_room.add_argument("--refresh", type=functools.partial(number, positive=True), default=3.0,
                          help="seconds between the page's reloads (default 3)")
    run_room.set_defaults(handler=run)
    return run_room
