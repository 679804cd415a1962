"""Floor 1, training data. Here, what needs no download: an embedded corpus, a character tokenizer,
batches; `text`, real text (documents from local files, a byte-level BPE, packed sequences).

The default corpus is made, not fetched: a small grammar writes sentences,
arithmetic facts and counting runs from a fixed seed. It has enough structure
for the tiny model's loss to fall visibly within a few hundred CPU steps.
A local text file, a list of documents (`packed_batches`), or a Hugging Face
dataset when the optional packages are installed (`hf_batches`) can replace it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

import torch

from pplab.base.arguments import check_positive_int
from pplab.base.lazy import submodules_on_first_use
from pplab.models.llama import IGNORE_INDEX

__all__ = ["CharTokenizer", "batches", "packed_batches", "split_microbatches"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, target_ids), int64 [batch, seq]


# --- tokenizer ---------------------------------------------------------------------------


class CharTokenizer:
    """Characters to ids: four special tokens, newline and printable ASCII (100 ids in all)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

    def __init__(self):
        chars = "\n" + "".join(chr(c) for c in range(32, 127))
        self.itos = list(self.SPECIALS) + list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(4)

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; characters outside the alphabet become <unk>."""
        return [self.stoi.get(c, self.unk_id) for c in text]

    def decode(self, ids) -> str:
        """Text of token ids; special tokens are dropped."""
        return "".join(self.itos[i] for i in ids if i >= len(self.SPECIALS))


# --- the embedded corpus -------------------------------------------------------------------

_ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "hen", "bat", "eel", "yak"]
_COLOURS = ["red", "blue", "green", "brown", "white", "black", "grey", "pink"]
_PLACES = ["the mat", "the barn", "a tree", "the river", "the hill", "a box", "the road"]
_VERBS = ["sat on", "ran to", "slept in", "looked at", "jumped over", "walked past"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _sentence(rng: random.Random) -> str:
    animal, colour = rng.choice(_ANIMALS), rng.choice(_COLOURS)
    return f"the {colour} {animal} {rng.choice(_VERBS)} {rng.choice(_PLACES)}."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(50), rng.randrange(50)
    return f"{a} + {b} = {a + b}."


def _counting(rng: random.Random) -> str:
    start = rng.randrange(7)
    return " ".join(_NUMBER_WORDS[start:start + 4]) + "."


def _spelling(rng: random.Random) -> str:
    word = rng.choice(_ANIMALS + _COLOURS)
    return f"{word} is spelled {'-'.join(word)}."


@lru_cache(maxsize=4)
def default_corpus(n_lines: int = 6000, seed: int = 1234) -> str:
    """The embedded corpus: `n_lines` lines of a small grammar, the same on every machine."""
    rng = random.Random(seed)
    makers = [_sentence, _sentence, _arithmetic, _counting, _spelling]
    return "\n".join(rng.choice(makers)(rng) for _ in range(n_lines)) + "\n"


def load_text(path: str | Path) -> str:
    """A local UTF-8 text file as one string (the real-text path)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text corpus {str(path)!r} does not exist; pass the path of a "
                                f"UTF-8 text file, or corpus=None for the embedded corpus")
    return path.read_text(encoding="utf-8")


# --- batches -----------------------------------------------------------------------------


def pad_sequences(sequences: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0) -> Batch:
    """Next-token (input, target) pairs from token lists, padded to `seq_len`.

    Padded inputs get `pad_id`; padded targets get IGNORE_INDEX so the loss skips them.
    """
    check_positive_int("seq_len", seq_len)
    inputs = torch.full((len(sequences), seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((len(sequences), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, tokens in enumerate(sequences):
        tokens = torch.as_tensor(list(tokens)[:seq_len + 1], dtype=torch.int64)
        if len(tokens) < 2:
            raise ValueError(f"sequence {row} has {len(tokens)} token(s); next-token training "
                             f"needs at least 2")
        inputs[row, :len(tokens) - 1] = tokens[:-1]
        targets[row, :len(tokens) - 1] = tokens[1:]
    return inputs, targets


SPLITS = ("all", "train", "heldout")
HELDOUT_FRACTION = 0.1  # the corpus' last tenth is held out for evaluation


def batches(batch_size: int, seq_len: int, seed: int = 0, text: str | None = None,
            path: str | Path | None = None, tokenizer: CharTokenizer | None = None,
            steps: int | None = None, split: str = "all", start: int = 0) -> Iterator[Batch]:
    """Random (input_ids, target_ids) windows of a corpus, int64 [batch_size, seq_len].

    The corpus is the embedded one, or `text`, or the text file at `path`; `split`
    takes all of it, its first nine tenths ("train") or its last tenth ("heldout"),
    so that an evaluation never sees training text. The stream is a pure function
    of `seed`; `start` skips that many batches (a training run's data position, so
    that a resumed run sees what the uninterrupted one would). It is endless unless
    `steps` is given. A corpus shorter than one window is padded, with targets set
    to IGNORE_INDEX.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    if steps is not None:
        check_positive_int("steps", steps)
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r}: give the number of batches to skip, >= 0")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: choose one of {', '.join(map(repr, SPLITS))}")
    if text is not None and path is not None:
        raise ValueError("give the corpus as text= or as path=, not both")
    if tokenizer is None and text is None and path is None:
        tokenizer, all_tokens = CharTokenizer(), _default_tokens()  # every default batch: encoded once
    else:
        tokenizer = tokenizer or CharTokenizer()
        corpus = load_text(path) if path is not None else default_corpus() if text is None else text
        all_tokens = torch.tensor(tokenizer.encode(corpus), dtype=torch.int64)
    tokens = _split_tokens(all_tokens, split)
    if len(tokens) < 2:
        raise ValueError(f"the corpus ({split}) has {len(tokens)} token(s); next-token training "
                         f"needs at least 2")
    generator = torch.Generator().manual_seed(seed)
    n_starts = max(1, len(tokens) - seq_len)  # windows of seq_len + 1 tokens
    for _ in range(start):  # the same draws as the skipped batches, without building them
        torch.randint(n_starts, (batch_size,), generator=generator)
    step = 0
    while steps is None or step < steps:
        starts = torch.randint(n_starts, (batch_size,), generator=generator).tolist()
        windows = [tokens[s:s + seq_len + 1].tolist() for s in starts]
        yield pad_sequences(windows, seq_len, tokenizer.pad_id)
        step += 1


@lru_cache(maxsize=1)
def _default_tokens() -> torch.Tensor:
    """The embedded corpus in the character tokenizer's ids (read only: batches copy windows out)."""
    return torch.tensor(CharTokenizer().encode(default_corpus()), dtype=torch.int64)


def _split_tokens(tokens: torch.Tensor, split: str) -> torch.Tensor:
    """All tokens, the training part or the held-out part."""
    cut = len(tokens) - int(len(tokens) * HELDOUT_FRACTION)
    return {"all": tokens, "train": tokens[:cut], "heldout": tokens[cut:]}[split]


def packed_batches(texts: Iterable[str], encode: Callable[[str], list[int]], batch_size: int,
                   seq_len: int, eos_id: int, pad_id: int = 0) -> Iterator[Batch]:
    """Batches of consecutive windows of `texts` encoded one after another, each ended by `eos_id`.

    Every window is seq_len + 1 tokens (inputs and targets shifted by one); the
    stream ends when the texts do, dropping the last, incomplete batch.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    window, buffer = seq_len + 1, []
    for text in texts:
        buffer.extend([*encode(text), eos_id])
        while len(buffer) >= batch_size * window:
            chunk, buffer = buffer[:batch_size * window], buffer[batch_size * window:]
            yield pad_sequences([chunk[i * window:(i + 1) * window] for i in range(batch_size)],
                                seq_len, pad_id)


def hf_batches(dataset: str, tokenizer: str, batch_size: int, seq_len: int, split: str = "train",
               text_field: str = "text", seed: int = 0) -> Iterator[Batch]:
    """Batches from a Hugging Face dataset and tokenizer (the optional extra: pip install 'pplab[hf]').

    `dataset` and `tokenizer` are hub names or local paths, loaded with
    `datasets.load_dataset` (streamed, shuffled with `seed`) and
    `transformers.AutoTokenizer`. Use a config whose vocab_size equals the
    tokenizer's. Never used by default.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    try:
        import datasets
        import transformers
    except ImportError as error:
        raise ImportError(f"hf_batches needs the optional packages 'datasets' and 'transformers', "
                          f"which are not installed ({error.msg}): pip install 'pplab[hf]' (or "
                          f"datasets transformers); the embedded corpus (pplab.data.batches) needs "
                          f"neither") from error
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    stream = datasets.load_dataset(dataset, split=split, streaming=True).shuffle(seed=seed)
    texts = (record[text_field] for record in stream)
    return packed_batches(texts, lambda text: tok(text)["input_ids"], batch_size, seq_len,
                          tok.eos_token_id or 0, tok.pad_token_id or 0)


def split_microbatches(batch: Batch, n_microbatches: int) -> list[Batch]:
    """Cut a batch into `n_microbatches` equal microbatches along the batch dimension."""
    check_positive_int("n_microbatches", n_microbatches)
    input_ids, target_ids = batch
    if input_ids.shape != target_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and target_ids "
                         f"{tuple(target_ids.shape)} must have the same shape")
    size = input_ids.shape[0]
    if size % n_microbatches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"n_microbatches={n_microbatches} does not divide the batch size {size}; "
                         f"use one of {divisors} or change the batch size")
    return list(zip(input_ids.chunk(n_microbatches), target_ids.chunk(n_microbatches)))


__getattr__ = submodules_on_first_use(__name__)  # pplab.data.text after a bare `import pplab`
