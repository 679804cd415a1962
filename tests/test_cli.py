"""The `pplab` command, run as a user would."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import pplab
from pplab import Timeline
from pplab.drivers.cluster import records
from pplab.planning.simulator import Costs, simulate
from pplab.schedules import build


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One `pplab demo` on 2 ranks, 3 microbatches, 2 steps per schedule: (its output, its folder).
    m=3 on 2 ranks: interleaved 1F1B has no textbook bubble (m is not a multiple of p), the
    other three have one, so the demo prints both kinds of line."""
    out = tmp_path_factory.mktemp("demo")
    done = subprocess.run([sys.executable, "-m", "pplab", "demo", "--n-ranks", "2", "--n-microbatches", "3",
                           "--steps", "2", "--forward", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, out


def test_demo_runs_every_schedule_checks_it_and_writes_pictures_and_traces(demo_run):
    done, out = demo_run
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert f"{name}" in done.stdout
        assert (out / f"{name}.png").stat().st_size > 10_000
        trace = json.loads((out / f"{name}.trace.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert done.stdout.count("parity ok") == 4 and "FAILED" not in done.stdout
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if "parity" in line}
    assert "(theory 25.0 %)" in lines["gpipe"]          # (p-1)/(m+p-1) with p=2, m=3
    assert "(theory n/a)" in lines["interleaved-1f1b"]
    assert "theory n/a: Megatron's formula needs n_microbatches a multiple of n_ranks" in done.stdout


def test_demo_runs_several_steps_and_writes_a_json_report(demo_run):
    done, out = demo_run
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    assert report["pplab_version"] == pplab.__version__ and report["torch_version"] == torch.__version__
    assert report["arguments"]["steps"] == 2 and report["arguments"]["n_ranks"] == 2
    names = [entry["name"] for entry in report["schedules"]]
    assert names == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
    for entry in report["schedules"]:
        assert entry["impl"] == "pplab" and entry["n_ranks"] == 2 and entry["n_microbatches"] == 3
        # No optimizer: the second step must repeat the first exactly, and both match one device.
        first, second = entry["losses"]
        assert first == second, entry["name"]
        assert abs(first - entry["parity"]["reference_loss"]) <= 1e-6 * abs(first)
        assert entry["parity"]["passed"] and len(entry["parity"]["max_abs_grad_diff_per_step"]) == 2
        assert entry["gradient_flow"]["passed"]
        assert 0 < entry["bubble_fraction"]["measured"] < 1
        assert len(entry["step_time_s_per_step"]) == 2 and entry["step_time_s"] > 0
        assert len(entry["peak_inflight"]["measured"]) == 2
        assert (out / entry["files"]["timeline"]).stat().st_size > 10_000
    by_name = {entry["name"]: entry for entry in report["schedules"]}
    assert by_name["gpipe"]["bubble_fraction"]["theory"] == pytest.approx(1 / 4)  # (p-1)/(m+p-1)
    assert by_name["gpipe"]["peak_inflight"]["measured"] == [3, 3]  # GPipe holds all m on every rank
    assert done.stdout.count("2 steps: losses all equal, gradients as the reference on every step") == 4


def test_demo_runs_torchs_schedules_with_impl_torch(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "pplab", "demo", "--n-ranks", "2", "--n-microbatches", "4",
                           "--forward", "0.01", "--impl", "torch", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch.distributed.pipelining" in done.stdout
    for name in ("torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b", "torch-zbv-zero-bubble"):
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    assert done.stdout.count("parity ok") == 4 and "FAILED" not in done.stdout


def refused(capsys, *argv: str) -> tuple[int, str, str]:
    """`pplab <argv>` called in this process, for arguments it refuses before doing anything:
    (exit code, stderr, stdout). The same `main` as the command; no interpreter to start.
    Refused before any rank started: the call leaves no new process behind it."""
    from pplab.cli import main

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    try:
        code = main(list(argv))
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    out, err = capsys.readouterr()
    started = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert not started, f"pplab {' '.join(argv)} started processes before refusing: {started}"
    return code, err, out


def run_simulate(*arguments: str) -> subprocess.CompletedProcess:
    """`pplab simulate ...` as a user types it."""
    return subprocess.run([sys.executable, "-m", "pplab", "simulate", *arguments],
                          capture_output=True, text=True, timeout=120)


def test_simulate_writes_the_predicted_timeline_trace_and_numbers(tmp_path):
    done = run_simulate("zb-h1", "--n-ranks", "4", "--n-microbatches", "8", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    expected = simulate(build("zb-h1", 4, 8), Costs(forward=1.0, backward=2.0))
    numbers = json.loads((tmp_path / "zb-h1.json").read_text())
    assert numbers["step_time"] == expected.step_time() == 27  # 8 * (F+I+W) + (p-1) * F
    assert numbers["bubble_fraction"] == pytest.approx(expected.bubble_fraction())
    assert numbers["theory"]["bubble_fraction"] == pytest.approx(1 / 9)
    assert numbers["peak_inflight"] == expected.peak_inflight_per_rank() == [4, 4, 4, 4]
    assert numbers["cost_per_stage"] == {"F": [1.0] * 4, "I": [1.0] * 4, "W": [1.0] * 4}
    assert (tmp_path / "zb-h1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "zb-h1.png").stat().st_size > 10_000
    traced = Timeline.from_chrome_trace(tmp_path / "zb-h1.trace.json")
    assert traced.step_time() == pytest.approx(27, rel=1e-6) and traced.n_ranks == 4
    assert "step time 27" in done.stdout and "(theory 11.1 %)" in done.stdout


def test_simulate_maps_weight_and_latency_onto_the_cost_model(tmp_path):
    done = run_simulate("zb-h1", "--n-ranks", "2", "--n-microbatches", "4", "--forward", "1,2",
                        "--weight-grad", "0.5", "--latency", "0.25", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    costs = Costs(forward=(1.0, 2.0), backward=(2.0, 4.0), weight_grad=0.5, latency=0.25)
    numbers = json.loads((tmp_path / "zb-h1.json").read_text())
    assert numbers["step_time"] == simulate(build("zb-h1", 2, 4), costs).step_time()
    assert numbers["cost_per_stage"] == {"F": [1.0, 2.0], "I": [1.5, 3.5], "W": [0.5, 0.5]}
    assert numbers["theory"]["bubble_fraction"] is None  # no closed form with a latency
    assert "theory n/a" in done.stdout


@pytest.mark.parametrize("arguments, message", [
    (("zb-h2", "--n-ranks", "4", "--n-microbatches", "8"),
     "unknown schedule 'zb-h2': known schedules are gpipe, 1f1b, interleaved-1f1b, zb-h1, looped-bfs"),
    (("1f1b", "--n-ranks", "0", "--n-microbatches", "8"), "argument --n-ranks: '0' is "
                                                          "not a whole number >= 1"),
    (("1f1b", "--n-ranks", "2", "--n-microbatches", "-3"), "argument --n-microbatches: '-3'"),
    (("interleaved-1f1b", "--n-ranks", "2", "--n-microbatches", "4", "--n-virtual", "1"),
     "--n-virtual 1: interleaved-1f1b runs 2 or more stages per rank"),
    (("1f1b", "--n-ranks", "2", "--n-microbatches", "4", "--weight-grad", "1"),
     "--weight-grad given, but 1f1b runs"),
    (("zb-h1", "--n-ranks", "2", "--n-microbatches", "4", "--weight-grad", "3"),
     "--weight-grad 3 exceeds the whole backward 2"),
    (("gpipe", "--n-ranks", "2", "--n-microbatches", "4", "--forward", "1,2,3"),
     "--forward has 3 values but gpipe on 2 ranks has 2 stages"),
])
def test_simulate_refuses_bad_arguments_with_one_clear_line(tmp_path, capsys, arguments, message):
    code, err, out = refused(capsys, "simulate", *arguments, "--out", str(tmp_path / "out"))
    assert code == 2, out + err
    assert f"pplab simulate: error: {message}" in err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "out").exists()  # nothing written for a command that failed



@pytest.mark.parametrize("arguments, message", [
    (("--steps", "0"), "argument --steps: '0' is not a whole number >= 1"),
    # the tiny model has 8 layers: refused before any rank starts
    (("--n-ranks", "9"), "n_stages=9 is more than n_layers=8"),
])
def test_demo_refuses_bad_arguments_with_one_clear_line(tmp_path, capsys, arguments, message):
    code, err, out = refused(capsys, "demo", *arguments, "--out", str(tmp_path / "out"))
    assert code == 2, out + err
    assert "pplab demo: error: " in err and message in err
    assert "Traceback" not in err and "starting" not in out
    assert not (tmp_path / "out").exists()


ORPHAN_KERNEL = (
    "import os, signal, pplab\n"
    "lab = pplab.Lab(n_ranks=2, device='cpu', verbose=False)\n"
    "print(lab.cluster_id, flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no lab.stop(): a killed kernel\n"
)


def run_train(*arguments: str, torchrun: bool = False, cwd=None) -> subprocess.CompletedProcess:
    """`pplab train ...` as a user types it: local ranks, or two ranks under torchrun."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
                if torchrun else [sys.executable])
    # A rank that dies of a signal prints its threads' Python stacks (torchrun reports only the signal).
    environment = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([*launcher, "-m", "pplab", "train", *arguments], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=environment)


def what_ranks_said(done: subprocess.CompletedProcess) -> str:
    """A failed run's stderr, the ranks' own lines first: torchrun's summary of a rank that died of a
    signal fills the tail and names only the signal."""
    said = done.stderr
    return said if len(said) <= 6000 else f"{said[:4000]}\n[...]\n{said[-2000:]}"


def reported_losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in json.loads(path.read_text())["records"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One `pplab train` of 6 steps on 2 local ranks, the held-out loss every 3 steps, a checkpoint
    every 3 (2 kept), every step's record in a report: (its output, its folder). Its checkpoints
    are copied by the tests that resume from them or damage them."""
    folder = tmp_path_factory.mktemp("train")
    done = run_train("--steps", "6", "--eval-every", "3", "--checkpoint-dir", str(folder / "run"),
                     "--checkpoint-every", "3", "--keep", "2", "--report", str(folder / "whole.json"))
    assert done.returncode == 0, what_ranks_said(done)
    return done, folder


def test_train_command_checkpoints_and_resumes_to_the_uninterrupted_losses(trained, tmp_path):
    import shutil

    whole, folder = trained
    assert "held-out loss 3: " in whole.stdout and "last checkpoint: " in whole.stdout
    assert sorted(path.name for path in (folder / "run").glob("step-*")) == ["step-00000003", "step-00000006"]
    run = shutil.copytree(folder / "run", tmp_path / "run")
    shutil.rmtree(run / "step-00000006")  # as if the run had stopped after step 3
    resumed = run_train("--steps", "6", "--checkpoint-dir", str(run), "--resume", "latest",
                        "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from latest" in resumed.stdout
    whole_losses = reported_losses(folder / "whole.json")
    resumed_losses = reported_losses(tmp_path / "resumed.json")
    assert sorted(resumed_losses) == [4, 5, 6]
    assert all(resumed_losses[step] == whole_losses[step] for step in resumed_losses)


def test_train_command_under_torchrun_is_the_same_run(trained, tmp_path):
    _, folder = trained
    launched = run_train("--steps", "6", "--eval-every", "3", "--report", str(tmp_path / "torchrun.json"),
                         torchrun=True)
    assert launched.returncode == 0, what_ranks_said(launched)
    assert "ranks started by torchrun" in launched.stdout
    assert reported_losses(tmp_path / "torchrun.json") == reported_losses(folder / "whole.json")


@pytest.mark.parametrize("arguments, message", [
    (["--batch-size", "6"], "batch_size=6 does not split into 4 microbatches"),
    (["--resume", "latest"], "resume='latest' needs checkpoint_dir"),
    (["--resume", "latest", "--checkpoint-dir", "nowhere"], "checkpoint 'nowhere' does not exist"),
    (["--resume", "latest", "--checkpoint-dir", "."], "no loadable checkpoint in '.'"),
    (["--resume", "step-00000003"], "checkpoint 'step-00000003' does not exist"),
    (["--schedule", "2f2b"], "2f2b"),
])
def test_train_command_refuses_bad_arguments_with_one_clear_line(tmp_path, capsys, monkeypatch, arguments,
                                                                 message):
    monkeypatch.chdir(tmp_path)  # relative checkpoint paths are the user's working directory's
    code, err, out = refused(capsys, "train", *arguments)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and not out


def test_train_command_reports_a_damaged_shard_as_one_line_per_rank(trained, tmp_path):
    import shutil

    run = shutil.copytree(trained[1] / "run", tmp_path / "run")
    shutil.rmtree(run / "step-00000003")  # the damaged checkpoint is the only one
    shard = run / "step-00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    done = run_train("--steps", "8", "--checkpoint-dir", str(run), "--resume", "latest")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("pplab train: error: rank 0 failed: CheckpointError: ") and len(lines) == 2
    assert all("__1_0.distcp is cut short (1000 bytes" in line for line in lines)


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
    orphans = records.with_descendants(record["processes"])
    # The fork server stops its engines, and itself, once it sees its kernel gone (a busy machine's
    # run got here after they had): what nothing but cleanup stops is the controller.
    left = {entry["role"] for entry in record["processes"] if records.find_process(entry) is not None}
    assert "controller" in left, (f"the lab's controller should outlive its killed kernel: "
                                  f"{left or 'nothing'} left")

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


KEEPING_KERNEL = (
    "import sys, pplab\n"
    "from pplab.drivers.cluster.kept import kept_now\n"
    "pplab.Lab(n_ranks=2, device='cpu', verbose=False).stop()  # keeps its controller and fork server\n"
    "print(kept_now().fork_server.pid, flush=True)\n"
    "sys.stdin.readline()  # a kernel between labs, until the test has run `pplab cleanup`\n"
    "lab = pplab.Lab(n_ranks=2, device='cpu', verbose=False)  # they are gone: a fresh start\n"
    "print(lab._launcher.reused or 'fresh', lab.run(lambda: 1), flush=True)\n"
    "lab.stop()\n"
)


@pytest.mark.timeout(180)
def test_cleanup_command_stops_what_a_running_kernel_keeps_for_its_next_lab(own_ipython_dir):
    env = {**os.environ, "IPYTHONDIR": own_ipython_dir}
    kernel = subprocess.Popen([sys.executable, "-c", KEEPING_KERNEL], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        server = psutil.Process(int(kernel.stdout.readline()))
        profile_dir = os.path.join(own_ipython_dir, f"profile_{records.PROFILE_NAME}")
        [record] = records.read_records(profile_dir)
        assert record["kept"] and server.pid in {entry["pid"] for entry in record["processes"]}
        kept = records.with_descendants(record["processes"])
        done = subprocess.run([sys.executable, "-m", "pplab", "cleanup"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (f"stopped the kept controller and fork server {record['cluster_id']} of a running kernel"
                in done.stdout)
        assert alive(kept) == []
        kernel.stdin.write("\n")
        kernel.stdin.flush()
        out, err = kernel.communicate(timeout=120)
        assert kernel.returncode == 0, err
        assert out.strip() == "fresh [1, 1]"
    finally:
        kernel.kill()
        kernel.wait()


def test_demo_runs_under_torchrun_with_one_process_per_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2",
                           "-m", "pplab", "demo", "--n-microbatches", "2", "--forward", "0.01",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert done.returncode == 0, done.stdout + what_ranks_said(done)
    assert "on 2 ranks started by torchrun" in done.stdout
    assert done.stdout.count("parity ok") == 4  # reported once, by rank 0
