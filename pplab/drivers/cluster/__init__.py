"""The lab cluster (part of floor 4, drivers/): ipyparallel engines as torch.distributed ranks.

    lab = pplab.Lab(n_ranks=4)    # start: engines up, ranks assigned, process group ready
    lab.run(fn, *args)            # fn on every rank, results ordered by rank
    for event in lab.stream(fn):  # events that ranks publish() while fn runs
        ...
    lab.restart()                 # after a hang or a crash
    lab.stop()                    # engines gone; the controller and fork server kept for the next lab

Modules, top to bottom: `plan` (backend/device, rank order), `errors`,
`gloo_adapter` and `ipyparallel_adapter` (the one place for what the lab relies on in
gloo and ipyparallel beyond what they promise), `engine` (what runs on each engine),
`forkserver` (fast engine start), `records` (on-disk records and `cleanup`), `kept` (what a
stopped lab keeps for the next lab of its process), `status`
(the ranks of a start and what calls learned about them), `calls` (waiting, errors,
streaming), `launchers` (a local cluster or a connected one) and `lab` (the Lab itself). The cluster knows
engines, ranks,
rendezvous and lifecycle only: pipelines on a lab are the session's
(`pplab.session`, whose `pplab.Lab` adds `lab.pipeline(...)`).
"""

import importlib

from pplab.drivers.cluster.errors import LabError, LabNeedsRestartError, LabStartError
from pplab.drivers.cluster.namespaces import NamespaceHosts
from pplab.drivers.cluster.plan import RoomPlan, gpus_for_seat, plan_room
from pplab.drivers.cluster.records import cleanup
from pplab.drivers.cluster.status import RankInfo, RankTable

# a call's failures: one class each, every driver's, public in pplab.session
from pplab.rank.rank_context import (  # noqa: F401
    RankContext,
    RankDiedError,
    RankEvent,
    RankFailedError,
    RankTimeoutError,
    publish,
    rank_context,
)

__all__ = ["LabError", "NamespaceHosts", "rank_context", "publish", "plan_room"]

# The Lab and its calls import torch (2 s): `pplab cleanup`, which needs only the records, should not.
_IMPORTED_WHEN_USED = {"Lab": "pplab.drivers.cluster.lab", "RankCall": "pplab.drivers.cluster.calls"}


def __getattr__(name: str):
    # one Lab a user sees: pplab.Lab (this one, without pipelines, is the driver beneath it)
    if name == "Lab":
        from pplab.base.renames import renamed_attribute

        renamed_attribute("pplab.drivers.cluster", name)
    if name in _IMPORTED_WHEN_USED:
        return getattr(importlib.import_module(_IMPORTED_WHEN_USED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

