"""The room: what every attendee's lab and exercise checks write to a folder the instructor names.

An instructor running a workshop on one server sets `PPLAB_ROOM=/some/shared/folder` for every
attendee (in JupyterHub's spawner environment, say) and, optionally, `PPLAB_SEAT` to each one's
seat or name (default: their login name). From then on, each attendee's lab writes one small
JSON file there when it starts, runs, restarts and stops (`labs/<attendee>--<lab>.json`: seat,
device, GPUs, ranks, its processes, last activity), and each exercise checker appends its verdict
to `verdicts/<attendee>.jsonl`. Nothing is sent anywhere: the attendees only write files, and
the instructor reads them (`pplab room FOLDER`, a page on loopback; or `pplab.widgets.RoomView`
in a notebook). Without `PPLAB_ROOM` nothing is written.

A lab counts as dead when its record says it runs but one of its processes is gone (on this
host); a lab on another host not heard of for `SILENT_SECONDS` is shown as silent.
"""

from __future__ import annotations

import contextlib
import getpass
import html
import itertools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOM_ENV, SEAT_ENV = "PPLAB_ROOM", "PPLAB_SEAT"
SILENT_SECONDS = 600.0  # a lab on another host not heard of for this long is shown as silent
ACTIVITY_EVERY = 2.0  # seconds: a lab's "last activity" is written at most this often


def room_folder() -> Path | None:
    """The room's folder (from PPLAB_ROOM), or None where no instructor asked for one."""
    folder = os.environ.get(ROOM_ENV)
    return Path(folder) if folder else None


def attendee() -> str:
    """Who this is: PPLAB_SEAT, else the login name (a file name's worth of it)."""
    name = os.environ.get(SEAT_ENV) or getpass.getuser()
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "anonymous"


# ---------------------------------------------------------------- writing (attendees)


def record_lab(lab_id: str, **facts) -> None:
    """Write (replace) this attendee's record of one lab: `facts` such as state, device, n_ranks,
    gpus, pids (the lab's processes on this host). Does nothing outside a room."""
    folder = room_folder()
    if folder is None:
        return
    record = {"attendee": attendee(), "lab": lab_id, "host": socket.gethostname(), "client_pid": os.getpid(),
              "last_activity": time.time(), **facts}
    with _never_in_the_way(folder):
        _write_atomically(folder / "labs" / f"{attendee()}--{lab_id}.json", json.dumps(record))


MESSAGE_CHARACTERS = 2000  # of a checker's message kept in the room (its hints included)


def record_verdict(exercise: str, right: bool, message: str) -> None:
    """Append one checker's verdict to this attendee's file: its first line is the reason, and the
    whole message (the checker's hints too) is kept for the instructor to read."""
    folder = room_folder()
    if folder is None:
        return
    reason = next((line for line in message.splitlines() if line.strip()), "")
    line = json.dumps({"attendee": attendee(), "exercise": exercise, "right": bool(right), "reason": reason,
                       "message": message[:MESSAGE_CHARACTERS], "time": time.time()})
    with _never_in_the_way(folder):
        make_room(folder)
        # One short line per write with O_APPEND: lines of several kernels never interleave.
        with open(folder / "verdicts" / f"{attendee()}.jsonl", "a") as file:
            file.write(line + "\n")


_warned: set[str] = set()


@contextlib.contextmanager
def _never_in_the_way(folder: Path):
    """A room that cannot be written to must not stop the attendee's work: say so once, go on."""
    try:
        yield
    except OSError as error:
        if str(folder) not in _warned:
            _warned.add(str(folder))
            print(f"pplab: cannot write to the room {folder} ({error}); the instructor will not see this lab",
                  file=sys.stderr)


def make_room(folder: str | Path) -> Path:
    """The room's folder and its two subfolders, writable by every attendee (each a Unix user of
    their own, say) and sticky, so that nobody can remove or replace another's files."""
    folder = Path(folder)
    for part in (folder, folder / "labs", folder / "verdicts"):
        if not part.is_dir():
            part.mkdir(parents=True, exist_ok=True)
            part.chmod(0o1777)
    return folder


def _write_atomically(path: Path, text: str) -> None:
    make_room(path.parent.parent)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)  # a reader sees the old record or the new one, never half of one


# ---------------------------------------------------------------- reading (the instructor)


@dataclass
class Seat:
    """One attendee: their newest lab, and every verdict of theirs per exercise (the latest last)."""

    attendee: str
    lab: dict | None = None
    state: str = "no lab"  # running, stopped, dead, no lab
    attempts: dict[str, list[dict]] = field(default_factory=dict)  # exercise -> its verdicts, oldest first

    @property
    def verdicts(self) -> dict[str, dict]:
        """exercise -> its latest verdict."""
        return {exercise: tries[-1] for exercise, tries in self.attempts.items()}

    @property
    def last_activity(self) -> float | None:
        times = [v["time"] for v in self.verdicts.values()] + ([self.lab["last_activity"]] if self.lab else [])
        return max(times, default=None)

    def stuck_since(self, exercise: str) -> float | None:
        """When the attendee's run of wrong answers to `exercise` began, while its latest is wrong
        (None: right, or not tried)."""
        tries = self.attempts.get(exercise, [])
        if not tries or tries[-1]["right"]:
            return None
        wrong_run = list(itertools.takewhile(lambda verdict: not verdict["right"], reversed(tries)))
        return wrong_run[-1]["time"]

    def was_right(self, exercise: str) -> bool:
        """Whether an earlier answer to `exercise` was right (a wrong one may have come since)."""
        return any(verdict["right"] for verdict in self.attempts.get(exercise, []))


def read_room(folder: str | Path, now: float | None = None) -> list[Seat]:
    """Every attendee the room's folder knows, by name: their newest lab (alive or dead) and verdicts."""
    folder, now = Path(folder), time.time() if now is None else now
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such room folder; give the folder set as {ROOM_ENV} for the "
                         f"attendees (make it before the workshop: the attendees' labs write into it)")
    seats: dict[str, Seat] = {}
    # A file being replaced, a line being written, one nobody may read: skipped, the next look reads it.
    for lab in _records(sorted((folder / "labs").glob("*.json")), ("attendee", "last_activity", "client_pid")):
        seat = seats.setdefault(lab["attendee"], Seat(lab["attendee"]))
        if seat.lab is None or lab["last_activity"] > seat.lab["last_activity"]:
            seat.lab, seat.state = lab, _lab_state(lab, now)
    for verdict in _records(sorted((folder / "verdicts").glob("*.jsonl")), ("attendee", "exercise", "right")):
        seat = seats.setdefault(verdict["attendee"], Seat(verdict["attendee"]))
        seat.attempts.setdefault(verdict["exercise"], []).append(verdict)
    for seat in seats.values():  # several kernels of one attendee append to one file: order by time
        for tries in seat.attempts.values():
            tries.sort(key=lambda verdict: verdict["time"])
    return [seats[name] for name in sorted(seats)]


def _records(paths: list[Path], needed: tuple[str, ...]):
    """The JSON objects of these files (one per file, or one per line), those with the `needed` keys."""
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and all(key in record for key in needed):
                record.setdefault("time", record.get("last_activity", 0.0))
                record.setdefault("reason", "")
                record.setdefault("message", record["reason"])  # written before messages were kept
                yield record


def _lab_state(lab: dict, now: float) -> str:
    """running, restarting, stopped; dead (a process of it gone, on this host); silent (another host's,
    not heard of for SILENT_SECONDS: its attendee may only be reading)."""
    state = str(lab.get("state", "unknown"))
    if state not in ("running", "restarting"):
        return state
    if lab.get("host") == socket.gethostname():
        pids = [lab["client_pid"], *(lab.get("pids", []) if state == "running" else [])]
        return state if all(_alive(pid) for pid in pids) else "dead"
    return state if now - lab["last_activity"] < SILENT_SECONDS else "silent"


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:  # Linux: the state follows the command's closing parenthesis in /proc/<pid>/stat
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


STUCK_MINUTES = 10.0  # an attendee wrong on an exercise for this long is counted as stuck


def room_summary(seats: list[Seat], now: float | None = None, columns: Mapping[str, str] | None = None) -> str:
    """'3 attendees: 2 labs running, 1 dead; 2 exercises right; 1 stuck over 10 min (longest: bo on 04b,
    14 min)' (`columns`: an exercise's short name, its notebook's id, as `room_table_html` takes)."""
    now = time.time() if now is None else now
    running = sum(seat.state == "running" for seat in seats)
    dead = sum(seat.state == "dead" for seat in seats)
    right = sum(verdict["right"] for seat in seats for verdict in seat.verdicts.values())
    text = (f"{len(seats)} attendee{'s' * (len(seats) != 1)}: {running} lab{'s' * (running != 1)} running, "
            f"{dead} dead; {right} exercise{'s' * (right != 1)} right")
    stuck = sorted(((now - since, seat.attendee, exercise) for seat in seats for exercise in seat.attempts
                    if (since := seat.stuck_since(exercise)) is not None and now - since >= STUCK_MINUTES * 60),
                   reverse=True)
    if stuck:
        longest, who, exercise = stuck[0]
        text += (f"; {len(stuck)} stuck over {STUCK_MINUTES:g} min (longest: {who} on "
                 f"{(columns or {}).get(exercise, exercise)}, {_ago(now - longest, now, ago=False)})")
    return text


TABLE_STYLE = ("<style>.pplab-room{border-collapse:collapse;font-size:12px;line-height:1.25}"
               ".pplab-room td,.pplab-room th{border:1px solid #ddd;padding:2px 6px;text-align:left;"
               "white-space:nowrap}.pplab-room td.verdict{max-width:260px;overflow:hidden;text-overflow:ellipsis;"
               "cursor:help}.pplab-room tfoot td{background:#f6f6f6;font-size:11px}</style>")  # for room_table_html


def room_table_html(seats: list[Seat], exercises: Mapping[str, str] | Sequence[str] = (),
                    now: float | None = None) -> str:
    """The room as one compact HTML table: a row per attendee (their lab, then a column per exercise),
    and a last row of tallies per exercise. `exercises`: the columns to show even before anyone tried
    them, as a list of names or a mapping of each name to its column's heading (the course's:
    `pplab.course.exercises.NOTEBOOK_OF_EXERCISE`, its notebook's id; the name shows on hover).

    An exercise's cell says right or wrong, how many tries it took, and for a wrong one how long the
    attendee has been wrong on it and the checker's first line; the whole message (hints included)
    shows on hover. A wrong answer after a right one is marked as such."""
    now = time.time() if now is None else now
    headings = dict(exercises) if isinstance(exercises, Mapping) else {}
    names = list(dict.fromkeys([*exercises, *(name for seat in seats for name in seat.attempts)]))
    colours = {"running": "#1a7f37", "dead": "#c00000", "stopped": "#777777", "restarting": "#b06000", "silent": "#b06000"}
    head = "".join(f"<th>{html.escape(text)}</th>" for text in ["seat", "lab", "device", "ranks", "last activity"])
    head += "".join(f"<th title='{html.escape(name, quote=True)}'>{html.escape(headings.get(name, name))}</th>"
                    for name in names)
    rows = []
    for seat in seats:
        lab = seat.lab or {}
        cells = [f"<td>{html.escape(seat.attendee)}</td>",
                 f"<td style='color:{colours.get(seat.state, '#000')}'>{html.escape(seat.state)}</td>",
                 f"<td>{html.escape(_device(lab))}</td>", f"<td>{lab.get('n_ranks', '')}</td>",
                 f"<td>{_ago(seat.last_activity, now)}</td>"]
        cells += [_verdict_cell(seat, name, now) for name in names]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    if not seats:
        rows.append(f"<tr><td colspan='{5 + len(names)}'>nobody yet</td></tr>")
    tallies = "".join(f"<td title='right · wrong now · not tried'>{_tally(seats, name)}</td>" for name in names)
    foot = f"<tfoot><tr><td colspan='5'>{len(seats)} seats: right · wrong · not yet</td>{tallies}</tr></tfoot>"
    return (f"<table class='pplab-room'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody>"
            f"{foot if seats else ''}</table>")


def _device(lab: dict) -> str:
    """'cuda (GPUs 0, 1; each rank up to 9% of a GPU)': the lab's device, its GPUs (one per rank; a GPU
    named twice is shared by those ranks) and the cap on each rank's memory."""
    device = lab.get("device", "")
    if lab.get("gpus"):
        gpus = list(dict.fromkeys(lab["gpus"]))
        shared = " shared" if len(gpus) < len(lab["gpus"]) else ""
        cap = lab.get("gpu_memory_fraction")
        capped = f"; each rank up to {cap:.0%} of a GPU" if cap else ""
        device += f" (GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}{shared}{capped})"
    return device


def _verdict_cell(seat: Seat, exercise: str, now: float) -> str:
    """'✔ right · 3 tries', or '✘ 4 tries · for 12 min · the reason'; the checker's whole message on hover."""
    tries = seat.attempts.get(exercise)
    if not tries:
        return "<td style='color:#777'>not yet</td>"
    latest, count = tries[-1], f"{len(tries)} tries" if len(tries) > 1 else ""
    hover = html.escape(f"{len(tries)} {'try' if len(tries) == 1 else 'tries'}; the latest says:\n{latest['message']}",
                        quote=True)
    if latest["right"]:
        return f"<td class='verdict' style='color:#1a7f37' title='{hover}'>✔ right{f' · {count}' if count else ''}</td>"
    mark = "✘ (was ✔)" if seat.was_right(exercise) else "✘"
    since = seat.stuck_since(exercise)
    details = [count, f"for {_ago(since, now, ago=False)}", html.escape(latest["reason"])]
    stuck = ";background:#fde2e2" if now - since >= STUCK_MINUTES * 60 else ""  # who needs help, at a glance
    return (f"<td class='verdict' style='color:#c00000{stuck}' title='{hover}'>{mark} "
            f"{' · '.join(part for part in details if part)}</td>")


def _tally(seats: list[Seat], exercise: str) -> str:
    latest = [seat.attempts[exercise][-1] for seat in seats if exercise in seat.attempts]
    right = sum(verdict["right"] for verdict in latest)
    return f"{right} · {len(latest) - right} · {len(seats) - len(latest)}"


def _ago(when: float | None, now: float, ago: bool = True) -> str:
    """'12 s ago', '5 min ago' (or without 'ago': '5 min')."""
    if when is None:
        return ""
    seconds = max(0, now - when)
    text = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    return f"{text} ago" if ago else text
