"""The public surface, held in one's head: every public name at one path, all of them listed in the
README's table, fewer than 120 in all, one class per error and one `Lab` a user meets."""

import importlib
import re
from pathlib import Path

import pytest

import pplab

pytestmark = pytest.mark.quick

README = Path(__file__).resolve().parents[1] / "README.md"
MOST_NAMES = 120


def public_names() -> set[tuple[str, str]]:
    """(module, name) for every public name: pplab.__all__ and each public module's __all__."""
    found = {("pplab", name) for name in pplab.__all__}
    for module in pplab._PUBLIC_MODULES:
        found |= {(module, name) for name in importlib.import_module(module).__all__}
    return found


def readme_table() -> set[tuple[str, str]]:
    """(module, name) for every name the README's table of the public API lists."""
    section = README.read_text().split("## The public API\n", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in re.findall(r"^\| `([\w.]+)` \| (.+?) \|", section, re.M):
        listed |= {(row[0], name) for name in re.findall(r"`(\w+)`", row[1])}
    return listed


def test_the_readme_table_lists_every_public_name_and_nothing_else():
    public, listed = public_names(), readme_table()
    assert not public - listed, f"public, not in the README's table: {sorted(public - listed)}"
    assert not listed - public, f"in the README's table, not public: {sorted(listed - public)}"


def test_fewer_than_120_public_names_each_at_one_path():
    public = public_names()
    assert len(public) < MOST_NAMES, len(public)
    paths = {}
    for module, name in public:
        paths.setdefault(name, []).append(module)
    assert {name: where for name, where in paths.items() if len(where) > 1} == {}
    count = re.search(r"all of it: (\d+) names", README.read_text())
    assert count is not None and int(count.group(1)) == len(public)  # the README says how many


def test_a_public_module_has_one_path_its_folder_and_no_other_answers_to_it():
    for module in pplab._PUBLIC_MODULES:
        assert importlib.import_module(module).__name__ == module
    assert set(pplab.__all__).isdisjoint(name.rpartition(".")[2] for name in pplab._PUBLIC_MODULES)


def test_one_class_per_error_and_one_lab_a_user_meets():
    import pplab.session

    classes = {}  # every public exception, by name
    for module, name in public_names():
        value = getattr(importlib.import_module(module), name)
        if isinstance(value, type) and issubclass(value, BaseException):
            classes.setdefault(name, set()).add(value)
            assert name.endswith(("Error", "Warning")), name
    assert all(len(kinds) == 1 for kinds in classes.values()), classes
    from pplab.drivers.cluster import calls
    from pplab.drivers.cluster import errors as lab_errors

    assert calls.RankFailedError is pplab.session.RankFailedError
    assert not {"RankFailedError", "RankDiedError", "RankTimeoutError"} & set(vars(lab_errors))
    labs = {module for module, name in public_names() if name == "Lab"}
    assert labs == {"pplab"}
