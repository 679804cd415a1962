"""The dashboard in a real browser: JupyterLab on loopback, driven by Playwright in headless Chromium.

The notebook starts a 2-rank lab, displays a dashboard and runs several steps; the test
watches the page while they run and asserts that the dashboard rendered and changed.
Screenshots go to the test's output folder (and to $PPLAB_SCREENSHOTS when set).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid

import nbformat
import pytest

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"  # Debian's chromium-headless-shell
STEPS = 6
CELLS = [
    "import pplab\nfrom pplab.planning.simulator import Costs\nlab = pplab.Lab(n_ranks=2)",
    "pipe = lab.pipeline(pplab.LlamaConfig.tiny(), schedule='1f1b', n_microbatches=4,\n"
    "                    timing=Costs(forward=0.05, backward=0.1))\ndash = pipe.dashboard()\ndash",
    f"results = dash.run_steps({STEPS})",
    "pipe.close()\nlab.stop()",
]


def open_page(page, url, tries=3):
    """page.goto(url), again where Chromium gave up because the machine's network changed.

    Chromium aborts a load in flight when an address appears on this machine, loopback included,
    and the namespace hosts of a test on another worker add and remove a bridge's address."""
    for attempt in range(tries):
        try:
            return page.goto(url)
        except Exception as error:  # playwright's Error; imported only where a browser is there
            if "ERR_NETWORK_CHANGED" not in str(error) or attempt == tries - 1:
                raise
            time.sleep(0.5)


def _browser_or_skip():
    """Playwright and Chromium, or a skip saying what is missing (a failure under CI=true)."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install playwright)")
    if not os.path.exists(CHROMIUM):
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium-headless-shell)")
    if missing:
        message = "no browser to test with: missing " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; .ci/run must install them")
        pytest.skip(message)


@pytest.fixture
def jupyter_lab(tmp_path, ipython_dir):
    """JupyterLab serving a folder with the dashboard notebook, on loopback; stopped afterwards."""
    from pplab.drivers.local import free_port

    _browser_or_skip()
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in CELLS],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(notebook, tmp_path / "dashboard.ipynb")
    port, token = free_port(), uuid.uuid4().hex
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.expose_app_in_browser=True", "--allow-root"],
        stdout=open(tmp_path / "jupyter.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "IPYTHONDIR": ipython_dir})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    said = (tmp_path / "jupyter.log").read_text()[-3000:]
                    pytest.fail("JupyterLab did not start:\n" + said)
                time.sleep(0.3)
        yield f"{base}/lab/tree/dashboard.ipynb?token={token}"
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        import pplab

        pplab.cleanup(verbose=False)  # a lab whose kernel died with the server


def _timeline_state(page) -> dict:
    """What the dashboard's timeline shows now: live SVG boxes, picture size, the status line."""
    return page.evaluate("""() => {
        const svgs = [...document.querySelectorAll('.jp-OutputArea svg')];
        const boxes = svgs.reduce((n, svg) => n + svg.querySelectorAll('rect').length, 0);
        const images = [...document.querySelectorAll('.jp-OutputArea .widget-image')]
            .filter(img => img.naturalWidth > 0 && img.offsetParent !== null);
        return {boxes, images: images.map(img => [img.naturalWidth, img.naturalHeight]),
                html: document.querySelector('.jp-Notebook')?.innerText ?? ''};
    }""")


def test_the_dashboard_renders_and_changes_while_steps_run(jupyter_lab, tmp_path):
    from playwright.sync_api import sync_playwright

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            open_page(page, jupyter_lab)
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                                   timeout=60_000)
            # The kernel's status in the status bar; then run every cell (not awaiting the promise,
            # which ends only when the cells do).
            page.wait_for_function("() => document.body.innerText.includes('| Idle')", timeout=90_000)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            seen, deadline = [], time.monotonic() + 240
            while time.monotonic() < deadline:
                state = _timeline_state(page)
                seen.append(state)
                if len(seen) % 10 == 1:
                    page.screenshot(path=str(shots / f"dashboard-{len(seen):03d}.png"), full_page=True)
                if f"{STEPS} steps done" in state["html"]:
                    break
                time.sleep(0.25)
            # The final pictures are drawn after the last step: on a busy machine that took more than
            # the 1.5 s once waited here, so wait for them (or a minute) instead.
            page.wait_for_function("""() => [...document.querySelectorAll('.jp-OutputArea .widget-image')]
                                          .some(img => img.naturalWidth > 0 && img.offsetParent !== null)""",
                                   timeout=60_000)
            final = _timeline_state(page)
            page.screenshot(path=str(shots / "dashboard-final.png"), full_page=True)
        finally:
            browser.close()
    if os.environ.get("PPLAB_SCREENSHOTS"):
        shutil.copytree(shots, os.environ["PPLAB_SCREENSHOTS"], dirs_exist_ok=True)
    assert f"{STEPS} steps done" in final["html"], (
        f"the run did not finish in the page: {final['html'][-1500:]}")
    # Live: the timeline's SVG was seen with different numbers of boxes while the steps ran.
    live_counts = {state["boxes"] for state in seen if state["boxes"]}
    assert len(live_counts) >= 3, f"the live timeline did not change while steps ran: {live_counts}"
    # Finished: the pictures are there and not empty (the timeline, bubbles, memory, loss).
    assert final["images"] and all(w > 100 and h > 50 for w, h in final["images"]), final["images"]
