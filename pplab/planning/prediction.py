"""Predict before you run: a schedule's step time, bubble and peak memory per rank, from
per-stage costs measured on one device.

A `Profile` holds what `pplab.rank.profiler.profile` measured for each stage (`StageProfile`):
the median seconds of its forward (F), full backward (B) and the zero-bubble halves of
the backward (I and W), the bytes a forward saves for backward, the boundary message, and
the static memory (parameters, gradients and AdamW's two moments); and, once measured, the
cost of a hop between ranks.

`predict` runs the simulator on those costs (B for schedules with whole backwards, I and W
for split ones, plus the measured cost of a hop as `latency`), and reads from the predicted
timeline the step time, the bubble, and each rank's peak memory: its stages' static bytes
plus the most activation bytes it holds at once.

The simulator gives every rank a core of its own. A prediction also reads the machine
(`pplab.base.machine`): where the ranks outnumber the cores no other process is using, they take
turns, and the step can be no shorter than all their compute spread over those cores; where
the load changed since the profile, every cost scaled with it. Both are said in its notes, with
the step time they imply, rather than a quiet machine's number presented as the answer.
Floor 2: pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pplab.base.formatting import ShownAsText, format_bytes, html_table, text_table
from pplab.base.machine import MachineLoad, recent_load
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import Schedule, add_communication
from pplab.trace.timeline import Timeline

# --- what was measured ----------------------------------------------------------------------------


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
    # how a message moves (`pplab.planning.simulator.Costs.link`), as measured by `with_link`
    link: str = "buffered"
    machine: MachineLoad | None = None  # how busy the machine was while it was measured

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
                         activation_bytes=activation_bytes, link=self.link)
        return Costs(forward=per_stage["forward"], backward=per_stage["backward"], latency=self.latency,
                     activation_bytes=activation_bytes, link=self.link)

    def costs_for(self, schedule: Schedule) -> Costs:
        """The costs `schedule` runs on: split backwards if it has I and W actions."""
        return self.costs(split_backward="I" in _kinds(schedule))

    def with_link(self, hop: dict) -> "Profile":
        """The same profile with a measured link (what `pplab.rank.profiler.hop_costs_on_rank` returns):
        a message arrives one hop after it is posted; posting takes the sender `send` seconds; and
        where a receive posted after its message was sent still waits more than half a hop for it,
        the link is a rendezvous (the message moved only once the receive was posted)."""
        send = min(hop["send"], hop["pplab"])
        latency = hop["pplab"] - send
        late = hop.get("late_receive")  # measurements from before it was measured: buffered
        link = "rendezvous" if late is not None and late > latency / 2 else "buffered"
        return replace(self, latency=latency, send_cost=send, link=link)

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


# --- the prediction -------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Prediction(ShownAsText):
    """What a schedule will do on measured costs: step time, bubble, peak memory per rank."""

    step_time: float  # seconds: the simulated timeline's first start to last end
    bubble: float  # idle fraction of the ranks' time (simulated)
    peak_activation_bytes: tuple[int, ...]  # per rank: most activation bytes held at once
    static_bytes: tuple[int, ...]  # per rank: parameters, gradients, AdamW state of its stages
    timeline: Timeline  # the simulated timeline (F events carry their stage's saved bytes)
    how: str  # where each number comes from
    machine: MachineLoad | None = None  # the machine it is predicted for
    shared_step_time: float | None = None  # the step the machine allows, where it differs (see notes)
    notes: tuple[str, ...] = ()  # what the machine changes, in sentences
    uncertainty: float | None = None  # with a lab's calibration: how much its computes varied (a fraction)
    left_out: str = ""  # without a lab: which of a lab's costs this leaves out, and how much they count

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Per rank: static bytes plus the peak of activations held."""
        return tuple(s + a for s, a in zip(self.static_bytes, self.peak_activation_bytes))

    def __str__(self) -> str:
        sure = "" if self.uncertainty is None else f" ± {self.uncertainty:.0%}"
        lines = [f"predicted step {self.step_time * 1e3:.1f} ms{sure}, bubble {self.bubble:.1%}"]
        lines += [f"  rank {r}: peak {format_bytes(peak)} = static {format_bytes(static)} + activations "
                  f"{format_bytes(act)}" for r, (peak, static, act) in
                  enumerate(zip(self.peak_bytes, self.static_bytes, self.peak_activation_bytes))]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  left out: {self.left_out}"] if self.left_out else []
        return "\n".join(lines)


last_calibration = None  # the last lab calibration made in this process (set by pplab.session.calibrate)


def predict(schedule: Schedule, costs: Costs | Profile, memory: Profile | None = None, *,
            machine: MachineLoad | None = None, lab=None) -> Prediction:
    """Predict `schedule`'s step time, bubble and peak memory per rank.

    `costs` is a `Profile` (its costs for this schedule and its bytes) or plain `Costs`
    (then `memory`, a Profile, gives the bytes; without it the memory is not predicted: zeros).
    `machine` is the load the ranks will run under (default: this machine's, read within the last 10 s).
    `lab`, the lab (or pool of ranks) it will run on: a profile's costs become that lab's
    (`lab.calibration`, measured on first use: pplab.planning.calibration), and the prediction says
    how sure it is; without it, the prediction says which of the lab's costs it leaves out.
    """
    profiled_on = costs.machine if isinstance(costs, Profile) else None
    calibration = None
    if lab is not None and not isinstance(costs, Profile):
        raise ValueError("predict(..., lab=...) turns a profile's costs into the lab's: give a Profile "
                         "(pplab.profile), not Costs")
    if isinstance(costs, Profile):
        memory = costs if memory is None else memory
        if lab is not None:
            calibration = lab.calibration
            if calibration.n_ranks != schedule.n_ranks:
                raise ValueError(f"the lab has {calibration.n_ranks} ranks and schedule {schedule.name!r} "
                                 f"{schedule.n_ranks}: predict for a lab of the schedule's ranks")
            costs = calibration.costs(costs, schedule)
        else:
            costs = costs.costs_for(schedule)
    if memory is not None and len(memory.stages) != schedule.n_stages:
        raise ValueError(f"the profile has {len(memory.stages)} stages but the schedule {schedule.name!r} "
                         f"has {schedule.n_stages}: profile with n_stages={schedule.n_stages}")
    if costs.link == "rendezvous" and not schedule.has_communication:
        schedule = add_communication(schedule)  # a rendezvous waits on receives: the schedule needs them
    timeline = simulate(schedule, costs)
    if memory is not None:  # each forward holds its stage's saved bytes until its backward ends
        timeline = Timeline([replace(e, bytes=memory.stages[e.stage].activation_bytes) if e.kind == "F" else e
                             for e in timeline.events], timeline.n_ranks, timeline.label)
    ranks = range(schedule.n_ranks)
    activations = tuple((timeline.peak_inflight_bytes(r) or 0) if memory else 0 for r in ranks)
    static = tuple(sum(memory.stages[s].static_bytes for s in schedule.stages_of(r)) if memory else 0
                   for r in ranks)
    how = ("step time and bubble: pplab's simulator on the measured per-stage costs "
           f"({'I and W' if costs.input_grad is not None and 'I' in _kinds(schedule) else 'B'} for "
           f"backwards, latency {costs.latency * 1e3:.2f} ms per hop, {costs.link} link); activations: the "
           "simulated timeline, each forward holding its stage's measured saved bytes until its backward "
           "(B, or W) ends; static: 4 x parameter bytes (parameters, gradients, AdamW's two moments)")
    machine = machine if machine is not None else recent_load()
    shared, notes = _on_this_machine(timeline, machine, profiled_on)
    if calibration is not None:
        how = (f"step time and bubble: pplab's simulator on the profiled costs as this lab runs them "
               f"({calibration}); " + how.split("; ", 1)[1])
    left_out = _left_out() if calibration is None and profiled_on is not None else ""
    return Prediction(timeline.step_time(), timeline.bubble_fraction(), activations, static, timeline, how,
                      machine, shared, notes, calibration.spread if calibration is not None else None,
                      left_out)


def _left_out() -> str:
    """What a prediction without a lab leaves out, and how much it counted at the last calibration."""
    said = ("without a lab (predict(..., lab=lab)) this leaves out what the lab adds: a compute on a rank "
            "beside the others, the runtime's own time between computes, and the messages' time between "
            "these ranks")
    last = last_calibration
    if last is None:
        return said + "; on a 2-core CPU lab they added 15-55 % to the step (bench/bench_predict.py)"
    return said + f"; this machine's last calibration: {last}"


def _on_this_machine(timeline: Timeline, machine: MachineLoad,
                     profiled_on: MachineLoad | None) -> tuple[float | None, tuple[str, ...]]:
    """The step the machine allows (None: the simulated one) and the sentences that say why."""
    notes, step = [], timeline.step_time()
    pace = 1.0
    if profiled_on is not None and abs(machine.slowdown / profiled_on.slowdown - 1) > 0.2:
        pace = machine.slowdown / profiled_on.slowdown
        notes.append(f"the machine's load changed since the profile (then {profiled_on.describe()}; now "
                     f"{machine.describe()}): every compute takes about {pace:.2f}x as long now")
    n_ranks = timeline.n_ranks
    compute = sum(timeline.busy_time(rank) for rank in range(n_ranks)) * pace
    if n_ranks > machine.free_cores:
        cores = max(machine.free_cores, 0.5)  # a rank always gets some time
        floor = compute / cores
        notes.append(f"{n_ranks} ranks on {machine.free_cores:.1f} free core(s) ({machine.describe()}): they "
                     f"take turns, so the step is at least their {compute * 1e3:.1f} ms of compute over the "
                     f"free cores, {floor * 1e3:.1f} ms, against {step * 1e3:.1f} ms with a core each")
        step = max(step * pace, floor)
    elif pace != 1.0:
        step *= pace
    return (step if notes else None), tuple(notes)


def _kinds(schedule: Schedule) -> set[str]:
    """The action kinds ("F", "I", ...) the schedule has."""
    return {a.kind.value for actions in schedule.actions for a in actions}
