"""The lab cluster with real processes: engines as gloo ranks on CPU, started, used, broken, restarted.

Functions sent to the ranks are defined at module level (the engines import this
module, as they would import a notebook's own module).
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import pplab
from pplab.base.machine import LoadWatch, measure_load
from pplab.drivers.cluster import (
    LabError,
    LabNeedsRestartError,
    LabStartError,
    publish,
    rank_context,
    records,
)
from pplab.drivers.cluster.kept import kept_now, stop_kept
from pplab.drivers.cluster.plan import (
    assign_ranks,
    check_gpus,
    check_memory_fraction,
    choose_backend_device,
    gpus_for_seat,
    local_ranks,
    plan_room,
)
from pplab.drivers.cluster.status import RankInfo, RankTable
from pplab.session import RankDiedError, RankFailedError, RankTimeoutError
from timing import SLACK, slack, within

# -- functions that run on the ranks ------------------------------------------------------


def whoami():
    import torch.distributed as dist

    context = rank_context()
    return {"rank": context.rank, "dist_rank": dist.get_rank(), "world_size": context.world_size,
            "pid": os.getpid()}


def all_reduce_sum():
    """Every rank contributes rank + 1; every rank must see 1 + 2 + ... + world_size."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def ring_exchange():
    """Each rank sends 10 * rank to the next rank and receives from the previous one."""
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    outgoing, incoming = torch.tensor([10.0 * rank]), torch.zeros(1)
    requests = [dist.isend(outgoing, (rank + 1) % size), dist.irecv(incoming, (rank - 1) % size)]
    for request in requests:
        request.wait()
    return incoming.item()


def raise_on_rank(bad_rank, others_wait_for_it):
    """`bad_rank` raises; the others return at once, or block receiving from it."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    if others_wait_for_it:
        dist.recv(torch.zeros(1), src=bad_rank)
    return "ok"


def exit_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(3)
    return "ok"


def sleep_for(seconds):
    """Keep a rank busy (but not blocked in torch.distributed) for `seconds`."""
    time.sleep(seconds)
    return seconds


def recv_that_never_comes():
    """Rank 1 waits for a message rank 0 never sends."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1), src=0)
    return "done"


def publish_numbered_events(count, release_flag):
    """Publish `count` numbered events, then keep running until `release_flag` exists."""
    import torch.distributed as dist

    for number in range(count):
        publish({"rank": dist.get_rank(), "number": number})
    deadline = time.time() + 30
    while not os.path.exists(release_flag) and time.time() < deadline:
        time.sleep(0.01)
    return count


def count_and_publish(count):
    """Publish `count` numbered events and return `count` (on a rank, or anywhere)."""
    for number in range(count):
        publish({"number": number})
    return count


def raise_on_every_rank(kind):
    """Every rank raises: an error that breaks the process group, or one that only looks like it."""
    import torch.distributed as dist

    class LookalikeError(Exception):
        pass

    LookalikeError.__name__ = "PipelineTimeoutError"
    if kind == "backend":
        raise dist.DistBackendError(f"communicator of rank {dist.get_rank()} aborted (injected)")
    raise LookalikeError("only the name of a timeout")


def listening_addresses():
    """The addresses this process listens on (TCP)."""
    connections = psutil.Process().net_connections(kind="inet")
    return sorted({c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN})


# -- helpers ------------------------------------------------------------------------------------


def assert_healthy(lab):
    """The lab answers, and a collective gives the right value on every rank."""
    n = lab.world_size
    assert lab.run(all_reduce_sum, timeout=20) == [n * (n + 1) / 2] * n


def all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


# -- decisions taken before anything starts (no processes) ---------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("arguments, named", [
    ({"n_ranks": 0}, "n_ranks=0"),
    ({"n_ranks": -2}, "n_ranks=-2"),
    ({"n_ranks": 1.5}, "n_ranks=1.5"),
    ({"n_ranks": "2"}, "n_ranks='2'"),
    ({"n_ranks": 2, "backend": "mpi"}, "backend='mpi'"),
    ({"n_ranks": 2, "device": "tpu"}, "device='tpu'"),
    pytest.param({"n_ranks": 2, "device": "cuda"}, "device='cuda'",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="has 2 GPUs")),
    ({"n_ranks": 2, "backend": "nccl", "device": "cpu"}, "backend='nccl'"),
    pytest.param({"n_ranks": 2, "backend": "nccl"}, "backend='nccl' needs",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="has 2 GPUs")),
    ({"n_ranks": 2, "op_timeout": 0}, "op_timeout=0"),
    ({"n_ranks": 2, "threads": 0}, "threads=0"),
    ({"n_ranks": 2, "cores": [0, 0]}, "give distinct core numbers, one per rank"),
])
def test_bad_arguments_are_rejected_before_anything_starts(arguments, named, ipython_dir):
    from conftest import lab_processes

    before = {process.pid for process in lab_processes(ipython_dir)}  # e.g. the session's lab
    started = time.monotonic()
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        pplab.Lab(**arguments, verbose=False)
    assert time.monotonic() - started < slack(), "rejected only after starting something"
    assert {process.pid for process in lab_processes(ipython_dir)} <= before


def test_backend_and_device_follow_the_gpus_of_each_host():
    two_hosts = {"a": 2, "b": 2}
    assert choose_backend_device("auto", "auto", {"a": 2, "b": 2}, two_hosts) == ("nccl", "cuda", False)
    # A host with fewer GPUs than ranks: they share its GPU and talk over gloo, through host memory.
    assert choose_backend_device("auto", "auto", {"a": 2, "b": 1}, two_hosts) == ("gloo", "cuda", True)
    assert choose_backend_device("auto", "cuda", {"a": 1}, {"a": 4}) == ("gloo", "cuda", True)
    assert choose_backend_device("auto", "auto", {"a": 2, "b": 0}, two_hosts) == ("gloo", "cpu", False)
    assert choose_backend_device("gloo", "auto", {"a": 2, "b": 2}, two_hosts) == ("gloo", "cpu", False)
    assert choose_backend_device("auto", "cpu", {"a": 8}, {"a": 2}) == ("gloo", "cpu", False)
    assert choose_backend_device("gloo", "cuda", {"a": 2}, {"a": 2}) == ("gloo", "cuda", True)
    # Asked for: through the host with a GPU per rank, or on CPU (the path tests run).
    assert choose_backend_device("auto", "cuda", {"a": 2}, {"a": 2}, True) == ("gloo", "cuda", True)
    assert choose_backend_device("auto", "auto", {"a": 0}, {"a": 2}, True) == ("gloo", "cpu", True)
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank .* host 'b' would run 2 "
                                         "ranks on 1 GPU.*leave it out .*share the GPUs"):
        choose_backend_device("nccl", "cuda", {"a": 2, "b": 1}, two_hosts)
    with pytest.raises(ValueError, match="host_messages=False needs one GPU per rank"):
        choose_backend_device("auto", "auto", {"a": 1}, {"a": 2}, False)
    with pytest.raises(ValueError, match="device='cuda' needs a GPU on every host, but host 'b' has none"):
        choose_backend_device("auto", "cuda", {"a": 2}, two_hosts)
    with pytest.raises(ValueError, match="host_messages=True sends every message over gloo"):
        choose_backend_device("nccl", "cuda", {"a": 2}, {"a": 2}, True)
    with pytest.raises(ValueError, match="backend='nccl' needs a GPU on every host, but host 'a' has none"):
        choose_backend_device("nccl", "auto", {"a": 0}, {"a": 2})
    with pytest.raises(ValueError, match="host_messages='yes': use True"):
        choose_backend_device("auto", "auto", {"a": 2}, {"a": 2}, "yes")


def test_a_room_is_dealt_round_the_gpus_each_rank_capped_and_a_room_that_does_not_fit_is_refused():
    room = plan_room(20, 2, 4)  # 40 ranks on 4 GPUs
    assert room.gpus(0) == [0, 1] and room.gpus(1) == [2, 3] and room.gpus(2) == [0, 1]
    assert all(len(set(room.gpus(seat))) == 2 for seat in range(20))  # a seat's ranks on distinct GPUs
    held = [sum(gpus.count(gpu) for gpus in room.seats) for gpu in range(4)]
    assert held == [10, 10, 10, 10] and room.ranks_per_gpu == 10
    assert room.memory_fraction == pytest.approx(0.09)  # a tenth of 0.9: the caps leave room for contexts
    assert "GPU 3: seats 1, 3, 5" in room.describe()
    assert plan_room(3, 4, 2).seats == ((0, 1, 0, 1),) * 3  # more ranks than GPUs: a seat shares them
    assert plan_room(5, 2, 4).ranks_per_gpu == 3  # uneven: some GPUs hold one rank more
    with pytest.raises(ValueError,
                       match=r"20 seats of 2 ranks put 10 ranks on a GPU: 10 x 1.5 GiB > 12 GiB\. "
                                         r"Seat at most 16 on these 4 GPU"):
        plan_room(20, 2, 4, gpu_memory_gib=12, rank_memory_gib=1.5)
    with pytest.raises(ValueError, match="gpu_count=0: a room on GPUs needs at least one"):
        plan_room(20, 2, 0)
    with pytest.raises(ValueError, match="seat=20: this plan has seats 0..19"):
        room.gpus(20)
    for wrong in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="gpu_memory_fraction=.*between 0 and 1"):
            check_memory_fraction(wrong)
    with pytest.raises(ValueError, match="gpu_memory_fraction=0.1 with device='cpu'"):
        pplab.Lab(2, device="cpu", gpu_memory_fraction=0.1)


@pytest.mark.quick
def test_a_seat_s_gpus_and_cap_from_its_environment_are_named_as_the_host_numbers_them(monkeypatch):
    from pplab.drivers.cluster.plan import MEMORY_FRACTION_ENV, describe_placement, seat_memory_fraction

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(MEMORY_FRACTION_ENV, raising=False)
    assert seat_memory_fraction() is None
    assert describe_placement("gloo", "cuda", [0, 0, 0, 0], None, True) == (
        "gloo on cuda (GPU 0: ranks 0-3; messages through host memory)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # what the workshop's hub gives seat 2 of 2-rank seats
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "0.45")
    assert seat_memory_fraction() == 0.45
    assert describe_placement("nccl", "cuda", [0, 1], 0.45, False) == (
        "nccl on cuda (GPU 4: rank 0, GPU 5: rank 1; each rank capped at 45.0% of its GPU's memory); this "
        "seat's, from CUDA_VISIBLE_DEVICES=4,5 and PPLAB_GPU_MEMORY_FRACTION=0.45")
    assert describe_placement("gloo", "cpu", [], 0.45, False) == "gloo on cpu"  # a CPU lab: no cap to apply
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "half")
    with pytest.raises(ValueError, match="PPLAB_GPU_MEMORY_FRACTION='half': give the share .* or unset it"):
        pplab.Lab(2)  # refused before anything starts


def test_pplab_room_plan_prints_each_seats_gpus_and_refuses_a_room_that_does_not_fit(capsys):
    from pplab.cli import main

    assert main(["room", "--plan", "6", "--gpus", "4", "--n-ranks", "2"]) == 0
    printed = capsys.readouterr().out
    assert "6 seat(s) of 2 rank(s) on 4 GPU(s): up to 3 rank(s) per GPU, each rank capped at 30.0%" in printed
    assert "seat 5: gpus=[2, 3]" in printed and "gpu_memory_fraction=0.3)" in printed
    assert main(["room", "--plan", "20", "--gpus", "4", "--gpu-memory", "12", "--rank-memory", "1.5"]) == 2
    assert "Seat at most 16 on these 4 GPU(s)" in capsys.readouterr().err


def test_each_attendee_chooses_the_gpus_of_a_lab_and_wrong_choices_are_refused_before_starting():
    assert check_gpus(None, 2, "auto", 0) is None
    assert check_gpus([4, 5], 2, "auto", 8) == (4, 5)
    assert gpus_for_seat(1, 2, 8) == [2, 3] and gpus_for_seat(3, 2, 8) == [6, 7]
    assert gpus_for_seat(4, 2, 8) == [0, 1]  # round again: seat 4 shares seat 0's GPUs
    with pytest.raises(ValueError, match=r"seat=-1: give the attendee's seat number"):
        gpus_for_seat(-1, 2, 8)
    with pytest.raises(ValueError, match=r"gpus=\[4\] names 1 GPU\(s\) for 2 ranks: give one per rank"):
        check_gpus([4], 2, "auto", 8)
    assert check_gpus([1, 1], 2, "auto", 8) == (1, 1)  # two ranks on GPU 1: shared
    with pytest.raises(ValueError, match=r"gpus=\[1, -1\]: give device numbers >= 0"):
        check_gpus([1, -1], 2, "auto", 8)
    with pytest.raises(ValueError,
                       match=r"gpus=\[6, 8\]: this host has 8 GPU\(s\) \(0..7\), so \[8\] do not exist"):
        check_gpus([6, 8], 2, "auto", 8)
    with pytest.raises(ValueError, match=r"with device='cpu': leave out gpus"):
        check_gpus([0, 1], 2, "cpu", 8)
    with pytest.raises(ValueError, match="give the CUDA device numbers of the ranks"):
        check_gpus("0,1", 2, "auto", 8)
    if torch.cuda.device_count() == 0:  # what a lab says on a host without GPUs, before starting
        with pytest.raises(ValueError, match=r"gpus=\[0, 1\]: this host has no GPU that torch can see"):
            pplab.Lab(n_ranks=2, gpus=[0, 1])


def test_ranks_are_grouped_by_host_and_numbered_within_it():
    engines = {7: "b", 3: "a", 5: "b", 4: "a"}  # engine ids are not ranks
    order = assign_ranks(engines)
    assert order == [3, 4, 5, 7]
    assert local_ranks([engines[e] for e in order]) == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_status_table_prints_as_text_and_html():
    table = RankTable([RankInfo(0, 3, "vm", 11, 0, "cpu", "gloo", "idle"),
                       RankInfo(1, 4, "vm", 12, 1, "cpu", "gloo", "busy")])
    text = str(table)
    assert text.splitlines()[0].split() == ["rank", "engine_id", "host", "pid", "local_rank",
                                            "device", "backend", "state"]
    assert text.splitlines()[2].split()[:2] == ["1", "4"]
    assert table._repr_html_().count("<tr>") == 3


def test_a_function_that_publishes_runs_outside_a_lab_engine_too():
    # Under torchrun or in a plain process nobody listens: the function runs all the same.
    assert count_and_publish(3) == 3
    with pytest.raises(RuntimeError, match="lab engine"):
        rank_context()


@pytest.mark.quick
def test_a_lab_process_stays_itself_when_the_wall_clock_moves(monkeypatch):
    # Linux recomputes the boot time from the wall clock at each read; an NTP step that moves it by a
    # second must not make a lab call its own live controller "exited during start-up".
    entry = records.process_entry(os.getpid(), "owner")
    wall_boot = psutil.boot_time()
    monkeypatch.setattr(psutil, "boot_time", lambda: wall_boot + 1.0)
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: wall_boot + 1.0)
    assert records.find_process(entry) is not None
    earlier = dict(entry, started=entry["started"] - 0.01)  # its pid, in another process's record
    assert records.find_process(earlier) is None  # a reused pid is still told apart


@pytest.mark.quick
def test_an_engine_whose_first_describe_request_was_lost_is_asked_again(monkeypatch):
    # ZMQ drops a request routed to an engine whose shell connection the scheduler has not seen
    # yet; the engine had registered all the same. Here engine 7 loses the first request.
    from types import SimpleNamespace

    from pplab.drivers.cluster import lab as lab_module

    monkeypatch.setattr(lab_module, "DESCRIBE_ASK_AGAIN_SECONDS", 0.05)
    sent = []

    class Request:
        def __init__(self, engine_id):
            self.engine_id, self.lost = engine_id, engine_id == 7 and not any(e == 7 for e in sent)
            sent.append(engine_id)

        def ready(self):
            return not self.lost

        def get(self):
            return {"host": "here", "engine": self.engine_id}

    client = {engine_id: SimpleNamespace(apply_async=lambda fn, e=engine_id: Request(e))
              for engine_id in (3, 7)}
    from pplab.base.machine import MachineLoad

    asking = pplab.Lab.__new__(pplab.Lab)  # only what _describe reads
    asking.start_timeout, asking.machine_load = 5.0, MachineLoad(2, 0.0, 1.0)
    asking._launcher = SimpleNamespace(client=client, check_alive=lambda: None)
    about = pplab.Lab._describe(asking, [3, 7])
    assert about == {3: {"host": "here", "engine": 3}, 7: {"host": "here", "engine": 7}}
    assert sorted(sent) == [3, 7, 7]  # asked again: only the engine that had not answered

    asking.start_timeout = 0.2  # one that never answers fails the start, naming it
    monkeypatch.setattr(Request, "ready", lambda self: self.engine_id != 7)
    asking._launcher.launch_logs = lambda: "(the logs)"
    with pytest.raises(LabStartError, match=r"engines \[7\] registered but did not answer within "
                                            r"start_timeout=0.2 s"):
        pplab.Lab._describe(asking, [3, 7])


def test_an_error_breaks_the_process_group_by_its_type_or_its_cause():
    from pplab.drivers.cluster.engine import breaks_process_group
    from pplab.rank.comm import PipelineTimeoutError

    class LookalikeError(Exception):
        pass

    LookalikeError.__name__ = "PipelineTimeoutError"  # a name proves nothing
    assert breaks_process_group(PipelineTimeoutError("rank 1 waited 2 s"))
    assert breaks_process_group(torch.distributed.DistBackendError("communicator aborted"))
    assert not breaks_process_group(LookalikeError("rank 1 waited 2 s"))
    assert not breaks_process_group(RuntimeError("Timed out waiting 2000ms for recv"))
    try:
        try:
            raise PipelineTimeoutError("rank 1 waited 2 s")
        except PipelineTimeoutError as timeout:
            raise ValueError("the step failed") from timeout
    except ValueError as wrapped:
        assert breaks_process_group(wrapped)


# -- a running lab -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_results_come_back_ordered_by_rank(lab2):
    results = lab2.run(whoami)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["dist_rank"] for r in results] == [0, 1]
    assert {r["world_size"] for r in results} == {2}
    status = lab2.status()
    assert [row.rank for row in status] == [0, 1]
    assert [row.pid for row in status] == [r["pid"] for r in results]
    assert {(row.device, row.backend, row.state) for row in status} == {("cpu", "gloo", "idle")}


@pytest.mark.timeout(60)
def test_all_reduce_and_p2p_give_the_right_values_on_every_rank(lab2):
    assert lab2.run(all_reduce_sum) == [3.0, 3.0]
    assert lab2.run(ring_exchange) == [10.0, 0.0]


@pytest.mark.timeout(60)
def test_px_cells_see_rank_world_size_device_and_dist(lab2):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        lab2.activate()
        shell.run_cell_magic("px", "", "seen = (rank, world_size, str(device), dist.get_rank())")
        assert lab2.view.pull("seen", block=True) == [(0, 2, "cpu", 0), (1, 2, "cpu", 1)]
    finally:
        InteractiveShell.clear_instance()


def receive_what_nobody_sends():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1), src=0)  # gloo gives up after the lab's timeout


@pytest.mark.timeout(60)
def test_a_raw_receive_that_timed_out_leaves_the_lab_asking_for_a_restart(fragile_lab):
    # gloo's own timeout closes the pair: the process group cannot be used again.
    with pytest.raises(RankFailedError, match="Timed out"):
        fragile_lab.run(receive_what_nobody_sends)
    assert fragile_lab.state.startswith("needs restart: rank 1's process group failed"), fragile_lab.state
    fragile_lab.restart()
    assert_healthy(fragile_lab)


@pytest.mark.timeout(60)
def test_what_px_cells_print_reads_in_rank_order(lab2, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        lab2.activate()
        # Rank 0 prints last, but its output is shown first.
        shell.run_cell_magic("px", "", "import time\nif rank == 0:\n    "
                                       "time.sleep(0.5)\nprint(f'hello from {rank}')")
        shown = capsys.readouterr().out
        assert shown.index("[stdout:0]") < shown.index("[stdout:1]"), shown
        assert shown.index("hello from 0") < shown.index("hello from 1"), shown
    finally:
        InteractiveShell.clear_instance()


@pytest.mark.timeout(60)
def test_100_events_stream_complete_and_in_order_while_the_call_runs(lab2, tmp_path):
    release = tmp_path / "release"
    call = lab2.run_async(publish_numbered_events, 100, str(release), timeout=40)
    received = {0: [], 1: []}
    for event in call.events():
        received[event.rank].append(event)
        if all(len(events) == 100 for events in received.values()):
            break
    assert not call.done(), "the events must arrive while the call is still running"
    release.touch()
    assert call.result() == [100, 100]
    for rank, events in received.items():
        assert [e.seq for e in events] == list(range(100))
        assert [e.payload for e in events] == [{"rank": rank, "number": n} for n in range(100)]
    assert call.poll_events() == [], "no event is delivered twice"


@pytest.mark.timeout(60)
def test_published_events_arrive_in_order_with_their_payload_after_a_short_call(lab2):
    events = list(lab2.stream(count_and_publish, 5, timeout=20))  # the call ends before they all arrive
    for rank in (0, 1):
        assert [(e.seq, e.payload) for e in events if e.rank == rank] == \
            [(number, {"number": number}) for number in range(5)]


@pytest.mark.timeout(60)
def test_every_lab_process_listens_on_loopback_only(lab2):
    from conftest import lab_processes

    engine_addresses = lab2.run(listening_addresses)
    assert engine_addresses and all(all(ip.startswith("127.") for ip in ips) for ips in engine_addresses)
    for process in lab_processes(os.environ["IPYTHONDIR"]):
        for connection in process.net_connections(kind="inet"):
            if connection.status == psutil.CONN_LISTEN:
                assert connection.laddr.ip.startswith("127."), (process.cmdline(), connection)


def heartbeat_patience(arguments: list[str]) -> float:
    """Seconds of missed beats before a controller started with `arguments` gives an engine up."""
    options = dict(a.removeprefix("--").split("=", 1) for a in arguments if "=" in a)
    return int(options["HeartMonitor.max_heartmonitor_misses"]) * int(options["HeartMonitor.period"]) / 1000


@pytest.mark.quick
def test_the_controllers_patience_with_a_silent_engine_grows_with_the_load_it_started_under():
    from pplab.base.machine import MachineLoad
    from pplab.drivers.cluster.launchers import HEARTBEAT_SECONDS, controller_args

    quiet = MachineLoad(cores=2, busy_cores=0.0, share=1.0, ready=1.0)
    crowded = MachineLoad(cores=2, busy_cores=2.0, share=0.4, ready=5.0)  # a thread gets 40 % of a core
    swamped = MachineLoad(cores=2, busy_cores=2.0, share=0.05, ready=40.0)
    beat = HEARTBEAT_SECONDS  # the patience is whole beats: at least what was asked, within a beat
    assert heartbeat_patience(controller_args(10.0)) == pytest.approx(10.0, abs=beat)
    assert heartbeat_patience(controller_args(10.0, quiet)) == pytest.approx(10.0, abs=beat)
    assert heartbeat_patience(controller_args(10.0, crowded)) == pytest.approx(25.0, abs=beat)
    assert heartbeat_patience(controller_args(10.0, swamped)) == pytest.approx(40.0, abs=beat)  # at most 4x


def test_a_labs_controller_waits_for_beats_as_long_as_the_load_it_measured_at_its_start_says(lab2):
    from pplab.drivers.cluster.launchers import HEARTBEAT_PATIENCE_SECONDS, controller_args

    with open(os.path.join(records.records_dir(lab2.profile_dir), f"{lab2.cluster_id}.json")) as file:
        entries = json.load(file)["processes"]
    controllers = [psutil.Process(entry["pid"]).cmdline() for entry in entries
                   if entry["role"] == "controller"]
    assert len(controllers) == 1, entries
    wanted = heartbeat_patience(controller_args(HEARTBEAT_PATIENCE_SECONDS, lab2.machine_load))
    assert heartbeat_patience(controllers[0]) == wanted >= HEARTBEAT_PATIENCE_SECONDS


# -- starting and stopping --------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [1, 4])
def test_start_and_stop_leave_nothing_running(ranks, lab_factory):
    lab = lab_factory(n_ranks=ranks)
    assert lab.world_size == ranks
    assert [r["rank"] for r in lab.run(whoami)] == list(range(ranks))
    assert_healthy(lab)
    record = os.path.join(records.records_dir(lab.profile_dir), f"{lab.cluster_id}.json")
    with open(record) as file:
        entries = json.load(file)["processes"]
    pids = [entry["pid"] for entry in entries]
    roles = [entry["role"] for entry in entries]
    assert roles.count("controller") == 1 and roles.count("engine fork server") == 1
    assert [role for role in roles if role.startswith("rank")] == [f"rank {r}" for r in range(ranks)]
    lab.stop()
    engines = [entry["pid"] for entry in entries if entry["role"].startswith("rank")]
    assert all_gone(engines), "an engine outlived lab.stop()"
    assert lab.state == "stopped"
    with pytest.raises(LabError, match="stopped"):
        lab.run(whoami)
    lab.stop()  # stopping twice is fine
    # The controller and the fork server wait for this process's next lab, on record as kept, and
    # `pplab cleanup` stops them (as this process does at exit).
    kept = kept_now()
    assert kept is not None and {e["role"] for e in kept.launched} >= {"controller", "engine fork server"}
    with open(record) as file:
        assert json.load(file)["kept"] is True
    assert records.cleanup(lab.profile_dir, kept=True, verbose=False) == [lab.cluster_id]
    assert all_gone(pids), "a controller or fork server outlived pplab cleanup"
    assert not os.path.exists(record)
    assert lab_factory(n_ranks=ranks).world_size == ranks  # the next lab sees they are gone: a fresh start


@pytest.mark.timeout(120)
def test_the_next_lab_of_a_process_forks_its_engines_from_the_kept_server_until_the_environment_changes(
        lab_factory, monkeypatch, capsys):
    lab_factory(n_ranks=2).stop()
    kept = kept_now()
    server = kept.fork_server.pid
    capsys.readouterr()
    second = lab_factory(n_ranks=3, verbose=True)  # another size: the server forks as many as asked
    assert kept_now() is None and second.cluster_id == kept.cluster_id  # taken, not shared
    said = capsys.readouterr().out
    ready = ("lab ready: 3 ranks, gloo on cpu; engines forked from this process's kept fork server "
             f"(pid {server})")
    assert ready in said
    assert [r["rank"] for r in second.run(whoami)] == [0, 1, 2]
    assert {psutil.Process(row.pid).ppid() for row in second.status()} == {server}
    second.stop()
    monkeypatch.setenv("PPLAB_TEST_CHANGED", "1")  # what its engines would inherit changed: a fresh start
    third = lab_factory(n_ranks=2)
    assert all_gone([server]) and third.cluster_id != kept.cluster_id
    assert {psutil.Process(row.pid).ppid() for row in third.status()} != {server}
    assert third.run(lambda: os.environ.get("PPLAB_TEST_CHANGED")) == ["1", "1"]


@pytest.mark.timeout(120)
def test_engines_started_one_process_each_without_the_fork_server(lab_factory):
    lab = lab_factory(n_ranks=2, fork=False)  # what non-Linux hosts use
    assert [r["rank"] for r in lab.run(whoami)] == [0, 1]
    assert_healthy(lab)
    pids = [row.pid for row in lab.status()]
    lab.stop()
    assert all_gone(pids)


def thread_cores() -> list[list[int]]:
    """The cores each thread of this process may run on (gloo's transport threads included)."""
    import os

    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})


TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 ranks needs 2 cores")


@TWO_CORES
@pytest.mark.timeout(120)
def test_a_lab_used_as_a_context_manager_stops_at_the_end_and_its_ranks_kept_their_cores(ipython_dir):
    cores = sorted(os.sched_getaffinity(0))[:2][::-1]  # reversed: rank 0 on the second core
    with pplab.Lab(n_ranks=2, device="cpu", cores=cores, verbose=False) as lab:
        pids = [row.pid for row in lab.status()]
        assert_healthy(lab)
        assert lab.run(thread_cores) == [[(cores[0],)], [(cores[1],)]]
    assert all_gone(pids)


@TWO_CORES
def test_a_pools_ranks_keep_their_cores_and_bad_cores_are_refused_before_starting():
    cores = sorted(os.sched_getaffinity(0))[:2][::-1]
    with pplab.RankPool(2, cores=cores) as pool:
        assert pool.run(thread_cores) == [[(cores[0],)], [(cores[1],)]]
    allowed = sorted(os.sched_getaffinity(0))
    for bad, said in ((cores[:1], r"names 1 core\(s\) for 2 ranks: give one per rank"),
                      ([cores[0]] * 2, "give distinct core numbers"),
                      ([allowed[0], 4096], re.escape("this process may run on cores "
                                                     f"{allowed}, not on [4096]")),
                      ("0,1", "give one core number per rank")):
        with pytest.raises(ValueError, match=said):
            pplab.RankPool(2, cores=bad)


@pytest.mark.timeout(120)
def test_cleanup_stops_the_lab_of_a_killed_kernel(ipython_dir):
    try:
        kernel = subprocess.run(
            [sys.executable, "-c",
             "import os, signal, pplab\n"
             "lab = pplab.Lab(n_ranks=2, device='cpu', verbose=False)\n"
             "print(lab.cluster_id, flush=True)\n"
             "os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no lab.stop(): a killed kernel\n"],
            capture_output=True, text=True, timeout=90, env=os.environ)
        cluster_id = kernel.stdout.strip()
        assert cluster_id, kernel.stderr
        profile_dir = records.default_profile_dir()
        [record] = [r for r in records.read_records(profile_dir) if r["cluster_id"] == cluster_id]
        pids = [entry["pid"] for entry in record["processes"]]
        assert pplab.cleanup() == [cluster_id]
        assert all_gone(pids)
        assert cluster_id not in [r["cluster_id"] for r in records.read_records(profile_dir)]
    finally:
        records.cleanup(verbose=False)  # if an assertion failed midway: still nothing left


# -- failures: each gives a clear error within its timeout, then restart works ------------------


@pytest.mark.timeout(60)
def test_a_rank_that_raises_is_named_with_its_traceback(fragile_lab):
    with within(SLACK + fragile_lab.grace), pytest.raises(RankFailedError) as caught:
        fragile_lab.run(raise_on_rank, 1, False)
    error = caught.value
    assert error.rank == 1 and error.ename == "ValueError" and error.still_running == []
    assert "rank 1 raised ValueError in raise_on_rank():\nboom from rank 1\n" in str(error)
    assert "Remote traceback (rank 1)" in str(error) and "raise_on_rank" in str(error)
    # for status lines
    assert error.summary == "rank 1 raised ValueError in raise_on_rank():\nboom from rank 1"
    assert fragile_lab.state == "running"  # the other rank finished: nothing to restart
    assert_healthy(fragile_lab)


@pytest.mark.timeout(60)
def test_ranks_left_waiting_for_a_failed_rank_get_a_bounded_time_then_restart_works(lab2):
    # On the session's lab: its ranks' own waits (20 s) outlast its grace (1 s) at any load.
    # the grace at the machine's pace
    with within(SLACK + lab2.grace), pytest.raises(RankFailedError) as caught:
        lab2.run(raise_on_rank, 1, True)
    assert caught.value.rank == 1 and caught.value.still_running == [0]
    said = re.search(r"Ranks \[0\] had not finished ([\d.]+) s later: waiting for rank 1", str(caught.value))
    assert said and float(said.group(1)) >= lab2.grace, str(caught.value)
    assert "lab.restart()" in str(caught.value)
    with pytest.raises(LabNeedsRestartError, match="lab.restart()"):
        lab2.run(whoami)
    lab2.restart()
    assert_healthy(lab2)


@pytest.mark.timeout(60)
def test_a_rank_whose_process_dies_is_named_then_restart_works(fragile_lab):
    old_pids = [row.pid for row in fragile_lab.status()]
    started = time.monotonic()
    with pytest.raises(RankDiedError) as caught:
        fragile_lab.run(exit_on_rank, 1, timeout=20)
    assert time.monotonic() - started < slack()  # noticed, not waited out (the call's timeout is 20 s)
    assert caught.value.ranks == [1]
    assert "rank 1 (engine" in str(caught.value) and "lab.restart()" in str(caught.value)
    assert "died (its process ended, exit status 3)" in str(caught.value)  # as its fork server reaped it
    assert [row.state for row in fragile_lab.status()] == ["idle", "dead"]
    fork_server = psutil.Process(old_pids[0]).ppid()  # the engines' supervisor, torch imported there
    fragile_lab.restart()
    assert_healthy(fragile_lab)
    assert not set(old_pids) & {row.pid for row in fragile_lab.status()}
    assert all_gone(old_pids)
    # The new ranks are forked by the same server: a restart does not import torch again.
    assert {psutil.Process(row.pid).ppid() for row in fragile_lab.status()} == {fork_server}


@pytest.mark.timeout(60)
def test_a_rank_blocked_in_recv_past_the_run_timeout_is_named_then_restart_works(fragile_lab):
    started = time.monotonic()
    with pytest.raises(RankTimeoutError) as caught:
        fragile_lab.run(recv_that_never_comes, timeout=1.5)
    assert 1.5 <= time.monotonic() - started < 1.5 + slack()  # never before the timeout
    assert caught.value.ranks == [1]
    assert "Ranks [1] were still running (ranks [0] had finished)." in str(caught.value)
    assert "lab.restart()" in str(caught.value)
    fragile_lab.restart()
    assert_healthy(fragile_lab)


@pytest.mark.timeout(60)
def test_a_rank_error_that_breaks_the_process_group_makes_the_lab_ask_for_a_restart(fragile_lab):
    with pytest.raises(RankFailedError) as caught:
        fragile_lab.run(raise_on_every_rank, "lookalike")
    assert "The process group is broken" not in str(caught.value)
    assert fragile_lab.state == "running"  # judged by the error's type on the rank, not its name
    with pytest.raises(RankFailedError, match=r"The process group is broken \(by the errors of "
                                              r"ranks \[0, 1\]\)\.\nCall lab.restart\(\)"):
        fragile_lab.run(raise_on_every_rank, "backend")
    assert fragile_lab.state == ("needs restart: rank 0's process group failed (DistBackendError: "
                                 "communicator of rank 0 aborted (injected))")
    assert set(fragile_lab.last_errors) == {0, 1}
    fragile_lab.restart()
    assert_healthy(fragile_lab)


@pytest.mark.timeout(60)
def test_the_process_group_timeout_turns_a_blocked_recv_into_an_error(fragile_lab):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        fragile_lab.run(recv_that_never_comes, timeout=fragile_lab.op_timeout + 30)
    assert time.monotonic() - started < fragile_lab.op_timeout + slack()
    assert caught.value.rank == 1
    fragile_lab.restart()  # a timed-out gloo pair is not to be trusted
    assert_healthy(fragile_lab)


def all_reduce_alone():
    """Rank 1 enters a collective that rank 0 never joins."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.all_reduce(torch.zeros(1))
    return "done"


@pytest.mark.timeout(90)
def test_the_process_group_timeout_follows_op_timeout_set_on_a_running_lab(fragile_lab):
    """A collective gives up at the new bound, not at the one the group was made with (a timeout
    never fires early, so the wait proves it)."""
    made_with = fragile_lab.op_timeout
    fragile_lab.op_timeout = made_with + 3
    started = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        fragile_lab.run(all_reduce_alone, timeout=fragile_lab.op_timeout + 30)
    waited = time.monotonic() - started
    assert made_with + 3 - 0.5 <= waited < fragile_lab.op_timeout + slack(), (made_with, waited)
    assert caught.value.rank == 1
    fragile_lab.op_timeout = made_with  # not running: kept for the restart's new group
    fragile_lab.restart()
    assert_healthy(fragile_lab)
    with pytest.raises(ValueError, match=r"op_timeout=0 must be a positive number of seconds"):
        fragile_lab.op_timeout = 0


LATE_RANK = """
import sys, time, torch, torch.distributed as dist
from pplab.drivers.cluster.engine import _join_process_group
from pplab.drivers.cluster.plan import RankSpec

rank, rendezvous = int(sys.argv[1]), sys.argv[2]
time.sleep(2 * rank)  # rank 1 comes 2 s late, as beside burners: longer than the 0.5 s op timeout
spec = RankSpec(rank, 2, rank, 2, "gloo", "cpu", rendezvous, 0.5, 1, "lo", join_timeout=float(sys.argv[3]))
_join_process_group(spec, torch.device("cpu"))
if rank == 1:  # once joined, every op is bounded by op_timeout again
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(1), src=0)
    except RuntimeError as error:
        print(f"recv gave up after {time.monotonic() - started:.1f} s: {error}")
else:
    time.sleep(3)
"""


def test_a_rank_late_to_the_rendezvous_joins_and_its_ops_keep_the_short_timeout(tmp_path):
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ranks = [subprocess.Popen([sys.executable, "-c", LATE_RANK, str(rank), rendezvous, "30"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        said = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], said
    gave_up = re.search(r"recv gave up after ([\d.]+) s: .*Timed out", said[1][0])
    assert gave_up and float(gave_up.group(1)) < 0.5 + slack(), said[1]


# -- connecting to a cluster started elsewhere ---------------------------------------------------


@pytest.mark.timeout(180)
def test_connect_uses_engines_of_a_cluster_started_elsewhere(tmp_path):
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=2, profile_dir=str(tmp_path / "profile_elsewhere"),
                          controller_ip="127.0.0.1", log_level=40,
                          controller_args=["--HeartMonitor.period=100"])
    cluster.start_cluster_sync()
    try:
        lab = pplab.Lab.connect(profile=None, profile_dir=cluster.profile_dir,
                                cluster_id=cluster.cluster_id, n_ranks=2, device="cpu",
                                verbose=False)
        try:
            assert_healthy(lab)
            assert lab.run(ring_exchange) == [10.0, 0.0]
            # On one host a connected lab also keeps its rendezvous and gloo on loopback.
            addresses = lab.run(listening_addresses)
            assert all(ips and all(ip.startswith("127.") for ip in ips) for ips in addresses), addresses
            first_pids = [row.pid for row in lab.status()]
            lab.restart()  # through the cluster's own launcher
            assert not set(first_pids) & {row.pid for row in lab.status()}
            assert_healthy(lab)
        finally:
            lab.stop()
        with pytest.raises(pplab.drivers.cluster.LabError, match="connect again with pplab.Lab.connect"):
            lab.restart()
        # Without its cluster file a connected lab cannot restart engines, and says why.
        os.rename(cluster.cluster_file, cluster.cluster_file + ".moved")
        try:
            lab = pplab.Lab.connect(profile=None, profile_dir=cluster.profile_dir,
                                    cluster_id=cluster.cluster_id, n_ranks=2, device="cpu",
                                    verbose=False)
            try:
                with pytest.raises(pplab.drivers.cluster.LabError, match=r"its cluster file could not be "
                                                                 r"read \(FileNotFoundError"):
                    lab.restart()
                assert lab.state == "running"  # refused before anything changed
                assert_healthy(lab)
            finally:
                lab.stop()
        finally:
            os.rename(cluster.cluster_file + ".moved", cluster.cluster_file)
        engines = [psutil.Process(row.pid) for row in lab.status()]
        assert all(engine.is_running() for engine in engines)  # the cluster belongs to its starter
        helpers = [child for engine in engines for child in engine.children(recursive=True)]
    finally:
        # The restart went through the cluster file, as `ipcluster stop` does: stop from it too.
        ipp.Cluster.from_file(profile_dir=cluster.profile_dir,
                              cluster_id=cluster.cluster_id).stop_cluster_sync()
        cluster.stop_cluster_sync()
    psutil.wait_procs(helpers, timeout=10)  # ipyparallel's nannies take a few seconds to exit


@pytest.mark.timeout(120)
def test_a_start_that_fails_midway_leaves_nothing_running(ipython_dir, fresh_start, monkeypatch):
    import ipyparallel as ipp

    from conftest import lab_processes

    async def controller_fails(self, **kwargs):
        raise RuntimeError("controller could not start (injected)")

    # (its *_sync twins are made on the fly from the async methods)
    monkeypatch.setattr(ipp.Cluster, "start_controller", controller_fails)
    before = {p.pid for p in lab_processes(ipython_dir)}  # other tests' labs may be running
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="injected"):
        pplab.Lab(n_ranks=2, device="cpu", verbose=False)  # the fork server was already up
    assert time.monotonic() - started < slack(30)
    assert {p.pid for p in lab_processes(ipython_dir)} <= before


@contextlib.contextmanager
def ctrl_c_while_waiting_in(function, until):
    """Press Ctrl-C every 0.1 s while the main thread waits inside `function`, until `until()`.

    A real Ctrl-C raises wherever the main thread happens to be, and one that lands in a
    finaliser (a __del__ run by the garbage collector) is printed and dropped: a single
    timed interrupt makes a test that fails on a loaded machine. So presses that land
    outside `function`, or in a __del__, are ignored, and pressing goes on until `until()`.
    """
    code = function.__code__

    def on_ctrl_c(signum, frame):
        stack = []
        while frame is not None:
            stack.append(frame.f_code)
            frame = frame.f_back
        if code not in stack or until():
            return
        if any(caller.co_name == "__del__" for caller in stack[:stack.index(code)]):
            return
        raise KeyboardInterrupt

    stop = threading.Event()

    def press():
        while not stop.wait(0.1):
            _thread.interrupt_main()  # what Ctrl-C / a kernel interrupt does

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    presser = threading.Thread(target=press, daemon=True)
    presser.start()
    try:
        yield
    finally:
        stop.set()
        presser.join()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("waiting_in", ["result", "events"])
def test_an_interrupted_call_makes_the_lab_ask_for_a_restart(fragile_lab, waiting_in):
    from pplab.drivers.cluster import RankCall

    started = time.monotonic()
    with ctrl_c_while_waiting_in(getattr(RankCall, waiting_in),
                                 until=lambda: fragile_lab.state != "running"):
        with pytest.raises(KeyboardInterrupt):
            call = fragile_lab.run_async(sleep_for, 30)
            call.result() if waiting_in == "result" else list(call.events())
    assert time.monotonic() - started < 20, "the call ran to its end: the interrupt was lost"
    assert call.running_ranks() == [0, 1]
    assert fragile_lab.state == "needs restart: sleep_for() was interrupted while ranks [0, 1] were running"
    assert [row.state for row in fragile_lab.status()] == ["busy", "busy"]
    with pytest.raises(LabNeedsRestartError, match="interrupted"):
        fragile_lab.run(sleep_for, 0)
    fragile_lab.restart()
    assert [row.state for row in fragile_lab.status()] == ["idle", "idle"]
    assert fragile_lab.run(sleep_for, 0) == [0, 0]


@pytest.mark.timeout(120)
def test_an_engine_that_dies_at_start_fails_the_start_at_once(ipython_dir, monkeypatch):
    import pplab.drivers.cluster.launchers as launchers
    from conftest import lab_processes

    monkeypatch.setattr(launchers, "ENGINE_ARGS", [*launchers.ENGINE_ARGS, "--no-such-flag"])
    before = {p.pid for p in lab_processes(ipython_dir)}  # other tests' labs may be running
    with within(30), pytest.raises(pplab.drivers.cluster.LabStartError,  # not the whole start_timeout
                                   match=r"engine \d \(pid \d+\) exited with status 2 during start-up"):
        pplab.Lab(n_ranks=2, device="cpu", verbose=False, start_timeout=60)
    assert {p.pid for p in lab_processes(ipython_dir)} <= before


@pytest.mark.timeout(120)
def test_a_controller_that_does_not_answer_fails_the_start_after_start_timeout(ipython_dir, fresh_start,
                                                                              monkeypatch):
    import ipyparallel as ipp

    from conftest import lab_processes

    start_controller = ipp.Cluster.start_controller

    async def start_and_freeze(cluster, **kwargs):  # a controller too busy to answer anyone
        await start_controller(cluster, **kwargs)
        info = await cluster.controller.get_connection_info()  # its files written,
        ports = {port for part in info.values() for value in part.values()
                 for port in (value if isinstance(value, list) else [value])
                 if isinstance(port, int) and not isinstance(port, bool)}
        controller = psutil.Process(cluster.controller.process.pid)
        for _ in range(600):  # every port bound (frozen earlier, it would be a controller that lost one),
            listening = {c.laddr.port for process in [controller, *controller.children(recursive=True)]
                         for c in process.net_connections("tcp") if c.status == "LISTEN"}
            if ports <= listening:
                break
            await asyncio.sleep(0.05)
        os.kill(controller.pid, signal.SIGSTOP)  # then no answer

    monkeypatch.setattr(ipp.Cluster, "start_controller", start_and_freeze)
    before = {p.pid for p in lab_processes(ipython_dir)}  # other tests' labs may be running
    began = time.monotonic()
    with LoadWatch() as during, pytest.raises(pplab.drivers.cluster.LabStartError) as failed:
        pplab.Lab(n_ranks=2, device="cpu", verbose=False, start_timeout=2)
    took = time.monotonic() - began
    waited = float(re.search(r"the controller did not answer the client within (\d+) "
                             r"s", str(failed.value))[1])
    # It waited start_timeout at this machine's pace, not ipyparallel's own 10 s (nor its 60 s for the
    # files); starting the controller and stopping it again take their 20 s at this machine's pace too
    # (beside two burners: 40 s in all, of which the wait was 4).
    pace = max(during.slowdown, measure_load().slowdown)
    assert waited - 1 <= took < waited + 20 * pace, (took, waited, pace, str(failed.value))
    assert {p.pid for p in lab_processes(ipython_dir)} <= before  # the frozen controller too


@pytest.mark.timeout(120)
def test_a_controller_that_lost_a_port_is_replaced_before_engines_are_asked_anything(ipython_dir, fresh_start,
                                                                                     monkeypatch):
    """ipyparallel picks free ports, then binds them: on a busy machine another process took one in
    between, a scheduler thread died, and every request to the engines was lost. The start looks at
    the ports the controller listens on, and starts a new controller when one is missing."""
    from pplab.drivers.cluster import launchers

    really_missing = launchers.LocalCluster._ports_not_taken
    controllers = []

    def first_one_lost_a_port(cluster):
        controllers.append(psutil.Process(cluster._cluster.controller.process.pid))
        missing = really_missing(cluster)
        return missing if len(controllers) > 1 else [*missing, 1]  # port 1: surely not the controller's

    monkeypatch.setattr(launchers.LocalCluster, "_ports_not_taken", first_one_lost_a_port)
    with pplab.Lab(n_ranks=2, device="cpu", verbose=False) as lab:
        assert lab.run(lambda: 1 + 1) == [2, 2]  # the second controller's engines answer
        assert len(controllers) == 2 and gone(controllers[0])
    stop_kept()  # what the lab kept for a next one
    assert gone(controllers[1])


def gone(process: psutil.Process) -> bool:
    """The process ended (within 5 s): stopped, and reaped by whoever started it."""
    try:
        process.wait(5)
        return True
    except psutil.TimeoutExpired:
        return False


def test_connect_to_a_cluster_id_with_no_files_says_which_clusters_have_them_at_once(tmp_path):
    security = tmp_path / "security"
    security.mkdir()
    (security / "ipcontroller-ours-client.json").write_text("{}")
    started = time.monotonic()
    with pytest.raises(pplab.drivers.cluster.LabStartError,
                       match=r"cluster_id='theirs': .*ipcontroller-theirs-client.json does not exist "
                             r"\(clusters with files there: ours\)"):
        pplab.Lab.connect(profile=None, profile_dir=str(tmp_path), cluster_id="theirs", verbose=False)
    assert time.monotonic() - started < slack()


def test_connect_to_a_controller_that_does_not_answer_names_its_address(tmp_path, monkeypatch):
    """A stale connection file (its controller gone): a clear error after the connect timeout."""
    import socket

    from pplab.drivers.cluster import launchers

    monkeypatch.setattr(launchers, "CONNECT_SECONDS", 2)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    security = tmp_path / "security"
    security.mkdir()
    (security / "ipcontroller-gone-client.json").write_text(json.dumps({
        "interface": "tcp://127.0.0.1", "registration": port, "key": "0" * 32, "pack": "json",
        "unpack": "json", "signature_scheme": "hmac-sha256", "ssh": "", "location": "127.0.0.1",
        "task_scheme": "leastload", "curve_serverkey": None,
        **{channel: port for channel in ("control", "mux", "task", "iopub", "notification", "broadcast")}}))
    started = time.monotonic()
    with pytest.raises(pplab.drivers.cluster.LabStartError,
                       match=rf"the controller of cluster 'gone' does not answer at "
                             rf"tcp://127.0.0.1:{port} .* within \d+ s"):  # 2 s at this machine's pace
        pplab.Lab.connect(profile=None, profile_dir=str(tmp_path), cluster_id="gone", verbose=False)
    assert time.monotonic() - started < 2 + slack()
