"""What runs on each engine: describe it, make it a rank, run calls, publish events, leave the group.

The client calls these functions on the engines (they are pickled by reference,
so every engine imports this module). Code that runs on a rank can call
`publish(...)` to stream an event to the notebook while it runs, and
`rank_context()` to learn its rank, world size and device.

Besides events, a call's published data carries what the rank says about the
call itself: `call_on_rank`, which runs every `Lab.run` function, notes there when
the function's error left the process group unusable. Only the rank can tell:
the client sees a remote error as a class name and a message.

The client imports this module too (to name these functions, and the keys of what ranks
publish), so torch is imported in the functions: a fresh kernel's lab starts without the
client importing torch (1-2 s); it imports it when it first uses it.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading

from pplab.drivers.cluster.gloo_adapter import gloo_transport_failed
from pplab.drivers.cluster.plan import RankSpec
from pplab.drivers.cores import pin_this_process
from pplab.drivers.local import free_port
from pplab.rank.rank_context import RankContext, import_before_joining, publish, set_rank_context

EVENT_KEY_PREFIX = "pplab-event-"
# The data key under which a rank notes that its call broke the process group (with why).
PROCESS_GROUP_BROKEN_KEY = "pplab-process-group-broken"


def event_key(sequence: int) -> str:
    """The data key of the `sequence`-th event of a call (unique, so no event overwrites another)."""
    return f"{EVENT_KEY_PREFIX}{sequence:09d}"


def describe() -> dict:
    """Report host, process and GPUs of this engine: what the client needs to assign ranks."""
    import torch

    from pplab.drivers.cluster import records

    return {
        "host": socket.gethostname(),
        "address": _host_address(),
        "pid": os.getpid(),
        "started": records.started(os.getpid()),
        "gpus": torch.cuda.device_count(),
    }


def _host_address() -> str:
    """An IP address of this host that other hosts can reach (used for a TCP rendezvous)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_tcp_port() -> int:
    """A TCP port free on every interface of this host (for a multi-host TCP rendezvous)."""
    return free_port("")


def _check_interface(name: str) -> None:
    """Refuse, before any rank waits, a gloo interface this host does not have, naming the ones it has."""
    here = [interface for _, interface in socket.if_nameindex()]
    if name not in here:
        raise ValueError(f"gloo_ifname={name!r}: host {socket.gethostname()} has no such network interface; "
                         f"it has {', '.join(here)}. Give Lab.connect(gloo_ifname=...) the interface of the "
                         f"network the hosts share")


def setup_rank(spec: RankSpec) -> dict:
    """Join the process group as `spec.rank`, do one barrier, and define rank names for %%px."""
    import torch
    import torch.distributed as dist

    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)  # so functions from the notebook's own modules import here
    if spec.core is not None:
        pin_this_process(spec.core)  # before the backend starts its threads: they inherit it
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.gloo_ifname:
        _check_interface(spec.gloo_ifname)
        os.environ["GLOO_SOCKET_IFNAME"] = spec.gloo_ifname
        os.environ["NCCL_SOCKET_IFNAME"] = spec.gloo_ifname

    if dist.is_initialized():
        dist.destroy_process_group()  # left by an earlier lab on these engines: start afresh
    if spec.device == "cuda":
        gpu = spec.local_rank if spec.gpu is None else spec.gpu
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        if spec.memory_fraction is not None:  # this rank's share of a GPU that others use too
            torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, gpu)
    else:
        device = torch.device("cpu")
    _join_process_group(spec, device)

    context = RankContext(spec.rank, spec.world_size, spec.local_rank, spec.local_world_size,
                          spec.backend, device, spec.host_messages)
    set_rank_context(context, _publish_event)
    _define_names_for_px_cells(context)
    return describe()


def _join_process_group(spec: RankSpec, device) -> None:
    """Join the process group once every rank has reached the rendezvous, then meet at a barrier.

    The group's ops wait `op_timeout`, and so does gloo's connect when the group is made: on a
    busy machine one rank may come to it seconds after another, past a short `op_timeout`. So the
    ranks first check in at the rendezvous's store, which waits the longer `join_timeout`; the
    group is made when all are there."""
    import torch.distributed as dist

    joining = datetime.timedelta(seconds=max(spec.op_timeout, spec.join_timeout))
    store, _, _ = next(dist.rendezvous(spec.rendezvous, spec.rank, spec.world_size, timeout=joining))
    store.set_timeout(joining)
    if store.add("pplab-checked-in", 1) == spec.world_size:  # the last rank to come says so
        store.set("pplab-all-in", "yes")
    store.wait(["pplab-all-in"], joining)
    import_before_joining()
    # Under the prefix torch gives the store it makes from an init_method: the same keys as before.
    dist.init_process_group(spec.backend, store=dist.PrefixStore("default_pg", store), rank=spec.rank,
                            world_size=spec.world_size, timeout=datetime.timedelta(seconds=spec.op_timeout))
    dist.barrier(device_ids=[device.index] if spec.backend == "nccl" else None)


def _define_names_for_px_cells(context: RankContext) -> None:
    """Put rank, world_size, device, dist, ... in the engine's namespace, where %%px cells run."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    shell.user_ns.update(
        rank=context.rank, world_size=context.world_size, local_rank=context.local_rank,
        device=context.device, backend=context.backend, torch=torch, dist=dist, publish=publish,
    )


def call_on_rank(fn, /, *args, **kwargs):
    """Run fn(*args, **kwargs) for Lab.run; if its error broke the process group, note it for the client."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        if breaks_process_group(error):
            first_line = next(iter(str(error).splitlines()), "").rstrip(".")
            # Published before the error reply: the call's output is complete only after it.
            _publish_data({PROCESS_GROUP_BROKEN_KEY: f"{type(error).__name__}: {first_line}"})
        raise


def breaks_process_group(error: BaseException) -> bool:
    """True if `error`, or an error it was raised from or while handling, leaves the group unusable."""
    seen, breaking = set(), breaking_errors()
    while error is not None and id(error) not in seen:
        if isinstance(error, breaking) or gloo_transport_failed(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def breaking_errors() -> tuple[type[BaseException], ...]:
    """The errors after which a rank's process group cannot be used again: a timed-out P2P wait of
    the runtime leaves gloo's pair closed; a backend error leaves the communicator unusable. (So does
    gloo's untyped error of a raw send/recv: gloo_adapter recognises it.)"""
    import torch.distributed as dist

    from pplab.rank.comm import PipelineTimeoutError

    return PipelineTimeoutError, dist.DistBackendError


def set_op_timeout(seconds: float) -> None:
    """Give the process group's collectives a new bound (`lab.op_timeout = ...` on a running lab).

    torch sets a group's timeout when it is made; its `_set_pg_timeout` (private, in torch 2.13)
    changes it after for collectives; gloo's raw send/recv keep the first one (its pairs were made
    with it). tests/test_cluster.py checks that a collective then gives up at the new bound, so a
    torch that drops it fails there."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds), dist.group.WORLD)


def teardown_rank() -> None:
    """Leave the process group, so that the engine can stop cleanly."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    set_rank_context(None)


# Events: ipyparallel's data publication keeps, per call, a dict that each message
# *updates*. Giving every event its own key (a per-call sequence number) means no
# event replaces another, and the client reads them back in order, exactly once.
_publish_lock = threading.Lock()
_current_call = {"id": None, "next": 0}


def _publish_event(payload: object) -> None:
    """The engine's way to `publish` (pplab.rank.rank_context): one data key per event of the call."""
    from IPython import get_ipython

    data_pub = get_ipython().data_pub
    with _publish_lock:
        call_id = data_pub.parent_header.get("msg_id")
        if call_id != _current_call["id"]:
            _current_call.update(id=call_id, next=0)
        sequence = _current_call["next"]
        _current_call["next"] += 1
        data_pub.publish_data({event_key(sequence): payload})


def _publish_data(data: dict) -> None:
    """Add `data` to the current call's published data (on an engine; elsewhere nobody listens)."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and getattr(shell, "data_pub", None) is not None:
        with _publish_lock:
            shell.data_pub.publish_data(data)
