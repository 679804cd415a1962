"""A workshop's folder: the hub's `jupyterhub_config.py`, the seats' accounts, a README for the
instructor; and the hub started from it (`pplab workshop init` / `start` / `remove-users`).

    DIR/jupyterhub_config.py   the hub's configuration: pplab.course.hub.configure(c, ...), edit at will
    DIR/README.md              what the instructor does, for this workshop
    DIR/seats.csv              account, password, GPUs (root only: the accounts made by --make-users)
    DIR/room/                  the room's folder (made with its seats when the hub starts)
"""

from __future__ import annotations

import csv
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from pplab.course.hub.seats import Workshop, count_gpus, seat_names

CONFIG, README, SEATS = "jupyterhub_config.py", "README.md", "seats.csv"


def default_notebooks() -> Path | None:
    """The course's notebooks beside pplab's source (an install from a clone), or None."""
    folder = Path(__file__).resolve().parents[3] / "notebooks"
    return folder if (folder / "README.md").is_file() else None


def init(folder: str | Path, seats: int | str, *, instructors: list[str], gpus: int | str = "auto",
         notebooks: str | Path | None = None, bind_url: str = "http://:8000", make_users: bool = False,
         prefix: str = "seat-", ranks_per_seat: int = 2, room_url: str = "http://127.0.0.1:8765") -> Workshop:
    """Write a workshop's folder (and, with `make_users`, its accounts with fresh passwords)."""
    folder = Path(folder).resolve()
    accounts = seat_names(seats, prefix)
    notebooks = Path(notebooks).resolve() if notebooks else default_notebooks()
    if notebooks is None or not notebooks.is_dir():
        raise ValueError(f"--notebooks {notebooks}: no course there; give the folder of pplab's notebooks "
                         f"(notebooks/ of a clone of pplab)")
    if not instructors:
        raise ValueError("give at least one --instructor account: the instructors alone open the room's page")
    gpu_count = count_gpus() if gpus == "auto" else int(gpus)
    workshop = Workshop(tuple(accounts), folder / "room", notebooks, gpu_count, ranks_per_seat)
    workshop.plan()  # a room the GPUs cannot take is refused now, not when the hub starts
    if (folder / CONFIG).exists():
        raise ValueError(f"{folder / CONFIG} exists: this folder holds a workshop already; give another "
                         "folder (or remove it)")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # the seats reach the room inside it
    passwords = make_accounts([*accounts, *instructors]) if make_users else {}
    (folder / CONFIG).write_text(_config_text(workshop, instructors, "auto" if gpus == "auto" else gpu_count,
                                              bind_url, room_url))
    with open(folder / SEATS, "w", newline="") as file:
        os.chmod(folder / SEATS, 0o600)  # the passwords are the instructor's to hand out
        writer = csv.writer(file)
        writer.writerow(["account", "role", "password", "gpus"])
        for account in [*accounts, *instructors]:
            role = "seat" if account in accounts else "instructor"
            gpus_of = workshop.environment(account).get("CUDA_VISIBLE_DEVICES", "") if role == "seat" else ""
            writer.writerow([account, role, passwords.get(account, ""), gpus_of])
    (folder / README).write_text(_readme_text(folder, workshop, instructors, bind_url, make_users))
    return workshop


def _config_text(workshop: Workshop, instructors: list[str], gpus: int | str, bind_url: str,
                 room_url: str) -> str:
    seats = list(workshop.seats)
    return f'''# The hub of a pplab workshop, written by `pplab workshop init`.
# Run it with `pplab workshop start {workshop.room.parent}`. Edit at will: it is JupyterHub's own
# config file (https://jupyterhub.readthedocs.io); pplab.course.hub fills in the rest.
import pplab.course.hub

pplab.course.hub.configure(
    c,
    seats={seats!r},  # the attendees' Unix accounts, one seat each
    instructors={instructors!r},  # they open the room's page (/services/pplab-room/) and are the hub's admins
    room={str(workshop.room)!r},
    # copied into each seat's ~/{workshop.course_folder} on its first start
    notebooks={str(workshop.notebooks)!r},
    gpus={gpus!r},  # this server's GPUs dealt round the seats ("auto": all it has; 0: labs on CPU)
    ranks_per_seat={workshop.ranks_per_seat},  # ranks of a lesson's lab, for the plan of the GPUs
    room_url={room_url!r},  # where the room's service listens, behind the hub's proxy
    # On a cluster, these two change: spawner="kubernetes" (or "slurm"), gpus_per_seat=1.
)
c.JupyterHub.bind_url = {bind_url!r}  # where the attendees' browsers come in
c.JupyterHub.db_url = "sqlite:///" + {str(workshop.room.parent / "jupyterhub.sqlite")!r}
c.JupyterHub.cookie_secret_file = {str(workshop.room.parent / "jupyterhub_cookie_secret")!r}
'''


def _readme_text(folder: Path, workshop: Workshop, instructors: list[str], bind_url: str, made: bool) -> str:
    accounts = ("The accounts were made with fresh passwords: hand each attendee theirs from `seats.csv` "
                "(readable by root alone)." if made else
                "Make the accounts first (`useradd -m NAME`, `passwd NAME`), or run `pplab workshop init` "
                "again in a new folder with `--make-users`.")
    first_seats = ", ".join(workshop.seats[:3]) + (" ..." if len(workshop.seats) > 3 else "")
    return f"""# A pplab workshop: {len(workshop.seats)} seats

Written by `pplab workshop init`. Every seat is a Unix account: {first_seats}.
{accounts}

## Seats and GPUs

```
{workshop.describe()}
```

## Run it

    sudo pplab workshop start {folder}      # the hub, at {bind_url} (Ctrl-C stops it and every seat's server)

An attendee logs in with their account and gets JupyterLab with the course in `~/{workshop.course_folder}`
(copied on the first start, never over their edits). Their `pplab.Lab(n_ranks=2)` runs on their seat's
GPUs with their memory cap, and their checkers' verdicts go to the room.

The room's page: log in as an instructor ({', '.join(instructors)}) and open `/services/pplab-room/`.
An attendee who opens it gets 403. Grades: the page's link, or
`pplab room {workshop.room} --export grades.csv`.

## Afterwards

    sudo pplab workshop remove-users {folder}   # the accounts this folder made, their homes with them
"""


def make_accounts(accounts: list[str]) -> dict[str, str]:
    """Make a Unix account for each name that has none, with a fresh password;
    {name: password} of those made."""
    if os.geteuid() != 0:
        raise ValueError("--make-users makes Unix accounts: run it as root (sudo), or make them yourself")
    import pwd

    made = {}
    for account in accounts:
        try:
            pwd.getpwnam(account)
            continue
        except KeyError:
            pass
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", account], check=True)
        made[account] = secrets.token_urlsafe(9)
        subprocess.run(["chpasswd"], input=f"{account}:{made[account]}\n", text=True, check=True)
    return made


def remove_users(folder: str | Path) -> list[str]:
    """Remove the accounts this workshop's folder made (those with a password in seats.csv), their
    homes and processes with them; the names removed."""
    with open(Path(folder) / SEATS) as file:
        made = [row["account"] for row in csv.DictReader(file) if row["password"]]
    for account in made:
        subprocess.run(["pkill", "-KILL", "-u", account], check=False)
        subprocess.run(["userdel", "--remove", account], check=False, stderr=subprocess.DEVNULL)
    return made


def start(folder: str | Path) -> None:
    """Run the workshop's hub in the foreground (this process becomes JupyterHub's)."""
    folder = Path(folder).resolve()
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{folder}: no {CONFIG} there; make the workshop first (pplab "
                         f"workshop init {folder})")
    if os.geteuid() != 0:
        raise ValueError("pplab workshop start: the hub runs each seat's server as the seat's account, which "
                         "needs root: run it with sudo")
    if shutil.which("configurable-http-proxy") is None:
        raise ValueError("configurable-http-proxy is not on PATH: JupyterHub's proxy comes from npm "
                         "(apt-get install nodejs npm; npm install -g configurable-http-proxy)")
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        raise ValueError("JupyterHub is not installed: pip install 'pplab[hub]'") from None
    os.chdir(folder)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub", "-f", str(folder / CONFIG)])
