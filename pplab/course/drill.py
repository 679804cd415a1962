"""The room's drill: how many attendees' labs this machine runs at once, every verdict right.

An instructor sizing a workshop server wants one number: how many seats it holds. A seat here is
what an attendee's kernel does in the lessons, in a process of its own: a 2-rank lab on CPU,
gpipe, 1F1B and ZB-H1 checked against one device with their gradient flow, three timing-mode
steps with stage 1 four times slower explained (the straggler must be rank 1), and 10 training
steps. The drill starts N seats at once and reports whether every verdict was right and how
long a seat took against one seat alone. `pplab room --drill N` runs it; `bench/bench_room.py`
climbs N until a verdict goes wrong or a seat takes too long.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DrillResult", "drill", "drill_table"]

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
# Stage 1 four times slower, in pads long enough that a rank's own compute fits in them even on a
# crowded machine (shorter pads can leave a seat's straggler verdict undecided).
SLOW_STAGE = dict(forward=(0.015, 0.06), backward=(0.03, 0.12))
SEAT_TIMEOUT_SECONDS = 900  # one seat's whole drill, however crowded the machine


@dataclass
class DrillResult:
    """N seats at once: whether each verdict was right, and each seat's time by phase."""

    seats: int
    seat_seconds: list[float]  # each seat's whole drill, lab start to stop
    phases: dict[str, float]  # the median seat's seconds per phase
    wrong: list[str] = field(default_factory=list)  # "seat 2: 1f1b parity failed", ...

    @property
    def all_right(self) -> bool:
        """Every seat finished and every verdict was right."""
        return not self.wrong and len(self.seat_seconds) == self.seats

    def to_json(self) -> dict:
        """As plain data."""
        return {"seats": self.seats, "all_right": self.all_right, "seat_seconds": self.seat_seconds,
                "median_seat_seconds": statistics.median(self.seat_seconds) if self.seat_seconds else None,
                "phases": self.phases, "wrong": self.wrong}


def seat(out: str) -> None:
    """One attendee's lessons on a lab of their own (run in a process of its own); writes JSON to `out`.
    (The session's lab: a drill's seats write no records in an instructor's room.)"""
    from pplab.models.llama import LlamaConfig
    from pplab.planning.bubble import explain
    from pplab.planning.simulator import Costs
    from pplab.session.drivers import Lab

    times, verdicts, started = {}, {}, time.monotonic()

    def phase(name: str, since: float) -> float:
        times[name] = time.monotonic() - since
        return time.monotonic()

    config = LlamaConfig.tiny()
    lab = Lab(n_ranks=2, device="cpu", verbose=False)
    try:
        now = phase("lab start", started)
        for name in SCHEDULES:
            pipe = lab.pipeline(config, schedule=name, n_microbatches=4)
            verdicts[f"{name} parity"] = pipe.check_parity().passed
            verdicts[f"{name} gradient flow"] = pipe.check_gradient_flow().passed
            pipe.close()
        now = phase("parity and flow", now)
        slow = lab.pipeline(config, "1f1b", n_microbatches=4, timing=Costs(**SLOW_STAGE))
        steps = [slow.step().timeline for _ in range(3)]  # each explained with the others as evidence
        for index, step in enumerate(steps):
            others = [other for other in steps if other is not step]
            verdicts[f"straggler, step {index + 1}"] = \
                explain(step, slow.schedule, steps=others).straggler == 1
        slow.close()
        now = phase("straggler", now)
        losses = lab.pipeline(config, "1f1b", n_microbatches=4).train(
            steps=10, batch_size=8, seq_len=32, warmup=2, eval_every=100, show=False).losses
        verdicts["training"] = len(losses) == 10 and all(loss == loss for loss in losses)
        now = phase("10 training steps", now)
    finally:
        lab.stop()
    times["total"] = time.monotonic() - started
    Path(out).write_text(json.dumps({"times": times, "verdicts": verdicts}))


def drill(seats: int, *, show: bool = True) -> DrillResult:
    """Run `seats` seats at once, each in a process of its own; wait for them all (bounded)."""
    if not isinstance(seats, int) or isinstance(seats, bool) or seats < 1:
        raise ValueError(f"seats={seats!r}: give a whole number of seats, 1 or more (e.g. 4)")
    folder = Path(tempfile.mkdtemp(prefix="pplab-drill-"))
    outs = [folder / f"seat{index}.json" for index in range(seats)]
    processes = [subprocess.Popen([sys.executable, "-m", "pplab.course.drill", str(out)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for out in outs]
    wrong, said = [], []
    deadline = time.monotonic() + SEAT_TIMEOUT_SECONDS
    try:
        for index, process in enumerate(processes):
            try:
                _, error = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                wrong.append(f"seat {index}: not done within {SEAT_TIMEOUT_SECONDS} s")
                continue
            if process.returncode != 0 or not outs[index].exists():
                last = (error or "").strip().splitlines()[-1:] or ["no output"]
                wrong.append(f"seat {index}: failed ({last[0]})")
                continue
            said.append(json.loads(outs[index].read_text()))
            wrong += [f"seat {index}: {name} wrong" for name, right in said[-1]["verdicts"].items()
                      if not right]
            if show:
                print(f"  seat {index + 1}/{seats} done in {said[-1]['times']['total']:.1f} s", flush=True)
    finally:
        for process in processes:
            if process.poll() is None:  # a seat that ran out of time: its lab stops with it
                process.terminate()
                process.wait(30)
    phases = {name: statistics.median(seat["times"][name] for seat in said) for name in said[0]["times"]} \
        if said else {}
    return DrillResult(seats, [seat["times"]["total"] for seat in said], phases, wrong)


def drill_table(results: list[DrillResult]) -> str:
    """One line per drill: seats, every verdict right, a seat's median time and its slowdown."""
    alone = next((r for r in results if r.seats == 1 and r.seat_seconds), None)
    lines = ["seats  verdicts     median seat   vs one seat alone"]
    for result in results:
        median = statistics.median(result.seat_seconds) if result.seat_seconds else float("nan")
        ratio = f"{median / statistics.median(alone.seat_seconds):.2f}x" if alone else "n/a"
        lines.append(f"{result.seats:5d}  {'all right' if result.all_right else 'WRONG':11s}  "
                     f"{median:9.1f} s   {ratio}")
        lines += [f"       {line}" for line in result.wrong[:5]]
    return "\n".join(lines)


if __name__ == "__main__":
    seat(sys.argv[1])
