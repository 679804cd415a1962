"""The drivers as a session uses them: a lab and a pool of ranks that build pipelines.

`Lab` is the ipyparallel lab (`pplab.cluster.Lab`) and `RankPool` the pool of local
processes (`pplab.drivers.local.RankPool`), each with `pipeline(...)`, which builds a
`PipelineRun` on its ranks. The drivers themselves know nothing of pipelines. (`pplab.Lab`
is the notebook's lab, `pplab.views.lab.Lab`: its pipelines also show live views.)
"""

from __future__ import annotations

from pplab.drivers.cluster.lab import Lab as _ClusterLab
from pplab.drivers.local import RankPool as _LocalPool
from pplab.schedules import Schedule
from pplab.session.pipeline import PipelineRun


class _BuildsPipelines:
    """`pipeline(...)` for a driver of ranks."""

    run_class = PipelineRun  # what `pipeline` builds (a notebook's lab builds a richer one)

    def pipeline(self, config, schedule: str | Schedule = "1f1b", n_microbatches: int | None = None,
                 n_virtual: int = 1, **options) -> PipelineRun:
        """Build a pipeline's stages on every rank (schedule validated first); step it with `.step()`.

        A wait between ranks gives up after the driver's `op_timeout` unless `op_timeout=` says otherwise.
        """
        self._check_usable()
        options.setdefault("op_timeout", self.op_timeout)
        return self.run_class(self, config, schedule, n_microbatches, n_virtual, **options)


class Lab(_BuildsPipelines, _ClusterLab):
    __doc__ = _ClusterLab.__doc__


class RankPool(_BuildsPipelines, _LocalPool):
    __doc__ = _LocalPool.__doc__
