"""Predict before you run: per-stage costs measured on one device, then a schedule's step time
and memory predicted from them.

`profile` builds each stage of a partition on one device and times its forward (F), full
backward (B), and the zero-bubble halves of the backward (I: input gradient; W: weight
gradients, from what I kept), with the very functions the runtime uses, a few repeats each,
one thread (a rank's share of a CPU), and keeps the medians. It also measures the bytes a
forward saves for backward (as the runtime counts them), the boundary message, and the
static memory of each stage: parameters, gradients and AdamW's two moments.

`predict` runs the simulator on those costs (B for schedules with whole backwards, I and W
for split ones, plus the measured cost of a hop as `latency`), and reads from the predicted
timeline the step time, the bubble, and each rank's peak memory: its stages' static bytes
plus the most activation bytes it holds at once. Floor 3: torch only, no Jupyter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pplab.arguments import check_positive_int
from pplab.formatting import ShownAsText, format_bytes, html_table, text_table
from pplab.model import LlamaConfig, loss_fn
from pplab.partition import build_stage, layer_ranges
from pplab.runtime import SavedBytes, input_gradient, weight_gradients
from pplab.schedules import Schedule
from pplab.simulator import Costs, simulate
from pplab.trace import Timeline


@dataclass(frozen=True)
class StageProfile:
    """One stage's measured costs (median seconds per microbatch) and bytes."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    parameter_bytes: int
    activation_bytes: int  # what a forward saves for its backward (parameters excluded)
    output_bytes: int  # the boundary message it sends on (0 on the last stage)

    @property
    def static_bytes(self) -> int:
        """Parameters, their gradients and AdamW's two moments: four times the parameters."""
        return 4 * self.parameter_bytes


@dataclass(frozen=True, repr=False)
class Profile(ShownAsText):
    """Per-stage costs and bytes of a model cut into stages, measured on one device."""

    stages: tuple[StageProfile, ...]
    microbatch_size: int
    seq_len: int
    latency: float = 0.0  # seconds from posting a message to its arrival (see `with_link`)
    send_cost: float = 0.0  # seconds the sender spends posting a message

    def costs(self, split_backward: bool) -> Costs:
        """The simulator's costs: whole backwards (B) or split ones (I and W), with the link.

        The simulator's sends cost their rank nothing; a real send takes `send_cost` of the
        sender's time, so it is added to the compute that makes the message: every forward
        but the last stage's, every backward (or I) but the first stage's.
        """
        last = len(self.stages) - 1
        per_stage = {name: [getattr(s, name) for s in self.stages]
                     for name in ("forward", "backward", "input_grad", "weight_grad")}
        for index in range(last + 1):
            if index < last:
                per_stage["forward"][index] += self.send_cost
            if index > 0:
                per_stage["backward"][index] += self.send_cost
                per_stage["input_grad"][index] += self.send_cost
        activation_bytes = [s.output_bytes for s in self.stages]
        if split_backward:
            return Costs(forward=per_stage["forward"], input_grad=per_stage["input_grad"],
                         weight_grad=per_stage["weight_grad"], latency=self.latency,
                         activation_bytes=activation_bytes)
        return Costs(forward=per_stage["forward"], backward=per_stage["backward"], latency=self.latency,
                     activation_bytes=activation_bytes)

    def costs_for(self, schedule: Schedule) -> Costs:
        """The costs `schedule` runs on: split backwards if it has I and W actions."""
        kinds = {a.kind.value for actions in schedule.actions for a in actions}
        return self.costs(split_backward="I" in kinds)

    def with_link(self, hop: dict) -> "Profile":
        """The same profile with a measured link (what `hop_costs_on_rank` returns): a message
        arrives one hop after it is posted; posting takes the sender `send` seconds."""
        send = min(hop["send"], hop["pplab"])
        return replace(self, latency=hop["pplab"] - send, send_cost=send)

    def table(self) -> list[list[str]]:
        """One row of text per stage."""
        return [[str(index), *(f"{getattr(s, name) * 1e3:.2f}" for name in
                               ("forward", "backward", "input_grad", "weight_grad")),
                 f"{(s.input_grad + s.weight_grad) / s.backward:.2f}",
                 *map(format_bytes, (s.activation_bytes, s.output_bytes, s.static_bytes))]
                for index, s in enumerate(self.stages)]

    HEADER = ["stage", "F ms", "B ms", "I ms", "W ms", "(I+W)/B", "saved / mb", "message", "static"]

    def __str__(self) -> str:
        return text_table(self.HEADER, self.table(), right=True)

    def _repr_html_(self) -> str:
        return html_table(self.HEADER, self.table(),
                          f"measured per stage, microbatch {self.microbatch_size} x {self.seq_len} "
                          f"(median of repeats; static = parameters, gradients, AdamW state)")


def profile(config: LlamaConfig, microbatch_size: int, seq_len: int, n_stages: int,
            balance: Sequence[int] | None = None, device="cpu", repeats: int = 7, threads: int | None = 1,
            seed: int = 0, show: bool = True) -> Profile:
    """Measure every stage's F, B, I, W (median of `repeats`, after one warm-up) and bytes.

    `threads=1` measures what one rank of a CPU lab gets (each rank runs one thread); None
    keeps torch's setting. `show` draws a progress bar (tqdm). Seconds on CPU for the tiny model.
    """
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
    try:
        stages = []
        for index in range(n_stages):
            stages.append(_profile_stage(config, index, n_stages, balance, microbatch_size, seq_len,
                                         device, repeats, seed))
            bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)
    return Profile(tuple(stages), microbatch_size, seq_len)


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


# --- prediction ---------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Prediction(ShownAsText):
    """What a schedule will do on measured costs: step time, bubble, peak memory per rank."""

    step_time: float  # seconds: the simulated timeline's first start to last end
    bubble: float  # idle fraction of the ranks' time (simulated)
    peak_activation_bytes: tuple[int, ...]  # per rank: most activation bytes held at once
    static_bytes: tuple[int, ...]  # per rank: parameters, gradients, AdamW state of its stages
    timeline: Timeline  # the simulated timeline (F events carry their stage's saved bytes)
    how: str  # where each number comes from

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Per rank: static bytes plus the peak of activations held."""
        return tuple(s + a for s, a in zip(self.static_bytes, self.peak_activation_bytes))

    def __str__(self) -> str:
        lines = [f"predicted step {self.step_time * 1e3:.1f} ms, bubble {self.bubble:.1%}"]
        lines += [f"  rank {r}: peak {format_bytes(peak)} = static {format_bytes(static)} + activations "
                  f"{format_bytes(act)}" for r, (peak, static, act) in
                  enumerate(zip(self.peak_bytes, self.static_bytes, self.peak_activation_bytes))]
        return "\n".join(lines)


def predict(schedule: Schedule, costs: Costs | Profile, memory: Profile | None = None) -> Prediction:
    """Predict `schedule`'s step time, bubble and peak memory per rank.

    `costs` is a `Profile` (its costs for this schedule and its bytes) or plain `Costs`
    (then `memory`, a Profile, gives the bytes; without it the memory is not predicted: zeros).
    """
    if isinstance(costs, Profile):
        memory = costs if memory is None else memory
        costs = costs.costs_for(schedule)
    if memory is not None and len(memory.stages) != schedule.n_stages:
        raise ValueError(f"the profile has {len(memory.stages)} stages but the schedule "
                         f"{schedule.name!r} has {schedule.n_stages}: profile with n_stages={schedule.n_stages}")
    timeline = simulate(schedule, costs)
    if memory is not None:  # each forward holds its stage's saved bytes until its backward ends
        timeline = Timeline([replace(e, bytes=memory.stages[e.stage].activation_bytes) if e.kind == "F" else e
                             for e in timeline.events], timeline.n_ranks, timeline.label)
    ranks = range(schedule.n_ranks)
    activations = tuple((timeline.peak_inflight_bytes(r) or 0) if memory else 0 for r in ranks)
    static = tuple(sum(memory.stages[s].static_bytes for s in schedule.stages_of(r)) if memory else 0
                   for r in ranks)
    how = ("step time and bubble: pplab's simulator on the measured per-stage costs "
           f"({'I and W' if costs.input_grad is not None and 'I' in _kinds(schedule) else 'B'} for backwards, "
           f"latency {costs.latency * 1e3:.2f} ms per hop); activations: the simulated timeline, each "
           f"forward holding its stage's measured saved bytes until its backward (B, or W) ends; static: "
           f"4 x parameter bytes (parameters, gradients, AdamW's two moments)")
    return Prediction(timeline.step_time(), timeline.bubble_fraction(), activations, static, timeline, how)


def _kinds(schedule: Schedule) -> set[str]:
    return {a.kind.value for actions in schedule.actions for a in actions}


# --- the cost of a hop ----------------------------------------------------------------------------


def hop_costs_on_rank(rank: int, world_size: int, nbytes: int, repeats: int = 200, device="cpu") -> dict:
    """One-way seconds of a boundary message between ranks 0 and 1: pplab's StageLink (batching,
    bounded waits, recording) and a bare isend/irecv ping-pong of the same tensor, interleaved.

    Run it on 2 ranks (e.g. `pplab.launch.run_ranks(2, hop_costs_on_rank, nbytes)`); each
    round trip carries an activation forward and its gradient back, as a pipeline's hops do.
    Returns, on every rank, the medians and all the samples (seconds, one way).
    """
    import torch.distributed as dist

    from pplab.comm import StageLink, monotonic_clock
    from pplab.schedules import Action, Kind, build

    if world_size != 2:
        raise ValueError(f"the hop is measured between 2 ranks, not {world_size}")
    device = torch.device(device)
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    schedule = build("gpipe", 2, 1)
    link = StageLink(schedule, rank, device, handshake=False)
    shapes = {Action(1, Kind.RECV_F, 0): (tensor.dtype, tuple(tensor.shape)),
              Action(0, Kind.RECV_B, 0): (tensor.dtype, tuple(tensor.shape))}
    peer = 1 - rank

    def pplab_round_trip():
        if rank == 0:
            link.exchange([Action(0, Kind.SEND_F, 0)], {Action(0, Kind.SEND_F, 0): tensor}, {}, monotonic_clock)
            link.exchange([Action(0, Kind.RECV_B, 0)], {}, shapes, monotonic_clock)
        else:
            link.exchange([Action(1, Kind.RECV_F, 0)], {}, shapes, monotonic_clock)
            link.exchange([Action(1, Kind.SEND_B, 0)], {Action(1, Kind.SEND_B, 0): tensor}, {}, monotonic_clock)
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
            link.exchange([Action(0, Kind.SEND_F, 0)], {Action(0, Kind.SEND_F, 0): tensor}, {}, monotonic_clock)
        posted = time.perf_counter() - started
        if rank == 1:
            link.exchange([Action(1, Kind.RECV_F, 0)], {}, shapes, monotonic_clock)
        link.finish()
        link.events.clear()
        link.mailbox.received.clear()
        return posted

    samples = {"pplab": [], "bare": [], "send": []}
    for index in range(repeats + 10):  # the first 10 warm up
        order = (("pplab", pplab_round_trip), ("bare", bare_round_trip))
        for name, round_trip in order if index % 2 else order[::-1]:
            dist.barrier()
            started = time.perf_counter()
            round_trip()
            if index >= 10:
                samples[name].append((time.perf_counter() - started) / 2)
        dist.barrier()
        posted = pplab_send()
        if index >= 10:
            samples["send"].append(posted)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {**medians, "send": medians["send"] if rank == 0 else None, "samples": samples}
