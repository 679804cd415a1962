"""What users type is a promise: the last release's keywords, flags and names still work, for one
release, with a DeprecationWarning naming the new one; and every public module imports by its
short name. Each check passes a value the new name refuses, so that the refusal (which names the
new keyword) proves where the old one arrived, before any process starts."""

import dataclasses
import importlib
import re
import sys
from types import SimpleNamespace

import pytest

import pplab
from pplab.rank.rank_pipeline import PipelineSpec
from pplab.session.drivers import Lab as SessionLab

CONFIG = pplab.LlamaConfig.tiny()
# what pipeline() reads first
RANKS = SimpleNamespace(world_size=2, op_timeout=5.0, _check_usable=lambda: None)

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("call, old, refusal", [
    (lambda: pplab.Lab(ranks=0), "ranks", r"n_ranks=0 must be at least 1"),
    (lambda: pplab.Lab(timeout=-1), "timeout", r"op_timeout=-1 must be a positive number of seconds"),
    (lambda: pplab.Lab.connect(ranks=0), "ranks", r"n_ranks=0 must be at least 1"),
    (lambda: pplab.RankPool(world_size=0), "world_size", r"n_ranks=0 must be at least 1"),
    (lambda: pplab.RankPool(2, init_timeout=0), "init_timeout", r"op_timeout=0 must be a positive number"),
    (lambda: pplab.drivers.cluster.NamespaceHosts(hosts=0), "hosts", r"n_hosts=0 must be at least 1"),
    (lambda: PipelineSpec.create(CONFIG, "1f1b", 2, microbatches=0), "microbatches",
     r"n_microbatches=0: give a whole number >= 1"),
    (lambda: SessionLab.pipeline(RANKS, CONFIG, "1f1b", microbatches=0), "microbatches",
     r"n_microbatches=0: give a whole number >= 1"),
])
def test_the_last_releases_keywords_still_work_and_name_the_new_one(call, old, refusal):
    with pytest.warns(DeprecationWarning,
                      match=rf"\({old}=\.\.\.\) is now \w+=\.\.\.; {old}= works until the "
                                                rf"next release") as warned, \
            pytest.raises(ValueError, match=refusal):
        call()
    assert warned[0].filename == __file__  # the warning points at the user's line


def test_an_old_keyword_that_arrives_as_it_should():
    with pytest.warns(DeprecationWarning) as warned:
        spec = PipelineSpec.create(CONFIG, "1f1b", 2, microbatches=4, timeout=5)
    assert spec.schedule.n_microbatches == 4 and spec.op_timeout == 5
    assert [str(w.message).split(";")[0] for w in warned] == [
        "PipelineSpec.create(microbatches=...) is now n_microbatches=...",
        "PipelineSpec.create(timeout=...) is now op_timeout=..."]


def test_an_old_and_a_new_keyword_together_are_refused():
    with pytest.raises(TypeError,
                       match=r"got ranks= and n_ranks=: ranks is the last release's name of n_ranks"):
        pplab.Lab(ranks=2, n_ranks=2)


def test_the_last_releases_names_are_the_new_ones():
    with pytest.warns(DeprecationWarning, match=r"pplab.PipelineRun is now pplab.Pipeline"):
        assert pplab.PipelineRun is pplab.Pipeline
    with pytest.warns(DeprecationWarning, match=r"pplab.session.PipelineRun is now pplab.session.Pipeline"):
        assert pplab.session.PipelineRun is pplab.Pipeline


def test_the_notebooks_pipeline_class_moved_to_a_module_of_its_own():
    """It left pplab.views.lab, so that pplab.Lab loads no torch (test_imports); one more release there."""
    import pplab.views.lab
    from pplab.views.notebook_pipeline import NotebookPipeline

    with pytest.warns(DeprecationWarning, match=r"pplab.views.lab.NotebookPipeline is now "
                                                r"pplab.views.notebook_pipeline.NotebookPipeline"):
        assert pplab.views.lab.NotebookPipeline is NotebookPipeline


def test_the_profiler_traces_reader_joined_pplab_trace():
    """"profile" means one thing, a profile of costs (pplab.profile); torch.profiler's runs are read by
    pplab.trace, and pplab.profiled, the module that did it, is the same module for one more release."""
    import importlib

    import pplab.trace

    vars(pplab).pop("profiled", None)  # bound by an earlier `import pplab.profiled`: found afresh, and said
    with pytest.warns(DeprecationWarning, match=r"pplab.profiled is now pplab.trace"):
        assert pplab.profiled.read_profiler_traces is pplab.trace.read_profiler_traces
    sys.modules.pop("pplab.profiled", None)  # imported by its old name before: imported afresh, and said
    vars(pplab).pop("profiled", None)  # (an import binds the name on the package)
    with pytest.warns(DeprecationWarning, match=r"pplab.profiled is now pplab.trace"):
        assert importlib.import_module("pplab.profiled").ImportedRun is pplab.trace.ImportedRun
    assert "profiled" not in pplab.__all__


def test_the_memory_table_moved_to_the_session_the_client_side():
    """pipe.memory()'s table is drawn on the client: it left pplab.rank.mesh (the ranks'
    floor), one more release there."""
    from pplab import session
    from pplab.rank import mesh

    with pytest.warns(DeprecationWarning,
                      match=r"pplab.rank.mesh.MemoryTable is now pplab.session.MemoryTable"):
        assert mesh.MemoryTable is session.MemoryTable
    assert "MemoryTable" not in mesh.__all__ and "MemoryTable" in session.__all__


def test_the_plain_ranks_training_entry_point_has_a_name_of_its_own():
    """pplab.rank.train.train_on_rank shared its name with the session's train_on_rank (which
    trains stages already built): it is build_and_train_on_rank now, the old name one more release."""
    import pplab.rank.train
    from pplab.session import on_rank

    with pytest.warns(DeprecationWarning, match=r"pplab.rank.train.train_on_rank is now "
                                                r"pplab.rank.train.build_and_train_on_rank"):
        assert pplab.rank.train.train_on_rank is pplab.rank.train.build_and_train_on_rank
    assert on_rank.train_on_rank is not pplab.rank.train.build_and_train_on_rank
    assert "train_on_rank" not in pplab.rank.train.__all__


def test_the_last_releases_flags_still_work_and_name_the_new_one(capsys):
    from pplab.cli import main

    new = ["simulate", "1f1b", "--n-ranks", "2", "--n-microbatches", "4"]
    assert main(new) == 0
    said = capsys.readouterr().out
    with pytest.warns(DeprecationWarning) as warned:
        assert main(["simulate", "1f1b", "--ranks", "2", "--microbatches=4"]) == 0
    assert [str(w.message).split(";")[0] for w in warned] == ["--ranks is now --n-ranks",
                                                              "--microbatches is now --n-microbatches"]
    out, err = capsys.readouterr()
    assert out == said
    assert "pplab: DeprecationWarning: --microbatches is now --n-microbatches; --microbatches works until " \
           "the next release" in err


@pytest.mark.parametrize("module", pplab._PUBLIC_MODULES)
def test_every_public_module_is_at_one_path_and_its_last_release_name_says_so(module):
    import warnings

    from pplab.base.renames import rows

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its one path: imported and reached, without a warning
        imported = importlib.import_module(module)
        reached = pplab
        for part in module.split(".")[1:]:
            reached = getattr(reached, part)
    assert reached is imported and imported.__name__ == imported.__spec__.name == module
    shorts = {row.new: old for old, row in rows("module", "pplab").items() if row.why == "one path"}
    short = shorts.get(module)
    if short is None:  # pplab.schedules, pplab.trace, ...: their path was always their folder's
        assert module.count(".") == 1
        return
    sys.modules.pop(f"pplab.{short}", None)
    vars(pplab).pop(short, None)
    with pytest.warns(DeprecationWarning, match=rf"pplab.{short} is now {module} \(one path\)"):
        assert importlib.import_module(f"pplab.{short}") is imported
    assert imported.__spec__.name == module  # the old name's import left the module's own spec


def test_pplab_train_and_run_train_start_from_the_same_defaults():
    """Each `pplab train` flag's default is its RunConfig field's (the flags are written apart from
    the fields, so that `pplab --help` loads no torch: this keeps the two from drifting again)."""
    from pplab.cli import build_parser
    from pplab.session.run import RunConfig

    flags = {action.dest: action for action in build_parser().train_parser._actions}
    walked = []
    for field in dataclasses.fields(RunConfig):
        flag = flags.get(field.name)  # one name: the field's is the flag's
        if flag is None:  # pp: from --n-ranks, --dp and --tp; eval_batches: TOML and Python only
            continue
        assert flag.default == field.default, (field.name, flag.default, field.default)
        walked.append(field.name)
    assert len(walked) >= 31, walked  # all but pp and eval_batches


def test_one_default_bound_for_a_wait_between_ranks_everywhere():
    import inspect

    from pplab.base.config import OP_TIMEOUT
    from pplab.drivers.local import run_ranks
    from pplab.drivers.torchrun import TorchrunRanks, run_as_torchrun_rank
    from pplab.rank.comm import StageLink
    from pplab.rank.runtime import RankRuntime

    takers = [pplab.Lab.__init__, pplab.Lab.connect, pplab.RankPool.__init__, run_ranks,
              TorchrunRanks.__init__,
              run_as_torchrun_rank, PipelineSpec.create, RankRuntime.__init__, StageLink.__init__]
    defaults = {taker.__qualname__: inspect.signature(taker).parameters["op_timeout"].default
                for taker in takers}
    assert defaults == dict.fromkeys(defaults, OP_TIMEOUT)
    assert {field.name: field.default
            for field in dataclasses.fields(PipelineSpec)}["op_timeout"] == OP_TIMEOUT


@pytest.mark.quick
@pytest.mark.parametrize("old, new", [("Event", "pplab.Event"), ("Timeline", "pplab.Timeline"),
                                      ("COMM_KINDS", "pplab.trace.COMM_EVENT_KINDS")])
def test_the_traces_last_release_names_still_work_and_say_where_they_are_now(old, new):
    import pplab.trace
    from pplab.trace.timeline import COMM_EVENT_KINDS, Event, Timeline

    with pytest.warns(DeprecationWarning, match=rf"pplab.trace.{old} is now {new}"):
        value = getattr(pplab.trace, old)
    assert value is {"Event": Event, "Timeline": Timeline, "COMM_KINDS": COMM_EVENT_KINDS}[old]


@pytest.mark.quick
def test_an_events_communication_kinds_are_the_schedules_messages_and_the_collectives():
    from pplab.schedules import COMM_KINDS
    from pplab.trace import COLLECTIVE_KINDS, COMM_EVENT_KINDS

    assert COMM_EVENT_KINDS == {kind.value for kind in COMM_KINDS} | COLLECTIVE_KINDS


@pytest.mark.quick
@pytest.mark.parametrize("module", ["pplab.drivers.cluster", "pplab.session"])
def test_one_lab_a_user_sees_the_others_say_where_it_is(module):
    from pplab.drivers.cluster.lab import Lab as ClusterLab

    public = importlib.import_module(module)
    assert "Lab" not in public.__all__ and "Lab" in pplab.__all__
    with pytest.warns(DeprecationWarning, match=rf"{module}.Lab is now pplab.Lab"):
        old = public.Lab
    assert issubclass(pplab.Lab, old) and issubclass(old, ClusterLab)


@pytest.mark.quick
def test_run_configs_last_release_names_still_work_and_files_keep_the_older_names():
    from pplab.session.run import RunConfig

    with pytest.warns(DeprecationWarning) as seen:
        config = RunConfig(microbatches=8, virtual_stages=2, schedule="interleaved-1f1b")
    assert sorted(str(w.message).split(";")[0] for w in seen) == [
        "RunConfig.__init__(microbatches=...) is now n_microbatches=...",
        "RunConfig.__init__(virtual_stages=...) is now n_virtual=..."]
    assert (config.n_microbatches, config.n_virtual) == (8, 2)
    with pytest.warns(DeprecationWarning, match="RunConfig.virtual_stages is now RunConfig.n_virtual"):
        assert config.virtual_stages == 2
    read = RunConfig.of({"parallel": {"microbatches": 8, "virtual-stages": 2}})  # the older names, quietly
    assert (read.n_microbatches, read.n_virtual) == (8, 2) and "n_microbatches = 8" in read.to_toml()


def _parser_flags() -> set[str]:
    """Every flag of every `pplab` command."""
    import argparse

    from pplab.cli import build_parser

    flags, parsers = set(), [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return flags


def _found(path: str):
    """The object at `path`, a module's dotted name followed by attributes (a qualified name)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise LookupError(path)


@pytest.mark.parametrize("row", __import__("pplab.base.renames", fromlist=["RENAMED"]).RENAMED,
                         ids=lambda row: f"{row.kind}:{row.where}.{row.old}")
def test_every_row_of_the_one_rename_table_is_taken_where_it_says(row):
    """The table (pplab.base.renames) is the one place an old name is written: each row's old name
    is taken where the row says, the warning names the row's new one, and that new one exists."""
    import inspect
    import warnings

    from pplab.base.renames import resolve, said

    if row.kind == "keyword":
        function = _found(row.where)
        assert row.old in function.renamed_keywords  # the decorator read this row
        assert row.new in inspect.signature(function.__wrapped__).parameters
    elif row.kind == "flag":
        from pplab.cli import with_renamed_flags

        with pytest.warns(DeprecationWarning, match=re.escape(said(row))):
            assert with_renamed_flags([row.old, "2"]) == [row.new, "2"]
        assert row.new in _parser_flags() and row.old not in _parser_flags()
    elif row.kind == "attribute":
        with pytest.warns(DeprecationWarning, match=re.escape(said(row))):
            getattr(importlib.import_module(row.where), row.old)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new name is found without a warning
            resolve(row.new)
    else:
        assert row.kind == "module" and row.where == "pplab"
        sys.modules.pop(f"pplab.{row.old}", None)
        vars(pplab).pop(row.old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(said(row))):
            assert getattr(pplab, row.old) is importlib.import_module(row.new)
