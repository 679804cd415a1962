"""The course's shape: every notebook says its goal and prerequisites, ends with a summary and
stops the lab it started, and the contents table lists every one; the notebooks, their
solutions and the snippets of the README and docs/ use only pplab's public API."""

import ast
import functools
import importlib
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

import pplab

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
STEMS = sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.quick
@pytest.mark.parametrize("stem", STEMS)
def test_a_notebook_states_its_goal_sums_up_and_stops_its_lab(stem):
    cells = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4).cells
    assert "**Goal:**" in cells[0].source and "**Prerequisites:**" in cells[0].source, stem
    assert any(c.cell_type == "markdown" and "## Summary" in c.source
               for c in cells), f"{stem} has no summary"
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


# -- the public API ----------------------------------------------------------------------------


@functools.cache  # imports every public module: once, and only where a test asks
def public_api() -> dict[str, set[str]]:
    """Each public module ("pplab", "pplab.views.viz", ...) -> the names its __all__ makes public."""
    api = {"pplab": set(pplab.__all__)}
    for module in pplab._PUBLIC_MODULES:
        api[module] = set(importlib.import_module(module).__all__)
    return api


# A public module is imported at its one path (`from pplab.views.viz import save`, `import pplab.rank.mesh`).
IMPORTABLE = {"pplab", *pplab._PUBLIC_MODULES}


def where_public(name: str) -> str:
    homes = sorted(f"{module}.{name}" for module, names in public_api().items() if name in names)
    return f"public as {' or '.join(homes)}" if homes else "public nowhere"


def python_of(source: str) -> str:
    """A cell's Python: magics (%%px, %matplotlib, !pip) blanked, line numbers kept."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _dotted(node) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for a chain that starts anywhere but at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def non_public_uses(source: str, modules: dict[str, str] | None = None) -> list[str]:
    """What `source` takes from pplab that no public module's __all__ has, each with where it is public.

    `modules`: the names earlier cells bound to public modules (`from pplab.views import viz`: "viz" ->
    "pplab.views.viz"), updated with this cell's; `pplab` is the package wherever it appears. A path
    (`pplab.rank.mesh.apply_fsdp`) is read from its longest public module on.
    """
    tree = ast.parse(python_of(source))
    modules = {"pplab": "pplab"} if modules is None else modules
    modules.setdefault("pplab", "pplab")
    api, found = public_api(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "pplab":
                    continue
                if alias.name not in IMPORTABLE:
                    found.append(f"import {alias.name}: not a public module")
                modules[alias.asname or "pplab"] = alias.name if alias.asname else "pplab"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pplab":
            for alias in node.names:
                if f"{node.module}.{alias.name}" in api:  # a public module, used by its name
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module not in IMPORTABLE:
                    found.append(f"from {node.module} import {alias.name}: {where_public(alias.name)}")
                elif alias.name not in api[node.module]:
                    found.append(f"{node.module}.{alias.name}: not in its __all__, "
                                 f"{where_public(alias.name)}")
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):  # whole attribute paths: pplab.data.batches, viz.plot_timeline, ...
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts = _dotted(node)
        if parts is None or parts[0] not in modules:
            continue
        path = modules[parts[0]].split(".") + parts[1:]
        cut = max(cut for cut in range(1, len(path)) if ".".join(path[:cut]) in api)
        module, name = ".".join(path[:cut]), path[cut]
        if name not in api[module]:
            found.append(f"{module}.{name}: not in its __all__, {where_public(name)}")
    return found


def documents():
    """Per notebook, solution file, the README and docs/: its Python snippets in order, as (where, source)."""
    for stem in STEMS:
        cells = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4).cells
        yield [(f"{stem}.ipynb cell {index}", cell.source) for index, cell in enumerate(cells)
               if cell.cell_type == "code"]
    for path in sorted((NOTEBOOKS / "solutions").glob("*.py")):
        yield [(f"solutions/{path.name}", path.read_text())]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
        # some sit in a list
        yield [(f"{path.relative_to(ROOT)} python block {number}", textwrap.dedent(block))
               for number, block in enumerate(blocks)]


@pytest.mark.quick
def test_the_notebooks_solutions_readme_and_docs_use_only_the_public_api():
    found = []
    for snippets in documents():
        modules = {}  # a notebook's cells share their names
        found += [f"{where}: {use}" for where, source in snippets for use in non_public_uses(source, modules)]
    assert not found, "\n".join(found)


@pytest.mark.quick
def test_the_public_api_check_names_what_is_not_public_and_where_it_is():
    bad = """%%px
import pplab
from pplab.rank.mesh import apply_fsdp
from pplab.views import viz
from pplab.rank import checks
from pplab.schedules import build, not_a_schedule_name
from pplab.views.viz import plot_timeline, plot_nothing
viz.plot_timeline(pplab.data.batches, pplab.data._split_tokens)
checks.gradient_stats([])
pplab.rank.runtime.gradient_stats
"""
    modules = {}
    assert non_public_uses("from pplab.views import viz as v", modules) == []
    assert modules["v"] == "pplab.views.viz"
    assert non_public_uses("v.save(v.plot_nothing())", modules) == [  # a later cell, no import of its own
        "pplab.views.viz.plot_nothing: not in its __all__, public nowhere"]
    assert non_public_uses("pplab.rank.mesh.apply_fsdp\npplab.run_ranks\npplab.viz.save") == [
        "pplab.run_ranks: not in its __all__, public nowhere",
        "pplab.viz: not in its __all__, public nowhere"]  # the last release's short name
    assert sorted(non_public_uses(bad)) == [
        "pplab.data._split_tokens: not in its __all__, public nowhere",
        "pplab.rank: not in its __all__, public nowhere",
        "pplab.schedules.not_a_schedule_name: not in its __all__, public nowhere",
        "pplab.views.viz.plot_nothing: not in its __all__, public nowhere",
    ]


@pytest.mark.quick
def test_a_checker_whose_inputs_are_gone_says_which_cell_to_run_again(tmp_path):
    from pplab.course import exercises
    from pplab.models.hf import Layout

    said = str(exercises.check_layout(Layout(embed="model.embed_tokens", blocks="model.layers",
                                             norm="model.norm",
                                             head="lm_head"), tmp_path / "removed"))
    assert "the model this checks against is gone" in said and "Re-run the notebook's first code cell" in said


FIGURE_MAKERS = {"plot_timeline", "compare_timelines", "plot_bubbles", "plot_memory", "plot_training"}


def figures_not_shown(source: str) -> list[str]:
    """Calls in a cell that build a figure (pplab.views.viz's, which never draw by themselves) and
    throw it away: anywhere but the cell's last statement, outside display(...)."""
    body = ast.parse(python_of(source)).body
    shown_last = body[-1] if body and isinstance(body[-1], ast.Expr) else None
    lost = []
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Expr) and node is not shown_last and isinstance(node.value, ast.Call):
            path = _dotted(node.value.func)
            if path and path[-1] in FIGURE_MAKERS:
                lost.append(f"line {node.lineno}: {'.'.join(path)}(...)")
    return lost


@pytest.mark.quick
def test_every_figure_a_notebook_cell_builds_is_shown():
    assert figures_not_shown("viz.plot_timeline(t)\nprint(1)") == ["line 1: viz.plot_timeline(...)"]
    assert figures_not_shown("x = 1\nviz.plot_timeline(t)") == []
    in_a_loop = figures_not_shown("for t in ts:\n    viz.compare_timelines(a, b)\n")
    assert in_a_loop == ["line 2: viz.compare_timelines(...)"]
    assert figures_not_shown("display(viz.plot_memory(t))\npipe.close()") == []
    lost = {f"{path.relative_to(ROOT)} cell {i}: {where}"
            for path in sorted(NOTEBOOKS.rglob("*.ipynb"))
            for i, cell in enumerate(nbformat.read(path, as_version=4).cells) if cell.cell_type == "code"
            for where in figures_not_shown(cell.source)}
    assert not lost, ("figures built and never shown (make them the cell's last expression, or "
                      "display(...)):\n" + "\n".join(sorted(lost)))
