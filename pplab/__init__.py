"""pplab: a lab kit to understand, teach and measure pipeline parallelism in PyTorch.

The folders are the floors; lower floors never import higher ones:

    pplab/base/, schedules/, models/, data/, trace/
                             floor 1: checks and the one configuration, schedules as data,
                             the model, data, the event model
    pplab/planning/          floor 2: simulator, prediction, search, the bubble explained
    pplab/rank/              what runs on a rank: runtime, torch's schedules, mesh,
                             checks, checkpoints, training
    pplab/drivers/           where ranks live: local processes, torchrun, a cluster of engines
    pplab/session/           the client side of a pipeline, over any driver
    pplab/course/            the workshop: the exercises' checkers, the room, its drill
    pplab/views/             pictures, live widgets, the notebook's Lab
    pplab/cli/               the `pplab` command, one module per subcommand

Every name below loads its module on first use: `import pplab` is instant, and
`import pplab.schedules` (or `trace`, `planning.simulator`) loads neither torch nor the
cluster layer (ipyparallel) nor matplotlib. A public module has one path, the folder it
lives in: `from pplab.schedules import build, theory`, `from pplab.views import viz`,
`pplab.rank.checkpoint.latest(...)` (the floors load on first use, after a bare `import pplab`).

The public API is `__all__` here and the `__all__` of each module in `_PUBLIC_MODULES`; each
name is public at one path; the README's surface table lists them all (tests/test_surface.py),
and the notebooks, their solutions and the docs use nothing else (tests/test_course.py).
"""

import importlib as _importlib
import sys as _sys
from importlib.util import spec_from_loader as _spec_from_loader
from typing import TYPE_CHECKING as _TYPE_CHECKING

from pplab._version import __version__  # noqa: F401  (written in _version.py alone)

# public name -> the module that defines it: the entry points the lessons use, each at this one path
_EXPORTS = {
    "LlamaConfig": "pplab.models.llama",
    "LlamaModel": "pplab.models.llama",
    "build_model": "pplab.models.llama",
    "generate": "pplab.models.llama",
    "build_stage": "pplab.models.partition",
    "layer_ranges": "pplab.models.partition",
    "reference_step": "pplab.rank.reference",
    "simulate": "pplab.planning.simulator",
    "Costs": "pplab.planning.simulator",
    "Event": "pplab.trace.timeline",
    "Timeline": "pplab.trace.timeline",
    "Mesh": "pplab.rank.mesh",
    "profile": "pplab.rank.profiler",
    "hop_costs_on_rank": "pplab.rank.profiler",  # run on two ranks: the time of one hop between them
    "predict": "pplab.planning.prediction",
    "doctor": "pplab.planning.doctor",  # what torch's runtime will run for a schedule, and its stalls
    "search": "pplab.planning.search",  # floor 2: it runs the simulator
    "search_balance": "pplab.planning.balance",
    "stage_costs": "pplab.planning.balance",  # a balance's per-stage costs, from per-layer ones
    "layer_layout": "pplab.models.layouts",  # a balance as torchtitan's or Megatron's layout
    "balance_of_layout": "pplab.models.layouts",  # and back
    "Lab": "pplab.views.lab",  # engines as ranks, from Jupyter: pipelines with live views
    "RankPool": "pplab.session",  # the same on local processes: command line, tests, scripts
    "TorchrunRanks": "pplab.session",  # in a torchrun script: this process is one rank
    "Pipeline": "pplab.session",  # what lab.pipeline(...) and pool.pipeline(...) build
    "cleanup": "pplab.drivers.cluster",
}
# The public modules, each at its one path (the folder it lives in); the names their __all__ holds.
_PUBLIC_MODULES = (
    "pplab.schedules", "pplab.trace", "pplab.data", "pplab.data.text",
    "pplab.models.llama", "pplab.models.hf", "pplab.models.traced",
    "pplab.planning.bubble", "pplab.base.machine",
    "pplab.rank.comm", "pplab.rank.checks", "pplab.rank.checkpoint", "pplab.rank.train", "pplab.rank.mesh",
    "pplab.rank.faults",
    "pplab.drivers.cluster", "pplab.session", "pplab.session.run",
    "pplab.course.exercises", "pplab.course.hub",
    "pplab.views.viz", "pplab.views.widgets",
)
# the floors: `pplab.rank.mesh.apply_fsdp` after a bare `import pplab` (each loads on first use)
_FLOORS = ("base", "schedules", "models", "data", "trace", "planning", "rank", "drivers", "session", "course",
           "views", "cli")

__all__ = [*_EXPORTS]

if _TYPE_CHECKING:  # what static checkers and editors see
    from pplab.drivers.cluster import cleanup
    from pplab.models.layouts import balance_of_layout, layer_layout
    from pplab.models.llama import LlamaConfig, LlamaModel, build_model, generate
    from pplab.models.partition import build_stage, layer_ranges
    from pplab.planning.balance import search_balance, stage_costs
    from pplab.planning.doctor import doctor
    from pplab.planning.prediction import predict
    from pplab.planning.search import search
    from pplab.planning.simulator import Costs, simulate
    from pplab.rank.mesh import Mesh
    from pplab.rank.profiler import hop_costs_on_rank, profile
    from pplab.rank.reference import reference_step
    from pplab.session import Pipeline, RankPool, TorchrunRanks
    from pplab.trace.timeline import Event, Timeline
    from pplab.views.lab import Lab


class _LastReleasesModules:
    """`import pplab.viz`, `from pplab.checkpoint import load_model`: the last release's short names
    of the public modules, each the module at its one path now (the same object, in sys.modules under
    both names), with a DeprecationWarning naming that path (pplab.base.renames)."""

    specs = {}  # a module's own spec, kept while its old name is imported

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        package, _, rest = fullname.partition(".")
        short, _, inner = rest.partition(".")
        # pplab.base holds the table: finding it, or any floor, must not look the table up
        if package != "pplab" or short in _FLOORS or short not in _moved_modules():
            return None
        return _spec_from_loader(fullname, _LastReleasesModules)

    @staticmethod
    def create_module(spec):
        short, _, inner = spec.name.removeprefix("pplab.").partition(".")
        module = _importlib.import_module(_module_of(short) + (f".{inner}" if inner else ""))
        _LastReleasesModules.specs[module.__name__] = module.__spec__
        return module

    @staticmethod
    def exec_module(module):
        # it ran when it was imported under its own name, which its spec keeps (the import of the old
        # name wrote that name's spec over it: `importlib.reload` would look for the old name)
        module.__spec__ = _LastReleasesModules.specs.pop(module.__name__)


_sys.meta_path.insert(0, _LastReleasesModules)


def _moved_modules() -> dict:
    """The last release's short names of modules (pplab.base.renames): short name -> row."""
    from pplab.base.renames import rows

    return rows("module", "pplab")


def _module_of(short: str) -> str:
    """The module a short name of the last release stands for, said in a DeprecationWarning."""
    from pplab.base.renames import warn

    moved = _moved_modules()[short]
    warn(moved, stacklevel=3)  # the user's line
    return moved.new


def __getattr__(name: str):
    if name in _FLOORS:  # pplab.rank.mesh: each floor, and each public module in it, loads on first use
        return _importlib.import_module(f"pplab.{name}")
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # found directly from now on
        return value
    from pplab.base.renames import renamed_attribute, resolve

    renamed = renamed_attribute("pplab", name)
    if renamed is not None:
        return resolve(renamed.new)
    if name in _moved_modules():
        return _importlib.import_module(_module_of(name))
    raise AttributeError(f"module 'pplab' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (the floors, bound here once imported, are not among them)."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
