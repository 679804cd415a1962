"""Predicted vs measured: step time and activation memory of real runs, the I/W split, the hop.

1. The hop: one boundary message between 2 ranks, pplab's StageLink (batched, bounded waits,
   recorded) vs a bare isend/irecv ping-pong of the same tensor, interleaved in one run.
   Goal: pplab / bare <= 1.3. Also the time a sender spends posting a message.
2. I + W vs B per stage (`pplab.profile`, one device, one thread), for the tiny model and for
   a wider one (hidden 256) where the matrix products, not the per-call overheads, dominate.
   Goal: (I + W) / B <= 1.10.
3. Real mode (no timing padding), 2 ranks, 8 microbatches: GPipe, 1F1B, ZB-H1, interleaved
   1F1B (v=2). Measured: the median step time over 10 steps (after 2 warm-ups) and each
   rank's peak of held activation bytes. Predicted: `pplab.predict` on `pplab.profile`'s
   costs with the measured hop as the link. Goals: within 5 % for time and memory, and the
   ZB-H1 / 1F1B step ratio within 5 % of the predicted ratio.

Run: python bench/bench_predict.py   (about a minute)
Writes bench/results/predict.json.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import pplab
from pplab.data import batches
from pplab.drivers.local import run_ranks
from pplab.prediction import predict
from pplab.rank.profiler import hop_costs_on_rank, profile

RESULTS = Path(__file__).parent / "results" / "predict.json"
CONFIG = pplab.LlamaConfig.tiny()
WIDE = pplab.LlamaConfig.tiny(hidden_size=256, intermediate_size=704)
MICROBATCH_SIZE, SEQ_LEN, MICROBATCHES, STEPS, WARMUP = 4, 64, 8, 12, 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


def hop(pool: pplab.RankPool) -> dict:
    activation = MICROBATCH_SIZE * SEQ_LEN * CONFIG.hidden_size * 4
    rows = {}
    for nbytes in (activation, 1 << 20):
        measured = run_ranks(pool.world_size, hop_costs_on_rank, nbytes, 300, timeout=300, pool=pool)[0]
        rows[str(nbytes)] = dict(pplab_s=measured["pplab"], bare_s=measured["bare"], send_s=measured["send"],
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
                met={label: all(r["ratio"] <= 1.10 for r in stage_rows) for label, stage_rows in rows.items()})


def real_runs(pool: pplab.RankPool, link: dict) -> dict:
    profiles = {v: profile(CONFIG, MICROBATCH_SIZE, SEQ_LEN, 2 * v, show=False).with_link(link) for v in (1, 2)}
    batch = next(batches(MICROBATCH_SIZE * MICROBATCHES, SEQ_LEN))
    rows = {}
    for name, v in SCHEDULES:
        with pool.pipeline(CONFIG, name, MICROBATCHES, v) as pipe:
            steps = [pipe.step(batch) for _ in range(STEPS)][WARMUP:]
        measured = statistics.median(s.timeline.step_time() for s in steps)
        prediction = predict(pipe.schedule, profiles[v])
        peaks = [steps[-1].timeline.peak_inflight_bytes(r) for r in range(2)]
        rows[name] = dict(measured_step_s=measured, predicted_step_s=prediction.step_time,
                          time_error=measured / prediction.step_time - 1,
                          measured_activation_bytes=peaks,
                          predicted_activation_bytes=list(prediction.peak_activation_bytes),
                          memory_error=max(abs(m / p - 1) for m, p in zip(peaks, prediction.peak_activation_bytes)))
    zb, one = rows["zb-h1"], rows["1f1b"]
    ratio = dict(measured=zb["measured_step_s"] / one["measured_step_s"],
                 predicted=zb["predicted_step_s"] / one["predicted_step_s"])
    ratio["error"] = ratio["measured"] / ratio["predicted"] - 1
    return dict(schedules=rows, zb_h1_over_1f1b=ratio, profile=str(profiles[1]),
                goal="time and memory within 5 %; ZB-H1/1F1B within 5 % of the predicted ratio",
                met=dict(time=all(abs(r["time_error"]) <= 0.05 for r in rows.values()),
                         memory=all(r["memory_error"] <= 0.05 for r in rows.values()),
                         zb_ratio=abs(ratio["error"]) <= 0.05))


def main() -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__,
              "microbatch_size": MICROBATCH_SIZE, "seq_len": SEQ_LEN, "microbatches": MICROBATCHES}
    with pplab.RankPool(2) as pool:  # the ranks of the hop and of the real runs, started once
        report["hop"] = hop(pool)
        for nbytes, row in report["hop"]["rows"].items():
            print(f"hop of {int(nbytes) / 1024:.0f} KiB: pplab {row['pplab_s'] * 1e6:.0f} us, bare "
                  f"{row['bare_s'] * 1e6:.0f} us, ratio {row['ratio']:.2f} (goal <= 1.3); posting a send "
                  f"{row['send_s'] * 1e6:.0f} us")
        report["split_backward"] = split_backward()
        for label, rows in report["split_backward"]["rows"].items():
            print(f"(I + W) / B, {label}: " + ", ".join(f"stage {r['stage']} {r['ratio']:.2f}" for r in rows))
        link = report["hop"]["rows"][str(report["hop"]["activation_bytes"])]
        report["real_mode"] = real_runs(pool, {"pplab": link["pplab_s"], "send": link["send_s"]})
    for name, row in report["real_mode"]["schedules"].items():
        print(f"{name:17s} step measured {row['measured_step_s'] * 1e3:6.1f} ms, predicted "
              f"{row['predicted_step_s'] * 1e3:6.1f} ms ({row['time_error']:+.1%}); activations "
              f"{row['memory_error']:.1%} off")
    ratio = report["real_mode"]["zb_h1_over_1f1b"]
    print(f"ZB-H1 / 1F1B: measured {ratio['measured']:.3f}, predicted {ratio['predicted']:.3f} "
          f"({ratio['error']:+.1%})")
    report["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
