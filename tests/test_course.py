"""The course's shape: every notebook says its goal and prerequisites, ends with a summary and
stops the lab it started, and the contents table lists every one."""

from pathlib import Path

import nbformat
import pytest


NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STEMS = sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.quick
@pytest.mark.parametrize("stem", STEMS)
def test_a_notebook_states_its_goal_sums_up_and_stops_its_lab(stem):
    cells = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4).cells
    assert "**Goal:**" in cells[0].source and "**Prerequisites:**" in cells[0].source, stem
    assert any(c.cell_type == "markdown" and "## Summary" in c.source for c in cells), f"{stem} has no summary"
    code = [c.source for c in cells if c.cell_type == "code"]
    if any("pplab.Lab(" in source or "Lab.connect(" in source for source in code):
        assert "lab.stop()" in code[-1], f"{stem} starts a lab but its last cell does not stop it"
    assert not any(c.get("outputs") for c in cells if c.cell_type == "code"), f"{stem} is saved with outputs"


@pytest.mark.quick
def test_the_contents_table_lists_every_notebook_in_order():
    contents = (NOTEBOOKS / "README.md").read_text()
    positions = [contents.find(f"`{stem}`") for stem in STEMS]
    assert all(position >= 0 for position in positions), [s for s, p in zip(STEMS, positions) if p < 0]
    assert positions == sorted(positions)
