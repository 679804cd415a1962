"""A damaged checkpoint never changes a run: each kind of damage is refused naming the file, on real ranks.

The rank functions train a little, save, damage a copy of the checkpoint by hand (rank 0,
between barriers), try to resume from it, and compare every piece of the run's state
before and after, bit for bit: parameters, gradients, optimizer moments and step counts,
scheduler, step, data position, RNG.
"""

import copy
import json
import random
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pplab.models.llama import LlamaConfig
from pplab.models.partition import build_stage
from pplab.rank import checkpoint
from pplab.rank.checkpoint import Checkpointer, CheckpointError, rank_module
from pplab.rank.rank_pipeline import PipelineSpec, RankPipeline
from pplab.rank.train import RankTrainer, TrainOptions, build_and_train_on_rank, make_optimizer
from ranks import run_ranks

CONFIG = LlamaConfig.tiny()
BASE = TrainOptions(steps=6, batch_size=8, seq_len=32, warmup=2, eval_every=0)


# --- the damage a checkpoint can come to ----------------------------------------------------


def last_shard(path: Path) -> Path:
    return max(path.glob("__*_0.distcp"), key=lambda p: int(p.name.split("_")[2]))


def cut_to_half(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def rewrite_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "pplab.json").read_text())
    change(manifest)
    (path / "pplab.json").write_text(json.dumps(manifest, indent=1))


# name -> (what it does to a checkpoint directory, the file the error must name, words it must hold)
DAMAGES = {
    "shard cut to half": (lambda p: cut_to_half(last_shard(p)), "last shard", "cut short"),
    "shard emptied": (lambda p: last_shard(p).write_bytes(b""), "last shard", "empty"),
    "shard lost": (lambda p: last_shard(p).unlink(), "last shard", "missing"),
    "shard with a flipped byte": (lambda p: flip_a_byte(last_shard(p)), "last shard", "damaged"),
    "metadata cut to half": (lambda p: cut_to_half(p / ".metadata"), ".metadata", "cut short"),
    "manifest of garbage": (lambda p: (p / "pplab.json").write_bytes(b"\x00\xffnot json"), "pplab.json",
                            "damaged"),
    "manifest cut to half": (lambda p: cut_to_half(p / "pplab.json"), "pplab.json", "damaged"),
    "manifest without config": (lambda p: rewrite_manifest(p, lambda m: m.pop("config")), "pplab.json",
                                "incomplete"),
    "manifest altered": (lambda p: rewrite_manifest(p, lambda m: m.update(step=7)), "pplab.json", "altered"),
}


def damaged_copy(saved: Path, name: str, into: Path) -> tuple[Path, str]:
    """A copy of `saved` with damage `name`; the name of the file the error must give."""
    target = into / name.replace(" ", "-") / saved.name
    shutil.copytree(saved, target)
    damage, named, _ = DAMAGES[name]
    shard = last_shard(target).name
    damage(target)
    return target, shard if named == "last shard" else named


# --- a run's whole state, bit for bit ---------------------------------------------------------


def run_state(trainer: RankTrainer) -> dict:
    """Everything a resume replaces: a deep copy."""
    module = trainer.module
    return copy.deepcopy({
        "parameters": {name: p.detach() for name, p in module.named_parameters()},
        "gradients": {name: None if p.grad is None else p.grad for name, p in module.named_parameters()},
        "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
        "counters": (trainer.step, trainer.data_position), "rng": torch.get_rng_state()})


def same(a, b) -> bool:
    """Equal to the last bit, through dicts, lists and tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --- on real ranks ----------------------------------------------------------------------------


def try_damaged_resumes(rank, world_size, spec, options, scratch):
    """For a sync and an async save: save at step 2, go on to 3, try to resume from each damaged copy of 2."""
    runs = []
    for async_save in (False, True):
        run_options = replace(options, checkpoint_dir=f"{options.checkpoint_dir}-{async_save}",
                              async_save=async_save)
        trainer = RankTrainer(RankPipeline(spec, rank), run_options)
        first = trainer.train(until=3).losses
        saved = checkpoint.step_directory(run_options.checkpoint_dir, 2)
        outcomes = {}
        for name in DAMAGES:
            before = run_state(trainer)
            into = Path(f"{scratch}-{async_save}")
            if rank == 0:
                damaged_copy(saved, name, into)
            dist.barrier()
            try:
                trainer.load(into / name.replace(" ", "-") / saved.name)
                error = None
            except CheckpointError as refused:
                error = str(refused)
            outcomes[name] = (error, same(before, run_state(trainer)))
        before = run_state(trainer)
        trainer.load(saved)  # the intact checkpoint does change the run: back to step 2
        changed = not same(before, run_state(trainer))
        runs.append((outcomes, changed, trainer.train(until=3).losses == first[2:]))
    return runs


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_no_rank_changes(tmp_path, ranks):
    options = replace(BASE, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2)
    spec = PipelineSpec.create(CONFIG, "1f1b", ranks, 4)
    results = run_ranks(ranks, try_damaged_resumes, spec, options, str(tmp_path / "damaged"), timeout=300)
    shard = f"__{ranks - 1}_0.distcp"
    for rank, runs in enumerate(results):
        for saving, (outcomes, changed, step_three_again) in zip(("sync", "async"), runs):
            for name, (error, unchanged) in outcomes.items():
                _, named, words = DAMAGES[name]
                named = shard if named == "last shard" else named
                assert error is not None, f"rank {rank} loaded a {saving} checkpoint with its {name}"
                assert named in error and words in error and "\n" not in error, (name, error)
                assert unchanged, (f"rank {rank}'s run changed when loading a {saving} checkpoint "
                                   f"with its {name}")
            assert changed and step_three_again  # the intact step 2 loads, and step 3 is the same again


def resume_after_training(rank, world_size, specs, options, roots):
    """Per spec: a fresh resume from step 2, and resumes on a pipeline and a trainer that trained to 4."""
    outcomes = []
    for spec, root in zip(specs, roots):
        step_two = str(checkpoint.step_directory(root, 2))
        trainer = RankTrainer(RankPipeline(spec, rank),
                              replace(options, checkpoint_dir=root, checkpoint_every=2))
        uninterrupted = trainer.train(until=4).losses
        # a lab's run.train(resume=...)
        again = RankTrainer(trainer.pipeline, replace(options, resume=step_two))
        on_pipeline = again.train(until=5).losses
        trainer.load(step_two)  # the same trainer, told to go back
        on_trainer = trainer.train(until=5).losses
        fresh = RankTrainer(RankPipeline(spec, rank), replace(options, resume=step_two))
        fresh_losses = fresh.train(until=5).losses
        outcomes.append((uninterrupted, fresh_losses, on_pipeline, on_trainer,
                         same(run_state(fresh), run_state(trainer)),
                         same(run_state(fresh), run_state(again))))
    return outcomes


def test_resuming_a_run_that_trained_before_equals_resuming_a_fresh_one(tmp_path):
    specs = [PipelineSpec.create(CONFIG, "1f1b", 2, 4),
             PipelineSpec.create(CONFIG, "1f1b", 2, 4, impl="torch"),
             PipelineSpec.create(CONFIG, "interleaved-1f1b", 2, 4, 2)]
    roots = [str(tmp_path / f"run{i}") for i in range(len(specs))]
    results = run_ranks(2, resume_after_training, specs, BASE, roots, timeout=300)
    for spec, outcome in zip(specs, results[0]):
        uninterrupted, fresh, on_pipeline, on_trainer, trainer_same, pipeline_same = outcome
        assert len(fresh) == 3 and fresh[:2] == uninterrupted[2:], spec.schedule.name
        assert on_pipeline == fresh and on_trainer == fresh, spec.schedule.name
        assert trainer_same and pipeline_same, spec.schedule.name


# --- on one device ---------------------------------------------------------------------------


SMALL = LlamaConfig.tiny(num_hidden_layers=2, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A committed 2-rank checkpoint of a small model at step 2."""
    root = tmp_path_factory.mktemp("small")
    spec = PipelineSpec.create(SMALL, "1f1b", 2, 2)
    run_ranks(2, build_and_train_on_rank, spec, replace(BASE, batch_size=4, checkpoint_dir=str(root)),
              2, False,
              timeout=180)
    return checkpoint.latest(root)


def one_device_trainer_state(seed: int):
    """A one-stage module, its AdamW with moments and gradients from a step: a run in progress."""
    module = rank_module({0: build_stage(SMALL, 0, 1, seed=seed)})
    optimizer, scheduler = make_optimizer(module.named_parameters(), BASE)
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    scheduler.step()
    return module, optimizer, scheduler


def state_of(module, optimizer, scheduler) -> dict:
    return copy.deepcopy({"parameters": dict(module.named_parameters()),
                          "gradients": {n: p.grad for n, p in module.named_parameters()},
                          "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})


def load_on_one_device(path):
    """(error or None, state before, state after) of a Checkpointer load into a run in progress."""
    module, optimizer, scheduler = one_device_trainer_state(seed=7)
    before = state_of(module, optimizer, scheduler)
    try:
        Checkpointer(path, 0).load(path, module, optimizer, scheduler, SMALL)
        error = None
    except CheckpointError as refused:
        error = refused
    return error, before, state_of(module, optimizer, scheduler)


@pytest.mark.parametrize("name", list(DAMAGES))
def test_load_model_export_and_a_one_device_load_refuse_each_damage(small_checkpoint, tmp_path, name):
    damaged, named = damaged_copy(small_checkpoint, name, tmp_path)
    _, _, words = DAMAGES[name]
    for attempt in (lambda: checkpoint.load_model(damaged),
                    lambda: checkpoint.export_model(damaged, tmp_path / "model.pt")):
        with pytest.raises(CheckpointError, match=words) as refused:
            attempt()
        assert named in str(refused.value) and str(damaged) in str(refused.value)
    assert not (tmp_path / "model.pt").exists()
    error, before, after = load_on_one_device(damaged)
    assert isinstance(error, CheckpointError) and named in str(error)
    assert same(before, after)


def test_random_damage_either_loads_exactly_or_is_refused_with_nothing_changed(small_checkpoint, tmp_path):
    _, _, reference = load_on_one_device(small_checkpoint)
    work = tmp_path / small_checkpoint.name
    shutil.copytree(small_checkpoint, work)
    files = sorted(p.name for p in work.iterdir())
    pristine = {name: (work / name).read_bytes() for name in files}
    chance, deadline = random.Random(2026), time.monotonic() + 60
    loaded = refused = 0
    for case in range(300):
        name = chance.choice(files)
        data = bytearray(pristine[name])
        offset = chance.randrange(len(data))
        if chance.random() < 0.5:
            data[offset] ^= chance.randrange(1, 256)
        else:
            del data[offset:]
        (work / name).write_bytes(bytes(data))
        error, before, after = load_on_one_device(work)
        if error is None:
            loaded += 1
            assert same(after, reference), f"case {case}: {name} damaged at byte {offset} loaded other values"
        else:
            refused += 1
            assert same(after, before), f"case {case}: a refused load of {name} changed the run"
        (work / name).write_bytes(pristine[name])
        if time.monotonic() > deadline:
            break
    assert refused > 0.9 * (loaded + refused) and loaded + refused >= 100


def test_a_checkpoint_written_before_hashes_still_loads_with_a_note(small_checkpoint, tmp_path):
    old = tmp_path / small_checkpoint.name
    shutil.copytree(small_checkpoint, old)
    manifest = json.loads((old / "pplab.json").read_text())
    for key in ("files", "digest"):
        manifest.pop(key)
    (old / "pplab.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.warns(UserWarning, match="cannot be verified"):
        error, _, after = load_on_one_device(old)
    _, _, reference = load_on_one_device(small_checkpoint)
    assert error is None and same(after, reference)
    cut_to_half(last_shard(old))  # without hashes, .metadata still tells how long each shard must be
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=f"{last_shard(old).name} is cut short"):
            checkpoint.load_model(old)


def test_latest_skips_a_checkpoint_whose_manifest_is_damaged_and_says_so(small_checkpoint, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(small_checkpoint, root / small_checkpoint.name)
    newer = checkpoint.step_directory(root, 9)
    shutil.copytree(small_checkpoint, newer)
    (newer / "pplab.json").write_text("{garbage")
    with pytest.warns(UserWarning, match=f"skipping a damaged checkpoint.*{newer.name}.*pplab.json"):
        assert checkpoint.latest(root) == root / small_checkpoint.name
    with pytest.warns(UserWarning, match="skipping a damaged checkpoint"):
        assert checkpoint.resolve(root) == root / small_checkpoint.name
    with pytest.raises(CheckpointError, match="pplab.json is damaged"):
        checkpoint.read_manifest(newer)
