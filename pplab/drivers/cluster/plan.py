"""Pure decisions taken before any rank blocks: backend and device, rank order, thread count.

Nothing here starts a process or imports ipyparallel, so every rule is cheap to
test and every bad argument is rejected before the lab spends a second starting.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import NamedTuple

from pplab.base.arguments import check_positive_int

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RankSpec:
    """Everything one engine needs to become rank `rank` of the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: str  # "cpu" or "cuda"
    rendezvous: str  # init_method URL: file:///... on one host, tcp://host:port across hosts
    op_timeout: float  # seconds, for every collective or P2P op
    threads: int | None  # torch threads per rank; None keeps the engine's default
    gloo_ifname: str | None  # network interface for gloo/NCCL sockets; None lets them choose
    sys_path: tuple[str, ...] = ()  # entries of the client's sys.path to add on the engine
    gpu: int | None = None  # the CUDA device of this rank (default: its local rank)
    core: int | None = None  # the core its threads stay on (default: none, the kernel places them)
    host_messages: bool = False  # copy messages through host memory (gloo between ranks on GPUs)
    memory_fraction: float | None = None  # the share of its GPU's memory this rank may take (None: all)
    join_timeout: float = 0.0  # seconds joining the process group may take, where longer than op_timeout


def check_threads(threads: object) -> int | None:
    """Return `threads` if it is None (torch's default) or a whole number >= 1, else raise."""
    return None if threads is None else check_positive_int("threads", threads, example=1)


def check_gpus(gpus: object, n_ranks: int, device: str, gpu_count: int) -> tuple[int, ...] | None:
    """The CUDA devices a local lab's ranks use, one per rank in rank order (None: chosen for them).

    On a server shared by several attendees each lab takes its own GPUs, e.g. seat 2 of
    a room with two ranks each takes `gpus=[4, 5]` (see `gpus_for_seat`); a device named
    twice is shared by those ranks (their messages then go through host memory).
    """
    if gpus is None:
        return None
    if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__iter__"):
        raise ValueError(f"gpus={gpus!r}: give the CUDA device numbers of the ranks, e.g. gpus=[0, 1]")
    gpus = tuple(gpus)
    if not all(isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0 for gpu in gpus):
        raise ValueError(f"gpus={list(gpus)!r}: give device numbers >= 0, one per rank, e.g. gpus=[0, 1]")
    if len(gpus) != n_ranks:
        raise ValueError(f"gpus={list(gpus)!r} names {len(gpus)} GPU(s) for {n_ranks} ranks: give one per "
                         "rank (a number twice where two ranks share a GPU)")
    if device == "cpu":
        raise ValueError(f"gpus={list(gpus)!r} with device='cpu': leave out gpus, or use device='cuda'")
    missing = [gpu for gpu in gpus if gpu >= gpu_count]
    if missing:
        raise ValueError(f"gpus={list(gpus)!r}: this host has {gpu_count} GPU(s) (0..{gpu_count - 1}), "
                         f"so {missing} do not exist" if gpu_count else
                         f"gpus={list(gpus)!r}: this host has no GPU that torch can see; leave out gpus "
                         f"(the lab then runs on CPU)")
    return gpus


def gpus_for_seat(seat: int, n_ranks: int, gpu_count: int) -> list[int]:
    """The GPUs of attendee `seat` (0, 1, ...) when each attendee's lab has `n_ranks` ranks: the
    ranks of the room dealt round the devices, e.g. seat 1 with 2 ranks on 8 GPUs gets [2, 3] and
    seat 4 gets [0, 1] again, shared with seat 0 (see `plan_room` for a whole room and its caps)."""
    if not isinstance(seat, int) or isinstance(seat, bool) or seat < 0:
        raise ValueError(f"seat={seat!r}: give the attendee's seat number, 0 or more")
    return plan_room(seat + 1, n_ranks, gpu_count).gpus(seat)


# A CUDA context (about 0.8 GiB per process on an H200, bench/results/gpu.json) lies outside the
# allocator's cap: the caps of a GPU's ranks add up to this much of it, the rest kept for contexts.
CAPPED_SHARE = 0.9


@dataclass(frozen=True)
class RoomPlan:
    """Which GPU each rank of each seat uses, and how much of a GPU's memory one rank may take."""

    n_seats: int
    n_ranks: int
    gpu_count: int
    seats: tuple[tuple[int, ...], ...]  # per seat, its ranks' GPUs
    ranks_per_gpu: int  # the most ranks any one GPU holds
    memory_fraction: float  # each rank's cap (torch.cuda.set_per_process_memory_fraction)

    def gpus(self, seat: int) -> list[int]:
        """Seat `seat`'s GPUs, one per rank (give them to `Lab(gpus=...)`)."""
        if not isinstance(seat, int) or isinstance(seat, bool) or not 0 <= seat < self.n_seats:
            raise ValueError(f"seat={seat!r}: this plan has seats 0..{self.n_seats - 1}")
        return list(self.seats[seat])

    def describe(self) -> str:
        """One line per GPU: the seats on it and each rank's cap."""
        lines = [f"{self.n_seats} seat(s) of {self.n_ranks} rank(s) on {self.gpu_count} GPU(s): up "
                 f"to {self.ranks_per_gpu} rank(s) per GPU, each rank capped at "
                 f"{self.memory_fraction:.1%} of its GPU"]
        for gpu in range(self.gpu_count):
            on_it = [seat for seat, gpus in enumerate(self.seats) if gpu in gpus]
            lines.append(f"  GPU {gpu}: seats {', '.join(map(str, on_it)) or '-'}")
        return "\n".join(lines)


def plan_room(n_seats: int, n_ranks: int, gpu_count: int, *, gpu_memory_gib: float | None = None,
              rank_memory_gib: float | None = None) -> RoomPlan:
    """Seats of `n_ranks` ranks dealt round `gpu_count` GPUs: rank r of seat s on GPU (s * n_ranks + r)
    % gpu_count, so that a seat's ranks are on distinct GPUs where there are enough and every GPU
    holds as many ranks as any other, give or take one. Each rank's cap is an equal share of
    `CAPPED_SHARE` of its GPU, so that no attendee can take a GPU from the others.

    With `gpu_memory_gib` (one GPU's memory) and `rank_memory_gib` (what one rank needs, its CUDA
    context included), a room that does not fit is refused, naming how many seats would.
    """
    check_positive_int("n_seats", n_seats, example=20)
    check_positive_int("n_ranks", n_ranks, example=2)
    if not isinstance(gpu_count, int) or gpu_count < 1:
        raise ValueError(f"gpu_count={gpu_count!r}: a room on GPUs needs at least one; without GPUs the "
                         f"labs run on CPU (device='cpu')")
    seats = tuple(tuple((seat * n_ranks + rank) % gpu_count for rank in range(n_ranks))
                  for seat in range(n_seats))
    ranks_per_gpu = -(-n_seats * n_ranks // gpu_count)
    fraction = CAPPED_SHARE / ranks_per_gpu
    if gpu_memory_gib is not None and rank_memory_gib is not None \
            and ranks_per_gpu * rank_memory_gib > gpu_memory_gib:
        fitting = int(gpu_memory_gib // rank_memory_gib) * gpu_count // n_ranks
        raise ValueError(f"{n_seats} seats of {n_ranks} ranks put {ranks_per_gpu} ranks on a GPU: "
                         f"{ranks_per_gpu} x {rank_memory_gib:g} GiB > {gpu_memory_gib:g} GiB. Seat at most "
                         f"{fitting} on these {gpu_count} GPU(s) (the others on CPU: device='cpu'), or use "
                         f"a smaller model or fewer ranks per lab")
    return RoomPlan(n_seats, n_ranks, gpu_count, seats, ranks_per_gpu, fraction)


def check_memory_fraction(fraction: object) -> float | None:
    """`fraction` if None or a share of a GPU in (0, 1], else raise naming it."""
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction={fraction!r}: give the share of a GPU's memory each rank may "
                         "take, between 0 and 1 (e.g. 0.1; pplab.drivers.cluster.plan_room computes it "
                         "for a room)")
    return float(fraction)


# A workshop's hub gives each seat its GPUs (CUDA_VISIBLE_DEVICES) and this cap for every rank of
# its labs (pplab.course.hub), so that a lesson's unchanged `pplab.Lab(n_ranks=2)` stays within its seat.
MEMORY_FRACTION_ENV = "PPLAB_GPU_MEMORY_FRACTION"


def seat_memory_fraction() -> float | None:
    """The cap on each rank's share of its GPU that this seat's environment sets, or None."""
    value = os.environ.get(MEMORY_FRACTION_ENV, "").strip()
    if not value:
        return None
    try:
        return check_memory_fraction(float(value))
    except ValueError:
        raise ValueError(f"{MEMORY_FRACTION_ENV}={value!r}: give the share of a GPU's memory each rank may "
                         "take, between 0 and 1 (a workshop's hub sets it per seat), or unset it") from None


def visible_gpus() -> list[str] | None:
    """The host's GPUs this process sees, in CUDA's order, as CUDA_VISIBLE_DEVICES names them (None:
    not set, every GPU by its own number)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if listed is None else [name.strip() for name in listed.split(",") if name.strip()]


def describe_placement(backend: str, device: str, rank_gpus: list[int], memory_fraction: float | None,
                       host_messages: bool) -> str:
    """Where the ranks compute and how they talk, in words: 'gloo on cuda (GPU 0: ranks 0-3; messages
    through host memory)'. GPUs are named as the host numbers them: under CUDA_VISIBLE_DEVICES=4,5 the
    lab's device 0 is GPU 4, and the line says where the GPUs and the cap came from."""
    said = f"{backend} on {device}"
    if rank_gpus:
        visible = visible_gpus()
        by_gpu: dict[int, list[int]] = {}
        for rank, gpu in enumerate(rank_gpus):
            by_gpu.setdefault(gpu, []).append(rank)
        said += " (" + ", ".join(f"GPU {visible[gpu] if visible and gpu < len(visible) else gpu}: "
                                 f"rank{'s' if len(ranks) > 1 else ''} {_spans(ranks)}"
                                 for gpu, ranks in sorted(by_gpu.items()))
        if memory_fraction is not None:
            said += f"; each rank capped at {memory_fraction:.1%} of its GPU's memory"
        said += "; messages through host memory)" if host_messages else ")"
        given = [f"CUDA_VISIBLE_DEVICES={','.join(visible)}"] if visible is not None else []
        if memory_fraction is not None and os.environ.get(MEMORY_FRACTION_ENV, "").strip():
            given.append(f"{MEMORY_FRACTION_ENV}={os.environ[MEMORY_FRACTION_ENV].strip()}")
        if given:
            said += f"; this seat's, from {' and '.join(given)}"
    elif host_messages:
        said += " (messages through host memory, as ranks that share a GPU send them)"
    return said


def _spans(ranks: list[int]) -> str:
    """'0-3' for [0, 1, 2, 3], '0, 2' for [0, 2]."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class Placement(NamedTuple):
    """Where a lab's ranks compute and how their messages travel."""

    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda"
    host_messages: bool  # messages copied through host memory (gloo with GPUs, or asked for)


def choose_backend_device(backend: str, device: str, gpus_per_host: dict[str, int],
                          ranks_per_host: dict[str, int], host_messages: bool | None = None) -> Placement:
    """Pick the placement: CUDA where every host has a GPU, else CPU; NCCL where every local
    rank owns a GPU, else gloo with messages through host memory (ranks sharing a GPU).

    `backend`, `device` and `host_messages` may be forced (`host_messages=True` also on CPU, so
    that the path runs in tests); a forced choice the hosts cannot honour raises a ValueError
    that names the value and the fix.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {', '.join(map(repr, BACKENDS))}")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is unknown; use one of {', '.join(map(repr, DEVICES))}")
    if host_messages not in (None, True, False):
        raise ValueError(f"host_messages={host_messages!r}: use True (messages through host memory, over "
                         f"gloo), False (NCCL between GPUs) or None (chosen for you)")
    without_gpu = [host for host in ranks_per_host if gpus_per_host.get(host, 0) == 0]
    sharing = {host: (ranks_per_host[host], gpus_per_host[host]) for host in ranks_per_host
               if 0 < gpus_per_host.get(host, 0) < ranks_per_host[host]}
    if device == "auto":
        device = "cuda" if backend == "nccl" or not (without_gpu or backend == "gloo") else "cpu"
    if device == "cuda" and without_gpu:
        asked = f"device={device!r}" if backend != "nccl" else f"backend={backend!r}"
        raise ValueError(f"{asked} needs a GPU on every host, but host {without_gpu[0]!r} has none; "
                         f"use device='cpu' (backend='gloo')")
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend='nccl' runs on GPUs only; use backend='gloo' for device='cpu'")
    if sharing and device == "cuda" and (backend == "nccl" or host_messages is False):
        host, (wanted, have) = next(iter(sharing.items()))
        asked = "backend='nccl'" if backend == "nccl" else "host_messages=False"
        raise ValueError(f"{asked} needs one GPU per rank (NCCL cannot hold two ranks of a group on one "
                         f"device), but host {host!r} would run {wanted} ranks on {have} GPU(s); leave it "
                         f"out (the ranks then share the GPUs, their messages through host memory over "
                         f"gloo), or use fewer ranks")
    if host_messages and backend == "nccl":
        raise ValueError("host_messages=True sends every message over gloo; leave out backend='nccl'")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and not sharing and not host_messages else "gloo"
    return Placement(backend, device, bool(host_messages) or (backend == "gloo" and device == "cuda"))


def assign_ranks(engines: dict[int, str]) -> list[int]:
    """Order engine ids into ranks: hosts in order of their lowest engine id, engine ids within a host.

    Engine ids are not ranks (they change after a restart); this order keeps each
    host's ranks contiguous so that local ranks 0..k-1 map onto its GPUs.
    """
    host_order: dict[str, int] = {}
    for engine_id in sorted(engines):
        host_order.setdefault(engines[engine_id], len(host_order))
    return sorted(engines, key=lambda engine_id: (host_order[engines[engine_id]], engine_id))


def local_ranks(hosts_by_rank: list[str]) -> list[tuple[int, int]]:
    """For each rank, (its index among the ranks on its host, how many ranks that host has)."""
    seen: dict[str, int] = {}
    for host in hosts_by_rank:
        seen[host] = seen.get(host, 0) + 1
    counter: dict[str, int] = {}
    pairs = []
    for host in hosts_by_rank:
        pairs.append((counter.get(host, 0), seen[host]))
        counter[host] = counter.get(host, 0) + 1
    return pairs


def loopback_interface() -> str:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address.startswith("127.")
               for address in addresses):
            return name
    return "lo"
