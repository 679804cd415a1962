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
    """Each public module ("pplab", "pplab.viz", ...) -> the names its __all__ makes public."""
    api = {"pplab": set(pplab.__all__)}
    for short, module in pplab._MODULES.items():
        api[f"pplab.{short}"] = set(importlib.import_module(module).__all__)
    return api


# Every public module is importable by its short name (`from pplab.viz import save`, `import pplab.model`),
# wherever its file lives.
IMPORTABLE = {"pplab"} | {f"pplab.{short}" for short in pplab._MODULES}


def where_public(name: str) -> str:
    homes = sorted(f"{module}.{name}" for module, names in public_api().items() if name in names)
    return f"public as {' or '.join(homes)}" if homes else "public nowhere"


def python_of(source: str) -> str:
    """A cell's Python: magics (%%px, %matplotlib, !pip) blanked, line numbers kept."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def non_public_uses(source: str, modules: dict[str, str] | None = None) -> list[str]:
    """What `source` takes from pplab that no public module's __all__ has, each with where it is public.

    `modules`: the names earlier cells bound to public modules (`from pplab import viz`: "viz" ->
    "pplab.viz"), updated with this cell's; `pplab` is the package wherever it appears.
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
                if node.module not in IMPORTABLE:
                    found.append(f"from {node.module} import {alias.name}: {where_public(alias.name)}")
                elif alias.name not in api[node.module]:
                    found.append(f"{node.module}.{alias.name}: not in its __all__, "
                                 f"{where_public(alias.name)}")
                elif f"{node.module}.{alias.name}" in api:  # a public module, used by its name
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):  # attribute paths: pplab.data.batches, viz.plot_timeline, ...
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            module = modules[node.value.id]
            if node.attr not in api[module]:
                found.append(f"{module}.{node.attr}: not in its __all__, {where_public(node.attr)}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and modules.get(node.value.value.id) == "pplab"
              and f"pplab.{node.value.attr}" in api and node.attr not in api[f"pplab.{node.value.attr}"]):
            found.append(f"pplab.{node.value.attr}.{node.attr}: not in its __all__, "
                         f"{where_public(node.attr)}")
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
from pplab import viz, checks
from pplab.schedules import build, not_a_schedule_name
from pplab.viz import plot_timeline, plot_nothing
viz.plot_timeline(pplab.data.batches, pplab.data._split_tokens)
checks.gradient_stats([])
pplab.rank.runtime.gradient_stats
"""
    modules = {}
    assert non_public_uses("from pplab import viz as v", modules) == [] and modules["v"] == "pplab.viz"
    assert non_public_uses("v.save(v.plot_nothing())", modules) == [  # a later cell, no import of its own
        "pplab.viz.plot_nothing: not in its __all__, public nowhere"]
    assert non_public_uses("pplab.mesh.apply_fsdp\npplab.run_ranks") == [
        "pplab.run_ranks: not in its __all__, public nowhere"]
    assert sorted(non_public_uses(bad)) == [
        "from pplab.rank.mesh import apply_fsdp: public as pplab.mesh.apply_fsdp",
        "pplab.data._split_tokens: not in its __all__, public nowhere",
        "pplab.rank: not in its __all__, public nowhere",
        "pplab.schedules.not_a_schedule_name: not in its __all__, public nowhere",
        "pplab.viz.plot_nothing: not in its __all__, public nowhere",
    ]


@pytest.mark.quick
def test_a_checker_whose_inputs_are_gone_says_which_cell_to_run_again(tmp_path):
    from pplab import exercises
    from pplab.hf import Layout

    said = str(exercises.check_layout(Layout(embed="model.embed_tokens", blocks="model.layers",
                                             norm="model.norm",
                                             head="lm_head"), tmp_path / "removed"))
    assert "the model this checks against is gone" in said and "Re-run the notebook's first code cell" in said
