"""`lab.pipeline` on real engines: the calls the notebooks and widgets build on."""

import pytest

import pplab
from pplab.data import batches

CONFIG = pplab.LlamaConfig.tiny()


def my_rank():
    from pplab.rank.rank_context import rank_context

    return rank_context().rank


@pytest.mark.quick
def test_lab_pipeline_writes_out_every_keyword_of_a_pipeline_spec_with_its_defaults():
    import dataclasses
    import inspect

    from pplab.rank.rank_pipeline import PipelineSpec

    pipeline = inspect.signature(pplab.RankPool.pipeline).parameters
    create = inspect.signature(PipelineSpec.create).parameters
    fields = {field.name: field.default for field in dataclasses.fields(PipelineSpec)}
    # One pipeline(...) for every driver: a notebook's lab builds a richer Pipeline, with the same keywords.
    assert pplab.Lab.pipeline is pplab.RankPool.pipeline and issubclass(pplab.Lab.pipeline_class,
                                                                        pplab.Pipeline)
    assert set(pipeline) - {"self"} == set(fields) | {"n_microbatches", "n_virtual"}
    assert set(create) - {"cls", "n_ranks"} == set(pipeline) - {"self"}
    for name in fields.keys() - {"config", "schedule"}:
        assert create[name].default == fields[name], name
        # None: the driver's
        assert pipeline[name].default == (None if name == "op_timeout" else fields[name]), name
        assert create[name].kind == pipeline[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    for name in ("n_microbatches", "n_virtual"):
        assert pipeline[name].default == create[name].default, name


@pytest.mark.quick
def test_stages_a_rank_built_are_checked_against_the_clients_spec():
    from pplab.rank.rank_pipeline import PipelineSpec
    from pplab.session.pipeline import wrong_placement

    spec = PipelineSpec.create(pplab.LlamaConfig.tiny(), "interleaved-1f1b", 2, 4, 2)
    built = [{"rank": 0, "pplab": "0.1.0", "stages": [0, 2], "coordinates": None},
             {"rank": 1, "pplab": "0.1.0", "stages": [1, 3], "coordinates": None}]
    assert wrong_placement(spec, built) is None
    # another pplab, on another host, built another cut
    built[1] = {**built[1], "pplab": "0.0.9", "stages": [1]}
    said = wrong_placement(spec, built)
    assert said.startswith("rank 1 built stages [1] at None, not [1, 3] at "
                           "None") and "runs pplab 0.0.9" in said
    mesh = PipelineSpec.create(pplab.LlamaConfig.tiny(), "1f1b", 4, 4, impl="torch", mesh={"pp": 2, "dp": 2})
    built = [{"stages": [mesh.schedule.stages_of(mesh.pp_rank(r))[0]],
              "coordinates": mesh.mesh.coordinates(r)}
             for r in range(4)]
    assert wrong_placement(mesh, built) is None
    built[2], built[1] = built[1], built[2]  # two ranks in each other's places
    assert wrong_placement(mesh, built).startswith("rank 1 built stages")


@pytest.mark.quick
def test_a_misspelt_keyword_of_lab_pipeline_is_pythons_own_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_microbatch'"):
        # Python refuses it before the body runs
        pplab.RankPool.pipeline(None, CONFIG, "1f1b", n_microbatch=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timout'"):
        pplab.Lab.pipeline(None, CONFIG, "1f1b", 4, timout=3)


def test_step_parity_gradient_flow_and_shapes_on_a_lab(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)
    result = pipe.step()
    assert result.timeline.n_ranks == 2
    assert {e.rank for e in result.timeline.events} == {0, 1}
    assert len(result.microbatch_losses) == 4 and 0 < result.timeline.bubble_fraction() < 1
    assert [row[:3] for row in pipe.boundary_shapes().rows()] == \
        [["0 -> 1", mb, (2, 32, CONFIG.hidden_size)] for mb in range(4)]

    parity = pipe.check_parity()
    assert parity.passed, str(parity)
    assert len(parity.grad_diffs) == sum(1 for _ in pplab.build_model(CONFIG).parameters())
    flow = pipe.check_gradient_flow()
    assert flow.passed, str(flow)
    pipe.close()


@pytest.mark.parametrize("schedule, microbatches, n_virtual", [("interleaved-1f1b", 4, 2), ("zb-h1", 3, 1)])
def test_interleaved_and_zero_bubble_match_one_device_on_a_lab(lab2, schedule, microbatches, n_virtual):
    pipe = lab2.pipeline(CONFIG, schedule=schedule, n_microbatches=microbatches, n_virtual=n_virtual)
    batch = next(batches(2 * microbatches, 24, seed=5))
    for _ in range(2):  # a second step on the same stages starts from zeroed gradients
        parity = pipe.check_parity(batch)
        assert parity.passed, str(parity)
    pipe.close()


def test_bad_pipelines_are_rejected_before_any_rank_runs(lab2):
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        lab2.pipeline(CONFIG, schedule="zigzag", n_microbatches=4)
    with pytest.raises(ValueError, match="schedule is for 3 ranks but the pipeline has 2"):
        lab2.pipeline(CONFIG, schedule=pplab.schedules.build("1f1b", 3, 3))
    with lab2.pipeline(CONFIG, schedule="gpipe", n_microbatches=4) as pipe:
        with pytest.raises(ValueError, match="n_microbatches=4 does not divide the batch size 6"):
            pipe.step(next(batches(6, 16)))
        assert pipe.step().loss > 0  # nothing was left half-done on the ranks
    # The block closed it: its stages are gone from every rank, the client says so before asking
    # them, and the lab goes on.
    with pytest.raises(RuntimeError, match="was closed .* build the pipeline again"):
        pipe.step()
    assert lab2.run(_holds, pipe.pipeline_id) == [False, False]
    assert lab2.state == "running"


def _holds(pipeline_id: str) -> bool:
    from pplab.session.on_rank import built_pipeline

    try:
        built_pipeline(pipeline_id)
    except LookupError:
        return False
    return True


def test_a_broken_process_group_makes_the_lab_ask_for_a_restart(fragile_lab):
    """Every rank times out: the lab says the group is broken. (A lab with 3 s of grace: on a busy
    machine the second rank's report can come more than the shared lab's 1 s after the first.)"""
    def every_rank_times_out():
        from pplab.rank.comm import PipelineTimeoutError

        raise PipelineTimeoutError(f"rank {my_rank()} waited 1 s for the activation of microbatch 0")

    with pytest.raises(pplab.session.RankFailedError, match="The process group is broken"):
        fragile_lab.run(every_rank_times_out)
    assert fragile_lab.state != "running"
    with pytest.raises(pplab.drivers.cluster.LabNeedsRestartError):
        fragile_lab.run(lambda: None)
    fragile_lab.restart()
    assert fragile_lab.run(my_rank) == [0, 1]


def loaded_modules() -> set[str]:
    import sys

    return set(sys.modules)


def test_no_step_imports_a_module_on_a_rank_not_even_the_first(fragile_lab):
    """What a stage's first backward imports (torch's symbolic shapes and sympy: 0.7 s of CPU) is
    imported while the pipeline is built, when no peer waits. Imported inside the first step, it
    kept the next rank waiting past a 20 s op timeout beside two CPU burners."""
    fragile_lab.restart()  # fresh ranks: no earlier pipeline's step imported anything on them
    pipe = fragile_lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)
    built = fragile_lab.run(loaded_modules)
    pipe.step()
    stepped = fragile_lab.run(loaded_modules)
    assert [sorted(after - before) for before, after in zip(built, stepped)] == [[], []]


def test_a_pipeline_stepped_after_a_restart_says_to_build_it_again(lab2):
    pipe = lab2.pipeline(CONFIG, schedule="gpipe", n_microbatches=2)
    lab2.restart()
    with pytest.raises(RuntimeError, match=r"built on ranks that were replaced since \(a restart.*: "
                                           r"build the pipeline again \(lab.pipeline\(...\)\)"):
        pipe.step()
    assert lab2.state == "running"  # refused on the client: no rank was called


def test_training_on_a_lab_is_the_training_of_plain_processes_and_reshards(lab2, tmp_path):
    from pplab.rank.rank_pipeline import PipelineSpec
    from pplab.rank.train import TrainOptions, build_and_train_on_rank
    from ranks import run_ranks

    options = dict(steps=6, batch_size=8, seq_len=32, warmup=2, eval_every=3)
    spec = PipelineSpec.create(CONFIG, "interleaved-1f1b", 2, 4, 2)
    plain = run_ranks(2, build_and_train_on_rank, spec, TrainOptions(**options), None, False, timeout=120)[0]

    pipe = lab2.pipeline(CONFIG, "interleaved-1f1b", n_microbatches=4, n_virtual=2)
    first = pipe.train(until=4, show=False, checkpoint_dir=str(tmp_path), checkpoint_every=2, **options)
    rest = pipe.train(show=False, checkpoint_dir=str(tmp_path), checkpoint_every=2, **options)  # goes on
    assert first.losses + rest.losses == plain.losses
    assert set(plain.eval_losses) <= set(pipe.history.eval_losses)  # and one where the first call stopped
    pipe.close()
    # 4 stages saved; 2 stages resume from step 4 and take the same step 5.
    fewer = lab2.pipeline(CONFIG, "1f1b", n_microbatches=4)
    resumed = fewer.train(until=5, show=False, resume=str(tmp_path / "step-00000004"), **options)
    assert resumed.losses == plain.losses[4:5]
    fewer.close()
