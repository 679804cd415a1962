"""The ranks torchrun starts, as a driver: every process is one rank and its own client.

`TorchrunRanks()` joins torchrun's process group (NCCL and one GPU per process where
there are GPUs, gloo otherwise) and offers what a session needs of its ranks (see
`pplab.session`), so `pplab demo` runs the same session code under torchrun as on a
`RankPool`. `run_as_torchrun_rank(fn, *args)` is the plain entry point: `fn(rank,
world_size, *args, device=...)` on each process, the results by rank on rank 0.
"""

from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta

from pplab.base.config import LabOptions, takes_options
from pplab.base.renames import renamed_keywords
from pplab.drivers.contract import arguments_by_rank, error_report, one_line
from pplab.rank.rank_context import (
    RankContext,
    RankEvent,
    RankFailedError,
    import_before_joining,
    set_rank_context,
)


def under_torchrun() -> bool:
    """True in a process that torchrun (or any launcher setting RANK and WORLD_SIZE) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class TorchrunRanks:
    """The ranks torchrun started, as a session's driver: each process is one rank and the client too.

    Every process runs the same session code; `run(fn, *args)` calls fn on this rank and
    gives every process the results of all ranks (one all-gather), so each can merge and
    check them alike (rank 0 reports). Nobody listens to `publish` here.
    """

    state = "running"

    @renamed_keywords
    @takes_options(LabOptions)
    def __init__(self, op_timeout: float = LabOptions.op_timeout):
        """Join torchrun's process group: on GPUs where there are any (NCCL with one GPU per process;
        gloo, messages through host memory, where processes outnumber the GPUs and share them), else
        gloo on CPU. `op_timeout`: seconds one wait between ranks (the rendezvous, a collective, a
        P2P op) may take."""
        import torch
        import torch.distributed as dist

        if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo on loopback
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # Every process decides alike from what all of them see (the host's GPUs, how many share them).
        self.device = torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")
        if gpus:
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        self.backend = "nccl" if gpus >= local_world_size else "gloo"
        import_before_joining()
        dist.init_process_group(self.backend, timeout=timedelta(seconds=op_timeout))
        self.op_timeout, self.rank, self.world_size = op_timeout, dist.get_rank(), dist.get_world_size()
        set_rank_context(RankContext(self.rank, self.world_size, local_rank,
                                     int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)), self.backend,
                                     self.device, host_messages=self.backend == "gloo" and bool(gpus)))

    def _check_usable(self) -> None:
        pass

    @property
    def rank_processes(self) -> tuple[tuple[str, int], ...]:
        """This process, the one rank a client here sees (never replaced)."""
        return ((socket.gethostname(), os.getpid()),)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on this rank; every rank's result, by rank, on every process."""
        import torch.distributed as dist

        by_rank = arguments_by_rank(fn, args, kwargs, self.world_size)
        if by_rank is not None:
            args, kwargs = by_rank[self.rank]  # this process is its rank
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except Exception as error:  # every rank learns who failed, instead of waiting for it
            outcome = ("error", error_report(error))
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, outcome)
        raised = {rank: value for rank, (status, value) in enumerate(gathered) if status == "error"}
        if raised:
            raise RankFailedError("\n".join(f"rank {r} failed:\n{e}: {v}\n{t}"
                                            for r, (e, v, t) in raised.items()),
                                 {r: f"failed: {one_line(e, v)}" for r, (e, v, _) in raised.items()},
                                 {r: (e, v) for r, (e, v, _) in raised.items()})
        return [value for _, value in gathered]

    def run_async(self, fn, *args, timeout: float | None = None, **kwargs) -> "_FinishedCall":
        """Run it now (each process is its own client): a call that has finished."""
        return _FinishedCall(self.run(fn, *args, timeout=timeout, **kwargs))

    def stop(self) -> None:
        """Leave the process group, once every rank is past its last call."""
        import torch.distributed as dist

        # Every rank past the last gather before any tears its connections down: a rank that
        # left while another still received was seen to abort in gloo's teardown (rarely).
        dist.barrier()
        gc.collect()  # what cycles hold of the ranks' communication goes while the group lives
        set_rank_context(None)
        dist.destroy_process_group()

    def __enter__(self) -> "TorchrunRanks":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class _FinishedCall:
    """A call that ran to its end before it was returned."""

    def __init__(self, results: list):
        self._results = results

    def done(self) -> bool:
        return True

    def running_ranks(self) -> list[int]:
        return []

    def poll_events(self) -> list[RankEvent]:
        return []

    def wait_for_events(self, seconds: float = 0.0) -> None:
        pass

    def result(self, timeout: float | None = None) -> list:
        return self._results


@renamed_keywords
@takes_options(LabOptions)
def run_as_torchrun_rank(fn, *args, op_timeout: float = LabOptions.op_timeout):
    """Join torchrun's process group, call `fn(rank, world_size, *args, device=...)`, and give rank 0
    the results by rank (None on the other ranks); `op_timeout` as for `TorchrunRanks`."""
    with TorchrunRanks(op_timeout) as ranks:
        results = ranks.run(fn, ranks.rank, ranks.world_size, *args, device=ranks.device)
    return results if ranks.rank == 0 else None
