"""Plain local processes as ranks: the torchrun-like launcher for tests, scripts and the CLI.

`run_ranks(world_size, fn, *args)` starts one process per rank, joins them in a
gloo (or NCCL) process group on loopback with a fresh port, calls
`fn(rank, world_size, *args)` on each, and returns the results ordered by rank.
A rank that raises or dies, or a run past its timeout, ends every process and
raises an error naming the rank. No process outlives the call.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

from pplab.arguments import check_positive_int


class LocalRankError(RuntimeError):
    """A rank raised, died, or did not finish in time; the message holds each failing rank's traceback."""

    def __init__(self, message: str, causes: dict[int, str] | None = None):
        super().__init__(message)
        self.causes = causes or {}  # rank -> what went wrong there, in one line

    @property
    def summary(self) -> str:
        """One line per failing rank with its cause (no tracebacks)."""
        if not self.causes:
            return str(self).splitlines()[0]
        return "\n".join(f"rank {rank} {cause}" for rank, cause in sorted(self.causes.items()))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (a fresh rendezvous per run; "" for every interface)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, backend, init_timeout, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=init_timeout))
        try:
            # Plain pickle copies tensors into bytes; the queue's default would pass a
            # shared-memory handle that dies with this process.
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # report everything, then exit non-zero
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(world_size: int, fn, *args, backend: str = "gloo", timeout: float = 120.0,
              init_timeout: float = 30.0, grace: float = 3.0) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; results by rank.

    When a rank fails, the others get `grace` seconds to report their own failure
    (a neighbour's timeout usually follows), then all are stopped and every
    failure is raised together, the first one first.
    """
    check_positive_int("world_size", world_size)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, world_size, port, backend, init_timeout, fn, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, timeout, grace)
    finally:
        # A rank that reported is returning: let it exit on its own (a killed process leaks
        # its semaphores), then stop whatever is still running.
        deadline = time.monotonic() + 2.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _collect(processes, results, timeout: float, grace: float) -> list:
    deadline, collected, failures, causes = time.monotonic() + timeout, {}, {}, {}

    def fail(rank: int, what: str, cause: str | None = None) -> None:
        nonlocal deadline
        if not failures:  # the first failure starts the others' grace period
            deadline = min(deadline, time.monotonic() + grace)
        failures[rank], causes[rank] = what, cause or what

    while len(collected) + len(failures) < len(processes):
        if failures and time.monotonic() > deadline:
            break
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank not in collected and rank not in failures and process.exitcode not in (None, 0):
                    time.sleep(0.5)  # its report may still be in the queue
                    if results.empty():
                        fail(rank, f"died (exit code {process.exitcode}) without reporting")
            if time.monotonic() > deadline and not failures:
                missing = [r for r in range(len(processes)) if r not in collected]
                raise LocalRankError(f"ranks {missing} did not finish within {timeout:g} s") from None
            continue
        if status == "error":
            fail(rank, f"failed:\n{value}", f"failed: {value.splitlines()[0]}")
        else:
            collected[rank] = pickle.loads(value)
    if failures:
        raise LocalRankError("\n".join(f"rank {rank} {what}" for rank, what in failures.items()), causes)
    return [collected[rank] for rank in range(len(processes))]


def under_torchrun() -> bool:
    """True in a process that torchrun (or any launcher setting RANK and WORLD_SIZE) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_as_torchrun_rank(fn, *args, timeout: float = 60.0):
    """Join torchrun's process group, call `fn(rank, world_size, *args, device=...)`, gather the
    results on rank 0: the list by rank there, None on the other ranks."""
    import torch
    import torch.distributed as dist

    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo on loopback
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        result = fn(rank, world_size, *args, device=device)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        # Every rank past the gather before any tears its connections down: a rank that left
        # while rank 0 still received was seen to abort in gloo's teardown (rarely, on 2 cores).
        dist.barrier()
        return gathered
    finally:
        gc.collect()  # what cycles hold of the ranks' communication goes while the group lives
        dist.destroy_process_group()
