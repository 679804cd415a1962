"""A workshop on a real JupyterHub: seats that are Unix accounts, the room behind the hub's login.

The quick tests read what `pplab.course.hub` gives the hub and each seat's server (this server's spawner
and the two cluster spawners, whose own code builds the pod and the Slurm script). The slow one
starts a hub as `pplab workshop start` does, on free loopback ports with three seat accounts and an
instructor made for it, and drives it in headless Chromium: three attendees log in and run exercise
01b wrong then right in their own JupyterLab, one of them forges, the instructor reads the room and
exports it, attendees are refused what is not theirs, and nothing is left when the hub stops.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import pwd
import re
import types

import pytest
from traitlets.config import Config

from pplab.course import room
from pplab.course.hub import Workshop, configure, prepare_seat

SEATS = ("daemon", "bin")  # accounts every Debian has: the quick tests make none


def spawner_of(cls, account: str, **options):
    """A spawner of `cls` for `account`'s server, as the hub makes one (without a hub to talk to)."""
    from jupyterhub.objects import Hub

    user = types.SimpleNamespace(name=account, id=1, url=f"/user/{account}/", escaped_name=account,
                                 server=None)
    return cls(user=user, hub=Hub(), **options)


@pytest.mark.quick
@pytest.mark.skipif(os.geteuid() != 0, reason="a room with seats gives each seat's folder to "
                                              "its account: needs root")
def test_each_seat_gets_its_room_gpus_and_cap_and_a_cluster_spawner_asks_for_whole_gpus(tmp_path,
                                                                                        monkeypatch):
    pytest.importorskip("jupyterhub", reason="the workshop's hub: pip install 'pplab[hub]'")
    from jupyterhub.spawner import LocalProcessSpawner

    workshop = Workshop(SEATS, tmp_path / "room", gpu_count=4, ranks_per_seat=2)
    assert workshop.environment("bin") == {"PPLAB_ROOM": str(tmp_path / "room"), "PPLAB_SEAT": "bin",
                                           "CUDA_VISIBLE_DEVICES": "2,3", "PPLAB_GPU_MEMORY_FRACTION": "0.9"}
    assert "bin: GPUs 2,3" in workshop.describe()
    assert Workshop(tuple(f"s{n}" for n in range(6)), tmp_path, gpu_count=4).environment("s5") == {
        "PPLAB_ROOM": str(tmp_path), "PPLAB_SEAT": "s5", "CUDA_VISIBLE_DEVICES": "2,3",
        "PPLAB_GPU_MEMORY_FRACTION": "0.3"}  # 12 ranks on 4 GPUs: 3 a GPU, each capped at a third of 90 %

    local = spawner_of(LocalProcessSpawner, "bin")
    prepare_seat(workshop, local)  # no notebooks to copy: the course's copy is the slow test's
    assert local.get_env()["CUDA_VISIBLE_DEVICES"] == "2,3" and local.get_env()["PPLAB_SEAT"] == "bin"
    assert room.seats_of(tmp_path / "room") == ["bin"]  # its seat's folder, made before its server starts
    assert (tmp_path / "room" / "verdicts" / "bin").stat().st_uid == pwd.getpwnam("bin").pw_uid
    instructor = spawner_of(LocalProcessSpawner, "root")
    prepare_seat(workshop, instructor)
    assert "PPLAB_ROOM" not in instructor.get_env()  # an instructor has no seat

    c = Config()
    configure(c, seats=list(SEATS), instructors=["root"], room=tmp_path / "room2", gpus=0, spawner="slurm",
              room_url="http://127.0.0.1:8799")
    assert c.JupyterHub.spawner_class == "batchspawner.SlurmSpawner"
    assert c.Authenticator.allowed_users == {"daemon", "bin", "root"}
    assert c.Authenticator.admin_users == {"root"}
    [service] = c.JupyterHub.services
    assert service["name"] == "pplab-room" and service["url"] == "http://127.0.0.1:8799"
    assert service["command"][1:4] == ["-m", "pplab.course.hub.service", str(tmp_path / "room2")]
    assert c.JupyterHub.load_roles == [{"name": "pplab-instructors", "users": ["root"],
                                        "scopes": ["access:services!service=pplab-room"]}]
    with pytest.raises(ValueError, match=r"\['root'\]: an instructor has no seat"):
        configure(Config(), seats=["root"], instructors=["root"], room=tmp_path, spawner="slurm")
    with pytest.raises(ValueError, match="spawner='docker': use one of 'local', 'kubernetes', 'slurm'"):
        configure(Config(), seats=2, room=tmp_path, spawner="docker")
    if not os.stat("/root").st_mode & 0o001:  # this machine keeps Python under /root, closed to others
        with pytest.raises(ValueError, match=r"the seats' accounts cannot reach /root \(mode 700"):
            configure(Config(), seats=list(SEATS), room=tmp_path / "room3", gpus=0)

    from batchspawner import SlurmSpawner

    slurm = spawner_of(SlurmSpawner, "bin")
    prepare_seat(workshop, slurm)
    script = asyncio.run(slurm._get_batch_script(**slurm.get_req_subvars(), cmd="jupyterhub-singleuser"))
    assert "#SBATCH --gres=gpu:1\n" in script  # Slurm hands the job its GPU and sets CUDA_VISIBLE_DEVICES
    assert "CUDA_VISIBLE_DEVICES" not in slurm.get_env() and slurm.get_env()["PPLAB_SEAT"] == "bin"
    assert "PPLAB_ROOM" in re.search(r"--export=(\S+)", script).group(1).split(",")

    kube_config = tmp_path / "kubeconfig"  # KubeSpawner reads one when made; no cluster is reached
    kube_config.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "
                           "'https://127.0.0.1:9'}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: "
                           "[{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n")
    monkeypatch.setenv("KUBECONFIG", str(kube_config))

    async def pod():
        from kubespawner import KubeSpawner

        kube = KubeSpawner(_mock=True)
        kube.user.name = "bin"
        prepare_seat(workshop, kube)
        return (await kube.get_pod_manifest()).spec.containers[0]

    container = asyncio.run(pod())
    assert container.resources.limits["nvidia.com/gpu"] == "1"  # the NVIDIA device plugin's whole GPU
    env = {variable.name: variable.value for variable in container.env}
    assert env["PPLAB_SEAT"] == "bin" and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.quick
def test_workshop_init_writes_a_hub_config_and_a_readme_and_refuses_what_cannot_work(tmp_path, capsys):
    from pplab.cli import main

    notebooks = tmp_path / "course"
    notebooks.mkdir()
    (notebooks / "README.md").write_text("the course")
    assert main(["workshop", "init", str(tmp_path / "w"), "--seats", "20", "--gpus", "4", "--instructor",
                 "teacher",
                 "--notebooks", str(notebooks)]) == 0
    said = capsys.readouterr().out
    assert "20 seat(s) of 2 rank(s) on 4 GPU(s): up to 10 rank(s) per GPU, each rank capped at 9.0%" in said
    assert "seat-20: GPUs 2,3" in said and "sudo pplab workshop start" in said
    config = (tmp_path / "w" / "jupyterhub_config.py").read_text()
    assert "pplab.course.hub.configure(" in config and "'seat-01'" in config and "gpus=4" in config
    compile(config, "jupyterhub_config.py", "exec")
    assert "/services/pplab-room/" in (tmp_path / "w" / "README.md").read_text()
    seats = list(csv.DictReader(open(tmp_path / "w" / "seats.csv")))
    assert [row["account"]
            for row in seats][:2] == ["seat-01", "seat-02"] and seats[-1]["role"] == "instructor"
    assert (tmp_path / "w" / "seats.csv").stat().st_mode & 0o077 == 0  # passwords: root's alone
    assert main(["workshop", "init", str(tmp_path / "w"), "--seats", "2", "--instructor", "t",
                 "--notebooks", str(notebooks)]) == 2
    assert "holds a workshop already" in capsys.readouterr().err
    assert main(["workshop", "start", str(tmp_path / "nowhere")]) == 2
    assert "no jupyterhub_config.py there; make the workshop first" in capsys.readouterr().err


# ------------------------------------------------------------------ the whole workshop, for real

CHECK_CELL = "exercises.check_stage_forward(stage_forward)"


def _solution(wrong: bool) -> str:
    from pathlib import Path

    solutions = Path(__file__).parents[1] / "notebooks" / "solutions"
    solution = (solutions / "01b_exercise_stage_forward.py").read_text()
    return solution.replace("stage.embed_tokens(x)", "stage.embed_tokens(x).detach()") if wrong else solution


RUN_ALL = """async (source) => {
  const app = window.jupyterapp, panel = app.shell.currentWidget;
  await panel.context.ready; await panel.sessionContext.ready;
  if (source !== null) {
    const cells = panel.content.model.cells;
    for (let i = 0; i < cells.length; i++) {
      const cell = cells.get(i).sharedModel;
      if (cell.getSource().startsWith('# EXERCISE')) cell.setSource(source);
    }
  }
  await app.commands.execute('notebook:clear-all-cell-outputs');
  await app.commands.execute('notebook:run-all-cells');
}"""
LAST_OUTPUT = """() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')];
  const output = cells.length ? cells[cells.length - 1].querySelector('.jp-OutputArea') : null;
  return output ? output.innerText : '';
}"""
IN_THE_KERNEL = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  let said = '';
  const future = kernel.requestExecute({code});
  future.onIOPub = (message) => {
    if (message.header.msg_type === 'stream') said += message.content.text;
    if (message.header.msg_type === 'error') said += message.content.ename + ': ' + message.content.evalue;
  };
  await future.done;
  return said;
}"""


def log_in(browser, hub, account):
    """A browser context of its own, logged in as `account` (the hub's login form, PAM behind it)."""
    from test_browser import open_page

    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    open_page(page, hub.url + "/hub/login")
    page.fill("#username_input", account)
    page.fill("#password_input", hub.passwords[account])
    page.click("#login_submit")
    return page


def run_exercise(page, source: str | None, timeout_ms: float) -> str:
    """Run the open notebook top to bottom (its exercise cell replaced by `source`), as Run All does;
    the checker's verdict as the page shows it."""
    page.evaluate(RUN_ALL, source)
    page.wait_for_function(f"({LAST_OUTPUT})().match(/right|not yet/)", timeout=timeout_ms)
    return page.evaluate(LAST_OUTPUT)


def attend(browser, hub, account, timeout_ms, screenshots) -> tuple:
    """`account` logs in, finds the course in its JupyterLab, runs 01b as it came, wrong, then right."""
    page = log_in(browser, hub, account)
    page.wait_for_url(re.compile(f".*/user/{account}/lab.*"), timeout=timeout_ms)
    page.wait_for_function("window.jupyterapp && window.jupyterapp.commands.hasCommand('docmanager:open')",
                           timeout=timeout_ms)
    page.evaluate("async (path) => { await window.jupyterapp.restored;"
                  " await window.jupyterapp.commands.execute('docmanager:open', {path}); }",
                  "01b_exercise_stage_forward.ipynb")
    verdicts = [run_exercise(page, None, timeout_ms), run_exercise(page, _solution(wrong=True), timeout_ms),
                run_exercise(page, _solution(wrong=False), timeout_ms)]
    page.screenshot(path=str(screenshots / f"seat-{account}.png"))
    return page, verdicts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_workshop_on_a_real_hub_three_seats_their_verdicts_the_room_and_no_forgery(tmp_path):
    from hub_harness import missing_for_a_hub, workshop_hub
    from test_browser import CHROMIUM, _browser_or_skip, open_page

    missing = missing_for_a_hub()
    if missing:  # before anything starts
        message = "no hub to test with: missing " + "; ".join(missing)
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(message + "; .ci/run must install them")
        pytest.skip(message)
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    from pplab.base.machine import recent_load

    timeout_ms = recent_load(max_age=30).scale(120) * 1000
    shots = tmp_path
    with workshop_hub(3, extra_config="c.Spawner.args = ['--LabApp.expose_app_in_browser=True']") as hub:
        ada, bo, cy = hub.seats
        home = pwd.getpwnam(ada).pw_dir
        os.makedirs(f"{home}/pplab-course")  # ada's own notes, there before her first start
        with open(f"{home}/pplab-course/README.md", "w") as notes:
            notes.write("my notes\n")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-background-networking", "--disable-component-update"])
            try:
                page, said = attend(browser, hub, ada, timeout_ms, shots)
                assert "not written yet" in said[0] and "not yet" in said[1] and "right" in said[2], said
                assert open(f"{home}/pplab-course/README.md").read() == "my notes\n"  # never copied over
                assert os.path.exists(f"{home}/pplab-course/04b_exercise_1f1b_warmup.ipynb")
                # the room is not an attendee's
                assert page.goto(hub.url + "/services/pplab-room/").status == 403
                page.screenshot(path=str(shots / "room-as-attendee-403.png"))

                page, said = attend(browser, hub, bo, timeout_ms, shots)
                assert "right" in said[2], said
                forged = page.evaluate(IN_THE_KERNEL, FORGERIES.format(ada=ada, cy=cy))
                assert forged.split() == ["denied", "denied", "denied", "written"], forged
                assert page.goto(hub.url + f"/user/{ada}/lab").status == 403  # another attendee's server

                page, said = attend(browser, hub, cy, timeout_ms, shots)  # cy's seat was not taken
                assert "right" in said[2], said

                gone = browser.new_page()  # logged out: the hub's login page
                open_page(gone, hub.url + "/services/pplab-room/")
                gone.wait_for_url(re.compile(".*/hub/login.*"), timeout=timeout_ms)
                gone.screenshot(path=str(shots / "login.png"))

                teacher = log_in(browser, hub, hub.instructor)
                teacher.wait_for_url(re.compile(".*/user/.*"), timeout=timeout_ms)
                open_page(teacher, hub.url + "/services/pplab-room/")
                teacher.wait_for_selector("table.pplab-room", timeout=timeout_ms)
                rows = {row.split("\t")[0]: row
                        for row in teacher.inner_text("table.pplab-room tbody").splitlines()}
                assert set(rows) == {ada, bo, cy}, rows
                for seat in (ada, bo, cy):  # the placeholder was no try
                    assert re.search(r"✔ right · 2 tries", rows[seat]), rows[seat]
                assert "✔ right" in rows[bo].split("\t")[7] and "not yet" in rows[ada].split("\t")[7]  # 04b
                notes = teacher.inner_text("main")
                assert "Seats are accounts" in notes, notes
                assert f"1 record naming '{ada}' in {bo}'s file" in notes, notes
                teacher.screenshot(path=str(shots / "room-as-instructor.png"), full_page=True)
                with teacher.expect_download() as download:
                    teacher.click("text=export grades (CSV)")
                grades = list(csv.DictReader(io.StringIO(open(download.value.path()).read())))
            finally:
                browser.close()
                # shown where the test fails: what the hub and the seats' servers said
                print(hub.log()[-6000:])
        if os.environ.get("PPLAB_SCREENSHOTS"):
            for shot in shots.glob("*.png"):
                os.replace(shot, os.path.join(os.environ["PPLAB_SCREENSHOTS"], f"hub-{shot.name}"))
    by_seat = {(row["student_id"], row["assignment"]): row for row in grades}
    for seat in (ada, bo, cy):
        assert (by_seat[(seat, "01b")]["tries"], by_seat[(seat, "01b")]["score"]) == ("2", "1")
        assert float(by_seat[(seat, "01b")]["seconds_to_right"]) > 0
    assert by_seat[(bo, "04b")]["score"] == "1" and by_seat[(ada, "04b")]["tries"] == "0"
    assert hub.left_behind == [], hub.left_behind  # the hub stopped every seat's server, the proxy, the room
    assert not any(account in open("/etc/passwd").read() for account in (ada, bo, cy, hub.instructor))


# bo, in her own kernel: a record for ada in her own file, cy's seat taken three ways, and a verdict
# written with PPLAB_SEAT set to ada (it lands in bo's folder, as bo's).
FORGERIES = """
import json, os, time
from pplab.course import room
folder = os.environ["PPLAB_ROOM"]
with open(f"{{folder}}/verdicts/{{os.environ['PPLAB_SEAT']}}/verdicts.jsonl", "a") as own:
    own.write(json.dumps({{"attendee": "{ada}", "exercise": "the 1F1B warm-up", "right": True,
                          "reason": "right", "message": "right", "time": time.time()}}) + "\\n")
for path in (f"{{folder}}/verdicts/{cy}/verdicts.jsonl", f"{{folder}}/verdicts/{cy}.jsonl",
             f"{{folder}}/labs/{cy}/x.json"):
    try:
        open(path, "a").close()
        print("taken", path)
    except PermissionError:
        print("denied")
os.environ["PPLAB_SEAT"] = "{ada}"
room.record_verdict("the 1F1B warm-up", True, "every rank warms up as 1F1B does")
print("written")
"""
