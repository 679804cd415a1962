"""The instructor's view of the room: what attendees' labs and checkers write, read back and served.

Three attendees work in three processes of their own, each with a real lab, and check exercises
right and wrong; one attendee's rank dies. The room's folder says it all, `RoomView` shows it,
and `pplab room` serves it to a real browser (headless Chromium), which sees it change.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pplab.course import room

ATTENDEE = textwrap.dedent("""
    import sys
    import pplab
    from pplab.course import exercises

    def warmup_forwards(rank, n_ranks, n_microbatches):
        return min(n_ranks - 1 - rank, n_microbatches) if {right} else n_ranks - 1 - rank

    lab = pplab.Lab(n_ranks=1, device="cpu", verbose=False)
    print(exercises.check_warmup(warmup_forwards), flush=True)
    print("pids", *[pid for _, pid in lab.rank_processes], flush=True)
    sys.stdin.readline()  # the test looks at the room now; then it lets this attendee go home
    lab.stop()
""")


@pytest.mark.quick
def test_what_a_lab_and_a_checker_write_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(room.ROOM_ENV, str(tmp_path))
    monkeypatch.setenv(room.SEAT_ENV, "seat 7")  # made a file name: seat_7
    room.record_lab("abc", state="running", device="cuda", n_ranks=2, gpus=[2, 3], pids=[os.getpid()])
    room.record_verdict("the 1F1B warm-up", False, "rank 0 of 3 with 1 microbatch: you "
                                                   "said 2, it runs 1.\nwhy")
    room.record_verdict("a stage's forward", True, "every stage computes what it should")
    (tmp_path / "verdicts" / "seat_7.jsonl").open("a").write('{"attendee": "seat_7", "exerc')  # being written
    for made in ("labs", "verdicts"):  # every attendee (a Unix user of their own) may write there
        assert (tmp_path / made).stat().st_mode & 0o7777 == 0o1777
    (tmp_path / "labs" / "broken.json").write_text('{"attendee": "x"}')  # no last_activity: skipped
    [seat] = room.read_room(tmp_path)
    assert seat.attendee == "seat_7" and seat.state == "running" and seat.lab["gpus"] == [2, 3]
    reason = seat.verdicts["the 1F1B warm-up"]["reason"]
    assert reason == "rank 0 of 3 with 1 microbatch: you said 2, it runs 1."
    page = room.room_table_html(room.read_room(tmp_path),
                                ["a stage's forward", "the 1F1B warm-up", "clipping"])
    assert "cuda (GPUs 2, 3)" in page and "✔ right" in page and "not yet" in page
    assert re.search(r"✘ for \d+ s · rank 0 of 3", page), page
    room.record_lab("abc", state="running", device="cuda", n_ranks=4, gpus=[5, 5, 5, 5], pids=[os.getpid()],
                    gpu_memory_fraction=0.1125)
    page = room.room_table_html(room.read_room(tmp_path), [])
    assert "cuda (GPU 5 shared; each rank up to 11% of a GPU)" in page
    # no such process
    room.record_lab("abc", state="running", device="cpu", n_ranks=2, pids=[2 ** 22 + 12345])
    assert room.read_room(tmp_path)[0].state == "dead"
    monkeypatch.delenv(room.ROOM_ENV)
    room.record_verdict("clipping", True, "right")  # outside a room: nothing written
    assert "clipping" not in room.read_room(tmp_path)[0].verdicts
    with pytest.raises(ValueError, match="no such room folder"):
        room.read_room(tmp_path / "nowhere")


def twenty_seats(folder, now: float) -> None:
    """A room of 20 seats as their labs and checkers write it: seat-00 .. seat-19, each with a running
    lab; every seat right on 01b at its first try; seat-03 ran 04b four times over the last 25
    minutes: twice the cell as it came (a placeholder, no try), twice wrong; seat-07 right on 04b, then wrong
    (a later edit broke it); the
    rest right on 04b; nobody has tried 14b."""
    room.make_room(folder)
    hint = ("rank 0 of 3 with 1 microbatch: you said 2, it runs 1.\nHint: a rank cannot warm up more "
            "microbatches than there are.")
    for seat in range(20):
        name = f"seat-{seat:02d}"
        lab = {"attendee": name, "lab": "x", "host": "elsewhere", "client_pid": 1, "state": "running",
               "device": "cpu", "n_ranks": 2, "last_activity": now - 5}
        (folder / "labs" / f"{name}--x.json").write_text(json.dumps(lab))
        verdicts = [("a stage's forward", True, "every stage computes what it should", now - 1800)]
        if seat == 3:
            verdicts += [("the 1F1B warm-up", False, hint if i % 2 else "not written yet: replace ...",
                          now - 1500 + i * 300)
                         for i in range(4)]
        elif seat == 7:
            verdicts += [("the 1F1B warm-up", True, "every rank warms up as 1F1B does", now - 900),
                         ("the 1F1B warm-up", False, hint, now - 120)]
        else:
            verdicts += [("the 1F1B warm-up", True, "every rank warms up as 1F1B does", now - 600)]
        with open(folder / "verdicts" / f"{name}.jsonl", "w") as file:
            for exercise, right, message, when in verdicts:
                file.write(json.dumps({"attendee": name, "exercise": exercise, "right": right, "time": when,
                                       "reason": message.splitlines()[0], "message": message}) + "\n")


@pytest.mark.quick
def test_a_room_of_twenty_shows_who_is_stuck_on_what_for_how_long(tmp_path):
    from pplab.course.exercises import NOTEBOOK_OF_EXERCISE

    now = time.time()
    twenty_seats(tmp_path, now)
    seats = room.read_room(tmp_path, now)
    by_name = {seat.attendee: seat for seat in seats}
    # placeholders: no try
    assert len(seats) == 20 and len(by_name["seat-03"].attempts["the 1F1B warm-up"]) == 2
    assert by_name["seat-03"].stuck_since("the 1F1B warm-up") == pytest.approx(now - 1200)
    assert by_name["seat-07"].stuck_since("the 1F1B warm-up") == pytest.approx(now - 120)
    assert by_name["seat-00"].stuck_since("the 1F1B warm-up") is None
    summary = room.room_summary(seats, now, columns=NOTEBOOK_OF_EXERCISE)
    assert summary.endswith("38 exercises right; 1 stuck over 10 min (longest: seat-03 on "
                            "04b, 20 min)"), summary
    page = room.room_table_html(seats, NOTEBOOK_OF_EXERCISE, now)
    rows = re.findall(r"<tr>(.*?)</tr>", page, re.DOTALL)
    header, seat_03, seat_07, tallies = rows[0], rows[4], rows[8], rows[-1]
    assert "<th title='a layout for your own model'>14b</th>" in header and ">04b</th>" in header
    assert "✘ 2 tries · for 20 min · rank 0 of 3 with 1 microbatch" in seat_03
    assert "Hint: a rank cannot warm up more microbatches" in seat_03  # the whole message, on hover
    assert "✘ (was ✔) 2 tries · for 2 min" in seat_07
    assert "<td title='right · wrong now · not tried'>18 · 2 · 0</td>" in tallies  # 04b
    assert "<td title='right · wrong now · not tried'>0 · 0 · 20</td>" in tallies  # 14b: nobody yet
    assert len(page) < 40_000  # 20 seats x 16 columns stay compact


@pytest.mark.timeout(180)
def test_three_attendees_labs_and_verdicts_are_seen_live_in_a_browser(tmp_path, ipython_dir):
    from test_browser import _browser_or_skip

    _browser_or_skip()  # before anything starts: a skip inside would leave the checks below unmade
    folder = tmp_path / "room"
    folder.mkdir()
    attendees = {}
    server = None
    try:
        for seat, right in (("ada", True), ("bo", False), ("cy", True)):
            env = {**os.environ, room.ROOM_ENV: str(folder), room.SEAT_ENV: seat}
            attendees[seat] = subprocess.Popen([sys.executable, "-c", ATTENDEE.format(right=right)], env=env,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = {seat: [process.stdout.readline(), process.stdout.readline()]
                for seat, process in attendees.items()}
        assert said["ada"][0].startswith("RIGHT") and said["bo"][0].startswith("NOT YET"), said
        os.kill(int(said["cy"][1].split()[1]), signal.SIGKILL)  # cy's rank dies
        deadline = time.monotonic() + 30  # the signal takes effect a moment later, on a busy machine
        while time.monotonic() < deadline and {s.attendee: s.state
                                               for s in room.read_room(folder)}["cy"] != "dead":
            time.sleep(0.1)

        seats = {seat.attendee: seat for seat in room.read_room(folder)}
        assert {name: seat.state for name, seat in seats.items()} == {"ada": "running", "bo": "running",
                                                                      "cy": "dead"}
        assert seats["bo"].verdicts["the 1F1B warm-up"]["reason"].startswith("rank 0 of 3 with 1 microbatch")

        from pplab.views.widgets import RoomView

        view = RoomView(folder)
        assert "3 attendees</b>: 2 labs running, 1 dead; 2 exercises right" in view.summary.value

        server = subprocess.Popen([sys.executable, "-m", "pplab", "room", str(folder), "--port", "0",
                                   "--refresh", "1"], stdout=subprocess.PIPE, text=True)
        url = re.search(r"http://127\.0\.0\.1:\d+/", server.stdout.readline()).group(0)
        _look_in_a_browser(url, attendees, server, tmp_path)
    finally:
        for process in attendees.values():
            if process.poll() is None:
                process.communicate("\n", timeout=60)  # each stops its lab (cy's with a dead rank)
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
    assert [process.returncode for process in attendees.values()] == [0, 0, 0]
    assert {seat.attendee: seat.state for seat in room.read_room(folder)} == {
        "ada": "stopped", "bo": "stopped", "cy": "stopped"}


def _look_in_a_browser(url, attendees, server, tmp_path):
    from playwright.sync_api import sync_playwright

    from test_browser import CHROMIUM, open_page

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            open_page(page, url)
            text = page.inner_text("table")
            assert re.search(r"ada\s+running", text) and re.search(r"cy\s+dead", text), text
            assert re.search(r"✘ for \d+ s · rank 0 of 3 with 1", text) and "✔ right" in text, text
            page.screenshot(path=str(tmp_path / "room-before.png"))
            attendees["ada"].communicate("\n", timeout=60)  # ada stops her lab and goes home
            page.wait_for_function("document.querySelector('table').innerText.includes('stopped')",
                                   timeout=15000)
            page.screenshot(path=str(tmp_path / "room-after.png"))
            if os.environ.get("PPLAB_SCREENSHOTS"):
                page.screenshot(path=os.path.join(os.environ["PPLAB_SCREENSHOTS"], "room.png"))
            server.terminate()  # the server goes away: the page keeps its last table and says so
            page.wait_for_function("document.getElementById('trouble').innerText.includes('could "
                                   "not re-read')",
                                   timeout=15000)
            assert re.search(r"ada\s+stopped", page.inner_text("table"))
            page.screenshot(path=str(tmp_path / "room-server-gone.png"))
        finally:
            browser.close()


SEATS = ("daemon", "bin", "nobody")  # accounts every Debian has: a room with seats needs no new ones here


def write_as(seat: str, path, records) -> None:
    """Write `records` (JSON lines) to `path` as if account `seat` had: the file is then `seat`'s."""
    import pwd

    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    os.chown(path, pwd.getpwnam(seat).pw_uid, pwd.getpwnam(seat).pw_gid)


def verdict(seat: str, exercise: str, right: bool, when: float, message: str = "") -> dict:
    return {"attendee": seat, "exercise": exercise, "right": right, "time": when,
            "reason": message or ("right" if right else "wrong"), "message": message}


@pytest.mark.quick
@pytest.mark.skipif(os.geteuid() != 0, reason="a room with seats gives each seat's folder to "
                                              "its account: needs root")
def test_a_room_with_seats_counts_a_verdict_for_the_account_whose_folder_holds_it(tmp_path):
    from pplab.cli import main
    from pplab.course.exercises import NOTEBOOK_OF_EXERCISE
    from pplab.course.exercises.verdicts import NOT_WRITTEN
    from pplab.course.grades import grade_rows
    from pplab.course.room_page import room_notes_html

    folder = room.make_room(tmp_path / "room", seats=SEATS)
    assert room.seats_of(folder) == list(SEATS)
    assert (folder / "verdicts").stat().st_mode & 0o7777 == 0o755  # nobody makes a seat's folder but root
    for seat in SEATS:
        own = (folder / "verdicts" / seat).stat()
        assert own.st_mode & 0o7777 == 0o700 and own.st_uid == __import__("pwd").getpwnam(seat).pw_uid
    now = time.time()
    write_as("daemon", folder / "verdicts" / "daemon" / "verdicts.jsonl", [
        # Run All on the cell as it came
        verdict("daemon", "a stage's forward", False, now - 60, NOT_WRITTEN),
        verdict("daemon", "a stage's forward", False, now - 50, "your stage detached its input"),
        verdict("daemon", "a stage's forward", True, now - 20)])
    # bin forges: a right answer for daemon in its own file, a file in nobody's folder, a stray file
    write_as("bin", folder / "verdicts" / "bin" / "verdicts.jsonl", [
        verdict("daemon", "the 1F1B warm-up", True, now - 10),
        verdict("bin", "the 1F1B warm-up", False, now - 5)])
    write_as("bin", folder / "verdicts" / "nobody" / "verdicts.jsonl",
             [verdict("nobody", "the 1F1B warm-up", True, now)])
    write_as("bin", folder / "verdicts" / "nobody.jsonl", [verdict("nobody", "a stage's forward", True, now)])

    reading = room.inspect_room(folder, now)
    seats = {seat.attendee: seat for seat in reading.seats}
    assert reading.checked and list(seats) == sorted(SEATS)  # every seat has its row, tried or not
    # no placeholder
    assert [v["right"] for v in seats["daemon"].attempts["a stage's forward"]] == [False, True]
    assert "the 1F1B warm-up" not in seats["daemon"].attempts  # bin's claim counts for nobody
    assert [v["right"] for v in seats["bin"].attempts["the 1F1B warm-up"]] == [False]  # bin stays on the page
    assert seats["nobody"].attempts == {}
    refused = {refusal.where: refusal.reason for refusal in reading.refusals}
    assert refused == {
        "verdicts/bin/verdicts.jsonl": "1 record naming 'daemon' in bin's file: a record counts for "
                                       "the seat that wrote it",
        "verdicts/nobody.jsonl": "not in a seat's folder (made by bin): only a seat's own folder counts",
        "verdicts/nobody/verdicts.jsonl": "written by bin, not by nobody"}, refused
    notes = room_notes_html(reading)
    assert "Seats are accounts" in notes and "3 files with records refused" in notes

    rows = {(row["student_id"], row["assignment"]): row for row in grade_rows(reading.seats,
                                                                              NOTEBOOK_OF_EXERCISE)}
    assert len(rows) == 3 * len(NOTEBOOK_OF_EXERCISE)
    assert rows[("daemon", "01b")] | {"timestamp": "", "first_right": ""} == {
        "assignment": "01b", "exercise": "a stage's forward", "student_id": "daemon", "timestamp": "",
        "raw_score": 1, "score": 1, "max_score": 1, "tries": 2, "first_right": "", "seconds_to_right": 30.0,
        "last_message": "right"}
    assert rows[("bin", "04b")]["score"] == 0 and rows[("bin", "04b")]["tries"] == 1
    assert rows[("nobody", "04b")]["tries"] == 0 and rows[("nobody", "04b")]["seconds_to_right"] == ""
    assert main(["room", str(folder), "--seats", "daemon,bin"]) == 0  # again: nothing changes, nothing served
    assert room.seats_of(folder) == list(SEATS) and len(room.inspect_room(folder, now).refusals) == 3
    assert main(["room", str(folder), "--export", str(tmp_path / "grades.csv")]) == 0
    exported = (tmp_path / "grades.csv").read_text().splitlines()
    assert exported[0].startswith("assignment,exercise,student_id,timestamp,raw_score,score,max_score,tries")
    assert len(exported) == 1 + 3 * len(NOTEBOOK_OF_EXERCISE)
    assert exported[1].startswith("01b,a stage's forward,bin,")

    (folder / room.SEATS_FILE).chmod(0o666)  # a seats file anyone could rewrite makes no room with seats
    assert room.seats_of(folder) is None
    with pytest.raises(ValueError, match="seat 'no-such-seat-x': this host has no such "
                                         "account; make it first"):
        room.make_room(folder, seats=["no-such-seat-x"])


@pytest.mark.quick
def test_a_trusted_room_says_so_and_counts_neither_placeholders_nor_records_naming_others(tmp_path,
                                                                                          monkeypatch):
    from pplab.course.exercises.verdicts import NOT_WRITTEN
    from pplab.course.room_page import room_page

    assert NOT_WRITTEN.startswith(room.PLACEHOLDER)
    monkeypatch.setenv(room.ROOM_ENV, str(tmp_path))
    monkeypatch.setenv(room.SEAT_ENV, "ada")
    room.record_verdict("a stage's forward", False, NOT_WRITTEN)
    room.record_verdict("a stage's forward", False, "wrong")
    room.record_verdict("a stage's forward", True, "right")
    with open(tmp_path / "verdicts" / "ada.jsonl", "a") as file:  # ada claims a verdict for bo
        file.write(json.dumps(verdict("bo", "the 1F1B warm-up", True, time.time())) + "\n")
    reading = room.inspect_room(tmp_path)
    [ada] = reading.seats
    assert not reading.checked and len(ada.attempts["a stage's forward"]) == 2
    assert "the 1F1B warm-up" not in ada.attempts
    page = html.unescape(room_page(reading, {"a stage's forward": "01b"}, 3, "loopback only, no login"))
    assert "Verdicts here are trusted, not checked" in page and "1 record naming 'bo' in ada's file" in page
    assert "✔ right · 2 tries" in page and "1 seat: right · wrong · not yet" in page
    assert "<a href='grades.csv' download>" in page
