"""Training throughput on a mesh: pp4 vs pp2 x dp2 vs pp2 x tp2 on the same 4 ranks, same model, same
global batch, measured side by side; and the bytes each rank sends per step in each dimension.

One `pplab.RankPool` of 4 gloo processes; pplab's tiny LLaMA; a global batch of 16 sequences of
64 tokens cut into 8 microbatches in all (pp4: 8 microbatches through one pipeline; pp2 x dp2:
4 through each of two pipelines; pp2 x tp2: 8 through one pipeline of TP pairs); 1f1b on
torch's schedules for all three (a mesh with dp or tp needs them). Each configuration trains
`--steps` steps per round (AdamW, clipping, no evaluation, no checkpoint), the three in
interleaved rounds (the order reversed every other round); throughput is the global batch's
tokens over the round's wall time from the client, the median over rounds. The bytes are those
of one recorded step (`pplab.rank.mesh.communicated_bytes`: a collective counts its full buffer).

Run: python bench/bench_mesh_training.py [--rounds 5] [--steps 5]   (about two minutes)
Writes bench/results/mesh_training.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import pplab
from measuring import load
from pplab.data import batches
from pplab.rank.mesh import communicated_bytes

RESULTS = Path(__file__).parent / "results" / "mesh_training.json"
BATCH, SEQ_LEN, MICROBATCHES_IN_ALL = 16, 64, 8
MESHES = {"pp4": {"pp": 4}, "pp2_dp2": {"pp": 2, "dp": 2}, "pp2_tp2": {"pp": 2, "tp": 2}}
LIMITS = {
    "pp4": "4 ranks on 2 cores: compute is shared two ways; the pipeline's fill and drain "
           "(bubble (p-1)/(m+p-1) = 3/11) idles ranks, which here lends their core to a neighbour",
    "pp2_dp2": "half the pipeline depth (bubble 1/5 with m = 4 per replica), plus per step one "
               "all-gather of each block's weights and one reduce-scatter of its gradients over gloo",
    "pp2_tp2": "bubble 1/9 (m = 8), but 7 all-reduces of an activation per block per microbatch over "
               "gloo: many small collectives, each a few hundred microseconds of latency on CPU",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="training steps per configuration per round")
    args = parser.parse_args()
    config = pplab.LlamaConfig.tiny()
    tokens_per_step = BATCH * SEQ_LEN
    total = args.steps * (args.rounds + 1)  # the warm-up's steps, then each round's
    options = dict(batch_size=BATCH, seq_len=SEQ_LEN, eval_every=0, warmup=2, show=False)
    result = dict(benchmark="training throughput: pp4 vs pp2 x dp2 vs pp2 x tp2 on 4 ranks",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, python=platform.python_version(), ranks=4,
                  model="LlamaConfig.tiny()", global_batch=f"{BATCH} x {SEQ_LEN} tokens",
                  microbatches_in_all=MICROBATCHES_IN_ALL, schedule="1f1b (torch)",
                  steps_per_round=args.steps, rounds=args.rounds, load_before=load())
    with pplab.RankPool(4) as pool:
        pipes = {name: pool.pipeline(config, "1f1b", MICROBATCHES_IN_ALL // mesh.get("dp", 1), impl="torch",
                                     mesh=mesh)
                 for name, mesh in MESHES.items()}
        batch = next(batches(BATCH, SEQ_LEN, 0))
        sent = {}
        for name, pipe in pipes.items():
            step = pipe.step(batch)
            per_rank = communicated_bytes(step.rank_steps, pipe.schedule, pipe.mesh)
            sent[name] = {dim: [row[dim] for row in per_rank] for dim in ("pp", "dp", "tp")}
            # Warm-up: the optimizer's state, torch's shape inference. Every call has the same options
            # (the run's whole length) and goes on to a later `until`: each round trains `steps` new steps.
            history = pipe.train(total, until=args.steps, **options)
            assert len(history.losses) == args.steps
        throughput = {name: [] for name in pipes}
        for round_index in range(args.rounds):
            until = args.steps * (round_index + 2)
            for name in (list(pipes) if round_index % 2 == 0 else list(pipes)[::-1]):
                started = time.perf_counter()
                history = pipes[name].train(total, until=until, **options)
                seconds = time.perf_counter() - started
                assert len(history.losses) == args.steps, "a round must train its steps"
                throughput[name].append(tokens_per_step * args.steps / seconds)
        for pipe in pipes.values():
            pipe.close()
    median = {name: statistics.median(values) for name, values in throughput.items()}
    result.update(
        tokens_per_second_median=median, tokens_per_second=throughput,
        relative_to_pp4={name: value / median["pp4"] for name, value in median.items()},
        bytes_sent_per_step_by_rank=sent, what_limits_each=LIMITS, load_after=load())
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name in MESHES:
        kib = {dim: f"{max(values) / 1024:.0f}" for dim, values in sent[name].items()}
        print(f"{name:8s} {median[name]:8.0f} tokens/s ({result['relative_to_pp4'][name]:.2f} x pp4); "
              f"KiB sent per step by the busiest rank: pp {kib['pp']}, dp {kib['dp']}, tp {kib['tp']}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
