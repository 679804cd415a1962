"""Floor 1, every name the last release used and what replaced it, in one table.

What users type is a promise: a keyword, flag, module attribute or public module that changed keeps
working for one release, with a DeprecationWarning that names the new one. Each is a row of
`RENAMED`, and everything that accepts an old name reads it there: the keyword decorator
(`renamed_keywords`), the command line's flags (`rows("flag")`), a run's configuration keys
(`keyword_renames`), the modules' `__getattr__` (`renamed_attribute`) and the top package's public
modules. `tests/test_renamed.py` walks the table. A row leaves when its release comes.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

UNTIL = "the next release"


@dataclass(frozen=True)
class Renamed:
    """One old name: of what `kind`, where, what it is now, and until when the old one works.

    kind "keyword": `where` is the function (module and qualified name), `new` its new keyword;
    "flag": `where` is "pplab", the command, `new` the new flag; "attribute": `where` is the
    module as users name it, `new` the full path of what to use now; "module": `where` is "pplab",
    `old` a public module's short name (`pplab.<old>`), `new` the module it stands for now, which
    `import pplab.<old>` hands out."""

    kind: str
    where: str
    old: str
    new: str
    why: str = ""
    until: str = UNTIL


RENAMED = (
    Renamed("keyword", "pplab.drivers.cluster.lab.Lab.__init__", "ranks", "n_ranks"),
    Renamed("keyword", "pplab.drivers.cluster.lab.Lab.__init__", "timeout", "op_timeout"),
    Renamed("keyword", "pplab.drivers.cluster.lab.Lab.connect", "ranks", "n_ranks"),
    Renamed("keyword", "pplab.drivers.cluster.lab.Lab.connect", "timeout", "op_timeout"),
    Renamed("keyword", "pplab.session.drivers._BuildsPipelines.pipeline", "microbatches", "n_microbatches"),
    Renamed("keyword", "pplab.session.drivers._BuildsPipelines.pipeline", "timeout", "op_timeout"),
    Renamed("keyword", "pplab.rank.rank_pipeline.PipelineSpec.create", "microbatches", "n_microbatches"),
    Renamed("keyword", "pplab.rank.rank_pipeline.PipelineSpec.create", "timeout", "op_timeout"),
    Renamed("keyword", "pplab.drivers.local.RankPool.__init__", "world_size", "n_ranks"),
    Renamed("keyword", "pplab.drivers.local.RankPool.__init__", "init_timeout", "op_timeout"),
    Renamed("keyword", "pplab.drivers.cluster.namespaces.NamespaceHosts.__init__", "hosts", "n_hosts"),
    Renamed("keyword", "pplab.drivers.torchrun.TorchrunRanks.__init__", "timeout", "op_timeout"),
    Renamed("keyword", "pplab.drivers.torchrun.run_as_torchrun_rank", "timeout", "op_timeout"),
    # RunConfig's: also its attributes, a dict's or a TOML file's keys and the train flags' names
    Renamed("keyword", "pplab.session.run.RunConfig.__init__", "microbatches", "n_microbatches"),
    Renamed("keyword", "pplab.session.run.RunConfig.__init__", "virtual_stages", "n_virtual"),
    Renamed("flag", "pplab", "--ranks", "--n-ranks"),
    Renamed("flag", "pplab", "--microbatches", "--n-microbatches"),
    Renamed("flag", "pplab", "--virtual", "--n-virtual"),
    Renamed("flag", "pplab", "--weight", "--weight-grad", "the cost model's field, weight_grad"),
    Renamed("attribute", "pplab", "PipelineRun", "pplab.Pipeline"),
    Renamed("attribute", "pplab.session", "PipelineRun", "pplab.session.Pipeline"),
    Renamed("attribute", "pplab.session", "Lab", "pplab.Lab", "with live views"),
    Renamed("attribute", "pplab.drivers.cluster", "Lab", "pplab.Lab",
            "the same lab, with pipelines and live views"),
    Renamed("attribute", "pplab.trace", "Event", "pplab.Event"),
    Renamed("attribute", "pplab.trace", "Timeline", "pplab.Timeline"),
    Renamed("attribute", "pplab.trace", "COMM_KINDS", "pplab.trace.COMM_EVENT_KINDS",
            "it holds the collectives too, unlike pplab.schedules.COMM_KINDS"),
    Renamed("attribute", "pplab.drivers.local", "LocalRankError", "pplab.session.RankError",
            "every driver raises it"),
    Renamed("attribute", "pplab.rank.mesh", "MemoryTable", "pplab.session.MemoryTable",
            "the table is drawn on the client"),
    Renamed("attribute", "pplab.rank.train", "train_on_rank", "pplab.rank.train.build_and_train_on_rank"),
    Renamed("attribute", "pplab.views.lab", "NotebookPipeline",
            "pplab.views.notebook_pipeline.NotebookPipeline"),
    Renamed("attribute", "pplab", "TrainOptions", "pplab.rank.train.TrainOptions", "one path"),
    Renamed("attribute", "pplab", "load_model", "pplab.rank.checkpoint.load_model", "one path"),
    Renamed("module", "pplab", "profiled", "pplab.trace"),
    # the short names of the last release's public modules: each has one path now, its folder's
    *(Renamed("module", "pplab", short, new, "one path") for short, new in (
        ("model", "pplab.models.llama"), ("simulator", "pplab.planning.simulator"),
        ("comm", "pplab.rank.comm"), ("viz", "pplab.views.viz"), ("widgets", "pplab.views.widgets"),
        ("exercises", "pplab.course.exercises"), ("checks", "pplab.rank.checks"),
        ("checkpoint", "pplab.rank.checkpoint"), ("train", "pplab.rank.train"), ("mesh", "pplab.rank.mesh"),
        ("faults", "pplab.rank.faults"), ("cluster", "pplab.drivers.cluster"), ("hf", "pplab.models.hf"),
        ("traced", "pplab.models.traced"), ("text", "pplab.data.text"), ("run", "pplab.session.run"),
        ("bubble", "pplab.planning.bubble"), ("machine", "pplab.base.machine"), ("hub", "pplab.course.hub"))),
)


def rows(kind: str, where: str | None = None) -> dict[str, Renamed]:
    """The table's rows of `kind` (and `where`, if given), by old name."""
    return {row.old: row for row in RENAMED if row.kind == kind and where in (None, row.where)}


def keyword_renames(where: str) -> dict[str, str]:
    """Old keyword -> new keyword of the function `where` (module and qualified name)."""
    return {old: row.new for old, row in rows("keyword", where).items()}


def renamed_keywords(function):
    """Decorate a function whose keywords the table renames: an old keyword still works, for one
    release, with a DeprecationWarning naming the new one; both at once are refused."""
    renames = rows("keyword", f"{function.__module__}.{function.__qualname__}")
    if not renames:
        raise LookupError(f"{function.__module__}.{function.__qualname__}: no keyword of it is in "
                          f"pplab.base.renames.RENAMED; add its rows there, or leave out the decorator")

    @functools.wraps(function)
    def accepting_old_names(*args, **kwargs):
        for old, row in renames.items():
            if old not in kwargs:
                continue
            if row.new in kwargs:
                raise TypeError(f"{function.__qualname__}() got {old}= and {row.new}=: {old} is the last "
                                f"release's name of {row.new}; pass {row.new}= alone")
            warnings.warn(f"{function.__qualname__}({old}=...) is now {row.new}=...; {old}= works until "
                          f"{row.until}", DeprecationWarning, stacklevel=2)
            kwargs[row.new] = kwargs.pop(old)
        return function(*args, **kwargs)

    accepting_old_names.renamed_keywords = tuple(renames)  # what tests/test_renamed.py checks
    return accepting_old_names


def renamed_attribute(module: str, name: str, stacklevel: int = 3) -> Renamed | None:
    """The row of `module.name` if the table renames it, said in a DeprecationWarning at the user's
    line (from a module's `__getattr__`, `stacklevel` 3); None where the name was never renamed."""
    row = rows("attribute", module).get(name)
    if row is not None:
        warn(row, stacklevel=stacklevel)  # counted from here: warn's own frame comes first
    return row


def said(row: Renamed) -> str:
    """'pplab.trace.Event is now pplab.Event; pplab.trace.Event works until the next release'."""
    old = row.old if row.kind == "flag" else f"{row.where}.{row.old}"
    why = f" ({row.why})" if row.why else ""
    return f"{old} is now {row.new}{why}; {old} works until {row.until}"


def warn(row: Renamed, stacklevel: int = 2) -> None:
    """Say that `row.old` (of `row.where`) is the last release's name, and what to use now, at the
    line `stacklevel` frames above the caller of `warn` (2: the caller's caller)."""
    warnings.warn(said(row), DeprecationWarning, stacklevel=stacklevel + 1)


def resolve(path: str):
    """The object at a public dotted path ('pplab.session.MemoryTable'): where an old name of a lower
    floor is served by what a higher floor defines now, found by name so that no import climbs."""
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
