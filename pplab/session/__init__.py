"""Floor 5, the session: the client side of a pipeline, above the drivers of ranks.

A `Pipeline` builds a pipeline's stages on the ranks, steps it, checks it against one
device, trains it and streams what the ranks do. It needs of its ranks only what every
driver offers:

    ranks.world_size, ranks.op_timeout, ranks.state, ranks.rank_processes
    ranks.run(fn, *args, timeout=...)        -> results by rank    (fn(*args) on every rank; an
                                                argument wrapped in PerRank: each rank its own item)
    ranks.run_async(fn, *args, timeout=...)  -> call: call.poll_events(), call.result(timeout=...),
                                                call.wait_for_events()

Drivers: `pplab.Lab` (ipyparallel engines, for notebooks) and `pplab.RankPool` (local
processes kept between calls, for the command line, tests, benchmarks and scripts), both
with `.pipeline(...)` (`pplab.session.drivers`). The rank side is `pplab.session.on_rank`.
The contract, written down: `pplab.drivers.contract.Ranks`.

A call that fails raises the same errors from every driver: `RankFailedError` (a rank raised),
`RankDiedError` (a rank's process ended), `RankTimeoutError` (past its bound), each a `RankError`
with `.ranks`, `.causes` (one line per rank) and `.summary`.
"""

import importlib as _importlib

from pplab.base.lazy import submodules_on_first_use

_submodule = submodules_on_first_use(__name__)

# Each name loads its module on first use: a rank that imports `pplab.session.on_rank`
# loads neither the drivers nor ipyparallel.
_EXPORTS = {"Lab": "pplab.session.drivers", "RankPool": "pplab.session.drivers",
            "TorchrunRanks": "pplab.session.drivers",
            "Pipeline": "pplab.session.pipeline", "LiveStep": "pplab.session.pipeline",
            "MemoryTable": "pplab.session.results",  # what pipe.memory() shows
            "PerRank": "pplab.drivers.contract",  # an argument of run(): one value per rank
            "read_torchtitan": "pplab.session.torchtitan", "TorchtitanJob": "pplab.session.torchtitan",
            # what every driver raises when a call fails (the lab's errors are these too)
            **{name: "pplab.rank.rank_context"
               for name in ("RankError", "RankFailedError", "RankDiedError", "RankTimeoutError")}}

# RankPool, TorchrunRanks and Pipeline are public at the top (pplab.RankPool), the one Lab a user sees
# is pplab.Lab: here, what every driver raises, and the session's tables and job files.
__all__ = ["RankError", "RankFailedError", "RankDiedError", "RankTimeoutError", "MemoryTable",
           "read_torchtitan"]


def __getattr__(name: str):
    """A public name, loaded on first use; the last release's names (pplab.base.renames) said and
    served: a name renamed here is the new one, `Lab` the session's (pplab.Lab is built on it)."""
    from pplab.base.renames import renamed_attribute

    row = renamed_attribute("pplab.session", name)
    if row is not None and row.new.startswith("pplab.session."):
        name = row.new.rpartition(".")[2]
    if name not in _EXPORTS:
        return _submodule(name)  # pplab.session.run after a bare `import pplab`
    return getattr(_importlib.import_module(_EXPORTS[name]), name)
