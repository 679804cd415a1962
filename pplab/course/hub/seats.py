"""A workshop's seats: which account sits where, which GPUs and memory cap each seat's labs get,
and what each seat's server is given. Pure decisions: nothing here needs JupyterHub.

On one server (JupyterHub's LocalProcessSpawner) the room's GPUs are dealt round the seats as
`pplab room --plan` deals them (`plan_room`): each seat sees only its GPUs (CUDA_VISIBLE_DEVICES),
and each rank of its labs is capped at its share of a GPU (PPLAB_GPU_MEMORY_FRACTION), so that a
lesson's unchanged `pplab.Lab(n_ranks=2)` runs within its seat. On a cluster (kubespawner,
batchspawner on Slurm) the scheduler hands each seat's server whole GPUs instead: the seat asks for
`gpus_per_seat` of them and sees them as its own, uncapped.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from pplab.base.arguments import check_positive_int
from pplab.course.room import ROOM_ENV, SEAT_ENV
from pplab.drivers.cluster.plan import MEMORY_FRACTION_ENV, RoomPlan, plan_room


def count_gpus() -> int:
    """The NVIDIA GPUs of this host, from their device files (no CUDA, no torch import in the hub)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def seat_names(seats: int | str | list[str], prefix: str = "seat-") -> list[str]:
    """The seats' accounts: `20` -> seat-01 .. seat-20; 'ada,bo' or a list: those names."""
    if isinstance(seats, str) and not seats.isdigit():
        seats = [name.strip() for name in seats.split(",") if name.strip()]
    if isinstance(seats, (int, str)):
        count = check_positive_int("seats", int(seats), example=20)
        return [f"{prefix}{number:0{max(2, len(str(count)))}d}" for number in range(1, count + 1)]
    names = list(seats)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"seats={names!r}: give a number of seats (e.g. 20) or distinct account names")
    return names


@dataclass(frozen=True)
class Workshop:
    """The seats of a workshop, in seat order, and what they share."""

    seats: tuple[str, ...]  # the seats' Unix accounts
    room: Path  # the room's folder (PPLAB_ROOM of every seat)
    notebooks: Path | None = None  # the course, copied into each seat's home on its first start
    gpu_count: int = 0  # the server's GPUs dealt round the seats (0: the labs run on CPU)
    ranks_per_seat: int = 2  # ranks of a lesson's lab, for the plan of the GPUs
    gpus_per_seat: int = 1  # on a cluster spawner: whole GPUs each seat's server asks for (0: CPU)
    course_folder: str = "pplab-course"  # where the notebooks go, in each seat's home

    def __post_init__(self):
        check_positive_int("ranks_per_seat", self.ranks_per_seat, example=2)
        if not isinstance(self.gpus_per_seat, int) or self.gpus_per_seat < 0:
            raise ValueError(f"gpus_per_seat={self.gpus_per_seat!r}: give the whole GPUs each seat's server "
                             "asks a cluster for (0: none, its labs on CPU)")
        if not isinstance(self.gpu_count, int) or self.gpu_count < 0:
            raise ValueError(f"gpus={self.gpu_count!r}: give the server's GPUs (0 or more), or 'auto'")

    def plan(self) -> RoomPlan | None:
        """The seats dealt round the server's GPUs (None without GPUs)."""
        return plan_room(len(self.seats), self.ranks_per_seat, self.gpu_count) if self.gpu_count else None

    def seat_of(self, account: str) -> int:
        """The seat number (0, 1, ...) of `account`."""
        if account not in self.seats:
            raise ValueError(f"{account!r} has no seat in this workshop (its seats: {', '.join(self.seats)})")
        return self.seats.index(account)

    def environment(self, account: str, cluster: bool = False) -> dict[str, str]:
        """What a seat's server is given: the room and the seat; on one server also its GPUs and cap
        (on a cluster the scheduler gives a seat its GPUs, see `gpu_request`)."""
        seat = self.seat_of(account)
        env = {ROOM_ENV: str(self.room), SEAT_ENV: account}
        plan = self.plan()
        if plan is not None and not cluster:
            gpus = plan.gpus(seat)
            # rank r on the r-th of them
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, dict.fromkeys(gpus)))
            env[MEMORY_FRACTION_ENV] = f"{plan.memory_fraction:.4g}"
        return env

    def describe(self) -> str:
        """One line per seat: its account and GPUs (or CPU), under the plan's summary."""
        plan = self.plan()
        lines = [plan.describe().splitlines()[0] if plan else f"{len(self.seats)} seat(s), "
                                                              "labs on CPU (no GPU)"]
        for account in self.seats:
            env = self.environment(account)
            where = f"GPUs {env['CUDA_VISIBLE_DEVICES']}" if plan else "CPU"
            lines.append(f"  {account}: {where}")
        return "\n".join(lines)


def gpu_request(spawner_traits: set[str], gpus: int) -> dict[str, object]:
    """The settings that ask a cluster spawner for a seat's whole GPUs: kubespawner's
    `extra_resource_limits` (the NVIDIA device plugin's resource), batchspawner's `req_gres` (Slurm's
    `--gres`); {} for a spawner on this server (LocalProcessSpawner), whose seats get their GPUs
    through `Workshop.environment`."""
    if not gpus:
        return {}
    if "extra_resource_limits" in spawner_traits:
        return {"extra_resource_limits": {"nvidia.com/gpu": str(gpus)}}
    if "req_gres" in spawner_traits:
        return {"req_gres": f"gpu:{gpus}"}
    return {}
