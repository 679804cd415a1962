"""A workshop on one server: three attendees' kernels, each with a lab of its own, at once.

Each "kernel" is a Python process that starts a lab, checks a pipeline against one device,
then waits for orders in a folder. No two labs share a cluster, a port or a file; stopping
one leaves the others working; `pplab cleanup` stops only the lab whose kernel is gone.
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

seat, folder = sys.argv[1], Path(sys.argv[2])


def say(name, text):  # whole or not at all: the test may read at any moment
    (folder / f"{name}.tmp").write_text(text)
    (folder / f"{name}.tmp").replace(folder / name)


lab = pplab.Lab(n_ranks=2, device="cpu", verbose=False)
pipe = lab.pipeline(pplab.LlamaConfig.tiny(), schedule="1f1b", n_microbatches=4)
assert pipe.check_parity().passed
files = Path(lab.profile_dir, "security").glob(f"ipcontroller-{lab.cluster_id}-*.json")
ports = sorted({port for path in files for value in json.loads(path.read_text()).values()
                for port in (value if isinstance(value, list) else [value])
                if isinstance(port, int) and not isinstance(port, bool)})
say(f"{seat}.ready", json.dumps({"cluster_id": lab.cluster_id, "ports": ports}))
while True:
    order = folder / f"{seat}.order"
    if order.exists():
        if order.read_text() == "stop":
            lab.stop()
            break
        order.unlink()
        passed = pipe.check_parity().passed
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
def test_three_attendees_labs_run_at_once_and_stop_alone(tmp_path, ipython_dir):
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")}  # the server's one user
    script = tmp_path / "attendee.py"
    script.write_text(ATTENDEE)
    attendees = {seat: subprocess.Popen([sys.executable, str(script), seat, str(tmp_path)], env=env,
                                        stderr=subprocess.PIPE, text=True)
                 for seat in ("ada", "bob", "cy")}
    try:
        started = {seat: json.loads(wait_for(tmp_path / f"{seat}.ready", 300, attendees.values()))
                   for seat in attendees}
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
        for attendee in attendees.values():
            if attendee.poll() is None:
                attendee.kill()
        cleanup(env)
    assert lab_processes(str(tmp_path / "ipython")) == []
    assert records.read_records(os.path.join(tmp_path, "ipython", f"profile_{records.PROFILE_NAME}")) == []
