"""Profile before you predict: each stage's costs and bytes measured on one device, and the
cost of a hop between two ranks.

`profile` builds each stage of a partition on one device and times its forward (F), full
backward (B), and the zero-bubble halves of the backward (I: input gradient; W: weight
gradients, from what I kept), with the very functions the runtime uses, a few repeats each,
one thread (a rank's share of a CPU), and keeps the medians. It also measures the bytes a
forward saves for backward (as the runtime counts them), the boundary message, and the
parameters' bytes. What it returns, a `pplab.planning.prediction.Profile`, is what `predict` reads.

`hop_costs_on_rank` measures, on two ranks, how long a boundary message takes one way and
how long posting it takes the sender (`Profile.with_link` adds both to a profile).
Floor 3: torch only, no Jupyter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from pplab.base.arguments import check_positive_int
from pplab.base.machine import measure_load
from pplab.models.llama import LlamaConfig, loss_fn
from pplab.models.partition import as_model, build_stage, layer_ranges
from pplab.planning.prediction import Profile, StageProfile
from pplab.rank.memory import SavedBytes
from pplab.rank.split_backward import input_gradient, weight_gradients


def profile(config: LlamaConfig, microbatch_size: int, seq_len: int, n_stages: int,
            balance: Sequence[int] | None = None, device="cpu", repeats: int = 7, threads: int | None = 1,
            seed: int = 0, show: bool = True) -> Profile:
    """Measure every stage's F, B, I, W (median of `repeats`, after one warm-up) and bytes.

    `threads=1` measures what one rank of a CPU lab gets (each rank runs one thread); None
    keeps torch's setting. `show` draws a progress bar (tqdm). Seconds on CPU for the tiny model.
    """
    config = as_model(config)  # a Hugging Face config or directory too
    check_positive_int("microbatch_size", microbatch_size)
    check_positive_int("seq_len", seq_len)
    check_positive_int("repeats", repeats, example=7)
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}; use shorter sequences or a larger config")
    layer_ranges(config.num_hidden_layers, n_stages, balance)  # a clear error before any work
    device = torch.device(device)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    from tqdm.auto import tqdm

    bar = tqdm(total=n_stages, desc="profiling stages", unit="stage", disable=not show)
    machine = measure_load()  # the load the costs are measured under, for predictions made later
    try:
        stages = []
        for index in range(n_stages):
            stages.append(_profile_stage(config, index, n_stages, balance, microbatch_size, seq_len,
                                         device, repeats, seed))
            bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)
    return Profile(tuple(stages), microbatch_size, seq_len, machine=machine)


def _profile_stage(config, index, n_stages, balance, microbatch_size, seq_len, device, repeats,
                   seed) -> StageProfile:
    stage = build_stage(config, index, n_stages, seed, device, balance)
    first, last = index == 0, index == n_stages - 1
    generator = torch.Generator().manual_seed(seed + index)
    if first:
        x = torch.randint(0, config.vocab_size, (microbatch_size, seq_len), generator=generator).to(device)
    else:
        x = torch.randn(microbatch_size, seq_len, config.hidden_size, generator=generator).to(device)
    targets = torch.randint(0, config.vocab_size, (microbatch_size, seq_len), generator=generator).to(device)
    weights = [p for p in stage.parameters() if p.requires_grad]

    def forward():
        """What the runtime's F does: the stage, and on the last stage its share of the loss."""
        inputs = x if first else x.detach().requires_grad_(True)
        out = stage(inputs)
        return inputs, (loss_fn(out, targets) if last else out)

    output_grad = None if last else torch.randn(microbatch_size, seq_len, config.hidden_size,
                                                generator=generator).to(device)
    saved = SavedBytes(stage)
    with saved.hooks():
        _, out = forward()
    output_bytes = 0 if last else out.numel() * out.element_size()
    del out

    times = {"forward": [], "backward": [], "input_grad": [], "weight_grad": []}
    # Gradients are not zeroed between repeats: in a step every microbatch but the first adds
    # its gradients to the ones already there, and that addition is part of its backward.
    for repeat in range(repeats + 1):  # the first is a warm-up
        took = {}
        started = _now(device)
        inputs, out = forward()
        took["forward"] = _now(device) - started
        started = _now(device)
        out.backward(output_grad)
        took["backward"] = _now(device) - started
        inputs, out = forward()
        started = _now(device)
        if first:  # no input gradient: I has nothing to do, W is the whole backward (as in the runtime)
            took["input_grad"] = 0.0
            out.backward(output_grad)
        else:
            _, work = input_gradient(out, output_grad, inputs, weights)
            took["input_grad"] = _now(device) - started
            started = _now(device)
            weight_gradients(weights, work)
        took["weight_grad"] = _now(device) - started
        if repeat:
            for name, seconds in took.items():
                times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    parameter_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    return StageProfile(**medians, parameter_bytes=parameter_bytes, activation_bytes=saved.bytes,
                        output_bytes=output_bytes)


def _now(device: torch.device) -> float:
    """A clock reading after the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- the cost of a hop ----------------------------------------------------------------------------


def hop_costs_on_rank(rank: int, world_size: int, nbytes: int, repeats: int = 200, device="cpu",
                      warmup: int = 10) -> dict:
    """One-way seconds of a boundary message between ranks 0 and 1: pplab's StageLink (batching,
    bounded waits, recording) and a bare isend/irecv ping-pong of the same tensor, interleaved,
    after `warmup` rounds that are not counted (at least 1: the first messages set the connection
    up; on a slow link, where each round takes most of a second, a few are enough).

    Run it on 2 ranks (e.g. `pplab.drivers.local.run_ranks(2, hop_costs_on_rank, nbytes)`); each
    round trip carries an activation forward and its gradient back, as a pipeline's hops do.
    Also how long a receive posted well after its message was sent still waits for it
    (`late_receive`: about a hop where the link moves a message only once its receive is posted,
    as gloo and NCCL do; about nothing where it buffers). Returns, on every rank, the medians and
    all the samples (seconds, one way).
    """
    import torch.distributed as dist

    from pplab.rank.comm import StageLink, monotonic_clock
    from pplab.schedules import Action, Kind, build

    if world_size != 2:
        raise ValueError(f"the hop is measured between 2 ranks, not {world_size}")
    check_positive_int("repeats", repeats, example=200)  # both ranks refuse alike: no one left waiting
    check_positive_int("warmup", warmup, example=10)
    device = torch.device(device)
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    schedule = build("gpipe", 2, 1)
    link = StageLink(schedule, rank, device, handshake=False)
    shapes = {Action(1, Kind.RECV_F, 0): (tensor.dtype, tuple(tensor.shape)),
              Action(0, Kind.RECV_B, 0): (tensor.dtype, tuple(tensor.shape))}
    peer = 1 - rank

    def pplab_round_trip():
        if rank == 0:
            link.exchange([Action(0, Kind.SEND_F, 0)], {Action(0, Kind.SEND_F, 0): tensor}, {},
                          monotonic_clock)
            link.exchange([Action(0, Kind.RECV_B, 0)], {}, shapes, monotonic_clock)
        else:
            link.exchange([Action(1, Kind.RECV_F, 0)], {}, shapes, monotonic_clock)
            link.exchange([Action(1, Kind.SEND_B, 0)], {Action(1, Kind.SEND_B, 0): tensor}, {},
                          monotonic_clock)
        link.finish()
        link.events.clear()
        link.mailbox.received.clear()

    def bare_round_trip():
        inbox = torch.empty_like(tensor)
        if rank == 0:
            dist.isend(tensor, peer).wait()
            dist.irecv(inbox, peer).wait()
        else:
            dist.irecv(inbox, peer).wait()
            dist.isend(tensor, peer).wait()

    def pplab_send():
        """Only the posting of a send (the receiver takes it after the clock stops)."""
        started = time.perf_counter()
        if rank == 0:
            link.exchange([Action(0, Kind.SEND_F, 0)], {Action(0, Kind.SEND_F, 0): tensor}, {},
                          monotonic_clock)
        posted = time.perf_counter() - started
        if rank == 1:
            link.exchange([Action(1, Kind.RECV_F, 0)], {}, shapes, monotonic_clock)
        link.finish()
        link.events.clear()
        link.mailbox.received.clear()
        return posted

    def late_receive() -> float | None:
        """How long a receive posted well after its message was sent (2 ms and three one-way
        hops so far) waits for it: about nothing if the link buffered the message, about a hop
        if it moves only once posted."""
        inbox = torch.empty_like(tensor)
        if rank == 0:
            dist.isend(tensor, peer).wait()
            return None
        time.sleep(0.002 + 3 * statistics.median(samples["pplab"] or [0.0]))
        started = _now(device)
        dist.irecv(inbox, peer).wait()
        return _now(device) - started

    samples = {"pplab": [], "bare": [], "send": [], "late_receive": []}
    for index in range(warmup + repeats):
        order = (("pplab", pplab_round_trip), ("bare", bare_round_trip))
        for name, round_trip in order if index % 2 else order[::-1]:
            dist.barrier()
            started = time.perf_counter()
            round_trip()
            if index >= warmup:
                samples[name].append((time.perf_counter() - started) / 2)
        dist.barrier()
        posted = pplab_send()
        dist.barrier()
        waited = late_receive()
        if index >= warmup:
            samples["send"].append(posted)
            if waited is not None:
                samples["late_receive"].append(waited)
    # Each rank knows its own half: the sender the posting, the receiver the late wait.
    late = torch.tensor([statistics.median(samples["late_receive"]) if rank == 1 else 0.0],
                        dtype=torch.float64, device=device)
    dist.broadcast(late, src=1)
    medians = {name: statistics.median(values) for name, values in samples.items() if values}
    return {**medians, "send": medians["send"] if rank == 0 else None, "late_receive": late.item(),
            "samples": samples}
