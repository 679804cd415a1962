"""Honest imports: the core (floors 1-3) loads none of the Jupyter or cluster layers.

Each import runs in a fresh interpreter, so what one test imported cannot hide
what another pulls in.
"""

import json
import subprocess
import sys

import pytest

import pplab

CORE = ["pplab.arguments", "pplab.model", "pplab.data", "pplab.schedules", "pplab.trace", "pplab.formatting",
        "pplab.partition", "pplab.simulator", "pplab.prediction", "pplab.comm", "pplab.runtime",
        "pplab.step_clock", "pplab.memory", "pplab.split_backward", "pplab.shards", "pplab.gradients",
        "pplab.reference", "pplab.checks", "pplab.rank_pipeline", "pplab.launch", "pplab.torch_pp",
        "pplab.checkpoint", "pplab.checkpoint_files", "pplab.train", "pplab.mesh", "pplab.profiler",
        "pplab.faults"]  # train is floor 4 but runs under torchrun: no Jupyter either
UPPER_FLOORS = ["ipyparallel", "IPython", "ipywidgets", "matplotlib", "pplab.cluster"]
PURE_PYTHON = ["pplab", "pplab.schedules", "pplab.trace", "pplab.formatting", "pplab.simulator",
               "pplab.prediction", "pplab.checkpoint_files"]  # not even torch


def loaded_after_import(module: str, watched: list[str]) -> list[str]:
    """Which of `watched` (packages, with their submodules) a fresh `import module` loads."""
    script = (f"import json, sys\nimport {module}\n"
              f"print(json.dumps(sorted({{w for w in {watched!r} for name in sys.modules "
              f"if name == w or name.startswith(w + '.')}})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", CORE)
def test_core_module_loads_no_upper_floor(module):
    assert loaded_after_import(module, UPPER_FLOORS) == [], f"import {module} pulled in an upper floor"


@pytest.mark.parametrize("module", PURE_PYTHON)
def test_schedules_trace_and_simulator_load_no_torch(module):
    assert loaded_after_import(module, ["torch", *UPPER_FLOORS]) == [], f"import {module} is not pure Python"


def test_the_top_level_names_load_on_first_use():
    script = ("import sys, pplab\n"
              "assert 'pplab.cluster' not in sys.modules\n"
              "lab_class = pplab.Lab\n"
              "assert 'pplab.cluster' in sys.modules and lab_class.__module__ == 'pplab.cluster.lab'\n"
              "assert 'matplotlib' not in sys.modules\n"
              "pplab.viz\n"
              "assert 'matplotlib' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_advertised_name_resolves_and_dir_lists_it():
    from pplab import schedules

    for name in pplab.__all__:
        assert getattr(pplab, name) is not None, name
    assert set(pplab.__all__) <= set(dir(pplab))
    assert {"Lab", "cleanup", "LlamaConfig", "simulate", "Timeline", "schedules", "viz"} <= set(pplab.__all__)
    # The schedule API is used from its module, not from the top level.
    assert pplab.schedules is schedules
    assert not hasattr(pplab, "build_schedule") and not hasattr(pplab, "Schedule")
    assert pplab.cluster.LabError.__name__ == "LabError"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        pplab.not_a_name  # noqa: B018
