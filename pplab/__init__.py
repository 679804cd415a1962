"""pplab: a lab kit to understand, teach and measure pipeline parallelism in PyTorch."""

from pplab.model import LlamaConfig, LlamaModel, build_model
from pplab.partition import build_stage, layer_ranges, stages_of_rank
from pplab.reference import reference_step
from pplab.schedules import Action, Kind, Schedule, ScheduleError, Theory
from pplab.schedules import build as build_schedule
from pplab.simulator import Costs, simulate
from pplab.trace import Event, Timeline
from pplab import data, trace

__all__ = [
    "simulate",
    "Costs",
    "Event",
    "Timeline",
    "trace",
    "viz",
    "LlamaConfig",
    "LlamaModel",
    "build_model",
    "build_stage",
    "layer_ranges",
    "stages_of_rank",
    "reference_step",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Theory",
    "build_schedule",
]

from pplab.cluster import Lab, cleanup  # noqa: E402  (floor 4: engines as ranks, from Jupyter)

__all__ += ["Lab", "cleanup"]


def __getattr__(name):
    # matplotlib is heavy: engines and the CLI load `pplab.viz` only when they draw.
    if name == "viz":
        import importlib

        return importlib.import_module("pplab.viz")
    raise AttributeError(f"module 'pplab' has no attribute {name!r}")
