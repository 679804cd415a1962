"""Real text: documents from files or a saved dataset, a byte-level BPE trained here, packed
sequences epoch by epoch, and `pplab train` on them, configured by flags or by a TOML file."""

import json
import subprocess
import sys

import pytest
import tomllib
import torch

import pplab
from pplab.cli import main
from pplab.data.text import BPETokenizer, PackedText, load_tokenizer, read_documents

# Documents written here: a small world the model can learn in a few hundred CPU steps.
WORDS = ["river", "mountain", "forest", "lantern", "harbour", "meadow"]


def story(seed: int, lines: int = 400) -> str:
    rng = torch.Generator().manual_seed(seed)
    pick = lambda: WORDS[int(torch.randint(len(WORDS), (1,), generator=rng))]  # noqa: E731
    return "\n".join(f"the {pick()} is near the {pick()}." for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    for index in range(3):
        (folder / f"part{index}.txt").write_text(story(index))
    return folder


@pytest.mark.quick
def test_the_bpe_tokenizer_round_trips_and_reloads(texts, tmp_path):
    documents = read_documents(texts)
    assert len(documents) == 3 and documents[0] == story(0)
    tokenizer = BPETokenizer.train(documents, 300)
    assert tokenizer.vocab_size == 300 and (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    text = "the lantern is near the harbour.\nünïcode too: ∑"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # bytes: nothing is unknown
    assert len(tokenizer.encode("the meadow is near the river.")) < 12  # merges learned whole words
    reloaded = load_tokenizer(str(tokenizer.save(tmp_path / "tokenizer.json")))
    assert reloaded.encode(text) == tokenizer.encode(text)


@pytest.mark.quick
def test_packed_text_visits_every_sequence_once_an_epoch(texts):
    # A text without repeats (counting), so that equal sequences are the same sequence.
    counting = [" ".join(map(str, range(start, start + 800))) for start in (0, 800)]
    tokenizer = pplab.data.CharTokenizer()
    packed = PackedText(counting, tokenizer, seq_len=16, batch_size=4, seed=3)
    per_epoch = packed.batches_per_epoch
    seen = [tuple(row.tolist()) for p in range(per_epoch) for row in packed.train_batch(p)[0]]
    assert len(set(seen)) == len(seen) == per_epoch * 4  # no sequence twice in an epoch
    second = [tuple(row.tolist()) for row in packed.train_batch(per_epoch)[0]]
    assert second != seen[:4]  # the next epoch draws another order
    inputs, targets = packed.train_batch(5)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert torch.equal(packed.train_batch(5)[0], inputs)  # a pure function of the position
    heldout = {tuple(row.tolist()) for ids, _ in packed.heldout_batches(2) for row in ids}
    assert heldout and not heldout & {row[:-1] for row in map(tuple, packed.train_windows.tolist())}
    first = packed.train_windows[0].tolist()
    assert first[0] == tokenizer.bos_id  # documents begin with <bos> ...
    assert tokenizer.eos_id in packed.train_windows.flatten().tolist()  # ... and end with <eos>


@pytest.mark.quick
def test_a_dataset_saved_with_the_datasets_library_is_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [story(0, 5), story(1, 5)]}).save_to_disk(str(tmp_path / "saved"))
    assert read_documents(tmp_path / "saved") == [story(0, 5), story(1, 5)]


def refused(capsys, *argv: str) -> tuple[int, str]:
    """`pplab train <argv>` in this process: (exit code, what it wrote to stderr)."""
    from pplab.cli import main

    code = main(["train", *argv])
    return code, capsys.readouterr().err


@pytest.mark.quick
@pytest.mark.parametrize("arguments, message", [
    (["--data", "nowhere.txt"], "data 'nowhere.txt' does not exist"),
    (["--tokenizer", "bpe"], "tokenizer='bpe' tokenises (and 'bpe' learns from) the training text"),
    (["--epochs", "2"], "epochs count passes over data=..."),
    (["--min-lr", "1"], "lr=0.003, min_lr=1.0: need min_lr <= lr"),
    (["--dp", "3"], "--dp 3 x --tp 1 does not divide 2 ranks"),
])
def test_bad_data_options_are_one_line_before_any_rank(capsys, arguments, message):
    code, err = refused(capsys, *arguments)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.quick
def test_a_tokenizer_larger_than_the_model_is_refused(capsys, texts, tmp_path):
    BPETokenizer.train(read_documents(texts), 300).save(tmp_path / "tokenizer.json")
    (tmp_path / "model.json").write_text(json.dumps({"vocab_size": 128, "num_hidden_layers": 2}))
    code, err = refused(capsys, "--data", str(texts), "--tokenizer", str(tmp_path / "tokenizer.json"),
                        "--model", str(tmp_path / "model.json"))
    assert code == 2 and "the tokenizer has 300 tokens but the model's vocab_size is 128" in err, err


@pytest.mark.quick
def test_a_config_file_reads_seed_003s_names_and_refuses_unknown_keys(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[parallel]\npp = 2\nschedule = "interleaved_1f1b"\nvirtual_stages = 2\n'
                      'microbatches = 4\n[optimizer]\nlr = 0.001\nmin_lr = 0\nbetas = [0.9, 0.99]\n')
    from pplab.cli import main

    assert main(["train", "--config", str(config), "--print-config"]) == 0
    printed = capsys.readouterr().out
    # canonical names
    for line in ('pp = 2', 'schedule = "interleaved_1f1b"', 'n_virtual = 2', 'n_microbatches = 4',
                 'lr = 0.001', 'min_lr = 0.0', 'betas = [0.9, 0.99]'):
        assert line in printed.splitlines(), line
    # What it prints is a config file that reads back the same; a flag wins over the file.
    (tmp_path / "printed.toml").write_text(printed)
    assert main(["train", "--config", str(tmp_path / "printed.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert main(["train", "--config", str(config), "--lr", "0.002", "--print-config"]) == 0
    assert "lr = 0.002" in capsys.readouterr().out.splitlines()
    config.write_text("stepz = 3\n")
    code, err = refused(capsys, "--config", str(config))
    assert code == 2 and "unknown key 'stepz'; the keys are " in err and "batch_size" in err
    # The configuration is one dataclass, RunConfig: what --print-config writes, it reads back.
    read = pplab.session.run.RunConfig.from_toml(tmp_path / "printed.toml")
    assert (read.pp, read.n_virtual, read.n_microbatches, read.betas) == (2, 2, 4, (0.9, 0.99))
    assert printed.endswith(read.to_toml())


def printed(capsys, *argv: str):
    """The configuration `pplab train ... --print-config` resolves (in this process), read back."""
    assert main(["train", *argv, "--print-config"]) == 0
    return pplab.session.run.RunConfig.of(tomllib.loads(capsys.readouterr().out))


def run_train(*arguments: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pplab", "train", *arguments], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_a_bpe_run_learns_the_text_and_its_checkpoint_generates_it(texts, tmp_path, capsys):
    done = run_train("--data", str(texts), "--tokenizer", "bpe", "--vocab-size", "300", "--steps", "60",
                     "--batch-size", "8", "--seq-len", "32", "--eval-every", "25", "--warmup", "10",
                     "--min-lr", "0", "--checkpoint-dir", "run", "--report", "report.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    evaluations = [r["eval_loss"] for r in records if r["eval_loss"] is not None]
    assert evaluations[-1] < evaluations[0] < records[0]["loss"] - 3.0, (records[0]["loss"], evaluations)
    tokenizer = load_tokenizer(str(tmp_path / "run"))  # saved beside the checkpoints
    model = pplab.rank.checkpoint.load_model(tmp_path / "run")
    text = tokenizer.decode(pplab.generate(model, [tokenizer.bos_id, *tokenizer.encode("the")], 24))
    words = text.replace(".", " ").split()
    assert any(word in WORDS for word in words) and set(words) <= {"the", "is", "near", *WORDS}, text
    # The same run configured by a TOML file (the last release's [training] table) is the run its
    # flags configure, and Python reads it the same: resolved here, without training it again
    # (test_config walks every field through each path; a configuration trains alike wherever given).
    short = ["--data", str(texts), "--tokenizer", str(tmp_path / "run" / "tokenizer.json"), "--model", "tiny",
             "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0"]
    (tmp_path / "run.toml").write_text(f'data = "{texts}"\ntokenizer = '
                                       f'"{tmp_path / "run" / "tokenizer.json"}"\n[training]\nsteps = '
                                       '3\nbatch_size = 8\nseq_len = 32\neval_every = 0\n')
    by_flags, by_file = printed(capsys, *short), printed(capsys, "--config", str(tmp_path / "run.toml"))
    from_toml = pplab.session.run.RunConfig.from_toml(tmp_path / "run.toml")
    assert by_flags == by_file == from_toml, (by_flags, by_file)
    assert by_file.steps == 3 and by_file.tokenizer == str(tmp_path / "run" / "tokenizer.json")
