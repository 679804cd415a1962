"""What each mesh dimension costs per rank: memory held and bytes sent per step, measured vs predicted.

The same model (pplab's tiny LLaMA) on 4 CPU ranks (plain gloo processes, torch's schedules):

  pp4        mesh pp=4                (a pipeline alone: each rank holds a quarter of the model)
  pp2_dp2    mesh pp=2 x dp=2         (FSDP2: each rank holds half of a half)
  pp2_tp2    mesh pp=2 x tp=2         (tensor parallel blocks)
  pp2_dp2_reshard   pp=2 x dp=2, reshard_after_forward=True
  pp2_dp2_ac        pp=2 x dp=2, activation checkpointing

Per rank, measured after a step: the bytes of parameters, gradients and AdamW state it holds
(a real AdamW steps with lr=0 to allocate its state), against the prediction: fp32 parameters
and gradients and two fp32 moments, 4 x 4 bytes per parameter element this rank stores, where
FSDP stores torch.chunk(rows, dp)[dp rank] of each parameter and TP splits the blocks'
projections by rows (column-parallel) or columns (row-parallel).

Per rank, the bytes sent in a step in each dimension (`pplab.rank.mesh.communicated_bytes`: a
collective counts its full buffer) against the formulas:
  pp: m x activation bytes forward (all but the last stage) + m x the same backward (all but the first)
  dp: all-gathers per unit (`all_gathers_per_unit`) x the stage's parameter bytes + one
      reduce-scatter of the stage's fp32 gradients
  tp: m x blocks x (2 forward + 5 backward) all-reduces of one activation
And, for the trade of activation checkpointing, the peak activation bytes held and the median
step time with and without it (the two pipelines interleaved, step by step).

Run: python bench/bench_mesh.py [--steps 6]   (about a minute)
Writes bench/results/mesh.json.
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
from pplab.data import batches
from pplab.models.llama import LlamaModel
from pplab.models.partition import layer_ranges
from pplab.rank.mesh import Mesh, all_gathers_per_unit, communicated_bytes
from pplab.schedules import Schedule

RESULTS = Path(__file__).parent / "results" / "mesh.json"
CONFIG = pplab.LlamaConfig.tiny()
RANKS, MICROBATCHES, MICROBATCH_SIZE, SEQ_LEN = 4, 4, 2, 32
MESHES = {
    "pp4": Mesh(pp=4),
    "pp2_dp2": Mesh(pp=2, dp=2),
    "pp2_tp2": Mesh(pp=2, tp=2),
    "pp2_dp2_reshard": Mesh(pp=2, dp=2, reshard_after_forward=True),
    "pp2_dp2_ac": Mesh(pp=2, dp=2, activation_checkpointing=True),
}
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# forward: after attention, after the MLP; backward: one per column-parallel input
TP_ALL_REDUCES_PER_BLOCK = 2 + 5


def measure(pipes: dict[str, pplab.Pipeline], steps: int) -> dict:
    """Per mesh: its last step, the length of each step but the first (it also infers shapes), and
    what each rank holds after the last step."""
    data = {name: next(batches(MICROBATCH_SIZE * MICROBATCHES * pipe.mesh.dp, SEQ_LEN))
            for name, pipe in pipes.items()}
    last, times = {}, {name: [] for name in pipes}
    for _ in range(steps):  # interleaved: a machine that gets busier slows every mesh alike
        for name, pipe in pipes.items():
            last[name] = pipe.step(data[name])
            # The step's own length (first start to last end over the ranks, on the step clock), not
            # the gradient statistics gathered after it nor the call's trip to the ranks and back.
            times[name].append(last[name].timeline.step_time())
    return {name: dict(step=last[name], times=times[name][1:], memory=pipe.memory())
            for name, pipe in pipes.items()}


def stored_elements(name: str, shape: tuple[int, ...], mesh: Mesh, rank: int) -> int:
    """Elements of parameter `name` this rank stores: TP's split, then FSDP's chunk of dim 0."""
    where = mesh.coordinates(rank)
    shape = list(shape)
    module = name.split(".")[-2]
    if mesh.tp > 1 and module in COLUMN_PARALLEL:
        shape[0] //= mesh.tp
    elif mesh.tp > 1 and module in ROW_PARALLEL:
        shape[1] //= mesh.tp
    rows = torch.empty(shape[0], device="meta").chunk(mesh.dp)
    local_rows = rows[where["dp"]].numel() if where["dp"] < len(rows) else 0
    return local_rows * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)


def stage_parameters(mesh: Mesh, rank: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the parameters of the stage `rank` runs."""
    stage = mesh.coordinates(rank)["pp"]
    start, end = layer_ranges(CONFIG.num_hidden_layers, mesh.pp)[stage]
    with torch.device("meta"):
        module = LlamaModel(CONFIG, layers=range(start, end), embed=stage == 0, head=stage == mesh.pp - 1)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def predicted(mesh: Mesh, schedule: Schedule, rank: int) -> dict:
    parameters = stage_parameters(mesh, rank)
    stored = sum(stored_elements(name, shape, mesh, rank) for name, shape in parameters.items())
    whole_bytes = 4 * sum(int(torch.tensor(shape).prod()) for shape in parameters.values())
    stage = mesh.coordinates(rank)["pp"]
    activation = MICROBATCH_SIZE * SEQ_LEN * CONFIG.hidden_size * 4
    blocks = sum(name.endswith("input_layernorm.weight") for name in parameters)
    pp_bytes = MICROBATCHES * activation * ((stage < mesh.pp - 1) + (stage > 0))
    dp_bytes = 0
    if mesh.dp > 1:
        gathers = all_gathers_per_unit(schedule, stage, mesh.reshard_after_forward)
        dp_bytes = gathers * whole_bytes // mesh.tp + whole_bytes // mesh.tp  # gathers + one reduce-scatter
    tp_bytes = MICROBATCHES * blocks * TP_ALL_REDUCES_PER_BLOCK * activation if mesh.tp > 1 else 0
    return dict(memory=4 * 4 * stored, unsharded_memory=4 * whole_bytes,
                bytes=dict(pp=pp_bytes, dp=dp_bytes, tp=tp_bytes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    started = time.perf_counter()
    with pplab.RankPool(RANKS) as pool:
        pipes = {name: pool.pipeline(CONFIG, "1f1b", MICROBATCHES, impl="torch", mesh=mesh)
                 for name, mesh in MESHES.items()}
        measured = measure(pipes, args.steps)
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__, "ranks": RANKS,
              "microbatches": MICROBATCHES, "microbatch_size": MICROBATCH_SIZE, "seq_len": SEQ_LEN,
              "seconds": round(time.perf_counter() - started, 1), "meshes": {}}
    for name, mesh in MESHES.items():
        step, schedule = measured[name]["step"], pipes[name].schedule
        sent = communicated_bytes(step.rank_steps, schedule, mesh)
        ranks, memory = [], measured[name]["memory"]
        for rank in range(RANKS):
            expected = predicted(mesh, schedule, rank)
            ranks.append(dict(rank=rank, coordinates=mesh.coordinates(rank), memory=memory.held(rank),
                              predicted_memory=expected["memory"],
                              unsharded_memory=expected["unsharded_memory"],
                              bytes=sent[rank], predicted_bytes=expected["bytes"]))
        peak = max(step.timeline.peak_inflight_bytes(r) or 0 for r in range(RANKS))
        report["meshes"][name] = dict(mesh=str(mesh).splitlines()[0], ranks=ranks,
                                      median_step_s=statistics.median(measured[name]["times"]),
                                      peak_activation_bytes=peak)
    for name, entry in report["meshes"].items():
        print(f"{name}: {entry['mesh']}")
        for row in entry["ranks"]:
            memory_ok = row["memory"] == row["predicted_memory"]
            bytes_ok = row["bytes"] == row["predicted_bytes"]
            print(f"  rank {row['rank']}: holds {row['memory'] / 2**20:.3f} MiB (predicted "
                  f"{row['predicted_memory'] / 2**20:.3f}, {'equal' if memory_ok else 'DIFFERENT'}; "
                  f"unsharded {row['unsharded_memory'] / 2**20:.3f}), sends "
                  + ", ".join(f"{d} {row['bytes'][d] / 2**20:.3f}" for d in ("pp", "dp", "tp"))
                  + f" MiB ({'= formula' if bytes_ok else 'formula ' + str(row['predicted_bytes'])})")
        print(f"  median step {entry['median_step_s'] * 1000:.0f} ms, peak activations held "
              f"{entry['peak_activation_bytes'] / 2**20:.2f} MiB")
    base = report["meshes"]["pp4"]["ranks"]
    fsdp = report["meshes"]["pp2_dp2"]["ranks"]
    report["memory_ratio_pp2_dp2_vs_pp4"] = max(r["memory"] for r in fsdp) / max(r["memory"] for r in base)
    plain, ac = report["meshes"]["pp2_dp2"], report["meshes"]["pp2_dp2_ac"]
    report["activation_checkpointing"] = dict(
        peak_bytes_ratio=ac["peak_activation_bytes"] / plain["peak_activation_bytes"],
        step_time_ratio=ac["median_step_s"] / plain["median_step_s"])
    report["all_predictions_met"] = all(row["memory"] == row["predicted_memory"]
                                        and row["bytes"] == row["predicted_bytes"]
                                        for entry in report["meshes"].values() for row in entry["ranks"])
    print(f"largest rank memory, pp=2 x dp=2 vs pp=4: {report['memory_ratio_pp2_dp2_vs_pp4']:.2f}")
    print("activation checkpointing: peak activation bytes "
          f"x{report['activation_checkpointing']['peak_bytes_ratio']:.2f}, step time "
          f"x{report['activation_checkpointing']['step_time_ratio']:.2f}")
    print(f"every measured memory and byte count equals its prediction: {report['all_predictions_met']}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
