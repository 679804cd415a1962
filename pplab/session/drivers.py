"""The drivers as a session uses them: a lab and a pool of ranks that build pipelines.

`Lab` is the ipyparallel lab (`pplab.drivers.cluster.lab.Lab`), `RankPool` the pool of local
processes (`pplab.drivers.local.RankPool`) and `TorchrunRanks` the processes torchrun started
(`pplab.drivers.torchrun`: in a script, this process is one rank), each with `pipeline(...)`,
which builds a `Pipeline` on its ranks. The drivers themselves know nothing of pipelines. (`pplab.Lab`
is the notebook's lab, `pplab.views.lab.Lab`: its pipelines also show live views.)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pplab.base.config import LabOptions, PipelineOptions, keywords_help, takes_options
from pplab.base.renames import renamed_keywords
from pplab.drivers.cluster.lab import Lab as _ClusterLab
from pplab.drivers.local import RankPool as _LocalPool
from pplab.drivers.torchrun import TorchrunRanks as _TorchrunRanks

if TYPE_CHECKING:  # imported when a pipeline is built: they import torch (1-2 s in a fresh kernel),
    # which a lab's start needs no more than a pool's (the engines import their own)
    from pplab.models.llama import LlamaConfig
    from pplab.planning.calibration import Calibration
    from pplab.planning.simulator import Costs
    from pplab.rank.mesh import Mesh
    from pplab.schedules import Schedule
    from pplab.session.pipeline import Pipeline


class ImportedOnUse:
    """A class attribute that is a class of another module, imported when first read: "module:Name"."""

    def __init__(self, where: str):
        self.module, self.name = where.split(":")

    def __get__(self, instance, owner) -> type:
        return getattr(importlib.import_module(self.module), self.name)


class _BuildsPipelines:
    """`pipeline(...)` for a driver of ranks."""

    # What `pipeline` builds (a notebook's lab builds a richer one).
    pipeline_class = ImportedOnUse("pplab.session.pipeline:Pipeline")

    @renamed_keywords
    @takes_options(LabOptions, differs={"op_timeout": "None: the driver's own op_timeout"})
    @takes_options(PipelineOptions, every=True, differs={
        "n_microbatches": "None: a Schedule's own count; {default} for a schedule's name"})
    def pipeline(self, config: LlamaConfig, schedule: str | Schedule = PipelineOptions.schedule,
                 n_microbatches: int | None = None, n_virtual: int = PipelineOptions.n_virtual, *,
                 impl: str = PipelineOptions.impl, seed: int = PipelineOptions.seed,
                 balance: Sequence[int] | None = PipelineOptions.balance,
                 allow_empty: bool = False, op_timeout: float | None = None, timing: Costs | None = None,
                 record: bool = True, mesh: Mesh | dict | None = None,
                 param_dtype: str = PipelineOptions.param_dtype) -> Pipeline:
        # The docstring is made below: its keywords that are a run's fields say what their field says.
        from pplab.rank.rank_pipeline import PipelineSpec

        self._check_usable()
        spec = PipelineSpec.create(config, schedule, self.world_size, n_microbatches, n_virtual, impl=impl,
                                   seed=seed, balance=balance, allow_empty=allow_empty,
                                   op_timeout=self.op_timeout if op_timeout is None else op_timeout,
                                   timing=timing, record=record, mesh=mesh, param_dtype=param_dtype)
        return self.pipeline_class(self, spec)

    _calibration = None

    def calibrate(self, steps: int = 5) -> Calibration:
        """Measure what these ranks add to a one-device profile, in a few seconds: a compute's time
        on a rank against its profile, the runtime's own time between computes, a message's time
        (pplab.session.calibrate). Kept as `calibration`, which `pplab.predict(..., lab=...)` uses."""
        from pplab.session.calibrate import calibrate

        self._check_usable()
        self._calibration = calibrate(self, steps)
        return self._calibration

    @property
    def calibration(self) -> Calibration:
        """The ranks' calibration: `calibrate()`'s, made the first time it is asked for."""
        return self._calibration if self._calibration is not None else self.calibrate()


# lab.pipeline's keywords: the pipeline's options (PipelineOptions) take their field's name, default
# (checked by takes_options) and help; the rest are its own.
_BuildsPipelines.pipeline.__doc__ = (
    "Build a pipeline's stages on every rank, everything checked first; step it with `.step()`.\n\n"
    + keywords_help(_BuildsPipelines.pipeline, PipelineOptions, {
        "config": "the model: a `pplab.LlamaConfig`; a Hugging Face causal-LM config or a local directory "
                  "holding one (config.json, optionally *.safetensors); or a `pplab.models.hf.HFModel` "
                  "(a layout of your own, tied sums off): see pplab.models.hf",
        "allow_empty": "let a stage have no layers",
        "op_timeout": "seconds one wait between ranks may take (default: the driver's `op_timeout`)",
        "timing": "timing mode: a `pplab.Costs`, each compute action padded to its cost",
        "record": "record the events of each step (the timeline)",
        "mesh": 'PP as one dimension of a mesh: {"pp": 2, "dp": 2} or `pplab.Mesh(...)` (FSDP on dp and '
                'tensor parallelism on tp need impl="torch")'}) + "\n")


class Lab(_BuildsPipelines, _ClusterLab):
    __doc__ = _ClusterLab.__doc__


class RankPool(_BuildsPipelines, _LocalPool):
    __doc__ = _LocalPool.__doc__


class TorchrunRanks(_BuildsPipelines, _TorchrunRanks):
    __doc__ = _TorchrunRanks.__doc__
