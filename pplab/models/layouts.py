"""A cut of the model (layers per stage) as the other frameworks write it, and read back.

pplab writes a cut as `balance`: one layer count per stage, in stage order, the embedding on the
first stage and the final norm, LM head and loss on the last. The same cut, written for:

* torchtitan: `module_fqns_per_model_part`, one list of module names per model part (stage), in
  stage order: `tok_embeddings` first, `layers.<i>` each, `norm` and `output` last (the names of
  torchtitan's llama3; another model's are given as `names`);
* Megatron-LM: `--pipeline-model-parallel-layout`, the stages in stage order (all of the first
  virtual stage's ranks, then the second's) split by `|`: `E` the embedding, `t` a decoder layer,
  `L` the loss with the output layer; `t*3` repeats a symbol, `(tt|)*2` a piece, commas are
  cosmetic and `||` is an empty stage.

`layer_layout(balance, "torchtitan" | "megatron")` writes one, `balance_of_layout(written)` reads
either back
(a string is Megatron's, a list of lists torchtitan's), each checked: a layout that places the
embedding or the loss elsewhere, skips or repeats a layer, or holds a name pplab does not know,
is a ValueError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["layer_layout", "balance_of_layout", "TORCHTITAN_NAMES"]

FRAMEWORKS = ("torchtitan", "megatron")
# torchtitan's llama3: (the embedding, a decoder layer's name pattern, what follows the last layer)
TORCHTITAN_NAMES = ("tok_embeddings", "layers.{}", ("norm", "output"))


def layer_layout(balance: Sequence[int], framework: str, names=TORCHTITAN_NAMES):
    """The cut `balance` (layers per stage) as `framework` writes it: torchtitan's list of module names
    per model part, or Megatron's layout string."""
    counts = _counts(balance)
    if framework == "torchtitan":
        embedding, layer, tail = names
        parts, start = [], 0
        for stage, count in enumerate(counts):
            part = [embedding] if stage == 0 else []
            part += [layer.format(index) for index in range(start, start + count)]
            part += list(tail) if stage == len(counts) - 1 else []
            parts.append(part)
            start += count
        return parts
    if framework == "megatron":
        stages = [("E" if stage == 0 else "") + ("t" * (count == 1) or f"t*{count}" * (count > 1))
                  + ("L" if stage == len(counts) - 1 else "") for stage, count in enumerate(counts)]
        return "|".join(stages)
    raise ValueError(f"framework={framework!r}: give one of {', '.join(map(repr, FRAMEWORKS))}")


def balance_of_layout(written, names=TORCHTITAN_NAMES) -> tuple[int, ...]:
    """The layers per stage of a layout: Megatron's string, or torchtitan's list of module names per
    model part."""
    if isinstance(written, str):
        return _megatron_counts(written)
    if isinstance(written, Sequence) and all(isinstance(part, Sequence) and not isinstance(part, str)
                                             for part in written):
        return _torchtitan_counts([list(part) for part in written], names)
    raise ValueError(f"{written!r}: give Megatron's layout string (e.g. 'Et|tL') or torchtitan's "
                     f"module_fqns_per_model_part, a list of lists of module names")


def _counts(balance: Sequence[int]) -> list[int]:
    counts = list(balance)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"balance={balance!r}: give one layer count (a whole number >= 0) per stage")
    return counts


def _megatron_counts(text: str) -> tuple[int, ...]:
    expanded = _expand(re.sub(r"[\s,]", "", text), text)
    stages = expanded.split("|")
    counts = []
    for stage, symbols in enumerate(stages):
        unknown = set(symbols) - set("EtL")
        if unknown:
            raise ValueError(f"layout {text!r}: stage {stage} holds {''.join(sorted(unknown))!r}; pplab's "
                             "model has E (the embedding), t (a decoder layer) and L (the loss)")
        first, last = stage == 0, stage == len(stages) - 1
        if symbols.count("E") != first or (first and not symbols.startswith("E")):
            raise ValueError(f"layout {text!r}: stage {stage} holds {symbols!r}; pplab's model has one "
                             "embedding (E), first on stage 0")
        if symbols.count("L") != last or (last and not symbols.endswith("L")):
            raise ValueError(f"layout {text!r}: stage {stage} holds {symbols!r}; pplab's model has one "
                             f"loss (L), last on stage {len(stages) - 1}")
        counts.append(symbols.count("t"))
    return tuple(counts)


def _expand(text: str, written: str) -> str:
    """Megatron's repetitions written out: `t*3` -> `ttt`, `(tt|)*2` -> `tt|tt|`."""
    pattern = re.compile(r"\(([^()]*)\)\*(\d+)|([A-Za-z])\*(\d+)")
    while True:
        expanded = pattern.sub(lambda m: (m.group(1) if m.group(1) is not None else m.group(3))
                               * int(m.group(2) or m.group(4)), text)
        if expanded == text:
            if set(text) & set("()*0123456789"):
                raise ValueError(f"layout {written!r}: a repetition pplab cannot read; write x*N or "
                                 "(piece)*N")
            return text
        text = expanded


def _torchtitan_counts(parts: list[list[str]], names) -> tuple[int, ...]:
    embedding, layer, tail = names
    pattern = re.compile(re.escape(layer).replace(r"\{\}", r"(\d+)"))
    if not parts or parts[0][:1] != [embedding] or parts[-1][-len(tail):] != list(tail):
        raise ValueError(f"module_fqns_per_model_part: pplab's model has {embedding!r} first in the first "
                         f"part and {', '.join(map(repr, tail))} last in the last, in that order; write them")
    seen, counts = [], []
    for index, part in enumerate(parts):
        count = 0
        for position, name in enumerate(part):
            if name == embedding:
                if index != 0 or position != 0:
                    raise ValueError(f"module_fqns_per_model_part: {embedding!r} is at part {index}, place "
                                     f"{position}; pplab's model has the embedding once, first in part 0")
                continue
            if name in tail:
                if index != len(parts) - 1 or position < len(part) - len(tail):
                    raise ValueError(f"module_fqns_per_model_part: {name!r} is in part {index}, place "
                                     f"{position}; pplab's model has {', '.join(tail)} once each, last in "
                                     "the last part")
                continue
            match = pattern.fullmatch(name)
            if match is None:
                raise ValueError(f"module_fqns_per_model_part: part {index} holds {name!r}, not one of "
                                 f"{embedding!r}, {layer.format('<i>')!r}, {', '.join(map(repr, tail))}")
            seen.append(int(match.group(1)))
            count += 1
        counts.append(count)
    if seen != list(range(len(seen))):
        raise ValueError(f"module_fqns_per_model_part: the layers are {seen}, not each layer once in order "
                         f"(0 to {len(seen) - 1})")
    return tuple(counts)
