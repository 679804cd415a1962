"""The folders are the floors: every import in pplab goes to its own floor or a lower one, and
no modules import each other in a circle. Read from the source, imports inside functions included
(a lazy import is still a dependency)."""

import ast
import re
from pathlib import Path

import pytest

import pplab

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

PACKAGE = Path(pplab.__file__).parent
COMMAND = 8  # cli/ and __main__.py: the `pplab` command


def floor_of_folder(folder: Path) -> int:
    """A folder's floor, as its docstring says it first: "Floor N, ..."."""
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    match = re.match(r"Floor (\d+), ", docstring)
    if not match:
        raise ValueError(f"pplab/{folder.name}/__init__.py does not begin 'Floor N, ': its floor is unknown")
    return int(match.group(1))


# The floors are the folders: each says its own in its docstring (the README's layout follows them).
FOLDER_FLOORS = {path.parent.name: floor_of_folder(path.parent)
                 for path in sorted(PACKAGE.glob("*/__init__.py"))}


def test_a_folder_inside_a_floor_says_it_is_part_of_that_floor():
    """A folder within a floor's folder (drivers/cluster/, views/widgets/) is on its parent's floor,
    and its docstring's first line says so, so that a reader who opens it first knows where it stands."""
    nested = sorted(PACKAGE.glob("*/*/__init__.py"))
    assert nested, "no folder within a floor's folder: this test has nothing to check"
    for path in nested:
        parent, folder = path.parent.parent.name, path.parent.name
        first_line = (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()[0]
        said = f"part of floor {FOLDER_FLOORS[parent]}, {parent}/"
        assert said in first_line, (f"pplab/{parent}/{folder}/__init__.py's first line should say '{said}': "
                                    f"{first_line!r}")
# the only modules outside a folder: the version, `python -m pplab`
LOOSE = {"_version": 1, "__main__": COMMAND}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    """The floor of a pplab module, from the folder it lives in."""
    parts = module.split(".")[1:]
    if not parts:
        raise ValueError("pplab itself has no floor")
    return FOLDER_FLOORS[parts[0]] if parts[0] in FOLDER_FLOORS else LOOSE[parts[0]]


def imports_of(path: Path) -> set[str]:
    """The pplab modules a file imports, anywhere in it (`from a import b` counts b if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("pplab.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pplab"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {name for name in found if name != "pplab"}


# `pplab/__init__.py` is the front door: it names every floor's public parts, loading each on use.
FILES = {module_name(path): path for path in PACKAGE.rglob("*.py") if path != PACKAGE / "__init__.py"}
MODULES = set(FILES)
IMPORTS = {module: imports_of(path) for module, path in FILES.items()}


def test_every_module_has_a_floor():
    assert [module for module in MODULES if floor(module) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_or_stay_on_the_floor(module):
    upward = sorted(f"{name} (floor {floor(name)})" for name in IMPORTS[module]
                    if name in MODULES and floor(name) > floor(module))
    assert upward == [], f"{module} (floor {floor(module)}) imports from above: {upward}"


def through_the_front_door(node: ast.AST) -> bool:
    """`from pplab import x` or `import pplab` (then `pplab.x`): x loads lazily, from any floor."""
    return ((isinstance(node, ast.ImportFrom) and node.module == "pplab")
            or (isinstance(node, ast.Import) and any(alias.name == "pplab" for alias in node.names)))


def test_no_module_imports_through_the_front_door():
    """The front door's names hide their floors from these checks (the room drill's seats took
    pplab.Lab, the notebook's, from the course floor below it)."""
    front_door = sorted(module for module, path in FILES.items()
                        for node in ast.walk(ast.parse(path.read_text()))
                        if through_the_front_door(node))
    assert front_door == [], f"these modules import pplab itself: {front_door}"


def test_no_modules_import_each_other_in_a_circle():
    edges = {module: {name for name in IMPORTS[module] if name in MODULES} for module in MODULES}
    # A package imports its own modules to offer their names; a module asking its package for a
    # sibling's name is no circle of modules, so a package's edges to its own submodules are left out.
    for module in edges:
        edges[module] = {name for name in edges[module] if not name.startswith(module + ".")}
    done, on_path, circles = set(), [], []

    def visit(module):
        if module in on_path:
            circles.append(on_path[on_path.index(module):] + [module])
            return
        if module in done:
            return
        on_path.append(module)
        for name in sorted(edges[module]):
            visit(name)
        on_path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)
    assert circles == [], "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_every_module_but_two_lives_in_a_floors_folder():
    loose = sorted(path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert loose == sorted(LOOSE), f"modules outside the floors' folders: {sorted(set(loose) - set(LOOSE))}"


def test_the_floors_are_what_the_readme_says():
    """Each folder's docstring gives its floor; the README's layout says the same, floor by floor."""
    readme = (PACKAGE.parent / "README.md").read_text()
    assert FOLDER_FLOORS["cli"] == COMMAND
    for number in sorted(set(FOLDER_FLOORS.values())):
        folders = ", ".join(f"`{folder}/`" for folder, floor in FOLDER_FLOORS.items() if floor == number)
        assert f"**floor {number}**, {folders}" in readme, \
            f"the README's layout does not say **floor {number}**, {folders}"


def test_pplab_itself_imports_modules_by_where_they_live():
    """Inside pplab, no import goes through a public short name (pplab.models.llama for pplab.models.llama):
    those hide a module's floor from these checks."""
    aliases = sorted(f"{module}: {name}" for module in MODULES for name in IMPORTS[module]
                     if name not in MODULES)
    assert aliases == []
