"""Distributed checkpoints on real ranks: resume, crash during a save, resharding, bad input."""

import json
import os
import shutil

import pytest
import torch

from pplab.data import batches
from pplab.models.llama import LlamaConfig, build_model
from pplab.models.partition import build_stage
from pplab.rank import checkpoint
from pplab.rank.checkpoint import Checkpointer, CheckpointError, rank_module
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline
from pplab.rank.reference import reference_step
from pplab.rank.train import RankTrainer, TrainOptions, build_and_train_on_rank, make_optimizer
from pplab.session import RankError
from ranks import run_ranks

CONFIG = LlamaConfig.tiny()
BASE = dict(steps=6, batch_size=8, seq_len=32, warmup=2, eval_every=0)


def spec_for(ranks, schedule="1f1b", n_virtual=1, impl="pplab"):
    return PipelineSpec.create(CONFIG, schedule, ranks, 4, n_virtual, impl=impl)


def train(ranks, options, until=None, spec=None):
    return run_ranks(ranks, build_and_train_on_rank, spec or spec_for(ranks), options, until, False,
                     timeout=180)[0]


@pytest.fixture(scope="module")
def uninterrupted():
    return train(2, TrainOptions(**BASE)).losses


@pytest.mark.parametrize("async_save", [False, True])
def test_stop_and_resume_gives_the_uninterrupted_losses(tmp_path, uninterrupted, async_save):
    options = TrainOptions(**BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep=5,
                           async_save=async_save)
    first = train(2, options, until=4)
    assert [r.checkpoint is not None for r in first.records] == [False, True, False, True]
    resumed = train(2, TrainOptions(**{**options.__dict__, "resume": "latest"}))
    assert resumed.resumed_from == str(checkpoint.step_directory(tmp_path, 4))
    assert first.losses + resumed.losses == uninterrupted
    # Step 2's checkpoint was written (in the background with async_save) while steps 3
    # and 4 changed the weights: it must still hold step 2's state.
    from_two = train(2, TrainOptions(**BASE, resume=str(checkpoint.step_directory(tmp_path, 2))))
    assert from_two.losses == uninterrupted[2:]


def train_with_a_crash_before_commit(rank, world_size, spec, options, device="cpu"):
    """Train to step 2 (saved), then rank 1 dies after writing step 4's shard, before it is committed."""
    trainer = RankTrainer(RankPipeline(spec, rank, device), options)
    trainer.train(until=2)
    if rank == 1:
        trainer.checkpointer.before_commit = lambda: os._exit(3)
    trainer.train(until=4)


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, uninterrupted):
    options = TrainOptions(**BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(RankError, match="rank 1"):
        run_ranks(2, train_with_a_crash_before_commit, spec_for(2), options, timeout=120)
    assert (tmp_path / ".step-00000004.partial").is_dir()  # written, never made visible
    assert checkpoint.latest(tmp_path) == checkpoint.step_directory(tmp_path, 2)
    resumed = train(2, TrainOptions(**{**options.__dict__, "resume": "latest"}))
    assert resumed.resumed_from.endswith("step-00000002")
    assert resumed.losses == uninterrupted[2:]
    assert not (tmp_path / ".step-00000004.partial").exists()  # the retried save replaced it


@pytest.fixture(scope="module")
def four_stage_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("four-stages")
    train(4, TrainOptions(**BASE, checkpoint_dir=str(root)), until=3)
    return root


@pytest.mark.parametrize("ranks, schedule, n_virtual, impl", [(2, "1f1b", 1, "pplab"),
                                                              (1, "gpipe", 1, "pplab"),
                                                               (2, "interleaved-1f1b", 2, "pplab"),
                                                               (2, "gpipe", 1, "torch")])
def test_a_checkpoint_of_four_stages_reshards_to_other_layouts(four_stage_checkpoint, uninterrupted,
                                                             ranks, schedule, n_virtual, impl):
    spec = spec_for(ranks, schedule, n_virtual, impl)
    history = train(ranks, TrainOptions(**BASE, resume=str(four_stage_checkpoint)), until=4, spec=spec)
    assert history.losses == [uninterrupted[3]]  # 4 stages or 2, the same run


def test_the_full_model_loads_on_one_device_and_exports(four_stage_checkpoint, uninterrupted, tmp_path):
    model = checkpoint.load_model(four_stage_checkpoint)
    next_batch = next(batches(8, 32, 0, split="train", start=3))
    assert reference_step(model, next_batch, 4).loss == uninterrupted[3]
    exported = checkpoint.export_model(four_stage_checkpoint, tmp_path / "model.pt")
    plain = build_model(CONFIG, seed=99)
    plain.load_state_dict(torch.load(exported))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    train(2, TrainOptions(**BASE, checkpoint_dir=str(tmp_path), checkpoint_every=1, keep=2))
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-00000005", "step-00000006"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- bad input: clear errors, nothing overwritten -------------------------------------------


@pytest.fixture
def saved(four_stage_checkpoint, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(four_stage_checkpoint, copy)
    return checkpoint.latest(copy)


def one_rank_state():
    stages = {0: build_stage(CONFIG, 0, 1, seed=7)}
    module = rank_module(stages)
    optimizer, scheduler = make_optimizer(module.named_parameters(), TrainOptions())
    return module, optimizer, scheduler


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(saved):
    other = LlamaConfig.tiny(hidden_size=128)
    with pytest.raises(CheckpointError, match="hidden_size=64 in the checkpoint, 128 here"):
        checkpoint.check_loadable(saved, other)
    module, optimizer, scheduler = one_rank_state()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError, match="num_hidden_layers=8 in the checkpoint, 4 here"):
        Checkpointer(saved.parent, 0).load(saved, module, optimizer, scheduler,
                                           LlamaConfig.tiny(num_hidden_layers=4))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # untouched


def test_missing_partial_and_newer_checkpoints_are_refused(saved):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.resolve(saved.parent / "step-00000099")
    partial = saved.parent / ".step-00000009.partial"
    partial.mkdir()
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve(partial)
    assert checkpoint.resolve(saved.parent) == saved  # the root resolves to its newest complete one
    manifest = json.loads((saved / "pplab.json").read_text())
    (saved / "pplab.json").write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99.*upgrade pplab"):
        checkpoint.check_loadable(saved, CONFIG)
    (saved / "pplab.json").write_text(json.dumps(manifest))
    shard = sorted(saved.glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing its file {shard.name}"):
        checkpoint.load_model(saved)
