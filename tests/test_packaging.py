"""The project's own files stay consistent: environment.yml vs pyproject, README vs CI."""

import re
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def requirement_names(requirements):
    return {re.split(r"[<>=!~\[ ]", r.strip())[0].lower() for r in requirements}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    conda_names = {"torch": "pytorch", "xxhash": "python-xxhash"}  # where conda-forge names them otherwise
    wanted = {conda_names.get(name, name) for name in wanted}
    listed = {re.split(r"[<>=!~ ]", line.strip()[2:])[0].lower()
              for line in (ROOT / "environment.yml").read_text().split("dependencies:")[1].splitlines()
              if line.startswith("  - ") and not line.strip().startswith("- pip")}
    assert wanted <= listed, f"environment.yml lacks {sorted(wanted - listed)}"
    assert listed - wanted <= {"python"}, f"environment.yml has extra {sorted(listed - wanted - {'python'})}"


def test_ci_runs_the_readme_test_command():
    command = subprocess.run(
        ["awk", '/<!-- test-command/ {found=1; next} found && /^pip install/ {print; exit}',
         str(ROOT / "README.md")], capture_output=True, text=True, check=True).stdout.strip()
    assert command.startswith("pip install torch==2.13.0") and "pytest" in command
    assert (ROOT / ".ci/run").read_text().count("test-command") >= 1


def test_version_has_one_source_that_the_installed_metadata_agrees_with():
    import importlib.metadata

    import pplab

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in setuptools["project"] and "version" in setuptools["project"]["dynamic"]
    assert setuptools["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pplab._version.__version__"}
    written = [path for path in (ROOT / "pplab").rglob("*.py") if re.search(r"^__version__ = ",
                                                                            path.read_text(), re.M)]
    assert written == [ROOT / "pplab" / "_version.py"], written
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", pplab.__version__)
    assert importlib.metadata.version("pplab") == pplab.__version__, "reinstall: pip install -e ."


def test_every_package_data_pattern_matches_a_file():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, patterns in setuptools.get("package-data", {}).items():
        for pattern in patterns:
            matched = list((ROOT / package.replace(".", "/")).glob(pattern))
            assert matched, f"{package}: {pattern} matches nothing"
