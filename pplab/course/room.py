"""The room: what every attendee's lab and exercise checks write to a folder the instructor names.

An instructor running a workshop on one server sets `PPLAB_ROOM=/some/shared/folder` for every
attendee (the workshop's hub does, `pplab.course.hub`). From then on, each attendee's lab writes one small
JSON file there when it starts, runs, restarts and stops (device, GPUs, ranks, its processes, last
activity), and each exercise checker appends its verdict. Nothing is sent anywhere: the attendees
only write files, and the instructor reads them (`pplab room FOLDER`, the hub's room service, or
`pplab.views.widgets.RoomView` in a notebook). Without `PPLAB_ROOM` nothing is written.

A room is one of two kinds:

- **with seats** (`make_room(folder, seats=[...])`, as root; the hub makes it): each seat is a Unix
  account with a folder of its own (`verdicts/<seat>/`, `labs/<seat>/`) that it owns and no one
  else can write. A record counts for the seat whose folder holds it, written by that account
  (the file's owner); a record naming another seat is refused, and nobody can take a seat.
- **trusted** (one account for everyone, or a room made without seats): every attendee writes to
  shared sticky folders (`verdicts/<seat>.jsonl`), the seat named by `PPLAB_SEAT` (default: the
  login name). The page says that its verdicts are trusted, not checked.

A lab counts as dead when its record says it runs but one of its processes is gone (on this
host); a lab on another host not heard of for `SILENT_SECONDS` is shown as silent.
"""

from __future__ import annotations

import collections
import contextlib
import getpass
import html
import itertools
import json
import os
import pwd
import re
import socket
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOM_ENV, SEAT_ENV = "PPLAB_ROOM", "PPLAB_SEAT"
SEATS_FILE = "room.json"  # in a room with seats: {"seats": [account, ...]}, written by whoever made the room
SILENT_SECONDS = 600.0  # a lab on another host not heard of for this long is shown as silent
ACTIVITY_EVERY = 2.0  # seconds: a lab's "last activity" is written at most this often
PLACEHOLDER = "not written yet"  # a checker's answer to an exercise cell left as it came: not a try


def room_folder() -> Path | None:
    """The room's folder (from PPLAB_ROOM), or None where no instructor asked for one."""
    folder = os.environ.get(ROOM_ENV)
    return Path(folder) if folder else None


def account() -> str:
    """This process's Unix account (its uid's name: no variable can change it)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a name (a container's): the login name is all there is
        return getpass.getuser()


def attendee() -> str:
    """Who this is: in a room with seats, the account; else PPLAB_SEAT, else the login name (a file
    name's worth of it)."""
    folder = room_folder()
    if folder is not None and seats_of(folder) is not None:
        return account()
    name = os.environ.get(SEAT_ENV) or getpass.getuser()
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "anonymous"


def seats_of(folder: str | Path) -> list[str] | None:
    """The seats (accounts) of a room with seats; None for a trusted room. Only a seats file that the
    room folder's owner wrote, in a folder no one else can write, makes a room one with seats."""
    folder = Path(folder)
    try:
        room, listed = folder.stat(), (folder / SEATS_FILE).stat()
        if listed.st_uid != room.st_uid or (room.st_mode | listed.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        seats = json.loads((folder / SEATS_FILE).read_text())["seats"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(seat) for seat in seats] if isinstance(seats, list) else None


# ---------------------------------------------------------------- writing (attendees)


def _own_file(folder: Path, lab_id: str | None = None) -> Path:
    """Where this attendee's record of lab `lab_id`, or else their verdicts, goes: their seat's folder
    in a room with seats (made by the instructor), else the shared folder, under their name."""
    kind = "labs" if lab_id else "verdicts"
    if seats_of(folder) is None:
        make_room(folder)
        return folder / kind / (f"{attendee()}--{lab_id}.json" if lab_id else f"{attendee()}.jsonl")
    return folder / kind / account() / (f"{lab_id}.json" if lab_id else "verdicts.jsonl")


def record_lab(lab_id: str, **facts) -> None:
    """Write (replace) this attendee's record of one lab: `facts` such as state, device, n_ranks,
    gpus, pids (the lab's processes on this host). Does nothing outside a room."""
    folder = room_folder()
    if folder is None:
        return
    record = {"attendee": attendee(), "lab": lab_id, "host": socket.gethostname(), "client_pid": os.getpid(),
              "last_activity": time.time(), **facts}
    with _never_in_the_way(folder):
        _write_atomically(_own_file(folder, lab_id), json.dumps(record))


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
        path = _own_file(folder)
        # One short line per write with O_APPEND: lines of several kernels never interleave.
        with open(path, "a") as file:
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
            seats = seats_of(folder)
            why = (f"; {account()} is not one of its seats (pplab room {folder} --seats ... adds one)"
                   if seats is not None and account() not in seats else "")
            print(f"pplab: cannot write to the room {folder} ({error}){why}; the "
                  "instructor will not see this",
                  file=sys.stderr)


def make_room(folder: str | Path, seats: Sequence[str] | None = None) -> Path:
    """The room's folder and its two subfolders.

    Without `seats`: a trusted room, its folders writable by every attendee and sticky, so that nobody
    can remove or replace another's files. With `seats` (Unix accounts; needs root): a room with
    seats, each seat's folder owned by its account and closed to everyone else, made before the
    attendees come so that no seat can be taken by another; seats of an earlier call are kept."""
    folder = Path(folder)
    if seats is None:
        for part in (folder, folder / "labs", folder / "verdicts"):
            if not part.is_dir():
                part.mkdir(parents=True, exist_ok=True)
                part.chmod(0o1777)
        return folder
    accounts = {}
    for seat in seats:
        try:
            accounts[seat] = pwd.getpwnam(seat)
        except KeyError:
            raise ValueError(f"seat {seat!r}: this host has no such account; make it first (useradd -m "
                             f"{seat}, or pplab workshop init --make-users), or leave it out") from None
    everyone = list(dict.fromkeys([*(seats_of(folder) or []), *seats]))
    try:
        for part in (folder, folder / "labs", folder / "verdicts"):
            part.mkdir(parents=True, exist_ok=True)
            part.chmod(0o755)  # readable, writable by its maker alone (a trusted room's 1777 closed)
        for seat, entry in accounts.items():
            for kind in ("labs", "verdicts"):
                own = folder / kind / seat
                own.mkdir(exist_ok=True)
                os.chown(own, entry.pw_uid, entry.pw_gid)  # re-owned if someone else made it first
                own.chmod(0o700)  # the seat's records are for the seat and the instructor alone
        _write_atomically(folder / SEATS_FILE, json.dumps({"seats": everyone}, indent=1))
        (folder / SEATS_FILE).chmod(0o644)
    except PermissionError as error:
        raise ValueError(f"{folder}: a room with seats needs root, to give each seat's folder to its "
                         f"account ({error.strerror}); run this as root, or leave out the seats for a "
                         f"trusted room") from None
    return folder


def _write_atomically(path: Path, text: str) -> None:
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
        times = [verdict["time"] for verdict in self.verdicts.values()]
        times += [self.lab["last_activity"]] if self.lab else []
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


@dataclass(frozen=True)
class Refusal:
    """Records the room did not count, and why: where they are (relative to the room) and the seat
    whose file holds them, if any (that seat's row stays as it is)."""

    where: str
    reason: str
    seat: str | None = None


@dataclass
class RoomReading:
    """What a look at the room's folder found: the seats, the records refused, and whether the seats
    are accounts whose files were checked (a room with seats) or names trusted as written."""

    folder: Path
    seats: list[Seat]
    refusals: list[Refusal]
    checked: bool


def read_room(folder: str | Path, now: float | None = None) -> list[Seat]:
    """Every seat the room's folder knows, by name: their newest lab (alive or dead) and verdicts."""
    return inspect_room(folder, now).seats


def inspect_room(folder: str | Path, now: float | None = None) -> RoomReading:
    """The room's seats with their newest lab and verdicts, and every record refused with its reason.

    A record counts for the seat whose file holds it (the place; in a room with seats also the
    file's owner), never for the seat a field inside it names; a placeholder answer is no try."""
    folder, now = Path(folder), time.time() if now is None else now
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such room folder; give the folder set as {ROOM_ENV} for the "
                         f"attendees (make it before the workshop: the attendees' labs write into it)")
    listed, refusals = seats_of(folder), []
    seats: dict[str, Seat] = {name: Seat(name) for name in listed or []}
    # A file being replaced, a line being written, one nobody may read: skipped, the next look reads it.
    for seat_name, lab in _seat_records(folder, "labs", listed, ("last_activity", "client_pid"), refusals):
        seat = seats.setdefault(seat_name, Seat(seat_name))
        if seat.lab is None or lab["last_activity"] > seat.lab["last_activity"]:
            seat.lab, seat.state = lab, _lab_state(lab, now)
    for seat_name, verdict in _seat_records(folder, "verdicts", listed, ("exercise", "right"), refusals):
        if not verdict["reason"].startswith(PLACEHOLDER):
            tries = seats.setdefault(seat_name, Seat(seat_name)).attempts.setdefault(verdict["exercise"], [])
            tries.append(verdict)
    for seat in seats.values():  # several kernels of one attendee append to one file: order by time
        for tries in seat.attempts.values():
            tries.sort(key=lambda verdict: verdict["time"])
    return RoomReading(folder, [seats[name] for name in sorted(seats)], refusals, listed is not None)


def _seat_records(folder: Path, kind: str, listed: list[str] | None, needed: tuple[str, ...],
                  refusals: list[Refusal]) -> Iterator[tuple[str, dict]]:
    """(seat, record) of every record of `kind` the room counts; what it does not count goes to
    `refusals`, one line per file and reason."""
    refused: collections.Counter = collections.Counter()
    for seat, path in _seat_files(folder / kind, "*.json" if kind == "labs" else "*.jsonl", listed, refusals):
        where = str(path.relative_to(folder))
        for record in _records([path], ("attendee", *needed)):
            if record["attendee"] != seat:
                refused[(where, seat, str(record["attendee"]))] += 1
                continue
            yield seat, record
    for (where, seat, named), count in refused.items():
        records = f"{count} record{'s' * (count != 1)}"
        refusals.append(Refusal(where, f"{records} naming {named!r} in {seat}'s file: a record counts for "
                                       "the seat that wrote it", seat))


def _seat_files(place: Path, pattern: str, listed: list[str] | None,
                refusals: list[Refusal]) -> Iterator[tuple[str, Path]]:
    """(seat, file) of every file in `place` (the room's labs/ or verdicts/): in a trusted room the seat
    is the file's name; in a room with seats, the seat folder it is in, where the folder and the file
    belong to that seat's account."""
    if listed is None:
        for path in sorted(place.glob(pattern)):
            yield path.name.rpartition("--")[0] if "--" in path.name else path.stem, path
        return
    room = place.parent
    for entry in sorted(place.iterdir()) if place.is_dir() else ():
        where = str(entry.relative_to(room))
        if entry.name.startswith("."):  # a record being written
            continue
        if not entry.is_dir() or entry.name not in listed:
            refusals.append(Refusal(where, f"not in a seat's folder (made by {_owner(entry)}): only a "
                                           "seat's own folder counts"))
            continue
        uid = _uid(entry.name)
        if entry.stat().st_uid != uid:
            refusals.append(Refusal(where, f"owned by {_owner(entry)}, not by {entry.name}: run "
                                           f"pplab room {room} --seats {entry.name} as root to "
                                           "give it back", entry.name))
            continue
        for path in sorted(entry.glob(pattern)):
            if path.stat().st_uid != uid:
                refusals.append(Refusal(str(path.relative_to(room)), f"written by {_owner(path)}, not by "
                                                                    f"{entry.name}", entry.name))
            else:
                yield entry.name, path


def _uid(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _owner(path: Path) -> str:
    """The account that owns `path` ('uid 1234' where it has no name)."""
    uid = path.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


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


def room_summary(seats: list[Seat], now: float | None = None,
                 columns: Mapping[str, str] | None = None) -> str:
    """'3 attendees: 2 labs running, 1 dead; 2 exercises right; 1 stuck over 10 min (longest: bo on 04b,
    14 min)' (`columns`: an exercise's short name, its notebook's id, as `room_table_html` takes)."""
    now = time.time() if now is None else now
    running = sum(seat.state == "running" for seat in seats)
    dead = sum(seat.state == "dead" for seat in seats)
    right = sum(verdict["right"] for seat in seats for verdict in seat.verdicts.values())
    text = (f"{len(seats)} attendee{'s' * (len(seats) != 1)}: {running} lab{'s' * (running != 1)} running, "
            f"{dead} dead; {right} exercise{'s' * (right != 1)} right")
    stuck = sorted(((now - since, seat.attendee, exercise) for seat in seats for exercise in seat.attempts
                    if (since := seat.stuck_since(exercise)) is not None
                    and now - since >= STUCK_MINUTES * 60), reverse=True)
    if stuck:
        longest, who, exercise = stuck[0]
        text += (f"; {len(stuck)} stuck over {STUCK_MINUTES:g} min (longest: {who} on "
                 f"{(columns or {}).get(exercise, exercise)}, {_ago(now - longest, now, ago=False)})")
    return text


TABLE_STYLE = ("<style>.pplab-room{border-collapse:collapse;font-size:12px;line-height:1.25}.pplab-room "
               "td,.pplab-room th{border:1px solid #ddd;padding:2px "
               "6px;text-align:left;white-space:nowrap}.pplab-room "
               "td.verdict{max-width:260px;overflow:hidden;text-overflow:ellipsis;"
               # for room_table_html
               "cursor:help}.pplab-room tfoot td{background:#f6f6f6;font-size:11px}</style>")


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
    colours = {"running": "#1a7f37", "dead": "#c00000", "stopped": "#777777", "restarting": "#b06000",
               "silent": "#b06000"}
    head = "".join(f"<th>{html.escape(text)}</th>" for text in ["seat", "lab", "device", "ranks",
                                                                "last activity"])
    head += "".join("<th "
                    f"title='{html.escape(name, quote=True)}'>{html.escape(headings.get(name, name))}</th>"
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
    tallies = "".join("<td title='right · wrong now · not "
                      f"tried'>{_tally(seats, name)}</td>" for name in names)
    foot = (f"<tfoot><tr><td colspan='5'>{len(seats)} seat{'s' * (len(seats) != 1)}: right · wrong · not "
            f"yet</td>{tallies}</tr></tfoot>")
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
    hover = html.escape(f"{len(tries)} {'try' if len(tries) == 1 else 'tries'}; the latest "
                        f"says:\n{latest['message']}",
                        quote=True)
    if latest["right"]:
        tries = f" · {count}" if count else ""
        return f"<td class='verdict' style='color:#1a7f37' title='{hover}'>✔ right{tries}</td>"
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
