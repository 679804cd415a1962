"""A hung job read from torch's flight recorder: real hangs under torchrun (a rank that stops before a
collective its peer enters; torch's runtime on an order whose receive no rank sends to), each
rank's recorder written by `dump_on_hang` while it waits, and the report naming what it can."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pplab.cli import main
from pplab.trace import read_flight_recorder

HANGING = r'''
import datetime, sys, time
import torch, torch.distributed as dist
from pplab.trace.flight_recorder import dump_on_hang

mode, folder = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=8))
rank = dist.get_rank()
dump_on_hang(folder, after=4)  # the ranks still running 4 s from now write their recorder
t = torch.zeros(4)
dist.all_reduce(t)
dist.all_reduce(t)
if mode == "stops":  # rank 0 leaves before the third collective, which rank 1 enters
    if rank == 1:
        dist.all_reduce(t)
    else:
        time.sleep(6)
else:  # torch's runtime on an order where rank 0 never sends the activation rank 1 waits for
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    with open(f"{folder}.csv", "w") as file:
        file.write("0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
    stage = PipelineStage(torch.nn.Linear(4, 4), rank, 2, torch.device("cpu"))
    runtime = _PipelineScheduleRuntime([stage], 1, loss_fn=lambda out, target: out.sum())
    runtime._load_csv(f"{folder}.csv", format="compute_comms")
    runtime.step(*([torch.zeros(2, 4)] if rank == 0 else []), target=torch.zeros(2, 4) if rank else None)
'''


def hang(tmp_path, mode: str):
    """Run the hanging job on 2 ranks; the recorder's folder once torchrun gave up on it."""
    script, folder = tmp_path / "hang.py", tmp_path / mode
    script.write_text(HANGING)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script), mode, str(folder)], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"})
    assert done.returncode != 0, "the job was meant to hang until its timeout"
    return folder


def test_a_rank_that_stops_is_named_by_the_collective_it_never_entered(tmp_path, capsys):
    record = read_flight_recorder(hang(tmp_path, "stops"))
    assert record.backend == "gloo" and sorted(record.operations) == [0, 1]
    assert [op.said for op in record.pending(1)] == ["gloo:all_reduce (collective #3)"]
    assert record.pending(0) == [] and record.last_collective(0) == 2
    assert record.findings()[0] == ("rank 1 waits in gloo:all_reduce (collective #3); rank 0 never "
                                    "entered it (its last: collective #2)")
    assert main(["analyze", "--flight-recorder", str(tmp_path / "stops")]) == 0
    assert "rank 1 waits in gloo:all_reduce (collective #3)" in capsys.readouterr().out


def test_a_hang_in_sends_and_receives_says_what_gloo_cannot_record(tmp_path):
    record = read_flight_recorder(hang(tmp_path, "unsent"))
    assert all(record.pending(rank) == [] for rank in (0, 1))  # its two collectives done, no P2P kept
    findings = record.findings()
    assert findings[0] == "no rank has an operation pending in the recorder"
    assert findings[1].startswith("gloo records collectives only (torch 2.13)")
    assert "pplab doctor" in findings[1]


@pytest.mark.quick
def test_collectives_are_numbered_per_process_group(tmp_path):
    """A rank far ahead in one group is still named absent from another group's collective."""
    def entry(name, group, collective, retired):
        return {"profiling_name": name, "pg_id": group, "collective_seq_id": collective, "p2p_seq_id": 0,
                "is_p2p": False, "retired": retired, "state": "scheduled"}

    pp = [entry("nccl:all_reduce", 1, 1, True)]
    dp = [entry("nccl:all_reduce", 2, n, True) for n in range(1, 41)]
    (tmp_path / "rank0.json").write_text(json.dumps({"entries": pp + dp}))
    stuck = entry("nccl:all_reduce", 1, 2, False)
    (tmp_path / "rank1.json").write_text(json.dumps({"entries": pp + [stuck]}))
    record = read_flight_recorder(tmp_path)
    assert record.backend == "nccl"
    assert record.findings() == ["rank 1 waits in nccl:all_reduce (collective #2 of group 1); rank 0 never "
                                 "entered it (its last: collective #1)"]
    (tmp_path / "rank2.json").write_text("{}")
    with pytest.raises(ValueError, match=r"rank2.json: not a flight recorder dump"):
        read_flight_recorder(tmp_path)
