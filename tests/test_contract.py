"""Every driver keeps the written contract (`pplab.drivers.contract`), and a failed call raises
the same errors from each: code written against a RankPool catches a lab's failures too."""

import inspect
import os
import time
import warnings

import pytest

from pplab.drivers import contract
from pplab.drivers.cluster import calls, errors
from pplab.drivers.cluster.lab import Lab
from pplab.drivers.local import PoolCall, RankPool
from pplab.drivers.torchrun import TorchrunRanks, _FinishedCall
from pplab.session import RankDiedError, RankError, RankFailedError, RankTimeoutError
from ranks import pool

DRIVERS = [Lab, RankPool, TorchrunRanks]
CALLS = [calls.RankCall, PoolCall, _FinishedCall]


def members(protocol) -> dict[str, object]:
    """The methods and properties a protocol asks for, by name."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


@pytest.mark.quick
@pytest.mark.parametrize("driver, protocol", [*[(d, contract.Ranks) for d in DRIVERS],
                                              *[(c, contract.RankCall) for c in CALLS]],
                         ids=lambda x: x.__name__)
def test_every_driver_and_its_calls_have_what_the_contract_asks_with_its_parameters(driver, protocol):
    for name, wanted in members(protocol).items():
        assert hasattr(driver, name), f"{driver.__name__} lacks {name}"
        if callable(wanted):
            assert parameters(getattr(driver, name)) == parameters(wanted), (driver.__name__, name)


@pytest.mark.quick
def test_the_labs_errors_are_the_errors_every_driver_raises_one_class_each():
    from pplab.drivers import local, torchrun
    for driver in (calls, local, torchrun):
        for kind in (RankFailedError, RankDiedError, RankTimeoutError):
            assert getattr(driver, kind.__name__, kind) is kind, (driver.__name__, kind.__name__)
    assert issubclass(RankTimeoutError, TimeoutError)
    assert all(issubclass(kind, RankError) for kind in (errors.LabStartError, errors.LabNeedsRestartError))
    assert not {"RankFailedError", "RankDiedError", "RankTimeoutError"} & set(vars(errors))


@pytest.mark.quick
def test_the_last_releases_local_rank_error_still_catches_a_pools_failures_and_says_its_new_name():
    from pplab.drivers import local

    with pytest.warns(DeprecationWarning, match=r"LocalRankError is now pplab.session.RankError"):
        renamed = local.LocalRankError
    assert renamed is RankError
    # its order
    old_style = renamed("rank 1 failed", {1: "failed: ValueError: no"}, {1: ("ValueError", "no")})
    assert old_style.first_raised() == ("ValueError", "no") and old_style.ranks == [1]


def fail_on_rank_one():
    from pplab.rank.rank_context import rank_context

    if rank_context().rank == 1:
        raise ValueError("rank one refuses")
    return "fine"


def die_on_rank_one():
    from pplab.rank.rank_context import rank_context

    if rank_context().rank == 1:
        os._exit(7)
    return "fine"


def what_this_rank_was_given(value, common, *, extra):
    from pplab.rank.rank_context import rank_context

    return rank_context().rank, value, common, extra


def test_a_per_rank_argument_gives_each_rank_its_own_item_on_a_pool_and_on_a_lab(lab2):
    for ranks in (pool(2), lab2):
        given = ranks.run(what_this_rank_was_given, contract.PerRank(["zero", "one"]), "both",
                          extra=contract.PerRank([{"n": 0}, {"n": 1}]))
        assert given == [(0, "zero", "both", {"n": 0}), (1, "one", "both", {"n": 1})], type(ranks)
        with pytest.raises(ValueError, match=r"what_this_rank_was_given\(\): argument 0 is a PerRank of 3 "
                                             r"values for 2 ranks: give exactly one value per rank"):
            ranks.run_async(what_this_rank_was_given, contract.PerRank([1, 2, 3]), "both", extra=None)
        # still usable
        assert ranks.run(what_this_rank_was_given, 1, 2, extra=3) == [(0, 1, 2, 3), (1, 1, 2, 3)]


def test_a_rank_that_raises_is_the_same_error_on_a_pool_and_on_a_lab(lab2):
    for ranks in (pool(2), lab2):
        assert isinstance(ranks, contract.Ranks)
        with pytest.raises(RankFailedError) as failure:
            ranks.run(fail_on_rank_one, timeout=60)
        assert failure.value.ranks == [1], (type(ranks), failure.value.ranks)
        assert failure.value.first_raised() == ("ValueError", "rank one refuses")
        assert failure.value.causes[1].startswith("failed: ValueError"), failure.value.causes
        assert "rank one refuses" in failure.value.summary


def process_groups_held_by_torch_defaults() -> int:
    """How many of torch.distributed.nn.functional's default arguments hold a process group, after
    the rank made an optimizer (the first one imports torch._dynamo, which imports that module)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as functional

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return sum(isinstance(default, dist.ProcessGroup)
               for function in vars(functional).values() if callable(function)
               for default in (getattr(function, "__defaults__", None) or ()))


def test_no_rank_lets_torchs_default_arguments_keep_its_process_group_alive(lab2):
    # A group held there outlives destroy_process_group and was torn down at interpreter exit,
    # where gloo aborted a torchrun rank now and then ("terminate called without an active exception").
    for ranks in (pool(2), lab2):
        assert ranks.run(process_groups_held_by_torch_defaults) == [0, 0], type(ranks)


def test_a_pools_rank_that_dies_or_overruns_is_named_with_the_labs_kinds():
    with pytest.raises(RankDiedError) as died:
        pool(2).run(die_on_rank_one, timeout=60)
    assert died.value.ranks == [1] and "exit code 7" in died.value.summary
    with pytest.raises(RankTimeoutError) as late:
        pool(2).run(time.sleep, 30, timeout=1)
    assert late.value.ranks == [0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pool(2).run(fail_on_rank_one.__name__.upper) == ["FAIL_ON_RANK_ONE"] * 2  # fresh ranks after
