"""Schedules as torch's CSV: written from any pplab schedule, read back equal, refused with the
action and the reason, and run by torch's own runtime (`_PipelineScheduleRuntime._load_csv`) in
a torchrun script with no pplab code on the ranks, its gradients those of one device; in both
formats, compute-only and compute+comms, and what torch lowers a schedule to, read back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pplab.planning.search import search
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build,
    check_torch_runs,
    from_text,
    from_torch,
    lowered_by_torch,
    validate,
)
from pplab.schedules.torch_csv import _stand_in_runtime


def searched(n_ranks: int, n_microbatches: int, costs: Costs) -> Schedule:
    return search(n_ranks, n_microbatches, costs, show=False, improve_seconds=0).schedule


SCHEDULES = {
    "1f1b": lambda: build("1f1b", 2, 4),
    "zb-h1": lambda: build("zb-h1", 4, 8),
    "interleaved-1f1b": lambda: build("interleaved-1f1b", 2, 4, 2),
    "zbv-zero-bubble (torch's plan, a V)": lambda: from_torch("zbv-zero-bubble", 2, 4, 2),
    "dualpipev (torch's plan, overlapped F and B)": lambda: from_torch("dualpipev", 2, 4, 2),
    "searched, uneven stages": lambda: searched(3, 6, Costs(forward=(1, 1, 2), input_grad=(1, 1, 2),
                                                            weight_grad=(1, 1, 2))),
    "by hand": lambda: from_text(["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]),
}


@pytest.mark.quick
@pytest.mark.parametrize("made", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_any_schedule_is_written_as_torchs_csv_and_read_back_equal(tmp_path, made):
    schedule = made()
    path = schedule.to_torch_csv(tmp_path / "schedule.csv")
    rows = path.read_text().splitlines()
    assert len(rows) == schedule.n_ranks
    assert [row.split(",") for row in rows] == [[str(a) for a in acts if a.is_compute]
                                                for acts in schedule.actions]
    again = Schedule.from_torch_csv(path, name=schedule.name)
    assert again.compute_only() == schedule.compute_only()  # torch's plans keep torch's own messages
    if schedule.name not in ("zbv-zero-bubble", "dualpipev"):
        assert again == schedule  # pplab's messages: the same rule both ways
    assert Schedule.from_torch_csv(path).name == "schedule"  # the file's stem by default
    check_torch_runs(schedule)  # torch validates and lowers it, as on the ranks


@pytest.mark.quick
def test_what_torchs_csv_cannot_hold_is_refused_naming_the_cell_and_why(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0\n")
    with pytest.raises(ScheduleError, match=r"bad.csv, row 1 \(rank 0\), cell 2: '0SEND_F0' is a "
                                            r"send or receive; .* F, B, I and W only \(torch adds "
                                            r"the messages itself\)"):
        Schedule.from_torch_csv(path)
    path.write_text("0UNSHARD,0F0,0B0,0RESHARD\n1F0,1B0\n")
    with pytest.raises(ScheduleError, match=r"cell 1: '0UNSHARD' is one of torch's own actions \(FSDP"):
        Schedule.from_torch_csv(path)
    path.write_text("0F0,0X0\n1F0,1B0\n")
    with pytest.raises(ScheduleError, match=r"cell 2: cannot read action '0X0'"):
        Schedule.from_torch_csv(path)
    # A schedule that breaks a dependency is not written: the validator names the action.
    backward_first = from_text(["0F0 0B0", "1B0 1F0"])
    with pytest.raises(ScheduleError, match=r"1B0"):
        backward_first.to_torch_csv(tmp_path / "never.csv")
    assert not (tmp_path / "never.csv").exists()


LOWERED = {"1f1b": (2, 4, 1), "interleaved-1f1b": (4, 8, 2), "zb-h1": (4, 8, 1), "gpipe": (2, 4, 1)}


@pytest.mark.quick
@pytest.mark.parametrize("name", LOWERED)
@pytest.mark.parametrize("defer", [False, True], ids=["early receives", "deferred receives"])
def test_what_torch_lowers_a_schedule_to_is_read_valid_and_round_trips_through_both(name, defer, tmp_path):
    schedule = build(name, *LOWERED[name])
    lowered = lowered_by_torch(schedule, defer_pp_recv=defer)
    validate(lowered)
    assert lowered.compute_only().actions == schedule.compute_only().actions  # torch keeps the order
    assert lowered.has_communication and lowered.stage_actions is not None
    for rank, extra in enumerate(lowered.stage_actions):  # every stage of the rank: gathered, freed
        texts = [text for _, text in extra]
        for stage in schedule.stages_of(rank):
            assert {f"{stage}UNSHARD", f"{stage}RESHARD", f"{stage}REDUCE_GRAD"} <= set(texts)
    path = lowered.to_torch_csv(tmp_path / "lowered.csv", format="compute_comms")
    assert Schedule.from_torch_csv(path, lowered.name, format="compute_comms") == lowered
    runtime = _stand_in_runtime(schedule)  # torch reads pplab's file as the one it wrote
    runtime._load_csv(str(path), format="compute_comms")
    runtime._dump_csv(str(tmp_path / "again.csv"), format="compute_comms")
    assert (tmp_path / "again.csv").read_text() == path.read_text()


@pytest.mark.quick
def test_torchs_early_receives_cost_an_interleaved_step_that_deferred_ones_do_not():
    """In pplab's model of a message (a rank's receive holds it until the message arrives), torch's
    lowering of interleaved-1F1B, each receive posted as early as it can be, stalls the pipeline
    behind receives that wait (the cascade of pytorch issue 172668); deferred, it runs as fast as
    the compute order allows."""
    schedule = build("interleaved-1f1b", 4, 8, 2)
    costs = Costs(latency=0.1)
    bound = simulate(schedule.compute_only(), costs).step_time()
    early = simulate(lowered_by_torch(schedule), costs).step_time()
    deferred = simulate(lowered_by_torch(schedule, defer_pp_recv=True), costs).step_time()
    assert early > 1.5 * bound and deferred == pytest.approx(bound), (bound, early, deferred)


@pytest.mark.quick
def test_a_format_torch_does_not_have_is_refused_and_a_compute_comms_file_holds_its_messages(tmp_path):
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"format='comms': give one of 'compute_only', 'compute_comms'"):
        schedule.to_torch_csv(tmp_path / "x.csv", format="comms")
    path = schedule.to_torch_csv(tmp_path / "own.csv", format="compute_comms")  # pplab's own order
    read = Schedule.from_torch_csv(path, format="compute_comms")
    assert read.actions == schedule.actions and read.has_communication
    assert read.stage_actions == (((0, "0UNSHARD"), (16, "0REDUCE_GRAD"), (16, "0RESHARD")),
                                  ((0, "1UNSHARD"), (16, "1REDUCE_GRAD"), (16, "1RESHARD")))
    path.write_text("0F0,(0F1;0B0)OVERLAP_F_B\n1F0,1B0\n")
    with pytest.raises(ScheduleError, match=r"cell 2: '\(0F1;0B0\)OVERLAP_F_B' is one of torch's actions "
                                            r"pplab does not model"):
        Schedule.from_torch_csv(path, format="compute_comms")


# Plain torch on the ranks: a stack of Linear + Tanh blocks, one per stage, in float64; each rank
# reads its stages off its own row of the CSV; torch's runtime loads the file and runs it; rank 0
# gathers every stage's gradients and compares them with one device's.
TORCHRUN_SCRIPT = r'''
import csv, json, re, sys
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
WIDTH, BATCH, N_MICROBATCHES = 8, 8, 4


def block(index):
    torch.manual_seed(index)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


torch.manual_seed(1234)
inputs, targets = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
results = {}
for path in sys.argv[2:]:
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    n_stages = 1 + max(int(re.match(r"\d+", cell).group()) for row in rows for cell in row if cell)
    mine = sorted({int(re.match(r"\d+", cell).group()) for cell in rows[rank] if cell})
    modules = {index: block(index) for index in mine}
    stages = [PipelineStage(modules[index], index, n_stages, torch.device("cpu")) for index in mine]
    runtime = _PipelineScheduleRuntime(stages, N_MICROBATCHES, loss_fn=loss_fn, scale_grads=True)
    runtime._load_csv(path, format="compute_comms" if path.endswith(".comms.csv") else "compute_only")
    losses = []
    first, last = 0 in mine, n_stages - 1 in mine
    runtime.step(*([inputs] if first else []), target=targets if last else None,
                 losses=losses if last else None)
    grads = {f"{index}.{name}": p.grad.tolist() for index, module in modules.items()
             for name, p in module.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    if rank == 0:
        whole = torch.nn.Sequential(*[block(index) for index in range(n_stages)])
        reference = sum(loss_fn(whole(x), y) for x, y in zip(inputs.chunk(N_MICROBATCHES),
                                                            targets.chunk(N_MICROBATCHES))) / N_MICROBATCHES
        reference.backward()
        expected = {f"{index}.{name}": p.grad for index in range(n_stages)
                    for name, p in whole[index].named_parameters()}
        got = {name: torch.tensor(value) for part in gathered for name, value in part.items()}
        results[path] = {"stages": n_stages, "same_names": sorted(got) == sorted(expected),
                         "max_difference": max(float((got[name] - expected[name]).abs().max())
                                               for name in expected)}
if rank == 0:
    with open(out, "w") as file:
        json.dump(results, file)
dist.destroy_process_group()
'''


def test_torchs_runtime_runs_pplabs_schedules_from_the_csv_exact_against_one_device(tmp_path):
    found = searched(2, 4, Costs(forward=(1, 3), input_grad=(1, 3), weight_grad=(1, 3)))
    shaped_v = from_torch("zbv-zero-bubble", 2, 4, 2)
    by_hand = from_text(["0F0 0F1 0I0 0I1 0W1 0W0 0F2 0F3 0I2 0W2 0I3 0W3",
                         "1F0 1I0 1F1 1I1 1W0 1W1 1F2 1I2 1F3 1I3 1W2 1W3"])
    paths = [schedule.to_torch_csv(tmp_path / f"{label}.csv")
             for label, schedule in (("searched", found), ("v", shaped_v), ("by-hand", by_hand))]
    # and as compute+comms: the doctor's fix for interleaved-1F1B on NCCL (its messages in the order they
    # move), and pplab's own order of messages
    import pplab

    fix = pplab.doctor(build("interleaved-1f1b", 2, 4, 2), Costs(latency=0.5))
    assert fix.fix.name.endswith("its messages in the order they move")
    paths += [fix.write_fix(tmp_path / "doctors-fix.comms.csv"),
              build("1f1b", 2, 4).to_torch_csv(tmp_path / "pplabs-order.comms.csv", format="compute_comms")]
    script, out = tmp_path / "run_csv.py", tmp_path / "results.json"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2",
                           str(script), str(out), *map(str, paths)], capture_output=True, text=True,
                           timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [results[str(path)]["stages"] for path in paths] == [2, 4, 2, 4, 2]
    for path in paths:
        assert results[str(path)]["same_names"], results
        assert results[str(path)]["max_difference"] < 1e-12, (path.name, results[str(path)])


@pytest.mark.quick
def test_the_command_line_searches_writes_the_csv_and_simulates_it(tmp_path, capsys):
    from pplab.cli import main

    csv_path, out = tmp_path / "found.csv", tmp_path / "simulated"
    costs = ["--forward", "1", "--weight-grad", "1", "--latency", "1.5"]
    assert main(["search", "--n-ranks", "4", "--n-microbatches", "8", *costs, "--memory-limit", "4",
                 "--csv", str(csv_path), "--quiet"]) == 0
    said = capsys.readouterr().out
    # (how far it improved: the machine's pace)
    name, step = re.search(r"found (.+?): step ([\d.]+)", said).groups()
    assert f"wrote {csv_path}: torch's compute-only CSV of {name!r}" in said
    assert main(["simulate", str(csv_path), *costs, "--out", str(out)]) == 0
    numbers = json.loads((out / "found.json").read_text())
    # printed to 4 digits: the schedule found
    assert numbers["step_time"] == pytest.approx(float(step), rel=5e-4)
    assert (numbers["n_ranks"], numbers["n_microbatches"]) == (4, 8)
    # Sizes come from the file: a flag that disagrees is refused, and a named schedule needs them.
    assert main(["simulate", str(csv_path), "--n-ranks", "2", "--out", str(out)]) == 2
    assert "--n-ranks 2, but" in capsys.readouterr().err
    assert main(["simulate", "zb-h1", "--out", str(out)]) == 2
    assert "--n-ranks is needed for a named schedule (zb-h1)" in capsys.readouterr().err


def test_a_lab_runs_a_searched_schedule_on_torchs_runtime_exactly(lab2):
    import pplab

    config = pplab.LlamaConfig.tiny()
    found = search(2, 4, Costs(forward=(1, 2), input_grad=(1, 2), weight_grad=(1, 2), latency=1), show=False,
                   improve_seconds=0)
    listed = next(c.schedule for c in found.tried if c.schedule is not None and c.name.startswith("list I+W"))
    pipe = lab2.pipeline(config, schedule=listed, impl="torch")
    try:
        assert repr(pipe).startswith(f"<Pipeline {listed.name} on torch's runtime: 2 ranks")
        parity = pipe.check_parity()
        assert parity.passed and parity.max_abs_diff == 0.0, str(parity)
        order = [[str(Action(e.stage, Kind(e.kind), e.microbatch)) for e in sorted(
            pipe.last.timeline.of_rank(rank), key=lambda e: e.start) if e.is_compute] for rank in range(2)]
        # torch ran this order
        assert order == [[str(a) for a in acts if a.is_compute] for acts in listed.actions]
    finally:
        pipe.close()


def test_a_csv_file_names_the_schedule_and_torch_runs_a_lowered_one_as_written(lab2, tmp_path):
    """`schedule="FILE.csv"` (also `pplab train --schedule FILE.csv`): a file with its messages runs
    on torch's runtime in its own order, exactly."""
    import pplab

    lowered = lowered_by_torch(build("interleaved-1f1b", 2, 4, 2), defer_pp_recv=True)
    path = lowered.to_torch_csv(tmp_path / "lowered.csv", format="compute_comms")
    pipe = lab2.pipeline(pplab.LlamaConfig.tiny(), schedule=str(path), impl="torch")
    try:
        assert pipe.schedule.stage_actions == lowered.stage_actions
        parity = pipe.check_parity()
        assert parity.passed and parity.max_abs_diff == 0.0, str(parity)
    finally:
        pipe.close()
    with pytest.raises(ScheduleError, match=r"no such file \(a schedule ending in .csv is read as torch's"):
        lab2.pipeline(pplab.LlamaConfig.tiny(), schedule=str(tmp_path / "nowhere.csv"), impl="torch")


@pytest.mark.quick
def test_the_doctor_names_the_cascade_a_job_torch_refuses_and_a_deadlocking_order(tmp_path, capsys):
    import pplab
    from pplab.cli import main

    interleaved, costs = build("interleaved-1f1b", 4, 8, 2), Costs(latency=0.1)
    # torch 2.13 on NCCL, a stream per pair of ranks: its early receives hold only sends to the same peer.
    on_pairs = pplab.doctor(interleaved, costs)
    assert on_pairs.runs and on_pairs.step == pytest.approx(on_pairs.bound) and on_pairs.fix is None
    # Every message of a rank on one stream: the cascade, and an order of the messages without it.
    coalesced = pplab.doctor(interleaved, costs, transport="nccl-coalesced")
    assert coalesced.step > 1.2 * coalesced.bound and coalesced.stalls
    assert coalesced.stalls[0].seconds == max(stall.seconds for stall in coalesced.stalls)
    assert coalesced.fix.name.endswith("its messages in the order they move")
    assert coalesced.fix_step == pytest.approx(coalesced.bound)
    # Large messages wait for their receives: torch's deferred receives deadlock there, never offered.
    assert coalesced.tried["interleaved-1f1b, as torch lowers it (deferred receives)"] is None
    # pplab's runtime, where a rank waits at each receive (as measured): the early receives cost most.
    on_pplab = pplab.doctor(interleaved, costs, transport="pplab")
    assert on_pplab.step > 1.5 * on_pplab.bound and "RECV" in on_pplab.stalls[0].waits_at
    assert on_pplab.fix_step == pytest.approx(on_pplab.bound)
    on_gloo = pplab.doctor(interleaved, costs, transport="gloo")  # messages in no order: no stall
    assert on_gloo.step == pytest.approx(on_gloo.bound) and not on_gloo.stalls and on_gloo.fix is None
    with pytest.raises(ValueError, match=r"transport='mpi': give one of 'nccl', 'nccl-coalesced', 'gloo'"):
        pplab.doctor(build("1f1b", 2, 4), transport="mpi")
    assert main(["doctor", "interleaved-1f1b", "--n-ranks", "4", "--n-microbatches", "8", "--latency", "0.1",
                 "--transport", "nccl-coalesced", "--out", str(tmp_path / "cascade")]) == 0
    fix = tmp_path / "cascade" / "fix.csv"
    runtime = _stand_in_runtime(interleaved)  # torch reads the fix as written
    runtime._load_csv(str(fix), format="compute_comms")
    report = json.loads((tmp_path / "cascade" / "report.json").read_text())
    assert report["fix"]["step"] == pytest.approx(coalesced.bound) and report["transport"] == "nccl-coalesced"
    # A torchtitan job's schedule, as torchtitan names it, at its sizes.
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\npipeline_parallel_degree = 4\n'
                   'pipeline_parallel_schedule = "Interleaved1F1B"\n[training]\nlocal_batch_size = 8\n')
    assert main(["doctor", "--torchtitan-config", str(job), "--out", str(tmp_path / "job")]) == 0
    assert "doctor: interleaved-1f1b on 4 ranks, 8 stages, 8 microbatches" in capsys.readouterr().out
    # Fewer microbatches than stages: torch's 1F1B refuses them, before anything starts.
    assert main(["doctor", "1f1b", "--n-ranks", "4", "--n-microbatches", "2"]) == 1
    assert "Number of microbatches (2) must be greater than or equal to the number of stages (4)" in \
        capsys.readouterr().out
    # An order written by hand that deadlocks: the ranks and what each waits for.
    dead = tmp_path / "dead.csv"
    dead.write_text("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
    assert main(["doctor", str(dead), "--out", str(tmp_path / "dead")]) == 1
    said = capsys.readouterr().out
    assert "torch's order deadlocks: schedule 'dead' deadlocks on one stream per pair of ranks" in said
    assert "rank 0's 0RECV_B0 waits for rank 1 to reach 1SEND_B0" in said
    assert "rank 0's 0SEND_F0 is queued behind 0RECV_B0 on its stream" in said
    # gloo's messages wait in no order: the same file runs there (as torch's runtime ran it on gloo).
    assert main(["doctor", str(dead), "--transport", "gloo", "--out", str(tmp_path / "dead")]) == 0
