"""A pipeline across two hosts (network namespaces on one machine, root only) with the link
slowed: step time and bubble measured vs predicted at 0, 1, 5 and 20 ms delay (tc netem), or,
where the kernel has no netem, at rates of 100, 20, 10 and 5 Mbit/s (a token bucket, tbf).

Two "hosts", one rank each (`pplab.drivers.cluster.namespaces.NamespaceHosts`), `Lab.connect`, the
tiny model, 1F1B with 8 microbatches of 4 x 64 tokens, real mode. For each link: pplab
measures it on the lab (one-way time of a message of a quarter and of a whole activation:
latency and bandwidth), the simulator predicts the step from the per-stage compute costs of
the lab's own steps on the clean link (`costs_from_timeline`) plus that link, messages
queueing on it (`link_contention`), and the median of 5 measured steps (after a warm-up) is
compared.
Goal: within 10 % where the link sets the pace (the two slowest links).

Run (as root): python bench/bench_hosts.py   (about a minute)
Writes bench/results/hosts.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import pplab
from pplab.drivers.cluster.namespaces import NamespaceHosts
from pplab.planning.simulator import costs_from_timeline

RESULTS = Path(__file__).parent / "results" / "hosts.json"
CONFIG = pplab.LlamaConfig.tiny()
MICROBATCH_SIZE, SEQ_LEN, MICROBATCHES, STEPS = 4, 64, 8, 6
LINKS_NETEM = [("clean", {}), ("1 ms", dict(delay_ms=1, rate_mbit=100)),
               ("5 ms", dict(delay_ms=5, rate_mbit=100)),
               ("20 ms", dict(delay_ms=20, rate_mbit=100))]
LINKS_TBF = [("clean", {}), ("100 Mbit/s", dict(rate_mbit=100)), ("20 Mbit/s", dict(rate_mbit=20)),
             ("10 Mbit/s", dict(rate_mbit=10)), ("5 Mbit/s", dict(rate_mbit=5))]


def measure_link(nbytes_list):
    """On each rank: the one-way time of a message of each size (pplab's StageLink)."""
    from pplab.rank.profiler import hop_costs_on_rank
    from pplab.rank.rank_context import rank_context

    me = rank_context()
    return [hop_costs_on_rank(me.rank, me.world_size, nbytes, repeats=20) for nbytes in nbytes_list]


def main() -> None:
    why = NamespaceHosts.why_not()
    if why:
        sys.exit(f"bench_hosts: {why}")
    started = time.perf_counter()
    torch.set_num_threads(1)
    activation = MICROBATCH_SIZE * SEQ_LEN * CONFIG.hidden_size * 4
    batch = next(pplab.data.batches(MICROBATCH_SIZE * MICROBATCHES, SEQ_LEN))
    rows = {}
    with NamespaceHosts(n_hosts=2, engines_per_host=1) as hosts:
        lab = pplab.Lab.connect(**hosts.connect_options(), n_ranks=2, op_timeout=60, verbose=False)
        try:
            pipe = lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=MICROBATCHES)
            compute = costs_from_timeline([pipe.step(batch).timeline for _ in range(3)][-1], 2)
            links = LINKS_NETEM if hosts.has_netem() else LINKS_TBF
            for label, shaping in links:
                hosts.shape_link(**shaping)
                small, large = lab.run(measure_link, [activation // 4, activation])[0]
                bandwidth = (activation - activation // 4) / max(large["pplab"] - small["pplab"], 1e-9)
                latency = max(large["pplab"] - activation / bandwidth, 0.0)
                costs = dataclasses.replace(compute, latency=latency, bandwidth=bandwidth,
                                            activation_bytes=activation, link_contention=True)
                predicted = pplab.simulate(pipe.schedule, costs)
                steps = [pipe.step(batch).timeline for _ in range(STEPS)][1:]
                measured = statistics.median(t.step_time() for t in steps)
                bubble = statistics.median(t.bubble_fraction() for t in steps)
                rows[label] = dict(
                    latency_s=latency, bandwidth_bytes_per_s=bandwidth, measured_step_s=measured,
                    predicted_step_s=predicted.step_time(), error=measured / predicted.step_time() - 1,
                    measured_bubble=bubble, predicted_bubble=predicted.bubble_fraction())
                row = rows[label]
                print(f"{label:10s}: link {latency * 1e3:6.2f} ms + bytes / {bandwidth / 1e6:7.1f} MB/s; "
                      f"step measured {measured * 1e3:6.1f} ms, predicted "
                      f"{row['predicted_step_s'] * 1e3:6.1f} ms ({row['error']:+.1%}); bubble {bubble:.0%} "
                      f"vs {row['predicted_bubble']:.0%}")
            pipe.close()
        finally:
            lab.stop()
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__, "schedule": "1f1b",
              "microbatches": MICROBATCHES, "microbatch": [MICROBATCH_SIZE, SEQ_LEN], "rows": rows,
              "netem": hosts.has_netem(),
              "goal": "measured step within 10 % of the prediction where the link sets the "
                      "pace (the two slowest)",
              "met": all(abs(rows[label]["error"]) <= 0.10 for label, _ in links[-2:]),
              "seconds": round(time.perf_counter() - started, 1)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
