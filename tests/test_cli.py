"""The `pplab` command, run as a user would."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pplab.cluster import records


def test_demo_runs_every_schedule_checks_it_and_writes_pictures_and_traces(tmp_path):
    # m=3 on 2 ranks: interleaved 1F1B has no textbook bubble (m is not a multiple of p),
    # the other three have one; the demo prints both kinds of line.
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "pplab", "demo", "--ranks", "2", "--microbatches", "3",
                           "--forward", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert f"{name}" in done.stdout
        assert (out / f"{name}.png").stat().st_size > 10_000
        trace = json.loads((out / f"{name}.trace.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert done.stdout.count("parity ok") == 4 and "FAILED" not in done.stdout
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if "parity" in line}
    assert "(theory 0.250)" in lines["gpipe"]          # (p-1)/(m+p-1) with p=2, m=3
    assert "(theory n/a)" in lines["interleaved-1f1b"]
    assert "theory n/a: Megatron's formula needs n_microbatches a multiple of n_ranks" in done.stdout


def test_demo_runs_torchs_schedules_with_impl_torch(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "pplab", "demo", "--ranks", "2", "--microbatches", "4",
                           "--forward", "0.01", "--impl", "torch", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch.distributed.pipelining" in done.stdout
    for name in ("torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b", "torch-ZBVZeroBubble"):
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    assert done.stdout.count("parity ok") == 4 and "FAILED" not in done.stdout


ORPHAN_KERNEL = (
    "import os, signal, pplab\n"
    "lab = pplab.Lab(ranks=2, device='cpu', verbose=False)\n"
    "print(lab.cluster_id, flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no lab.stop(): a killed kernel\n"
)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has exited)."""
    _, still = psutil.wait_procs(processes, timeout=10)
    running = []
    for process in still:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.fixture
def own_ipython_dir(ipython_dir):
    """An IPYTHONDIR of this test only (inside the session's, so its leak check covers it too);
    afterwards every lab process started under it is killed, whatever the test did."""
    from conftest import lab_processes

    path = str(Path(ipython_dir) / "cli-cleanup")
    os.makedirs(path, exist_ok=True)
    yield path
    records.cleanup(os.path.join(path, f"profile_{records.PROFILE_NAME}"), force=True, verbose=False)
    for process in lab_processes(path):
        process.kill()


@pytest.mark.timeout(180)
def test_cleanup_command_stops_the_lab_a_killed_kernel_left(own_ipython_dir):
    env = {**os.environ, "IPYTHONDIR": own_ipython_dir}
    kernel = subprocess.run([sys.executable, "-c", ORPHAN_KERNEL], capture_output=True, text=True,
                            timeout=120, env=env)
    assert kernel.returncode == -signal.SIGKILL, kernel.stderr
    cluster_id = kernel.stdout.strip()
    profile_dir = os.path.join(own_ipython_dir, f"profile_{records.PROFILE_NAME}")
    [record] = records.read_records(profile_dir)
    assert record["cluster_id"] == cluster_id
    orphans = records.with_descendants(record["processes"])  # controller, fork server, ranks
    assert len(orphans) >= 4, "the lab should still be running after its kernel was killed"

    done = subprocess.run([sys.executable, "-m", "pplab", "cleanup"], capture_output=True, text=True,
                          timeout=60, env=env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"stopped lab {cluster_id} of a kernel that is gone" in done.stdout
    assert "pplab cleanup: 1 lab(s) stopped" in done.stdout
    assert alive(orphans) == [], "a process of the orphaned lab outlived `pplab cleanup`"
    assert records.read_records(profile_dir) == []
    again = subprocess.run([sys.executable, "-m", "pplab", "cleanup"], capture_output=True, text=True,
                           timeout=60, env=env)
    assert again.returncode == 0 and "pplab cleanup: nothing to stop" in again.stdout


def test_demo_runs_under_torchrun_with_one_process_per_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "pplab", "demo", "--microbatches", "2", "--forward", "0.01",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 ranks started by torchrun" in done.stdout
    assert done.stdout.count("parity ok") == 4  # reported once, by rank 0
