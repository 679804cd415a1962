"""A module of the user's own, cut by torch's tracer, against the same module on one device.

The models live in toy_models.py, which the ranks import by name; every run is on real gloo ranks.
"""

import pytest

from pplab.data import batches
from pplab.models.traced import TracedModel
from pplab.rank.checkpoint import step_directory
from pplab.rank.rank_pipeline import PipelineSpec
from ranks import pool
from toy_models import BranchyLM, TinyLM, TwoStreamLM

# (ranks, split points, schedule, runtime, stages per rank)
RUNS = [(2, ["layers.2"], "gpipe", "pplab", 1), (2, ["layers.2"], "1f1b", "torch", 1),
        (3, ["layers.1", "layers.3"], "zb-h1", "pplab", 1),
        (2, ["layers.1", "layers.2", "layers.3"], "interleaved-1f1b", "pplab", 2)]


@pytest.mark.parametrize("n_ranks, split_at, schedule, impl, n_virtual", RUNS)
def test_a_traced_module_matches_itself_on_one_device(n_ranks, split_at, schedule, impl, n_virtual):
    model = TracedModel(TinyLM, split_at, example_shape=(2, 16))
    with pool(n_ranks).pipeline(model, schedule=schedule, n_microbatches=4, n_virtual=n_virtual,
                                impl=impl) as pipe:
        parity, flow = pipe.check_parity(next(batches(8, 16, 0))), pipe.check_gradient_flow()
        shapes = {tuple(b.shape) for b in pipe.boundary_shapes().boundaries}
    assert parity.passed, parity
    assert flow.passed, flow
    assert shapes == {(2, 16, 32)}


def test_a_traced_module_trains_and_resumes_bitwise(tmp_path):
    # Two stages per rank: the rank's module merges their traced containers (layers.0, layers.2 ...).
    model = TracedModel(TinyLM, ["layers.1", "layers.2", "layers.3"], example_shape=(2, 16))
    options = dict(batch_size=8, seq_len=16, warmup=2, eval_every=0, lr=3e-3,
                   checkpoint_dir=str(tmp_path), checkpoint_every=4)
    with pool(2).pipeline(model, schedule="interleaved-1f1b", n_microbatches=4, n_virtual=2) as pipe:
        whole = pipe.train(8, show=False, **options)
        resumed = pipe.train(8, show=False, **options, resume=str(step_directory(tmp_path, 4)))
    assert resumed.losses == whole.losses[4:]
    assert whole.losses[-1] < whole.losses[0]


@pytest.mark.quick
@pytest.mark.parametrize("make, split_at, options, message", [
    (BranchyLM, ["layers.2"], {}, "torch's tracer cannot trace BranchyLM"),
    (TinyLM, ["layer.2"], {}, r"split_at names \['layer.2'\], which TinyLM does not have"),
    (TwoStreamLM, ["layers.2"], {}, "boundary after stage 0 is 2 values"),
    (TinyLM, ["layers.1", "layers.2"], {}, "makes 3 stages but the schedule has n_stages=2"),
    (TinyLM, ["layers.2"], {"balance": [1, 1]}, "move the split points"),
    (lambda: TinyLM(), ["layers.2"], {}, "cannot travel to the ranks"),
])
def test_bad_traced_models_are_refused_on_the_client(make, split_at, options, message):
    with pytest.raises(ValueError, match=message):
        PipelineSpec.create(TracedModel(make, split_at), "1f1b", 2, 2, **options)


@pytest.mark.quick
def test_one_split_point_may_be_a_name_and_a_factory_in_main_is_refused():
    assert TracedModel(TinyLM, "layers.2").split_at == ("layers.2",)

    def made_in_a_notebook():
        return TinyLM()

    made_in_a_notebook.__module__ = "__main__"  # as a notebook cell's function is
    with pytest.raises(ValueError, match="defined in __main__ .* put it in a .py file"):
        TracedModel(made_in_a_notebook, ["layers.2"])


@pytest.mark.quick
def test_a_traced_model_runs_the_shape_it_was_traced_at():
    from pplab.rank.rank_pipeline import split_for_ranks

    spec = PipelineSpec.create(TracedModel(TinyLM, ["layers.2"], example_shape=(2, 16)), "1f1b", 2, 2)
    assert spec.config.hidden_size == 32 and spec.config.vocab_size == 128
    with pytest.raises(ValueError, match=r"traced for \(2, 16\): make it with TracedModel\(\.\.\., "
                                         r"example_shape=\(4, 16\)\)"):
        split_for_ranks(spec, next(batches(8, 16, 0)))
