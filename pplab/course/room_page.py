"""The room as a web page: the table, what the room trusts or refused, and the grades to download.

`pplab room FOLDER` serves it on loopback; the workshop's hub serves it behind its login
(`pplab.course.hub`). The page re-reads itself in place, so a reload that fails keeps the last table.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence

from pplab.course.grades import grades_csv
from pplab.course.room import TABLE_STYLE, RoomReading, inspect_room, room_summary, room_table_html


def room_notes_html(reading: RoomReading) -> str:
    """Whether the seats' verdicts are checked or trusted, and every record refused with its reason."""
    if reading.checked:
        trust = ("Seats are accounts: a verdict counts for the account whose seat folder holds it, "
                 "whatever the record says.")
    else:
        trust = ("Verdicts here are trusted, not checked: the attendees write as one account (or into a "
                 "shared folder), and a seat is the name each gives (PPLAB_SEAT).")
    notes = f"<p class='trust'>{html.escape(trust)}</p>"
    if reading.refusals:
        items = "".join(f"<li><code>{html.escape(refusal.where)}</code>: {html.escape(refusal.reason)}</li>"
                        for refusal in reading.refusals)
        count = len(reading.refusals)
        notes += (f"<details class='refused' open><summary style='color:#c00000'>{count} "
                  f"{'file' if count == 1 else 'files'} with records "
                  f"refused</summary><ul>{items}</ul></details>")
    return notes


def room_page(reading: RoomReading, exercises: Mapping[str, str] | Sequence[str], refresh: float,
              access: str) -> str:
    """The whole page: `access` says who can open it (a line under the heading)."""
    summary = html.escape(room_summary(reading.seats,
                                       columns=exercises if isinstance(exercises, Mapping) else None))
    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            f"<noscript><meta http-equiv='refresh' content='{refresh:g}'></noscript>"
            f"<title>pplab room</title><style>body{{font-family:sans-serif;margin:20px}}"
            f".access{{color:#555;font-size:12px}}</style>{TABLE_STYLE}"
            f"</head><body><h2>pplab room: {html.escape(str(reading.folder))}</h2>"
            f"<p class='access'>{html.escape(access)} · "
            f"<a href='grades.csv' download>export grades (CSV)</a></p>"
            f"<main id='room'><p>{summary} (re-read every {refresh:g} s)</p>"
            f"{room_table_html(reading.seats, exercises)}{room_notes_html(reading)}</main>"
            f"<p id='trouble' style='color:#b00'></p>"
            f"<script>{_ROOM_RELOADER.replace('INTERVAL_MS', str(round(refresh * 1000)))}</script>"
            f"</body></html>")


def room_response(folder: str, path: str, refresh: float, access: str) -> tuple[int, str, str]:
    """(status, content type, body) of the room's page at `path` ('/', '/room.json', '/grades.csv'):
    what both the loopback page and the hub's service answer."""
    from pplab.course.exercises import NOTEBOOK_OF_EXERCISE

    try:
        reading = inspect_room(folder)
    except ValueError as error:  # the folder went away: say so on the page
        return 500, "text/plain; charset=utf-8", str(error)
    if path == "/room.json":
        seats = [{**vars(seat), "verdicts": seat.verdicts} for seat in reading.seats]
        return 200, "application/json", json.dumps({"seats": seats, "checked": reading.checked,
                                                    "refused": [vars(refusal)
                                                                for refusal in reading.refusals]})
    if path == "/grades.csv":
        return 200, "text/csv; charset=utf-8", grades_csv(reading.seats, NOTEBOOK_OF_EXERCISE)
    if path == "/":
        return 200, "text/html; charset=utf-8", room_page(reading, NOTEBOOK_OF_EXERCISE, refresh, access)
    return 404, "text/plain; charset=utf-8", "the room is at / (and /room.json, /grades.csv)"


# The page re-reads itself in place rather than by a meta refresh: a reload that fails (the server
# restarting, the network changing under the browser) would leave an error page that never reloads,
# where this keeps the last table, says what went wrong, and tries again.
_ROOM_RELOADER = """
async function reread() {
  const trouble = document.getElementById('trouble');
  try {
    const answer = await fetch(location.pathname, {cache: 'no-store'});
    if (!answer.ok) throw new Error('the server answered ' + answer.status);
    const page = new DOMParser().parseFromString(await answer.text(), 'text/html');
    document.getElementById('room').innerHTML = page.getElementById('room').innerHTML;
    trouble.textContent = '';
  } catch (error) {
    trouble.textContent = 'could not re-read the room at ' + new Date().toLocaleTimeString()
      + ' (' + error.message + '); the table above is the last one read; trying again';
  }
  setTimeout(reread, INTERVAL_MS);
}
setTimeout(reread, INTERVAL_MS);
"""
