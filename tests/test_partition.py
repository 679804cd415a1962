"""Partitioning: layer ranges, stages that are exact slices of the model, meta-device building."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pplab

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

CONFIG = pplab.LlamaConfig.tiny()


@pytest.mark.parametrize("n_layers, n_stages, kwargs, expected", [
    (8, 1, {}, [(0, 8)]),
    (8, 4, {}, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (8, 3, {}, [(0, 3), (3, 6), (6, 8)]),            # earlier stages take the extra layers
    (10, 4, {}, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    (8, 8, {}, [(i, i + 1) for i in range(8)]),
    (8, 3, dict(balance=[1, 5, 2]), [(0, 1), (1, 6), (6, 8)]),
    (8, 3, dict(balance=[0, 8, 0], allow_empty=True), [(0, 0), (0, 8), (8, 8)]),
    (2, 4, dict(allow_empty=True), [(0, 1), (1, 2), (2, 2), (2, 2)]),
])
def test_layer_ranges(n_layers, n_stages, kwargs, expected):
    assert pplab.layer_ranges(n_layers, n_stages, **kwargs) == expected


@pytest.mark.parametrize("args, kwargs, message", [
    ((8, 9), {}, "n_stages=9 is more than n_layers=8.*allow_empty=True"),
    ((8, 0), {}, "n_stages=0"),
    ((0, 2), {}, "n_layers=0"),
    ((8, 2.0), {}, "n_stages=2.0"),
    ((8, 3), dict(balance=[4, 4]), r"balance=\[4, 4\] has 2 entries but n_stages=3"),
    ((8, 2), dict(balance=[4, 5]), "sums to 9 but the model has n_layers=8"),
    ((8, 2), dict(balance=[-1, 9]), "non-negative integers"),
    ((8, 2), dict(balance=[0, 8]), "stage 0 without layers.*allow_empty=True"),
])
def test_layer_ranges_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pplab.layer_ranges(*args, **kwargs)


def test_stage_index_is_checked():
    with pytest.raises(ValueError, match="stage_index=4 is not a stage of n_stages=4"):
        pplab.build_stage(CONFIG, 4, 4)


@pytest.mark.parametrize("n_stages", range(1, CONFIG.num_hidden_layers + 1))
def test_stages_are_exactly_the_full_model(n_stages):
    full = pplab.build_model(CONFIG, seed=3)
    stages = [pplab.build_stage(CONFIG, s, n_stages, seed=3) for s in range(n_stages)]

    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in full.named_parameters())  # each exactly once
    full_params = dict(full.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, full_params[name]), name   # bitwise
    assert stages[0].is_first and stages[-1].is_last

    ids = torch.randint(0, CONFIG.vocab_size, (2, 12))
    hidden = ids
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, full(ids))


def test_pass_through_stages_forward_activations_and_gradients():
    stages = [pplab.build_stage(CONFIG, s, 10, allow_empty=True) for s in range(10)]
    assert [len(s.layers) for s in stages] == [1] * 8 + [0, 0]
    assert list(stages[8].parameters()) == []
    hidden = torch.randn(1, 4, CONFIG.hidden_size, requires_grad=True)
    out = stages[8](hidden)
    out.sum().backward()
    assert torch.equal(out, hidden) and torch.equal(hidden.grad, torch.ones_like(hidden))


class AllocationCounter(TorchDispatchMode):
    """Adds up the bytes of every new (non-meta) tensor storage that ops create."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("stage_index, n_stages", [(0, 1), (0, 4), (2, 4), (3, 4), (5, 8)])
def test_stage_allocates_only_what_it_owns(stage_index, n_stages):
    full = {name: p.numel() * p.element_size() for name, p in pplab.build_model(CONFIG).named_parameters()}
    with AllocationCounter() as counter:
        stage = pplab.build_stage(CONFIG, stage_index, n_stages)
    own = sum(full[name] for name, _ in stage.named_parameters())
    buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
    # Everything allocated is the stage's own parameters and buffers, plus a few bytes of
    # temporaries for the rotary frequencies: never another stage's weights.
    assert own + buffers <= counter.bytes <= own + buffers + 1024
    if n_stages > 1:
        assert counter.bytes < sum(full.values()) / 2


def test_every_parameter_name_maps_to_the_stage_that_holds_it():
    from pplab.models.partition import stage_of_parameter

    config = pplab.LlamaConfig.tiny()
    for n_stages in (1, 2, 3, 5, 8):
        ranges = pplab.layer_ranges(config.num_hidden_layers, n_stages)
        for stage in range(n_stages):
            module = pplab.build_stage(config, stage, n_stages, device="meta")
            for name, _ in module.named_parameters():
                assert stage_of_parameter(name, ranges) == stage, (n_stages, name)
