"""A crowded room: a workshop server's attendees, each with a lab of their own, on busy cores.

Three attendees' kernels (Python processes), each with a 2-rank lab, beside two CPU burners on
2 cores: every lab checks gpipe, 1F1B and ZB-H1 against one device with their gradient flow,
explains three timing-mode steps whose stage 1 is four times slower (the straggler named each
time), and trains 20 steps; then they go home one by one. No two labs share a cluster, a port
or a file; stopping one leaves the others working; `pplab cleanup` stops only the lab whose
kernel is gone; nothing is left running.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import lab_processes
from pplab.drivers.cluster import records

ATTENDEE = """
import json, sys, time
from pathlib import Path
import pplab
from pplab.course.drill import SLOW_STAGE

seat, folder = sys.argv[1], Path(sys.argv[2])


def say(name, text):  # whole or not at all: the test may read at any moment
    (folder / f"{name}.tmp").write_text(text)
    (folder / f"{name}.tmp").replace(folder / name)


config = pplab.LlamaConfig.tiny()
lab = pplab.Lab(n_ranks=2, device="cpu", verbose=False)
checked = {}
for name in ("gpipe", "1f1b", "zb-h1"):
    pipe = lab.pipeline(config, schedule=name, n_microbatches=4)
    checked[name] = [pipe.check_parity().passed, pipe.check_gradient_flow().passed]
    pipe.close()
slow = lab.pipeline(config, "1f1b", n_microbatches=4,
                    timing=pplab.Costs(**SLOW_STAGE))  # the drill's: stage 1 four times slower
steps = [slow.step().timeline for _ in range(3)]  # each explained with the others as evidence
reports = [pplab.planning.bubble.explain(step, slow.schedule,
                                         steps=[other for other in steps if other is not step])
           for step in steps]
stragglers = [report.straggler for report in reports]
verdicts = [report.verdict.text() for report in reports]  # the evidence, should a verdict be wrong
slow.close()
pipe = lab.pipeline(config, schedule="1f1b", n_microbatches=4)
losses = pipe.train(steps=20, batch_size=8, seq_len=32, warmup=2, eval_every=100, show=False).losses
files = Path(lab.profile_dir, "security").glob(f"ipcontroller-{lab.cluster_id}-*.json")
ports = sorted({port for path in files for value in json.loads(path.read_text()).values()
                for port in (value if isinstance(value, list) else [value])
                if isinstance(port, int) and not isinstance(port, bool)})
say(f"{seat}.ready", json.dumps({"cluster_id": lab.cluster_id, "ports": ports, "checked": checked,
                                 "stragglers": stragglers, "verdicts": verdicts, "losses": losses}))
while True:
    order = folder / f"{seat}.order"
    if order.exists():
        if order.read_text() == "stop":
            lab.stop()
            break
        order.unlink()
        passed = lab.pipeline(config, schedule="1f1b", n_microbatches=4).check_parity().passed
        say(f"{seat}.again", str(passed))
    time.sleep(0.1)
"""


def wait_for(path: Path, seconds: float, attendees) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists():
        failed = [a for a in attendees if a.poll() not in (None, 0)]
        assert not failed, failed[0].stderr.read() if failed[0].stderr else failed
        assert time.monotonic() < deadline, f"{path.name} did not appear in {seconds} s"
        time.sleep(0.1)
    return path.read_text()


def order(folder: Path, seat: str, what: str) -> None:
    (folder / f"{seat}.tmp").write_text(what)
    (folder / f"{seat}.tmp").replace(folder / f"{seat}.order")


def cleanup(env) -> str:
    done = subprocess.run([sys.executable, "-m", "pplab", "cleanup"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(600)
def test_three_attendees_labs_work_beside_two_burners_and_stop_alone(tmp_path, ipython_dir):
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")}  # the server's one user
    script = tmp_path / "attendee.py"
    script.write_text(ATTENDEE)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    attendees = {seat: subprocess.Popen([sys.executable, str(script), seat, str(tmp_path)], env=env,
                                        stderr=subprocess.PIPE, text=True)
                 for seat in ("ada", "bob", "cy")}
    try:
        started = {seat: json.loads(wait_for(tmp_path / f"{seat}.ready", 500, attendees.values()))
                   for seat in attendees}
        for burner in burners:  # the lessons' work is done: the rest is about stopping
            burner.kill()
        for seat, lab in started.items():
            assert lab["checked"] == {name: [True, True] for name in ("gpipe", "1f1b", "zb-h1")}, (seat, lab)
            assert lab["stragglers"] == [1, 1, 1], (seat, lab["verdicts"])
            losses = lab["losses"]
            assert len(losses) == 20 and all(loss == loss
                                             for loss in losses) and losses[-1] < losses[0], losses
        # Three labs, no cluster and no port shared.
        assert len({lab["cluster_id"] for lab in started.values()}) == 3
        ports = [port for lab in started.values() for port in lab["ports"]]
        assert len(ports) >= 3 * 10 and len(ports) == len(set(ports)), started

        # Ada stops her lab: the others go on working.
        order(tmp_path, "ada", "stop")
        assert attendees["ada"].wait(60) == 0
        assert "nothing to stop" in cleanup(env)  # every other lab's kernel is alive

        # Cy's kernel dies: cleanup stops his lab, and only his.
        attendees["cy"].send_signal(signal.SIGKILL)
        attendees["cy"].wait(30)
        said = cleanup(env)
        assert f"stopped lab {started['cy']['cluster_id']} of a kernel that is gone" in said, said
        assert started["bob"]["cluster_id"] not in said
        order(tmp_path, "bob", "again")
        assert wait_for(tmp_path / "bob.again", 120, [attendees["bob"]]) == "True"
        order(tmp_path, "bob", "stop")
        assert attendees["bob"].wait(60) == 0
    finally:
        for process in [*burners, *attendees.values()]:
            if process.poll() is None:
                process.kill()
        cleanup(env)
    assert lab_processes(str(tmp_path / "ipython")) == []
    assert records.read_records(os.path.join(tmp_path, "ipython", f"profile_{records.PROFILE_NAME}")) == []
