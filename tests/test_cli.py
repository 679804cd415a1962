"""The `pplab` command, run as a user would."""

import json
import subprocess
import sys


def test_demo_runs_every_schedule_checks_it_and_writes_pictures_and_traces(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "pplab", "demo", "--ranks", "2", "--microbatches", "2",
                           "--forward", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert f"{name}" in done.stdout
        assert (out / f"{name}.png").stat().st_size > 10_000
        trace = json.loads((out / f"{name}.trace.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert done.stdout.count("parity ok") == 4 and "FAILED" not in done.stdout


def test_cleanup_command_runs():
    done = subprocess.run([sys.executable, "-m", "pplab", "cleanup"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "pplab cleanup" in done.stdout


def test_demo_runs_under_torchrun_with_one_process_per_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "pplab", "demo", "--microbatches", "2", "--forward", "0.01",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 ranks started by torchrun" in done.stdout
    assert done.stdout.count("parity ok") == 4  # reported once, by rank 0
