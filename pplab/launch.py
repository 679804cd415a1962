"""Plain local processes as ranks: the torchrun-like launcher for tests, scripts and the CLI.

`run_ranks(world_size, fn, *args)` starts one process per rank, joins them in a
gloo (or NCCL) process group on loopback with a fresh port, calls
`fn(rank, world_size, *args)` on each, and returns the results ordered by rank.
A rank that raises or dies, or a run past its timeout, ends every process and
raises an error naming the rank. No process outlives the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta


class RankFailed(RuntimeError):
    """A rank raised, died, or did not finish in time."""


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
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive integer")
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
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _collect(processes, results, timeout: float, grace: float) -> list:
    deadline, collected, failures = time.monotonic() + timeout, {}, {}

    def fail(rank: int, what: str) -> None:
        nonlocal deadline
        if not failures:  # the first failure starts the others' grace period
            deadline = min(deadline, time.monotonic() + grace)
        failures[rank] = what

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
                raise RankFailed(f"ranks {missing} did not finish within {timeout:g} s") from None
            continue
        if status == "error":
            fail(rank, f"failed:\n{value}")
        else:
            collected[rank] = pickle.loads(value)
    if failures:
        raise RankFailed("\n".join(f"rank {rank} {what}" for rank, what in failures.items()))
    return [collected[rank] for rank in range(len(processes))]
