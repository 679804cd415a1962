"""A Hugging Face Llama as pipeline stages vs pplab's own model of the same shape, side by side.

On 2 ranks (one `pplab.RankPool` of gloo processes), 1f1b with 8 microbatches of 4 x 64 tokens,
pplab's runtime, record=False, the same batch for both. Per config the session builds two
pipelines: pplab's `LlamaConfig` and `transformers.LlamaConfig` with the same sizes (sdpa
attention, RMSNorm eps, rope theta, no biases, untied head). A loop on the ranks warms both
up, then times them in interleaved rounds (the order reversed every other round); a step is
timed on every rank from a barrier to the step's return, and its time is the slowest rank's.

Goal: hf / pplab <= 1.05 (median of steps). Where slower, `why` in the JSON says where the
time goes, from one cProfile'd step of each on each rank.

Run: python bench/bench_hf.py [--rounds N] [--warmup 3] [--quick]   (about a minute)
Writes bench/results/hf.json.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import pplab
from measuring import load, top_functions
from pplab.data import batches
from pplab.session.on_rank import built_pipeline

RESULTS = Path(__file__).parent / "results" / "hf.json"
RANKS, MICROBATCHES, SCHEDULE = 2, 8, "1f1b"
MICROBATCH_SIZE, SEQ_LEN = 4, 64
GOAL = 1.05
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128),
    "larger": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=128),
}


def models(sizes: dict) -> dict:
    """pplab's model and the transformers Llama of the same shape."""
    common = dict(max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)
    return {"pplab": pplab.LlamaConfig(**sizes, **common),
            "hf": transformers.LlamaConfig(**sizes, **common, tie_word_embeddings=False,
                                           attention_bias=False, mlp_bias=False)}


def rank_main(pipeline_ids: dict, batch, warmup: int, rounds: int) -> dict:
    """On each rank: warm up, time interleaved rounds, then one cProfile'd step of each."""
    pipelines = {name: built_pipeline(pid) for name, pid in pipeline_ids.items()}
    shares = {name: pipeline.share(batch) for name, pipeline in pipelines.items()}
    names = list(pipelines)
    for _ in range(warmup):
        for name in names:
            dist.barrier()
            pipelines[name].step(shares[name])
    times = {name: [] for name in names}
    for round_index in range(rounds):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            dist.barrier()
            started = time.perf_counter()
            pipelines[name].step(shares[name])
            times[name].append(time.perf_counter() - started)
    profiles = {}
    for name in names:
        dist.barrier()
        profile = cProfile.Profile()
        profile.enable()
        pipelines[name].step(shares[name])
        profile.disable()
        profiles[name] = top_functions(profile)
    dist.barrier()
    return dict(times=times, profiles=profiles)


def measure(pool, sizes: dict, warmup: int, rounds: int) -> dict:
    batch = next(batches(MICROBATCH_SIZE * MICROBATCHES, SEQ_LEN, seed=0))
    pipes = {name: pool.pipeline(model, SCHEDULE, MICROBATCHES, record=False)
             for name, model in models(sizes).items()}
    try:
        parity = {name: pipe.check_parity(batch).passed for name, pipe in pipes.items()}
        per_rank = pool.run(rank_main, {name: pipe.pipeline_id for name, pipe in pipes.items()},
                            batch, warmup, rounds, timeout=900)
    finally:
        for pipe in pipes.values():
            pipe.close()
    steps = {name: [max(r["times"][name][i] for r in per_rank) for i in range(rounds)] for name in pipes}
    median = {name: statistics.median(values) for name, values in steps.items()}
    ratio = median["hf"] / median["pplab"]
    return dict(sizes=sizes, parity_passed=parity, rounds=rounds, warmup_rounds=warmup,
                median_step_s=median, min_step_s={name: min(v) for name, v in steps.items()},
                hf_over_pplab=dict(ratio=ratio,
                                   paired_round_ratio=statistics.median(
                                       h / p for h, p in zip(steps["hf"], steps["pplab"])),
                                   goal=f"<= {GOAL}", met=ratio <= GOAL),
                profiled_step_by_rank=[r["profiles"] for r in per_rank])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 rounds of the tiny size only")
    args = parser.parse_args()
    configs = {"tiny": SIZES["tiny"]} if args.quick else SIZES
    rounds = 5 if args.quick else args.rounds
    result = dict(benchmark="HF Llama stages vs pplab's own model, same shape, same schedule",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, transformers=transformers.__version__,
                  python=platform.python_version(), ranks=RANKS, schedule=SCHEDULE,
                  microbatches=MICROBATCHES, microbatch_size=MICROBATCH_SIZE, seq_len=SEQ_LEN,
                  runtime="pplab, record=False", load_before=load(), configs={})
    with pplab.RankPool(RANKS) as pool:
        for name, sizes in configs.items():
            started = time.perf_counter()
            row = measure(pool, sizes, args.warmup, rounds)
            row["wall_s"] = time.perf_counter() - started
            result["configs"][name] = row
            med = row["median_step_s"]
            print(f"[{name}] median step: pplab {med['pplab'] * 1000:.1f} ms, hf {med['hf'] * 1000:.1f} ms; "
                  f"hf/pplab = {row['hf_over_pplab']['ratio']:.3f} (paired "
                  f"{row['hf_over_pplab']['paired_round_ratio']:.3f}; goal <= {GOAL}: "
                  f"{'met' if row['hf_over_pplab']['met'] else 'NOT met'}); parity {row['parity_passed']}")
    result["load_after"] = load()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
