"""One configuration: every field of a run, walked through Python, a TOML file, the `pplab train`
flags, `--config`, a rebuild and the ranks' side, arrives with the same value; a bad value is
refused by its name on every path. A field added without a value here fails the first test.

And every option written once: each field of every family (TrainOptions, PipelineOptions,
LabOptions, Costs) has its help, kind and default in one place; every function and flag that takes
it has its default, or says why not (`takes_options`, `add_option_flag`)."""

import dataclasses
import inspect
import json
import re

import pytest
import tomllib

from pplab.base.config import LabOptions, PipelineOptions, TrainOptions, takes_options
from pplab.cli import build_parser, main
from pplab.planning.simulator import Costs
from pplab.session.drivers import Lab, RankPool
from pplab.session.run import RunConfig

pytestmark = pytest.mark.quick  # starts no process

# A value other than the default, for every field.
CHANGED = {
    "steps": 7, "batch_size": 16, "seq_len": 32, "lr": 0.001, "min_lr": 0.0, "warmup": 3,
    "weight_decay": 0.05,
    "betas": (0.8, 0.99), "eps": 1e-6, "clip": 0.5, "data_seed": 5, "data": "corpus.txt", "tokenizer": "bpe",
    "vocab_size": 300, "epochs": 2, "eval_every": 10, "eval_batches": 3, "checkpoint_dir": "runs",
    "checkpoint_every": 5, "keep": 2, "async_save": True, "resume": "latest",
    "model": "small", "param_dtype": "bfloat16", "seed": 7, "pp": 4, "dp": 2, "tp": 2, "schedule": "zb-h1",
    "impl": "torch", "n_microbatches": 8, "n_virtual": 2, "balance": (3, 5),
}
FIELDS = [field.name for field in dataclasses.fields(RunConfig)]


def test_every_field_has_a_changed_value_and_a_help():
    assert sorted(CHANGED) == sorted(FIELDS)
    for field in dataclasses.fields(RunConfig):
        assert CHANGED[field.name] != field.default, field.name
        assert field.metadata["help"] and field.metadata["section"], field.name


def flag_arguments(name: str, value) -> list[str]:
    """The `pplab train` arguments that say `name = value`, and the ranks to keep the layout's pp."""
    config = RunConfig(**{name: value})
    ranks = ["--n-ranks", str(config.n_ranks)]  # the command line gives pp as ranks / (dp x tp)
    if name == "pp":
        return ranks
    if isinstance(value, bool):
        return [f"--{name.replace('_', '-')}", *ranks]
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    return [f"--{name.replace('_', '-')}", text, *ranks]


def printed(capsys, *argv: str) -> RunConfig:
    """The configuration `pplab train ... --print-config` resolves, read back."""
    assert main(["train", *argv, "--print-config"]) == 0
    return RunConfig.of(tomllib.loads(capsys.readouterr().out))


@pytest.mark.parametrize("name", FIELDS)
def test_a_field_arrives_the_same_by_every_path(name, capsys, tmp_path):
    value = CHANGED[name]
    in_python = RunConfig(**{name: value})
    assert getattr(in_python, name) == value
    # A TOML file, as written and as a user writes one key of it (in its table or not).
    written = tmp_path / "written.toml"
    written.write_text(in_python.to_toml())
    assert RunConfig.from_toml(written) == in_python
    one_key = tmp_path / "one.toml"
    line = next(line for line in in_python.to_toml().splitlines() if line.startswith(f"{name} ="))
    one_key.write_text(f"[{dataclasses.fields(RunConfig)[FIELDS.index(name)].metadata['section']}]\n{line}\n")
    assert RunConfig.from_toml(one_key) == in_python
    # The command line: its flag, and --config's file.
    assert printed(capsys, *flag_arguments(name, value)) == in_python
    assert printed(capsys, "--config", str(written)) == in_python
    # A rebuild: the default configuration with this one field changed.
    assert dataclasses.replace(RunConfig(), **{name: value}) == in_python
    assert RunConfig().with_changes(**{name: value}) == in_python


# Each field's layout as the ranks' pipeline shows it; other fields set where the value needs them.
ON_THE_RANKS = {
    "model": ({}, lambda spec: spec.config.hidden_size),
    "param_dtype": ({}, lambda spec: spec.param_dtype),
    "seed": ({}, lambda spec: spec.seed),
    "pp": ({}, lambda spec: spec.schedule.n_ranks),
    "dp": ({"impl": "torch"}, lambda spec: spec.mesh.dp if spec.mesh else 1),
    "tp": ({"impl": "torch"}, lambda spec: spec.mesh.tp if spec.mesh else 1),
    "schedule": ({}, lambda spec: spec.schedule.name),
    "impl": ({}, lambda spec: spec.impl),
    "n_microbatches": ({}, lambda spec: spec.schedule.n_microbatches),
    "n_virtual": ({"schedule": "interleaved-1f1b"}, lambda spec: spec.schedule.n_virtual),
    "balance": ({}, lambda spec: spec.balance and tuple(spec.balance)),
}


@pytest.mark.parametrize("name", FIELDS)
def test_a_field_reaches_the_ranks(name):
    """What the ranks are handed: the training's fields as TrainOptions, the
    layout's in the pipeline's spec."""
    if name not in ON_THE_RANKS:
        assert getattr(RunConfig(**{name: CHANGED[name]}).training(), name) == CHANGED[name]
        return
    needs, seen = ON_THE_RANKS[name]
    before = seen(RunConfig().pipeline_spec())
    after = seen(RunConfig(**needs, **{name: CHANGED[name]}).pipeline_spec())
    assert before != after, name
    assert after == (768 if name == "model" else CHANGED[name]), (name, after)  # small: 768 wide


def test_lab_pipeline_keywords_have_the_fields_names_defaults_and_help():
    """lab.pipeline's keywords (every driver's) that are a run's fields take the
    field's name, default and help."""
    for pipeline in (Lab.pipeline, RankPool.pipeline):
        keywords = inspect.signature(pipeline).parameters
        shared = [name for name in keywords if name in FIELDS]
        assert sorted(shared) == sorted(f.name for f in dataclasses.fields(PipelineOptions))
        for name in shared:
            default = dataclasses.fields(RunConfig)[FIELDS.index(name)].default
            if name == "n_microbatches":  # a Schedule given by itself brings its own count
                assert keywords[name].default is None
            else:
                assert keywords[name].default == default, name
            # and its help, as the field gives it (help(lab.pipeline) reads what `pplab train --help` reads)
            said = dataclasses.fields(RunConfig)[FIELDS.index(name)].metadata["help"]
            assert " ".join(said.split()) in " ".join(pipeline.__doc__.split()), name


# A value of the wrong kind, as a flag's text and as Python's value.
BAD = {"a whole number >= 1": ("0", 0), "a whole number >= 0": ("-1", -1), "a whole number": ("1.5", 1.5),
       "a number > 0": ("0", 0.0), "a number >= 0": ("-1", -1.0),
       "two numbers in [0, 1)": ("0.9,1.5", (0.9, 1.5)),
       "layers per stage, whole numbers >= 1": ("3,0", (3, 0)),
       "a norm > 0 (None: no clipping; 0 in a file or a flag)": ("-1", -1.0),
       "a text or a path": (None, 5), "a schedule's name, or a Schedule": (None, 5),
       "true or false": (None, "yes")}


@pytest.mark.parametrize("name", FIELDS)
def test_a_bad_value_is_refused_by_name_on_every_path(name, capsys, tmp_path):
    field = dataclasses.fields(RunConfig)[FIELDS.index(name)]
    kind = field.metadata["kind"]
    text, value = BAD.get(kind.said, ("float16", "float16"))  # a choice: a name it does not have
    with pytest.raises(ValueError, match=re.escape(f"RunConfig.{name}={value!r}: give {kind.said}")):
        RunConfig(**{name: value}).check(4)
    if text is not None:  # any text is a text; a switch is there or not
        flag = "--n-ranks" if name == "pp" else f"--{name.replace('_', '-')}"
        with pytest.raises(SystemExit) as exit:
            main(["train", flag, text, "--print-config"])
        assert exit.value.code == 2
        assert f"argument {flag}: {text!r} is not {kind.said}" in capsys.readouterr().err
    if text is not None or kind.choices:  # a file's value, read as the flag reads its text
        file = tmp_path / "bad.toml"
        file.write_text(f"{name} = {json.dumps(list(value) if isinstance(value, tuple) else value)}\n")
        assert main(["train", "--config", str(file), "--print-config"]) == 2
        err = capsys.readouterr().err
        assert f"--config {str(file)!r}: " in err and name in err and err.count("\n") == 1, err


def test_a_path_is_taken_where_a_file_or_folder_is_meant_and_kept_as_text(tmp_path):
    config = RunConfig(checkpoint_dir=tmp_path / "run", data=tmp_path / "notes.txt",
                       model=tmp_path / "config.json")
    assert (config.checkpoint_dir, config.data, config.model) == tuple(str(tmp_path / name) for name in
                                                                       ("run", "notes.txt", "config.json"))
    assert RunConfig.of(tomllib.loads(config.to_toml())) == config
    with pytest.raises(ValueError, match=r"TrainOptions.clip=0: give a norm > 0 \(None: no clipping"):
        TrainOptions(clip=0).check(4)
    assert RunConfig(clip=0).clip is None  # as a file or a flag says it


def test_a_run_config_is_train_and_pipeline_options_and_the_models_layout():
    trained = [f.name for f in dataclasses.fields(TrainOptions)]
    piped = [f.name for f in dataclasses.fields(PipelineOptions)]
    assert FIELDS == piped + trained + ["model", "pp", "dp", "tp"]
    assert RunConfig().training() == TrainOptions()


# -- every family, every taker -------------------------------------------------------------------

FAMILIES = [TrainOptions, PipelineOptions, LabOptions, Costs]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.__name__)
def test_every_option_has_a_help_a_section_and_a_default_of_its_kind(family):
    for field in dataclasses.fields(family):
        meta = field.metadata
        assert meta["help"] and meta["section"] and meta["kind"], (family.__name__, field.name)
        meta["kind"].check(field.name, field.default, optional=meta["optional"])


def test_the_labs_keywords_are_every_lab_option_with_its_default_and_help():
    keywords = inspect.signature(Lab.__init__).parameters
    for field in dataclasses.fields(LabOptions):
        assert keywords[field.name].default == field.default, field.name
        said = " ".join(field.metadata["help"].split())
        assert said in " ".join(Lab.__init__.__doc__.split()), field.name


def test_a_default_that_differs_without_a_reason_is_refused_at_import():
    with pytest.raises(TypeError, match=r"wait takes LabOptions's options: default op_timeout=5 "
                                        r"\(the field's: 60.0\)"):
        @takes_options(LabOptions)
        def wait(op_timeout=5): ...
    with pytest.raises(TypeError, match=r"default op_timeout=60.0 is the field's default: leave it out"):
        @takes_options(LabOptions, differs={"op_timeout": "no reason left"})
        def wait_again(op_timeout=LabOptions.op_timeout): ...
    with pytest.raises(TypeError, match=r"it lacks n_virtual; it lacks param_dtype"):
        @takes_options(PipelineOptions, every=True, differs={"n_microbatches": "None: counted"})
        def build(schedule="1f1b", n_microbatches=None, impl="pplab", seed=0, balance=None): ...

    @takes_options(LabOptions, differs={"n_ranks": "4: more to see"})
    def shown(n_ranks=4, grace=LabOptions.grace): ...

    assert shown.__takes_options__ == {LabOptions: {"n_ranks": "4: more to see"}}


# Options whose name means the same wherever it appears (a `device` may be a torch.device, `steps`
# a count of anything): a keyword or a flag of that name takes the option's default or says why.
WATCHED = {"n_ranks", "op_timeout", "start_timeout", "grace", "threads", "cores", "gpu_memory_fraction",
           "backend", "n_microbatches", "n_virtual", "impl", "param_dtype", "balance", "seq_len",
           "batch_size", *(field.name for field in dataclasses.fields(Costs))}
# Floor 1's builders count what they are given: `from_text(lines)` and `from_lists(actions)` read the
# microbatches off the actions, `Timeline(events)` the ranks off the events.
COUNTED_FROM_WHAT_THEY_ARE_GIVEN = {"pplab.schedules.communication.from_text",
                                    "pplab.schedules.schedule.from_lists",
                                    "pplab.trace.timeline.Timeline.__init__"}


def _functions():
    """Every function and method pplab defines, with its module's name."""
    import importlib
    import pkgutil

    import pplab

    for found in pkgutil.walk_packages(pplab.__path__, "pplab."):
        if found.name.endswith("__main__"):
            continue
        module = importlib.import_module(found.name)
        for value in vars(module).values():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                yield value
            elif inspect.isclass(value):
                yield from (getattr(member, "__func__", member) for member in vars(value).values()
                            if inspect.isfunction(getattr(member, "__func__", member)))


def test_no_keyword_takes_an_option_with_another_default_unless_it_says_why():
    defaults = {field.name: (family, field.default) for family in FAMILIES
                for field in dataclasses.fields(family) if field.name in WATCHED}
    unexplained = set()
    for function in _functions():
        where = f"{function.__module__}.{function.__qualname__}"
        for name, parameter in inspect.signature(function).parameters.items():
            if name not in defaults or parameter.default is inspect.Parameter.empty:
                continue
            family, default = defaults[name]
            if parameter.default != default and family not in getattr(function, "__takes_options__", {}) \
                    and where not in COUNTED_FROM_WHAT_THEY_ARE_GIVEN:
                unexplained.add(f"{where}({name}={parameter.default!r}), {family.__name__}'s: {default!r}")
    assert not unexplained, sorted(unexplained)


def _flags():
    """(command, action) for every flag of every `pplab` command."""
    import argparse

    parsers = [("pplab", build_parser())]
    while parsers:
        command, parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.items())
            elif action.option_strings:
                yield command, action


def test_every_flag_of_an_option_is_made_from_its_field():
    names = {field.name for family in FAMILIES for field in dataclasses.fields(family)}
    hand_written = [f"{command} {action.option_strings[0]}" for command, action in _flags()
                    if action.dest in names & WATCHED and not hasattr(action, "option_of")]
    assert hand_written == []
    n_ranks = [command for command, action in _flags() if action.dest == "n_ranks"]
    # (init: a workshop's)
    assert sorted(n_ranks) == ["demo", "doctor", "init", "room", "search", "simulate", "train"]


@pytest.mark.parametrize("command", ["simulate", "search"])
def test_every_cost_field_is_a_flag_whose_value_reaches_the_cost_model(command):
    from pplab.cli.simulate import costs_from_flags

    changed = {"forward": ("0.5,1", (0.5, 1.0)), "backward": ("3", 3.0), "input_grad": ("2", 2.0),
               "weight_grad": ("1", 1.0), "latency": ("0.25", 0.25), "bandwidth": ("1e6", 1e6),
               "activation_bytes": ("4096", 4096), "link_contention": (None, True),
               "link": ("rendezvous", "rendezvous")}
    assert sorted(changed) == sorted(field.name for field in dataclasses.fields(Costs))
    sizes = ["--n-ranks", "2", "--n-microbatches", "4"] + (["zb-h1"] if command == "simulate" else [])
    for name, (text, value) in changed.items():
        flag = ["--" + name.replace("_", "-")] + ([] if text is None else [text])
        args = build_parser().parse_args([command, *sizes, *flag])
        if name == "input_grad":
            args.weight_grad = 1.0  # I with W: B is their sum
        if name == "bandwidth":
            args.activation_bytes = 4096  # a bandwidth prices a message's bytes
        assert getattr(costs_from_flags(args), name) == value, name
