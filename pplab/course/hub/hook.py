"""What the hub does for a seat before its server starts (JupyterHub's `pre_spawn_hook`).

On this server: the seat's folder in the room (owned by its account, so no one else can write its
verdicts or take its seat), the course's notebooks copied into its home on the first start (a file
already there is the attendee's and is never replaced), and the environment that puts its labs on
its GPUs with its cap. On a cluster spawner: the same environment, less the GPUs, which the seat
asks the scheduler for instead (`seats.gpu_request`).
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from pplab.course.hub.seats import Workshop, gpu_request
from pplab.course.room import make_room


def on_this_server(spawner) -> bool:
    """Whether the seat's server runs on the hub's own host, as the seat's account (a cluster
    spawner's runs elsewhere, where the scheduler hands out the GPUs)."""
    return not gpu_request(set(spawner.trait_names()), 1)


def prepare_seat(workshop: Workshop, spawner) -> None:
    """Ready `spawner` for its user's seat; an instructor (no seat) gets the room's folder only."""
    account = spawner.user.name
    if account not in workshop.seats:
        return
    local = on_this_server(spawner)
    spawner.environment = {**spawner.environment, **workshop.environment(account, cluster=not local)}
    if not local:
        for name, value in gpu_request(set(spawner.trait_names()), workshop.gpus_per_seat).items():
            setattr(spawner, name, {**getattr(spawner, name), **value} if isinstance(value, dict) else value)
        return
    make_room(workshop.room, [account])  # made at the hub's start too; again for a seat added since
    if workshop.notebooks is not None:
        course = copy_course(workshop.notebooks, account, workshop.course_folder)
        spawner.notebook_dir = str(course)


def copy_course(notebooks: Path, account: str, folder: str) -> Path:
    """Copy the course into `account`'s home (`~/folder`), owned by the account; every file already
    there is left as it is, so an attendee's edits and outputs survive a restart of their server."""
    entry = pwd.getpwnam(account)
    course = Path(entry.pw_dir) / folder
    for source in [Path(notebooks), *sorted(Path(notebooks).rglob("*"))]:
        if any(part.startswith(".") or part == "__pycache__" for part in source.relative_to(notebooks).parts):
            continue  # checkpoints, caches: not the course
        target = course / source.relative_to(notebooks)
        if target.exists():
            continue
        if source.is_dir():
            target.mkdir(parents=True)
        else:
            shutil.copyfile(source, target)
        os.chown(target, entry.pw_uid, entry.pw_gid)
    return course
