"""Honest imports: the core (floors 1-3) loads none of the Jupyter or cluster layers.

Each import runs in a fresh process, so what one check imported cannot hide what another
pulls in. The processes are forked from one helper interpreter, so each check costs a fork
rather than a new interpreter: the pure-Python checks fork from a helper that has imported
nothing, the core checks from one that has imported only torch (and is checked to hold
none of the upper floors: torch pulls in none of them).
"""

import json
import subprocess
import sys
import textwrap
import types

import pytest

import pplab

CORE = ["pplab.base.arguments", "pplab.models.llama", "pplab.data", "pplab.schedules", "pplab.trace.timeline",
        "pplab.trace",
        "pplab.trace.profiled", "pplab.planning.bubble", "pplab.base.formatting",
        "pplab.models.partition", "pplab.planning.simulator", "pplab.planning.prediction", "pplab.rank.comm",
        "pplab.rank.runtime",
        "pplab.rank.step_clock", "pplab.rank.memory", "pplab.rank.split_backward", "pplab.rank.shards",
        "pplab.rank.gradients",
        "pplab.rank.reference", "pplab.rank.checks", "pplab.rank.rank_pipeline", "pplab.drivers.local",
        "pplab.drivers.torchrun", "pplab.rank.torch_pp",
        "pplab.rank.checkpoint", "pplab.base.checkpoint_files", "pplab.rank.train", "pplab.rank.mesh",
        "pplab.rank.profiler",
        "pplab.rank.faults", "pplab.rank.rank_context", "pplab.rank.tied", "pplab.models.hf",
        "pplab.models.traced",
        "pplab.data.text",
        "pplab.session.on_rank"]  # train and the session's rank side run under torchrun: no Jupyter either
UPPER_FLOORS = ["ipyparallel", "IPython", "ipywidgets", "matplotlib", "pplab.drivers.cluster", "pplab.course",
                "pplab.views",
                # the hf extra: loaded on its path only, even by pplab.models.hf
                "transformers", "safetensors", "tokenizers", "datasets"]
PURE_PYTHON = ["pplab", "pplab.schedules", "pplab.trace.timeline", "pplab.trace", "pplab.trace.profiled",
               "pplab.base.formatting",
               "pplab.planning.simulator",
               "pplab.planning.prediction", "pplab.base.checkpoint_files", "pplab.rank.rank_context",
               # not even torch (the CLI builds its flags from run's fields)
               "pplab.base.config", "pplab.session.run", "pplab.cli"]



CHECKS = textwrap.dedent("""
    import json, os, sys

    def loaded_after_import(module, watched):
        # In a forked child: import `module`, then say which of `watched` (with submodules) it loaded.
        read, write = os.pipe()
        if os.fork() == 0:
            os.close(read)
            try:
                __import__(module)
                found = sorted({w for w in watched for name in sys.modules
                                if name == w or name.startswith(w + ".")})
                answer = {"loaded": found}
            except BaseException as error:
                answer = {"error": f"{type(error).__name__}: {error}"}
            os.write(write, json.dumps(answer).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            answer = json.loads(pipe.read() or '{"error": "the child died"}')
        os.wait()
        return answer

    pure, core, upper = json.loads(sys.argv[1])
    results = {"pure": {m: loaded_after_import(m, ["torch", *upper]) for m in pure}}
    import torch  # noqa: F401  (what every core module loads anyway)
    results["torch alone"] = sorted({w for w in upper for name in sys.modules
                                     if name == w or name.startswith(w + ".")})
    results["core"] = {m: loaded_after_import(m, upper) for m in core}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def imports_seen() -> dict:
    """What each checked module loads, each import in a fresh forked process."""
    done = subprocess.run([sys.executable, "-c", CHECKS, json.dumps([PURE_PYTHON, CORE, UPPER_FLOORS])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["torch alone"] == [], (f"torch itself loads {seen['torch alone']}: the core checks need a "
                                       f"fresh interpreter each")
    return seen


def loaded(answer: dict) -> list[str]:
    assert "error" not in answer, answer.get("error")
    return answer["loaded"]


@pytest.mark.parametrize("module", CORE)
def test_core_module_loads_no_upper_floor(module, imports_seen):
    assert loaded(imports_seen["core"][module]) == [], f"import {module} pulled in an upper floor"


@pytest.mark.parametrize("module", PURE_PYTHON)
def test_schedules_trace_and_simulator_load_no_torch(module, imports_seen):
    assert loaded(imports_seen["pure"][module]) == [], f"import {module} is not pure Python"


def test_the_top_level_names_load_on_first_use():
    script = ("import sys, pplab\n"
              "assert 'pplab.drivers.cluster' not in sys.modules\n"
              "lab_class = pplab.Lab\n"
              "assert 'pplab.drivers.cluster' in sys.modules and lab_class.__module__ == 'pplab.views.lab'\n"
              # a fresh kernel's lab starts without importing torch (1-2 s): the engines import their own
              "assert 'torch' not in sys.modules, 'pplab.Lab imports torch'\n"
              "assert 'matplotlib' not in sys.modules\n"
              "pplab.views.viz\n"
              "assert 'matplotlib' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_advertised_name_resolves_and_dir_lists_it():
    from pplab import schedules

    for name in pplab.__all__:
        assert getattr(pplab, name) is not None, name
    assert set(pplab.__all__) <= set(dir(pplab))
    assert {"Lab", "cleanup", "LlamaConfig", "simulate", "Timeline"} <= set(pplab.__all__)
    # The schedule API is used from its module, not from the top level.
    assert pplab.schedules is schedules
    assert not hasattr(pplab, "build_schedule") and not hasattr(pplab, "Schedule")
    assert pplab.drivers.cluster.LabError.__name__ == "LabError"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        pplab.not_a_name  # noqa: B018


def test_nothing_but_the_public_names_is_on_the_top_level():
    """(The README's table lists them: tests/test_surface.py.)"""
    for name in pplab.__all__:  # every name resolved: what lands in the module is public or private
        getattr(pplab, name)
    # Python binds each imported submodule on its package: the floors' own modules are there, unlisted.
    loose = [name for name, value in vars(pplab).items()
             if not name.startswith("_") and name not in pplab.__all__
             and not (isinstance(value, types.ModuleType) and value.__name__ == f"pplab.{name}")]
    assert loose == [], f"on pplab's surface but not public: {loose} (give them a leading underscore)"
    assert [name for name in dir(pplab) if not name.startswith("__")] == sorted(pplab.__all__)
