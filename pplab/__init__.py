"""pplab: a lab kit to understand, teach and measure pipeline parallelism in PyTorch.

Every name below loads its module on first use: `import pplab` is instant, and
`import pplab.schedules` (or `trace`, `simulator`) loads neither torch nor the
cluster layer (ipyparallel) nor matplotlib. Schedules are used from their own
module, as the notebooks do: `from pplab.schedules import build, theory`.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

# public name -> the module that defines it
_EXPORTS = {
    "LlamaConfig": "pplab.model",
    "LlamaModel": "pplab.model",
    "build_model": "pplab.model",
    "generate": "pplab.model",
    "build_stage": "pplab.partition",
    "layer_ranges": "pplab.partition",
    "reference_step": "pplab.reference",
    "simulate": "pplab.simulator",
    "Costs": "pplab.simulator",
    "Event": "pplab.trace",
    "Timeline": "pplab.trace",
    "TrainOptions": "pplab.train",
    "load_model": "pplab.checkpoint",
    "Mesh": "pplab.mesh",
    "profile": "pplab.profiler",
    "predict": "pplab.prediction",
    "search": "pplab.schedule_search",  # floor 2: it runs the simulator, so it sits beside it
    "search_balance": "pplab.schedule_search",
    "Lab": "pplab.session",  # floor 5: a lab of engines as ranks that builds pipelines, from Jupyter
    "RankPool": "pplab.session",  # the same on local processes: command line, tests, scripts
    "cleanup": "pplab.cluster",
}
_MODULES = ("data", "schedules", "trace", "viz", "checkpoint", "train", "mesh", "faults")

# Reachable as attributes after a bare `import pplab` (e.g. `pplab.cluster.LabError`).
_SUBPACKAGES = ("cluster",)

__all__ = [*_EXPORTS, *_MODULES]

if _TYPE_CHECKING:  # what static checkers and editors see
    from pplab import checkpoint, data, faults, mesh, schedules, train, trace, viz
    from pplab.checkpoint import load_model
    from pplab.cluster import cleanup
    from pplab.mesh import Mesh
    from pplab.model import LlamaConfig, LlamaModel, build_model, generate
    from pplab.partition import build_stage, layer_ranges
    from pplab.prediction import predict
    from pplab.profiler import profile
    from pplab.reference import reference_step
    from pplab.schedule_search import search, search_balance
    from pplab.session import Lab, RankPool
    from pplab.simulator import Costs, simulate
    from pplab.trace import Event, Timeline
    from pplab.train import TrainOptions


def __getattr__(name: str):
    if name in _MODULES or name in _SUBPACKAGES:
        return _importlib.import_module(f"pplab.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pplab' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})
