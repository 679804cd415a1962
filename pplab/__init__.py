"""pplab: a lab kit to understand, teach and measure pipeline parallelism in PyTorch."""

from pplab.model import LlamaConfig, LlamaModel, build_model
from pplab.partition import build_stage, layer_ranges, stages_of_rank
from pplab.reference import reference_step

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "build_model",
    "build_stage",
    "layer_ranges",
    "stages_of_rank",
    "reference_step",
]
