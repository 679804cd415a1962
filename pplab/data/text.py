"""Real text for training: documents from local files, a byte-level BPE tokenizer trained on them,
and packed sequences drawn epoch by epoch.

`read_documents(source)` takes a UTF-8 text file (one document), a directory of `.txt` files
(each one document, in name order) or a dataset saved with the `datasets` library
(`save_to_disk`; its "text" column). `BPETokenizer.train(documents, vocab_size)` learns a
byte-level BPE with the `tokenizers` library, locally (nothing is downloaded); it is saved as
one JSON file and loaded from it. `PackedText` joins the documents as `<bos> text <eos>`,
one after another, keeps the last tenth of the tokens for evaluation, cuts the rest into
sequences of seq_len + 1 tokens, and draws them in a new order each epoch: batch `position`
is a pure function of (seed, position), so a resumed run sees what the uninterrupted one would.

Floor 1: `tokenizers` and `datasets` (the `hf` extra) are imported on their paths only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

from pplab.base.arguments import check_positive_int
from pplab.data import HELDOUT_FRACTION, Batch, CharTokenizer

__all__ = ["BPETokenizer", "PackedText", "read_documents", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"  # its name beside a run's checkpoints


# --- documents -----------------------------------------------------------------------------


def read_documents(source: str | Path) -> list[str]:
    """The documents at `source`: a text file, a directory of .txt files, or a saved `datasets` dataset."""
    path = Path(source)
    if path.is_file():
        return [_text_of(path)]
    if not path.is_dir():
        raise ValueError(f"data {str(source)!r} does not exist: give a UTF-8 text file, a directory "
                                f"of .txt files, or a dataset saved with datasets' save_to_disk")
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        return _saved_dataset(path)
    files = sorted(path.glob("*.txt"))
    if not files:
        raise ValueError(f"data {str(source)!r} is a directory without .txt files or a saved dataset: put "
                         f"the documents there as .txt files, one document each")
    return [_text_of(file) for file in files]


def _text_of(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}): convert "
                         "it to UTF-8, or leave it out of the data") from None


def _saved_dataset(path: Path) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{str(path)!r} is a saved dataset: reading it needs the datasets package "
                          f"(pip install 'pplab[hf]')") from None
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if "text" not in dataset.column_names:
        raise ValueError(f"the dataset at {str(path)!r} has columns {dataset.column_names}, no 'text': "
                         f"save one with a 'text' column of documents")
    return list(dataset["text"])


# --- tokenizers ------------------------------------------------------------------------------


def _tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ImportError("the BPE tokenizer needs the tokenizers package: pip install 'pplab[hf]'") from None


class BPETokenizer:
    """Byte-level BPE (the `tokenizers` library), with <pad>, <bos> and <eos> as ids 0, 1, 2."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id = (tokenizer.token_to_id(s) for s in self.SPECIALS)

    @classmethod
    def train(cls, documents: Sequence[str], vocab_size: int) -> "BPETokenizer":
        """Learn merges on `documents` until the vocabulary has `vocab_size` tokens (256 bytes and the
        three specials at least)."""
        check_positive_int("vocab_size", vocab_size)
        _tokenizers()
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        smallest = 256 + len(cls.SPECIALS)
        if vocab_size < smallest:
            raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {smallest} tokens "
                             f"(256 bytes and {len(cls.SPECIALS)} specials)")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(cls.SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator(documents, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """The tokenizer `save` wrote."""
        _tokenizers()
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> Path:
        """Write it as one JSON file (written whole or not at all)."""
        path = Path(path)
        scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # torchrun's processes may all save it
        self._tokenizer.save(str(scratch))
        scratch.replace(path)
        return path

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self._tokenizer.get_vocab_size()

    def same_as(self, other: "BPETokenizer") -> bool:
        """The same vocabulary and merges (so the same ids for every text)."""
        return self._tokenizer.to_str() == other._tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self._tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        """Text of token ids; special tokens are dropped."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(name: str) -> CharTokenizer | BPETokenizer:
    """'char', or the path of a BPE tokenizer's JSON file (a run's checkpoint directory holds one)."""
    if name == "char":
        return CharTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file() or not _is_tokenizer_json(path):
        raise ValueError(f"tokenizer={name!r}: give 'char', 'bpe' (trained on the data), or the path of a "
                         f"tokenizer.json a run saved")
    return BPETokenizer.load(path)


def _is_tokenizer_json(path: Path) -> bool:
    try:
        return "model" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


# --- packed sequences, epoch by epoch -----------------------------------------------------------


def join_documents(token_lists: Sequence[Sequence[int]], bos: int, eos: int) -> torch.Tensor:
    """One stream of token ids: each document as `<bos> ids <eos>`, one after another. The markers
    tell the model where a document starts and ends, so it does not learn to continue one
    document into the next as if they were one text."""
    return torch.tensor([t for ids in token_lists for t in (bos, *ids, eos)], dtype=torch.int64)


def cut_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive windows of seq_len + 1 tokens, each starting where the last one's inputs end:
    row[:-1] is a sequence's input and row[1:] its targets, and the last target of one window is
    the first input of the next, so every adjacent pair of the stream (but the tail's) is learned
    once. The tail too short for a whole window is dropped (padding it would spend compute on pad tokens)."""
    count = max(0, (len(tokens) - 1) // seq_len)
    if not count:
        return torch.empty((0, seq_len + 1), dtype=torch.int64)
    return torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])


class PackedText:
    """Documents as `<bos> text <eos>` back to back, cut into sequences of seq_len + 1 tokens."""

    def __init__(self, documents: Sequence[str], tokenizer, seq_len: int, batch_size: int, seed: int = 0):
        check_positive_int("seq_len", seq_len)
        check_positive_int("batch_size", batch_size)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.pad_id = tokenizer.pad_id
        tokens = join_documents([tokenizer.encode(document) for document in documents],
                                tokenizer.bos_id, tokenizer.eos_id)
        cut = len(tokens) - int(len(tokens) * HELDOUT_FRACTION)
        self.train_windows = cut_sequences(tokens[:cut], seq_len)
        self.heldout_windows = cut_sequences(tokens[cut:], seq_len)
        if min(len(self.train_windows), len(self.heldout_windows)) < batch_size:
            raise ValueError(f"the text makes {len(tokens)} tokens: {len(self.train_windows)} training and "
                             f"{len(self.heldout_windows)} held-out sequences of seq_len + 1 = {seq_len + 1} "
                             f"tokens, but a batch takes {batch_size} of each: give more text, or a smaller "
                             f"seq_len or batch_size")

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in one pass over the training sequences (the rest waits for the next epoch)."""
        return len(self.train_windows) // self.batch_size

    def train_batch(self, position: int) -> Batch:
        """Batch `position` of the run: epoch position // batches_per_epoch, in that epoch's order."""
        epoch, index = divmod(position, self.batches_per_epoch)
        order = torch.randperm(len(self.train_windows),
                               generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        chosen = self.train_windows[order[index * self.batch_size:(index + 1) * self.batch_size]]
        return chosen[:, :-1].clone(), chosen[:, 1:].clone()

    def heldout_batches(self, count: int) -> list[Batch]:
        """The first `count` whole batches of held-out sequences (fewer if the text has fewer)."""
        whole = min(count, len(self.heldout_windows) // self.batch_size)
        rows = self.heldout_windows[:whole * self.batch_size]
        return [(chunk[:, :-1].clone(), chunk[:, 1:].clone()) for chunk in rows.split(self.batch_size)]


@lru_cache(maxsize=2)
def packed_text(data: str, tokenizer: str, seq_len: int, batch_size: int, seed: int,
                stamp=None) -> PackedText:
    """The packed text of a run (read and tokenised once per process, again when `stamp`, the files'
    modification times, says they changed)."""
    return PackedText(read_documents(data), load_tokenizer(tokenizer), seq_len, batch_size, seed)
