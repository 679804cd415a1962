"""Data: the embedded corpus, tokenizer, deterministic batches, padding, the real-text path."""

import json
import sys

import pytest
import torch

import pplab
from pplab.data import (
    CharTokenizer,
    batches,
    default_corpus,
    hf_batches,
    packed_batches,
    pad_sequences,
    split_microbatches,
)
from pplab.models.llama import IGNORE_INDEX, loss_fn


@pytest.mark.quick
def test_tokenizer_round_trip_and_vocabulary_fits_tiny():
    tok = CharTokenizer()
    text = "the red fox.\n12 + 3 = 15."
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size <= pplab.LlamaConfig.tiny().vocab_size
    assert tok.encode("é") == [tok.unk_id]


@pytest.mark.quick
def test_batches_are_deterministic_per_seed_and_well_formed():
    a = list(batches(4, 32, seed=7, steps=3))
    b = list(batches(4, 32, seed=7, steps=3))
    c = list(batches(4, 32, seed=8, steps=3))
    assert len(a) == 3
    for (x, y), (x2, y2) in zip(a, b):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not all(torch.equal(x, x3) for (x, _), (x3, _) in zip(a, c))
    x, y = a[0]
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert int(x.max()) < pplab.LlamaConfig.tiny().vocab_size
    assert default_corpus() == default_corpus.__wrapped__()  # made, the same every time


@pytest.mark.quick
def test_local_text_file_path(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefghij" * 20, encoding="utf-8")
    x, y = next(batches(2, 8, path=path))
    assert CharTokenizer().decode(x[0].tolist()) in "abcdefghij" * 20
    with pytest.raises(FileNotFoundError, match="does not exist"):
        next(batches(2, 8, path=tmp_path / "missing.txt"))


@pytest.mark.quick
def test_short_corpus_is_padded_with_the_ignore_index():
    x, y = next(batches(1, 10, text="hello"))
    assert CharTokenizer().decode(x[0].tolist()) == "hell"
    assert (y[0, 4:] == IGNORE_INDEX).all() and (y[0, :4] != IGNORE_INDEX).all()
    logits = torch.randn(1, 10, 128)
    assert torch.allclose(loss_fn(logits, y), loss_fn(logits[:, :4], y[:, :4]))


@pytest.mark.quick
@pytest.mark.parametrize("call, message", [
    (lambda: next(batches(0, 8)), "batch_size=0"),
    (lambda: next(batches(2, -1)), "seq_len=-1"),
    (lambda: next(batches(2, 8, text="abc", path="x.txt")), "not both"),
    (lambda: next(batches(2, 8, text="a")), "1 token"),
    (lambda: pad_sequences([[1]], 4), "sequence 0 has 1 token"),
    (lambda: split_microbatches(next(batches(6, 8)), 4),
     r"n_microbatches=4 does not divide the batch size 6; use one of \[1, 2, 3, 6\]"),
])
def test_data_errors_name_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.quick
def test_embedded_corpus_is_learnable():
    torch.manual_seed(0)
    model = pplab.build_model(pplab.LlamaConfig.tiny())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches(8, 64, steps=60):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 4.5                       # ~ln(128): chance level
    assert sum(losses[-10:]) / 10 < 2.5          # falls to half of it within 60 steps (1.96 here)


# -- documents packed into windows; the optional Hugging Face path ---------------------------


DOCUMENTS = [f"the {colour} {animal} sat on the mat." for colour in ("red", "blue", "green")
             for animal in ("cat", "dog", "owl", "bee")]


@pytest.mark.quick
def test_packed_batches_cut_the_documents_one_after_another_into_windows():
    tok = CharTokenizer()
    stream = [token for doc in DOCUMENTS for token in [*tok.encode(doc), tok.eos_id]]
    got = list(packed_batches(DOCUMENTS, tok.encode, batch_size=2, seq_len=15, eos_id=tok.eos_id))
    assert len(got) == len(stream) // (2 * 16)   # the last, incomplete batch is dropped
    windows = [stream[i * 16:(i + 1) * 16] for i in range(2 * len(got))]
    for index, (x, y) in enumerate(got):
        assert x.shape == y.shape == (2, 15) and x.dtype == y.dtype == torch.int64
        for row in range(2):
            window = windows[2 * index + row]
            assert x[row].tolist() == window[:-1] and y[row].tolist() == window[1:]
    assert tok.eos_id in torch.cat([x for x, _ in got]).flatten().tolist()  # documents end with <eos>


@pytest.mark.quick
def test_hf_batches_without_the_optional_packages_says_how_to_install_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"optional packages 'datasets' and 'transformers'.*"
                                          r"pip install 'pplab\[hf\]'"):
        hf_batches("some/dataset", "some/tokenizer", batch_size=2, seq_len=8)  # raises on the call
    with pytest.raises(ValueError, match="seq_len=0"):
        hf_batches("some/dataset", "some/tokenizer", batch_size=2, seq_len=0)


@pytest.mark.quick
def test_hf_batches_on_a_local_dataset_and_tokenizer(tmp_path, monkeypatch):
    """Only where the optional extra is installed: nothing is downloaded."""
    pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCUMENTS))
    words = sorted({word for doc in DOCUMENTS for word in doc.split()})
    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                         unk_token="<unk>").save_pretrained(tmp_path / "tokenizer")

    got = list(hf_batches(str(corpus), str(tmp_path / "tokenizer"), batch_size=2, seq_len=7, seed=3))

    n_tokens = sum(len(doc.split()) + 1 for doc in DOCUMENTS)   # words and one <eos> per document
    assert len(got) == n_tokens // (2 * 8)
    for x, y in got:
        assert x.shape == (2, 7) and torch.equal(x[:, 1:], y[:, :-1])
        assert vocab["<unk>"] not in x.tolist() and int(x.max()) < len(vocab)
    again = list(hf_batches(str(corpus), str(tmp_path / "tokenizer"), batch_size=2, seq_len=7, seed=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, again))


@pytest.mark.quick
def test_a_stream_resumed_at_a_position_continues_where_it_was():
    stream = list(batches(4, 16, seed=3, split="train", steps=5))
    resumed = next(batches(4, 16, seed=3, split="train", start=3))
    assert all(torch.equal(a, b) for a, b in zip(stream[3], resumed))


@pytest.mark.quick
def test_held_out_text_is_not_training_text():
    from pplab.data import HELDOUT_FRACTION, default_corpus

    corpus = default_corpus()
    cut = len(corpus) - int(len(corpus) * HELDOUT_FRACTION)
    heldout = next(batches(8, 32, split="heldout"))[0]
    train = next(batches(8, 32, split="train"))[0]
    tokenizer = CharTokenizer()
    for row in heldout:
        assert tokenizer.decode(row.tolist()) in corpus[cut - 1:]
    for row in train:
        assert tokenizer.decode(row.tolist()) in corpus[:cut]
    with pytest.raises(ValueError, match="split='test'"):
        next(batches(8, 32, split="test"))
