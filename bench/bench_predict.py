"""Predicted vs measured: step time and activation memory of real runs, the I/W split, the hop.

1. The hop: one boundary message between 2 ranks, pplab's StageLink (batched, bounded waits,
   recorded) vs a bare isend/irecv ping-pong of the same tensor, interleaved in one run.
   Goal: pplab / bare <= 1.3. Also the time a sender spends posting a message.
2. I + W vs B per stage (`pplab.profile`, one device, one thread), for the tiny model and for
   a wider one (hidden 256) where the matrix products, not the per-call overheads, dominate.
   Goal: (I + W) / B <= 1.10.
3. Real mode (no timing padding) and timing mode (every compute padded to 12 ms per F, I, W),
   2 ranks, 8 microbatches: GPipe, 1F1B, ZB-H1, interleaved 1F1B (v=2), 5 runs each, the
   schedules interleaved in every round. Measured: per run the median step time over 10
   steps (after 2 warm-ups); in real mode also each rank's peak of held activation bytes.
   Predicted: `pplab.predict` on `pplab.profile`'s costs (timing mode: the padded costs) with
   the measured hop as the link, rendezvous or buffered as `Profile.with_link` reads it off
   the hop's late receive; the buffered prediction beside it. Reported: the median error over
   the runs and its range. Goals: real mode within 10 %, timing mode within 5 %, memory 1 %.

   All of 1 and 3 twice: with the ranks placed by the kernel (free, the default) and with each
   rank's threads kept on a core of its own (pinned: `RankPool(2, cores=[0, 1])`).
4. Before you run, as a new user predicts (issue 65): `pplab.predict(schedule, pplab.profile(...))`
   alone, and with the lab's own costs (`lab=`, its calibration measured once at the start), against
   the median measured step, on a 2-rank lab: the tiny, 128- and 256-wide models, GPipe, 1F1B, ZB-H1,
   interleaved 1F1B (v=2), 8 microbatches of 4 x 64 tokens, the schedules interleaved over rounds.
   Goal: with the lab's costs, every row within 10 %.

Run: python bench/bench_predict.py [--placements free pinned] [--parts ...] [--output PATH]
(about ten minutes; `--parts before-you-run` runs part 4 alone and keeps the file's other parts)
Writes bench/results/predict.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

import pplab
from pplab.data import batches
from pplab.drivers.local import run_ranks
from pplab.planning.prediction import predict
from pplab.rank.profiler import hop_costs_on_rank, profile
from pplab.schedules import Kind

RESULTS = Path(__file__).parent / "results" / "predict.json"
CONFIG = pplab.LlamaConfig.tiny()
WIDE = pplab.LlamaConfig.tiny(hidden_size=256, intermediate_size=704)
MICROBATCH_SIZE, SEQ_LEN, MICROBATCHES, STEPS, WARMUP, ROUNDS = 4, 64, 8, 12, 2, 5
# padded: above what the tiny stages take
TIMING = pplab.Costs(forward=0.012, input_grad=0.012, weight_grad=0.012)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


def hop(pool: pplab.RankPool) -> dict:
    activation = MICROBATCH_SIZE * SEQ_LEN * CONFIG.hidden_size * 4
    rows = {}
    for nbytes in (activation, 1 << 20):
        measured = run_ranks(pool.world_size, hop_costs_on_rank, nbytes, 300, timeout=300, pool=pool)[0]
        rows[str(nbytes)] = dict(pplab_s=measured["pplab"], bare_s=measured["bare"], send_s=measured["send"],
                                 late_receive_s=measured["late_receive"],
                                 ratio=measured["pplab"] / measured["bare"])
    return dict(rows=rows, activation_bytes=activation, goal="pplab / bare <= 1.3",
                met=all(row["ratio"] <= 1.3 for row in rows.values()))


def split_backward() -> dict:
    rows = {}
    for label, config, size in (("tiny", CONFIG, (MICROBATCH_SIZE, SEQ_LEN)), ("wide", WIDE, (8, 128))):
        measured = profile(config, *size, 2, repeats=9, show=False)
        rows[label] = [dict(stage=index, backward_s=s.backward, input_grad_s=s.input_grad,
                            weight_grad_s=s.weight_grad, ratio=(s.input_grad + s.weight_grad) / s.backward)
                       for index, s in enumerate(measured.stages)]
    return dict(rows=rows, goal="(I + W) / B <= 1.10 per stage",
                met={label: all(r["ratio"] <= 1.10 for r in stage_rows)
                     for label, stage_rows in rows.items()})


def real_runs(pool: pplab.RankPool, link: dict, modes=("real", "timing"), rounds: int = ROUNDS) -> dict:
    """Real mode and timing mode, `rounds` rounds each (the schedules interleaved in every round, so
    that a machine getting busier affects all alike): per round the median step of STEPS steps,
    against the prediction on a buffered link and on the link `with_link` measured."""
    profiles = {v: profile(CONFIG, MICROBATCH_SIZE, SEQ_LEN, 2 * v, show=False).with_link(link)
                for v in (1, 2)}
    buffered = {v: replace(p, link="buffered") for v, p in profiles.items()}
    batch = next(batches(MICROBATCH_SIZE * MICROBATCHES, SEQ_LEN))
    modes = {mode: timing for mode, timing in {"real": None, "timing": TIMING}.items() if mode in modes}
    measured = {mode: {name: [] for name, _ in SCHEDULES} for mode in modes}
    peaks, schedules = {}, {}
    for _ in range(rounds):
        for mode, timing in modes.items():
            for name, v in SCHEDULES:
                with pool.pipeline(CONFIG, name, MICROBATCHES, v, timing=timing) as pipe:
                    steps = [pipe.step(batch) for _ in range(STEPS)][WARMUP:]
                schedules[name] = pipe.schedule
                measured[mode][name].append(statistics.median(s.timeline.step_time() for s in steps))
                if mode == "real":
                    peaks[name] = [steps[-1].timeline.peak_inflight_bytes(r) for r in range(2)]
    report = {}
    for mode, timing in modes.items():
        rows = {}
        for name, v in SCHEDULES:
            if timing is None:
                on_link, on_buffer = predict(schedules[name], profiles[v]), predict(schedules[name],
                                                                                    buffered[v])
            else:  # the profile with the padded costs as its compute: the link and the sends' posting kept
                padded = replace(profiles[v], stages=tuple(
                    replace(stage, forward=timing.compute_time(Kind.F, s),
                            backward=timing.compute_time(Kind.B, s),
                            input_grad=timing.compute_time(Kind.I, s),
                            weight_grad=timing.compute_time(Kind.W, s))
                    for s, stage in enumerate(profiles[v].stages)))
                on_link = predict(schedules[name], padded)
                on_buffer = predict(schedules[name], replace(padded, link="buffered"))
            errors = [m / on_link.step_time - 1 for m in measured[mode][name]]
            rows[name] = dict(measured_step_s=measured[mode][name], predicted_step_s=on_link.step_time,
                              predicted_buffered_step_s=on_buffer.step_time,
                              time_error=dict(median=statistics.median(errors), low=min(errors),
                                              high=max(errors)),
                              time_error_buffered=statistics.median(m / on_buffer.step_time - 1
                                                                    for m in measured[mode][name]))
            if timing is None:
                rows[name].update(measured_activation_bytes=peaks[name],
                                  predicted_activation_bytes=list(on_link.peak_activation_bytes),
                                  memory_error=max(abs(m / p - 1) for m, p in
                                                   zip(peaks[name], on_link.peak_activation_bytes)))
        goal = 0.10 if timing is None else 0.05
        report[mode] = dict(schedules=rows, goal=f"median step time within {goal:.0%} of the prediction",
                            met=all(abs(r["time_error"]["median"]) <= goal for r in rows.values()))
    report["link"] = dict(link=profiles[1].link, latency_s=profiles[1].latency, send_s=profiles[1].send_cost)
    if "real" in report:
        report["real"]["memory_met"] = all(r["memory_error"] <= 0.01
                                           for r in report["real"]["schedules"].values())
    report["profile"] = str(profiles[1])
    return report


BEFORE_YOU_RUN_MODELS = {
    "tiny": pplab.LlamaConfig.tiny(),
    "128-wide, 4 layers": pplab.LlamaConfig.tiny(hidden_size=128, intermediate_size=352, num_hidden_layers=4),
    "256-wide, 8 layers": pplab.LlamaConfig.tiny(hidden_size=256, intermediate_size=704, num_hidden_layers=8)}
BEFORE_YOU_RUN_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2))


def before_you_run(rounds: int) -> dict:
    """Part 4: predictions from one-device profiles, with and without the lab's costs, against the
    median measured step (each round runs every schedule once, the first in turn)."""
    started = time.perf_counter()
    rows = []
    with pplab.Lab(n_ranks=2) as lab:
        calibration = lab.calibrate()
        print(f"before you run: {calibration}", flush=True)
        for model, config in BEFORE_YOU_RUN_MODELS.items():
            profiles = {v: pplab.profile(config, MICROBATCH_SIZE, SEQ_LEN, 2 * v, show=False) for v in (1, 2)}
            batch = next(batches(MICROBATCH_SIZE * MICROBATCHES, SEQ_LEN))
            measured = {name: [] for name, _ in BEFORE_YOU_RUN_SCHEDULES}
            predicted = {}
            for round_index in range(rounds):
                first = round_index % len(BEFORE_YOU_RUN_SCHEDULES)
                order = BEFORE_YOU_RUN_SCHEDULES[first:] + BEFORE_YOU_RUN_SCHEDULES[:first]
                for name, v in order:
                    with lab.pipeline(config, schedule=name, n_microbatches=MICROBATCHES,
                                      n_virtual=v) as pipe:
                        if name not in predicted:
                            predicted[name] = (pplab.predict(pipe.schedule, profiles[v]).step_time,
                                               pplab.predict(pipe.schedule, profiles[v], lab=lab).step_time)
                        steps = [pipe.step(batch).timeline.step_time() for _ in range(WARMUP + 5)][WARMUP:]
                    measured[name].append(statistics.median(steps))
            for name, _ in BEFORE_YOU_RUN_SCHEDULES:
                step = statistics.median(measured[name])
                alone, on_lab = predicted[name]
                rows.append(dict(model=model, schedule=name, predicted_alone_s=alone,
                                 predicted_with_lab_s=on_lab,
                                 measured_s=step, measured_per_round_s=measured[name],
                                 error_alone=alone / step - 1, error_with_lab=on_lab / step - 1))
                print(f"{model:19s} {name:17s} predicted {alone * 1e3:6.1f} ms alone "
                      f"({alone / step - 1:+.0%}), "
                      f"{on_lab * 1e3:6.1f} ms with the lab's costs ({on_lab / step - 1:+.0%}); measured "
                      f"{step * 1e3:6.1f} ms", flush=True)
    worst = max(abs(row["error_with_lab"]) for row in rows)
    return {"calibration": dict(str=str(calibration), scale=calibration.scale, fixed_s=calibration.fixed,
                                overhead_s=calibration.overhead, latency_s=calibration.latency,
                                spread=calibration.spread, seconds=calibration.seconds),
            "rounds": rounds, "rows": rows, "goal": "with the lab's costs, every row within 10 %",
            "worst_error_with_lab": worst, "worst_error_alone": max(abs(row["error_alone"]) for row in rows),
            "mean_abs_error_with_lab": statistics.fmean(abs(r["error_with_lab"]) for r in rows),
            "mean_abs_error_alone": statistics.fmean(abs(r["error_alone"]) for r in rows),
            "met": worst <= 0.10, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", nargs="+", choices=("free", "pinned"), default=["free", "pinned"])
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--modes", nargs="+", choices=("real", "timing"), default=["real", "timing"])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--parts", nargs="+", choices=("measured", "before-you-run"),
                        default=["measured", "before-you-run"],
                        help="measured: parts 1-3; before-you-run: part 4 (alone, it keeps the file's "
                             "other parts)")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    output = Path(args.output)
    kept = json.loads(output.read_text()) if "measured" not in args.parts and output.exists() else {}
    report = {**kept, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__,
              "microbatch_size": MICROBATCH_SIZE, "seq_len": SEQ_LEN, "microbatches": MICROBATCHES}
    if "before-you-run" in args.parts:
        part = report["before_you_run"] = before_you_run(args.rounds)
        print(f"before you run: worst error {part['worst_error_alone']:+.0%} alone, "
              f"{part['worst_error_with_lab']:.0%} with the lab's costs: {part['goal']}: "
              f"{'met' if part['met'] else 'NOT met'}")
    if "measured" not in args.parts:
        args.placements = []
    else:
        report["split_backward"] = split_backward()
        for label, rows in report["split_backward"]["rows"].items():
            print(f"(I + W) / B, {label}: " + ", ".join(f"stage {r['stage']} {r['ratio']:.2f}" for r in rows))
    # The ranks placed by the kernel (the default), and each kept on a core of its own (pplab.drivers.cores)
    placements = {"free": None, "pinned": sorted(os.sched_getaffinity(0))[:2]}
    for placement in args.placements:
        cores = placements[placement]
        # the ranks of the hop and of the real runs, started once
        with pplab.RankPool(2, cores=cores) as pool:
            hop_report = hop(pool)
            for nbytes, row in hop_report["rows"].items():
                print(f"{placement}: hop of {int(nbytes) / 1024:.0f} KiB: pplab {row['pplab_s'] * 1e6:.0f} "
                      f"us, bare {row['bare_s'] * 1e6:.0f} us, ratio {row['ratio']:.2f} (goal <= 1.3); "
                      f"posting a send {row['send_s'] * 1e6:.0f} us")
            link = hop_report["rows"][str(hop_report["activation_bytes"])]
            runs = real_runs(pool, {"pplab": link["pplab_s"], "send": link["send_s"],
                                    "late_receive": link["late_receive_s"]}, args.modes, args.rounds)
        report[placement] = {"cores": cores, "hop": hop_report, "runs": runs}
        print(f"{placement}: link: {runs['link']}")
        for mode in args.modes:
            for name, row in runs[mode]["schedules"].items():
                error = row["time_error"]
                print(f"{placement} {mode:6s} {name:17s} step measured "
                      f"{statistics.median(row['measured_step_s']) * 1e3:6.1f} ms, predicted "
                      f"{row['predicted_step_s'] * 1e3:6.1f} ms: {error['median']:+.1%} "
                      f"[{error['low']:+.1%}, {error['high']:+.1%}] over {args.rounds} runs (buffered link: "
                      f"{row['time_error_buffered']:+.1%})" + (f"; activations {row['memory_error']:.1%} off"
                                                               if "memory_error" in row else ""))
            print(f"{placement} {mode}: {runs[mode]['goal']}: {'met' if runs[mode]['met'] else 'NOT met'}")
    report["seconds"] = round(time.perf_counter() - started, 1)
    output.parent.mkdir(exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
