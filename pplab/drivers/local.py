"""Plain local processes as ranks: the driver for the CLI, tests, benchmarks and scripts.

`RankPool(n_ranks)` starts one process per rank once (torch imported once, the process group
joined once, gloo on loopback, or NCCL) and keeps them: `pool.run(fn, *args)` calls `fn(*args)` on
every rank (which asks `pplab.rank.rank_context` who it is) and returns the results ordered by
rank; `pool.run_async` returns at once with a call that streams what the ranks `publish`. It is
the interface a lab offers, so a pipeline session runs on either.

`run_ranks(n_ranks, fn, *args)` calls `fn(rank, world_size, *args)`, torchrun's way (`world_size`,
torch.distributed's word, is the number of ranks): on a pool when given one, else in fresh
processes for this one call (for code that must own its process group).

A rank that raises or dies, or a call past its timeout, ends with an error naming the
rank; a pool then replaces its processes before the next call (a failure can leave a
process group half-used). No process outlives the pool, or the call of `run_ranks`.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing import connection

from pplab.base.arguments import check_positive_int, check_positive_seconds
from pplab.base.config import LabOptions, takes_options
from pplab.base.renames import renamed_keywords
from pplab.drivers.contract import arguments_by_rank, call_name, error_report, one_line
from pplab.drivers.cores import check_cores, pin_this_process
from pplab.rank.rank_context import (
    RankContext,
    RankDiedError,
    RankError,
    RankEvent,
    RankFailedError,
    RankTimeoutError,
    StillRunningError,
    import_before_joining,
    rank_context,
    set_rank_context,
)

# What every rank imports, once, in the fork server its ranks are forked from (a spawned rank
# would import torch itself). torch._dynamo is there because an optimizer's first parameter group
# and torch's pipelining import it anyway; with it in, the rest costs little. A lab's engines
# preload less: pplab.drivers.cluster.forkserver.ENGINE_IMPORTS.
RANK_IMPORTS = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
                "torch.distributed.pipelining", "pplab.rank.rank_pipeline", "pplab.rank.train"]

# Why a pool's backend defaults to gloo where a lab's decides for itself (pplab.base.config.LabOptions).
_CPU_FIRST = "gloo: the command line's, the tests' and the benches' ranks, on CPU unless told"


def process_context():
    """Where rank processes come from: on Linux, forked from multiprocessing's fork server
    (started once per client, RANK_IMPORTS imported there before any thread exists); elsewhere
    spawned. Either way a rank starts from a clean interpreter state, not a copy of the client."""
    if sys.platform != "linux":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_IMPORTS)
    return context


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (a fresh rendezvous per run; "" for every interface)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def with_rank(fn, *args):
    """fn(rank, world_size, *args) on the rank this is (torchrun's calling convention, on any driver)."""
    context = rank_context()
    return fn(context.rank, context.world_size, *args)


class _Rendezvous:
    """Where one host's fresh ranks meet: a file store in a directory of its own.

    A file, not a TCP port: a port found free can be taken by another process in the
    seconds before rank 0 listens on it (EADDRINUSE).
    """

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="pplab-rendezvous-")
        self.url = f"file://{os.path.join(self.directory, 'store')}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _join_group(rank: int, world_size: int, rendezvous: str, backend: str, op_timeout: float,
                core: int | None = None):
    """Make this fresh process rank `rank` of a process group on this host (on
    `core`, if given); its device."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    if core is not None:  # before the backend starts its threads: they inherit it
        pin_this_process(core)
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes (a signal, not an exception) prints where, on stderr
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    import_before_joining()
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=op_timeout))
    return device


def _rank_main(rank, world_size, rendezvous, backend, op_timeout, fn, args, results):
    import torch.distributed as dist

    try:
        _join_group(rank, world_size, rendezvous, backend, op_timeout)
        try:
            # Plain pickle copies tensors into bytes; the queue's default would pass a
            # shared-memory handle that dies with this process.
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # report everything, then exit non-zero
        results.put((rank, "error", error_report(error)))
        raise SystemExit(1)


@takes_options(LabOptions, differs={"backend": _CPU_FIRST})
def run_ranks(n_ranks: int, fn, *args, backend: str = "gloo", timeout: float = 120.0,
              op_timeout: float = LabOptions.op_timeout, grace: float = LabOptions.grace,
              pool: RankPool | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `pool`, or in `n_ranks` fresh processes; results by rank.

    `timeout`: how long this call may take; `op_timeout` (fresh processes): how long one wait
    between ranks may take (a pool's ranks keep their own).

    When a rank fails, the others get `grace` seconds to report their own failure
    (a neighbour's timeout usually follows), then all are stopped and every
    failure is raised together, the first one first.
    """
    check_positive_int("n_ranks", n_ranks)
    if pool is not None:
        if pool.world_size != n_ranks:
            raise ValueError(f"n_ranks={n_ranks}, but the pool has {pool.world_size} ranks: give a "
                             f"pool of {n_ranks} ranks, or no pool")
        return pool.run(with_rank, fn, *args, timeout=timeout)
    context = process_context()
    results = context.Queue()
    rendezvous = _Rendezvous()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, n_ranks, rendezvous.url, backend, op_timeout, fn, args, results))
                 for rank in range(n_ranks)]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, timeout, grace)
    finally:
        _end(processes, patience=2.0)  # a rank that reported is returning: let it
        rendezvous.remove()


def _end(processes, patience: float) -> None:
    """Give the processes `patience` seconds to exit by themselves, then kill the rest.

    A process that exits by itself cleans up; a killed one leaves its queues' semaphores
    behind, and multiprocessing's resource tracker then complains on stderr.
    """
    started = [process for process in processes if process.pid is not None]
    deadline = time.monotonic() + patience
    for process in started:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(5)


def _collect(processes, results, timeout: float, grace: float) -> list:
    deadline, collected, failures, causes, raised = time.monotonic() + timeout, {}, {}, {}, {}

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
                raise RankTimeoutError(f"ranks {missing} did not finish within {timeout:g} "
                                       "s", ranks=missing) from None
            continue
        if status == "error":
            ename, evalue, trace = value
            raised[rank] = (ename, evalue)
            fail(rank, f"failed:\n{ename}: {evalue}\n{trace}", f"failed: {one_line(ename, evalue)}")
        else:
            collected[rank] = pickle.loads(value)
    if failures:
        kind = RankFailedError if raised else RankDiedError
        raise kind("\n".join(f"rank {rank} {what}" for rank, what in failures.items()), causes, raised)
    return [collected[rank] for rank in range(len(processes))]


# --- a pool of ranks kept between calls ------------------------------------------------------

# A pool talks to each rank over a pipe of its own: no queue, so no semaphore that a killed
# rank could leave behind (multiprocessing's resource tracker complains about those on stderr).
_STOP = b""  # what a pool sends a rank to make it leave


def _pool_rank_main(rank, world_size, rendezvous, backend, op_timeout, link, core=None, host_messages=False):
    """A pool's rank: join the group once, then run each call sent, until told to stop."""
    lock = threading.Lock()  # the call's thread and its feed's thread both send

    def send(*message) -> None:
        with lock:
            link.send(message)

    try:
        device = _join_group(rank, world_size, rendezvous, backend, op_timeout, core)
    except BaseException as error:
        send(None, "error", error_report(error))
        raise SystemExit(1)
    import torch
    import torch.distributed as dist

    current = {"call": None, "seq": 0}

    def publish(payload) -> None:  # rank_context.publish, from any thread of the call
        seq, current["seq"] = current["seq"], current["seq"] + 1
        send(current["call"], "event", (seq, pickle.dumps(payload)))

    set_rank_context(RankContext(rank, world_size, rank, world_size, backend, device, host_messages), publish)
    # Each call starts from the random state a fresh process has, so results do not
    # depend on what ran before on the pool.
    fresh_torch, fresh_python = torch.get_rng_state(), random.getstate()
    # torch's and pplab's modules are a quarter of a million objects that live as long as the
    # rank: frozen, the collection after each call walks only what calls made (0.1 s less a call).
    gc.freeze()
    send(None, "ready", os.getpid())
    while (message := link.recv_bytes()) != _STOP:
        call_id, fn, args, kwargs = pickle.loads(message)
        current.update(call=call_id, seq=0)
        torch.set_rng_state(fresh_torch)
        random.setstate(fresh_python)
        try:
            reply = ("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException as error:  # reported; the pool replaces its ranks after a failure
            reply = ("error", error_report(error))
        send(call_id, *reply)
        gc.collect()  # what the call left in cycles goes now, not during the next call
    set_rank_context(None)
    dist.destroy_process_group()


class RankPool:
    """`n_ranks` local processes kept as ranks: run functions on all of them, many times.

        with RankPool(2) as pool:
            losses = pool.run(fn, spec)          # fn(spec) on each rank, results by rank
            call = pool.run_async(fn, spec)      # returns at once; call.poll_events(), call.result()
            run_ranks(2, fn, spec, pool=pool)    # fn(rank, world_size, spec) on each rank

    A call that fails (a rank raised or died, or it ran past its timeout) ends every
    process; the next call starts fresh ones. `stop()` (or leaving the `with`) ends them.
    """

    @renamed_keywords
    @takes_options(LabOptions, differs={"backend": _CPU_FIRST,
                                        "host_messages": "False: its ranks share no GPU unless told"})
    def __init__(self, n_ranks: int, *, backend: str = "gloo", timeout: float = 120.0,
                 op_timeout: float = LabOptions.op_timeout, grace: float = LabOptions.grace,
                 cores: Sequence[int] | None = LabOptions.cores, host_messages: bool = False):
        """`timeout`: how long a call may take (the default of `run(..., timeout=)`); `op_timeout`:
        how long ONE wait between ranks may take (joining the group, a collective, a P2P op).
        `cores`: one core per rank to keep its threads on (e.g. [0, 1]; default: none, the kernel
        places them; see pplab.drivers.cores for when pinning pays). `host_messages`: copy each
        message through host memory, as ranks that share a GPU do (see pplab.rank.host_messages).

        `pool.world_size` is `n_ranks` (torch.distributed's word for the number of ranks).
        """
        check_positive_int("n_ranks", n_ranks)
        check_positive_seconds("timeout", timeout)
        check_positive_seconds("op_timeout", op_timeout)
        self.world_size, self.backend, self.cores = n_ranks, backend, check_cores(cores, n_ranks)
        self.host_messages = bool(host_messages)
        self.timeout, self.op_timeout, self.grace = timeout, op_timeout, grace
        self._context = process_context()
        self._processes: list = []
        self._links: list = []  # a pipe to each rank, by rank (closed once its rank is gone)
        self._calls: dict[int, PoolCall] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._start()
        _running_pools.add(self)

    # -- what a session needs of its ranks -------------------------------------------------

    @property
    def state(self) -> str:
        """'running', 'stopped', or 'restarting' (a failed call ended the
        processes; the next call starts new)."""
        if self._stopped:
            return "stopped"
        return "running" if self._processes else "restarting"

    @property
    def rank_processes(self) -> tuple[tuple[str, int], ...]:
        """(host, pid) of each rank's process, by rank: it changes when the processes are replaced."""
        return tuple((socket.gethostname(), process.pid) for process in self._processes)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the results ordered by rank."""
        return self.run_async(fn, *args, timeout=timeout, **kwargs).result()

    def run_async(self, fn, *args, timeout: float | None = None, **kwargs) -> "PoolCall":
        """Start fn(*args, **kwargs) on every rank and return at once."""
        self._check_usable()
        if timeout is not None:
            check_positive_seconds("timeout", timeout)
        by_rank = arguments_by_rank(fn, args, kwargs, self.world_size)
        for running in list(self._calls.values()):  # the ranks run one call at a time, in order
            try:
                running.result()
            except RankError:  # that call's own failure (its result() says so); its ranks were replaced
                pass
        if not self._processes:
            self._start()
        call_id = next(self._call_ids)
        # Every message is made before any is sent (one that cannot be pickled fails the call before
        # a rank starts it); the same one for every rank unless an argument is a PerRank.
        messages = ([pickle.dumps((call_id, fn, args, kwargs))] * self.world_size if by_rank is None else
                    [pickle.dumps((call_id, fn, *arguments)) for arguments in by_rank])
        for rank, (link, message) in enumerate(zip(self._links, messages)):
            try:
                link.send_bytes(message)
            except OSError:  # its process is gone: this call fails, the next one starts afresh
                self._end_processes(patience=0.0)
                raise RankDiedError(f"rank {rank}'s process has ended; call again for fresh "
                                    "ranks", ranks=[rank]) from None
        call = PoolCall(self, call_id, call_name(fn), self.timeout if timeout is None else timeout)
        self._calls[call_id] = call
        return call

    def _check_usable(self) -> None:
        if self._stopped:
            raise RuntimeError("this RankPool is stopped; start a new one")

    def restart(self) -> None:
        """Replace every process by a fresh one (a new process group)."""
        self._end_processes(patience=1.0)
        self._start()

    def stop(self) -> None:
        """Let the ranks leave their process group, and end every process."""
        if self._stopped:
            return
        self._stopped = True
        _running_pools.discard(self)
        self._end_processes(patience=5.0)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __del__(self) -> None:
        if not getattr(self, "_stopped", True):
            self._end_processes(patience=1.0)

    def __repr__(self) -> str:
        return f"<RankPool {self.world_size} ranks, {self.backend}: {self.state}>"

    # -- processes ----------------------------------------------------------------------------

    def _start(self) -> None:
        """Start the ranks and wait until every one has joined the process group."""
        self._rendezvous, links = _Rendezvous(), [self._context.Pipe() for _ in range(self.world_size)]
        self._processes = [self._context.Process(
            target=_pool_rank_main, daemon=True, name=f"pplab-rank-{rank}",
            args=(rank, self.world_size, self._rendezvous.url, self.backend, self.op_timeout, links[rank][1],
                  self.cores[rank] if self.cores else None, self.host_messages))
            for rank in range(self.world_size)]
        for process in self._processes:
            process.start()
        for _, rank_end in links:
            rank_end.close()  # the rank holds it now: when the rank ends, our end reads the end of the pipe
        self._links = [pool_end for pool_end, _ in links]
        ready, deadline = set(), time.monotonic() + self.op_timeout + 60  # imports come first
        while len(ready) < self.world_size:
            for _, rank, kind, value in self._receive(0.2):
                if kind == "error":
                    self._end_processes(patience=0.0)
                    raise RankFailedError(f"rank {rank} could not join the process group: "
                                          f"{one_line(*value[:2])}",
                                         {rank: f"failed: {one_line(*value[:2])}"}, {rank: value[:2]})
                ready.add(rank)
            dead = [r for r, p in enumerate(self._processes) if p.exitcode is not None and r not in ready]
            if dead or (len(ready) < self.world_size and time.monotonic() > deadline):
                self._end_processes(patience=0.0)
                why = (f"ranks {dead} died" if dead
                       else f"not every rank was up after {self.op_timeout + 60:g} s")
                missing = dead or [r for r in range(self.world_size) if r not in ready]
                raise (RankDiedError if dead else RankTimeoutError)(f"the pool's ranks did not start: {why}",
                                                                   ranks=missing)

    def _end_processes(self, patience: float) -> None:
        """End the ranks: asked to leave (one waiting for its next call leaves at once), and
        killed if still there after `patience` seconds."""
        for link in self._links:
            try:
                link.send_bytes(_STOP)
            except OSError:  # that rank is gone already
                pass
        _end(self._processes, patience)
        for link in self._links:
            link.close()
        if getattr(self, "_rendezvous", None) is not None:
            self._rendezvous.remove()
            self._rendezvous = None
        self._processes, self._links = [], []
        for call in self._calls.values():
            call._abandon()
        self._calls.clear()

    def _receive(self, wait: float) -> list[tuple]:
        """(call id, rank, kind, value) of what the ranks sent, waiting at most `wait` s for the first."""
        messages = []
        for link in connection.wait([link for link in self._links if not link.closed], timeout=wait):
            rank = self._links.index(link)
            try:
                while link.poll():
                    call_id, kind, value = link.recv()
                    messages.append((call_id, rank, kind, value))
            except (EOFError, OSError):  # the rank's process ended: nothing more will come
                link.close()
        return messages

    def _drain(self, wait: float) -> None:
        """Hand what the ranks sent to the calls it belongs to (waiting at most `wait` for the first)."""
        for call_id, rank, kind, value in self._receive(wait):
            if call_id in self._calls:
                self._calls[call_id]._arrived(rank, kind, value)

    def _finished(self, call: "PoolCall", failed: bool) -> None:
        """A call is over; after a failure the ranks are ended (the next call starts fresh ones)."""
        self._calls.pop(call.call_id, None)
        if failed:  # the ranks that reported leave by themselves; one stuck in a wait is killed
            self._end_processes(patience=2.0)


class PoolCall:
    """A function running on every rank of a pool: its results ordered by rank, its events as they arrive."""

    def __init__(self, pool: RankPool, call_id: int, name: str, timeout: float):
        self.pool, self.call_id, self.name, self.timeout = pool, call_id, name, timeout
        self._deadline = time.monotonic() + timeout
        self._results: dict[int, object] = {}
        self._raised: dict[int, tuple[str, str, str]] = {}
        self._events: list[RankEvent] = []
        self._first_failure_at: float | None = None
        self._error: RankError | None = None
        self._over = False

    def __repr__(self) -> str:
        state = "done" if self._over else "running"
        return f"<PoolCall {self.name} on {self.pool.world_size} ranks: {state}>"

    def _arrived(self, rank: int, kind: str, value) -> None:
        if kind == "event":
            seq, payload = value
            self._events.append(RankEvent(rank, seq, pickle.loads(payload)))
        elif kind == "ok":
            self._results[rank] = pickle.loads(value)
        elif kind == "error":
            self._raised[rank] = value
            self._first_failure_at = self._first_failure_at or time.monotonic()

    def _abandon(self) -> None:
        """The pool ended its processes while this call had not finished."""
        if not self._over:
            self._error = self._error or RankDiedError(f"{self.name} was abandoned: the "
                                                       "pool's ranks were ended",
                                                       ranks=self.running_ranks())
            self._over = True

    def running_ranks(self) -> list[int]:
        """The ranks that have not finished this call yet."""
        return [r for r in range(self.pool.world_size) if r not in self._results and r not in self._raised]

    def done(self) -> bool:
        """True when every rank has finished (successfully or not)."""
        return self._over

    def poll_events(self) -> list[RankEvent]:
        """The events that arrived since the last look, without waiting."""
        if not self._over:
            self.pool._drain(0)
        events, self._events = self._events, []
        return events

    def wait_for_events(self, seconds: float = 0.0) -> None:
        """Nothing to wait for: a rank's events reach the pool before its result."""

    def result(self, timeout: float | None = None) -> list:
        """Wait for every rank; their results ordered by rank, or a RankError naming the rank."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        while not self._over:
            self._look()
            if self._over:
                break
            if wait_until is not None and time.monotonic() >= wait_until:
                raise StillRunningError(f"{self.name} still running after result(timeout={timeout}); "
                                   "the call goes on, ask again later")
            self.pool._drain(0.1 if wait_until is None else max(0.0, min(0.1, wait_until - time.monotonic())))
        if self._error is not None:
            raise self._error
        return [self._results[rank] for rank in range(self.pool.world_size)]

    def _look(self) -> None:
        """End the call when every rank answered, one failed (after the others' grace), or time ran out."""
        running = self.running_ranks()
        died = [r for r in running if self.pool._processes[r].exitcode is not None]
        if died:
            time.sleep(0.2)  # its last words may still be on their way
            self.pool._drain(0)
            died = [r for r in died if r in self.running_ranks()]
            self._first_failure_at = self._first_failure_at or time.monotonic()
        failed = self._raised or died
        past_grace = failed and time.monotonic() - self._first_failure_at >= self.pool.grace
        if not running or (failed and (past_grace or len(died) + len(self._raised) == self.pool.world_size)):
            self._end(died, [r for r in running if r not in died])
        elif time.monotonic() >= self._deadline:
            self._end(died, running, timed_out=True)

    def _end(self, died: list[int], running: list[int], timed_out: bool = False) -> None:
        self._over = True
        failures, causes = {}, {}
        for rank, (ename, evalue, trace) in sorted(self._raised.items()):
            failures[rank] = f"failed:\n{ename}: {evalue}\n{trace}"
            causes[rank] = f"failed: {one_line(ename, evalue)}"
        for rank in died:
            exit_code = self.pool._processes[rank].exitcode
            failures[rank] = causes[rank] = f"died (exit code {exit_code}) without reporting"
        if timed_out and not failures:
            self._error = RankTimeoutError(f"ranks {running} did not finish {self.name} "
                                           f"within {self.timeout:g} s",
                                           ranks=running)
        elif failures:
            message = "\n".join(f"rank {r} {what}" for r, what in sorted(failures.items()))
            if self._raised:
                self._error = RankFailedError(message, causes,
                                              {r: (e, v) for r, (e, v, _) in self._raised.items()})
            else:
                self._error = RankDiedError(message, causes)
        self.pool._finished(self, failed=self._error is not None)


_running_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@atexit.register
def _stop_running_pools() -> None:
    for pool in list(_running_pools):
        pool._end_processes(patience=1.0)


def __getattr__(name: str):
    """`LocalRankError`, the last release's name (pplab.base.renames): every driver now raises the
    same errors (RankFailedError, RankDiedError, RankTimeoutError, each a RankError)."""
    from pplab.base.renames import renamed_attribute

    if renamed_attribute("pplab.drivers.local", name) is not None:
        return RankError
    raise AttributeError(f"module 'pplab.drivers.local' has no attribute {name!r}")
