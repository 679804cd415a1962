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
`import pplab.schedules` (or `trace`, `simulator`) loads neither torch nor the
cluster layer (ipyparallel) nor matplotlib. Schedules are used from their own
module, as the notebooks do: `from pplab.schedules import build, theory`; the public
modules of the upper floors by their short names: `from pplab import viz, checkpoint`,
`import pplab.checkpoint` or `from pplab.viz import save` (each is the module itself, not a copy).

The public API is `__all__` here and the `__all__` of each public module (`_MODULES`);
the notebooks, their solutions and the README use nothing else (tests/test_course.py).
"""

import importlib as _importlib
import sys as _sys
from importlib.util import spec_from_loader as _spec_from_loader
from typing import TYPE_CHECKING as _TYPE_CHECKING

from pplab._version import __version__  # noqa: F401  (written in _version.py alone)

# public name -> the module that defines it
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
    "TrainOptions": "pplab.base.config",
    "load_model": "pplab.rank.checkpoint",
    "Mesh": "pplab.rank.mesh",
    "profile": "pplab.rank.profiler",
    "hop_costs_on_rank": "pplab.rank.profiler",  # run on two ranks: the time of one hop between them
    "predict": "pplab.planning.prediction",
    "search": "pplab.planning.search",  # floor 2: it runs the simulator
    "search_balance": "pplab.planning.balance",
    "stage_costs": "pplab.planning.balance",  # a balance's per-stage costs, from per-layer ones
    "Lab": "pplab.views.lab",  # engines as ranks, from Jupyter: pipelines with live views
    "RankPool": "pplab.session",  # the same on local processes: command line, tests, scripts
    "TorchrunRanks": "pplab.session",  # in a torchrun script: this process is one rank
    "Pipeline": "pplab.session",  # what lab.pipeline(...) and pool.pipeline(...) build
    "cleanup": "pplab.drivers.cluster",
}
# public module -> where it lives (`pplab.viz`, `from pplab import checkpoint`)
_MODULES = {
    "model": "pplab.models.llama", "data": "pplab.data", "schedules": "pplab.schedules",
    "trace": "pplab.trace",
    "simulator": "pplab.planning.simulator", "comm": "pplab.rank.comm", "viz": "pplab.views.viz",
    "widgets": "pplab.views.widgets",
    "exercises": "pplab.course.exercises", "checks": "pplab.rank.checks",
    "checkpoint": "pplab.rank.checkpoint",
    "train": "pplab.rank.train", "mesh": "pplab.rank.mesh", "faults": "pplab.rank.faults",
    "cluster": "pplab.drivers.cluster", "session": "pplab.session",
    "hf": "pplab.models.hf",  # Hugging Face models as stages (pip install 'pplab[hf]')
    "traced": "pplab.models.traced",  # any module, cut by torch's tracer
    "text": "pplab.data.text",  # documents, a byte-level BPE, packed sequences (tokenizers: the hf extra)
    "run": "pplab.session.run",  # one training run from one configuration: run.train(...), RunConfig
    "bubble": "pplab.planning.bubble",  # where a measured step's bubble went, and what would shrink it
    "machine": "pplab.base.machine",  # how busy this machine is: what waits and predictions scale with
    "hub": "pplab.course.hub",  # a workshop on JupyterHub (pip install 'pplab[hub]')
}

__all__ = [*_EXPORTS, *_MODULES]

if _TYPE_CHECKING:  # what static checkers and editors see
    from pplab import data, schedules, session, trace
    from pplab.base import machine
    from pplab.base.config import TrainOptions
    from pplab.course import exercises, hub
    from pplab.data import text
    from pplab.drivers import cluster
    from pplab.drivers.cluster import cleanup
    from pplab.models import hf, traced
    from pplab.models import llama as model
    from pplab.models.llama import LlamaConfig, LlamaModel, build_model, generate
    from pplab.models.partition import build_stage, layer_ranges
    from pplab.planning import bubble, simulator
    from pplab.planning.balance import search_balance, stage_costs
    from pplab.planning.prediction import predict
    from pplab.planning.search import search
    from pplab.planning.simulator import Costs, simulate
    from pplab.rank import checkpoint, checks, comm, faults, mesh, train
    from pplab.rank.checkpoint import load_model
    from pplab.rank.mesh import Mesh
    from pplab.rank.profiler import hop_costs_on_rank, profile
    from pplab.rank.reference import reference_step
    from pplab.session import Pipeline, RankPool, TorchrunRanks, run
    from pplab.trace.timeline import Event, Timeline
    from pplab.views import viz, widgets
    from pplab.views.lab import Lab


class _PublicModules:
    """`import pplab.viz`, `from pplab.checkpoint import load_model`: a public module by its short
    name is the module itself (one object, in sys.modules under both names), and so is a module
    inside a public package (`pplab.cluster.records` is `pplab.drivers.cluster.records`)."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        package, _, rest = fullname.partition(".")
        short, _, inner = rest.partition(".")
        # pplab.base holds the table of moved modules: finding it must not look the table up
        if package != "pplab" or short == "base" or short not in {**_MODULES, **_moved_modules()} \
                or _MODULES.get(short) == f"pplab.{short}":
            return None
        return _spec_from_loader(fullname, _PublicModules)

    @staticmethod
    def create_module(spec):
        short, _, inner = spec.name.removeprefix("pplab.").partition(".")
        return _importlib.import_module(_module_of(short) + (f".{inner}" if inner else ""))

    @staticmethod
    def exec_module(module):
        pass  # it ran when it was imported under its own name


_sys.meta_path.insert(0, _PublicModules)

def _moved_modules() -> dict:
    """Public modules that joined another, kept for one release (pplab.base.renames): short name -> row."""
    from pplab.base.renames import rows

    return rows("module", "pplab")


def _module_of(short: str) -> str:
    """Where the public module `short` lives (a moved one's old module, with a DeprecationWarning)."""
    moved = _moved_modules().get(short)
    if moved is not None:
        from pplab.base.renames import warn

        warn(moved, stacklevel=3)  # the user's line
        return f"{moved.new}.{moved.old}"  # the old module lives on inside the one that holds it now
    return _MODULES[short]


def __getattr__(name: str):
    from pplab.base.renames import renamed_attribute

    renamed = renamed_attribute("pplab", name)
    if renamed is not None:
        return __getattr__(renamed.new.rpartition(".")[2])
    if name in _MODULES or name in _moved_modules():
        return _importlib.import_module(_module_of(name))
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pplab' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    """The public names (the floors' own modules, bound here once imported, are not among them)."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
