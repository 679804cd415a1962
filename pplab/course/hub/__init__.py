"""A workshop on JupyterHub (part of floor 6, course/): seats that are accounts, the room behind the login.

In the hub's own `jupyterhub_config.py` (`pplab workshop init DIR` writes one):

    import pplab.course.hub
    pplab.course.hub.configure(c, seats=20, instructors=["teacher"], room="/srv/pplab-room",
                        notebooks="/opt/pplab/notebooks", gpus="auto")

Each seat is a Unix account (seat-01 .. seat-20) that logs in with its own password (PAM); its
server runs as that account (LocalProcessSpawner, the hub running as root) with the course copied
into its home, its GPUs and memory cap (`seats.Workshop.environment`), and the room's folder, where
a verdict counts for the account that wrote it (`pplab.course.room`). The room's page is a service
of the hub (`service`), open to the instructors' role alone. On a cluster, `spawner="kubernetes"`
or `spawner="slurm"` with `gpus_per_seat` asks the scheduler for each seat's GPUs instead.

JupyterHub is needed by the hub alone: `pip install 'pplab[hub]'`, and `configurable-http-proxy`
from npm (`npm install -g configurable-http-proxy`).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from pplab.course.hub.hook import prepare_seat
from pplab.course.hub.seats import Workshop, count_gpus, seat_names
from pplab.course.room import make_room

__all__ = ["configure", "Workshop"]

ROOM_SERVICE = "pplab-room"  # the room's page, at /services/pplab-room/
INSTRUCTORS_ROLE = "pplab-instructors"  # who may open it
SPAWNERS = {"local": "jupyterhub.spawner.LocalProcessSpawner", "kubernetes": "kubespawner.KubeSpawner",
            "slurm": "batchspawner.SlurmSpawner"}


def configure(c, *, seats: int | str | Sequence[str], room: str | Path, instructors: Sequence[str] = (),
              notebooks: str | Path | None = None, gpus: int | str = "auto", ranks_per_seat: int = 2,
              spawner: str = "local", gpus_per_seat: int = 1, room_url: str = "http://127.0.0.1:8765",
              refresh: float = 3.0) -> Workshop:
    """Configure the JupyterHub whose config is `c` for a workshop, and return its seats.

    seats: their number (seat-01, ...) or the accounts' names; instructors: accounts that may open
    the room's page (and are the hub's admins). room: the room's folder. notebooks: the course,
    copied into each seat's home on its first start. gpus: the server's GPUs to deal round the
    seats ("auto": as many as it has; 0: labs on CPU). spawner: "local" (this server), "kubernetes"
    (kubespawner) or "slurm" (batchspawner), which ask for `gpus_per_seat` whole GPUs per seat.
    room_url: where the room's service listens (the hub proxies it; keep it on loopback)."""
    if spawner not in SPAWNERS:
        raise ValueError(f"spawner={spawner!r}: use one of {', '.join(map(repr, SPAWNERS))}")
    accounts, instructors = seat_names(seats), list(instructors)
    if set(accounts) & set(instructors):
        raise ValueError(f"{sorted(set(accounts) & set(instructors))}: an instructor has no seat; give them "
                         f"accounts of their own")
    workshop = Workshop(tuple(accounts), Path(room).resolve(),
                        Path(notebooks).resolve() if notebooks else None,
                        count_gpus() if gpus == "auto" else gpus, ranks_per_seat, gpus_per_seat)
    if notebooks is not None and not workshop.notebooks.is_dir():
        raise ValueError(f"notebooks={str(notebooks)!r}: no such folder; give the course's notebooks folder")
    if spawner == "local":
        _check_seats_can_reach([Path(sys.executable), Path(__file__).parents[2], workshop.room.parent,
                                *([workshop.notebooks] if workshop.notebooks else [])])
        make_room(workshop.room, accounts)  # every seat's folder, before anyone logs in: none can be taken

    c.JupyterHub.spawner_class = SPAWNERS[spawner]
    c.Authenticator.allowed_users = set(accounts) | set(instructors)
    c.Authenticator.admin_users = set(instructors)
    c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = "/lab"
    c.Spawner.pre_spawn_hook = lambda spawner_: prepare_seat(workshop, spawner_)
    c.JupyterHub.services = [*c.JupyterHub.get("services", []), {
        "name": ROOM_SERVICE, "url": room_url, "oauth_no_confirm": True, "display": True,
        "command": [sys.executable, "-m", "pplab.course.hub.service", str(workshop.room), "--refresh",
                    f"{refresh:g}"]}]
    c.JupyterHub.load_roles = [*c.JupyterHub.get("load_roles", []), {
        "name": INSTRUCTORS_ROLE, "users": instructors,
        "scopes": [f"access:services!service={ROOM_SERVICE}"]}]
    return workshop


def _check_seats_can_reach(paths: list[Path]) -> None:
    """Refuse a workshop whose seats' servers could not start: they run as the seats' accounts, which
    must be able to reach Python, pplab, the room and the course (every folder above them open to
    all, as /opt and /srv are)."""
    closed = []
    for path in paths:
        path = path.resolve()
        for folder in [*reversed(path.parents), *([path] if path.is_dir() else [])]:
            if folder.exists() and not os.stat(folder).st_mode & stat.S_IXOTH:  # one made later is open
                closed.append(f"{folder} (mode {stat.S_IMODE(os.stat(folder).st_mode):o}, on "
                              f"the way to {path})")
                break
    if closed:
        raise ValueError(f"the seats' accounts cannot reach {'; '.join(closed)}: their servers would not "
                         "start. Install pplab's environment and the course where every account can read "
                         "them (e.g. /opt/pplab, docs/instructor.md), or open those folders (chmod o+x)")
