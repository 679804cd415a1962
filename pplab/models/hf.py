"""Hugging Face causal language models as pipeline stages (the `pplab[hf]` extra).

`HFModel` describes a `transformers` decoder to pplab in the terms its own model uses
(an embedding, a run of blocks, a final norm, a head, a position encoding, tied
weights), so that every part of the kit — both runtimes, parity, gradient flow,
training and checkpoints — takes it where it takes a `LlamaConfig`.

A stage holds the model's own modules at the model's own dotted paths, so its parameter
names are the model's (`model.layers.5.mlp.up_proj.weight`) and a checkpoint exports
back to a directory that `transformers` loads (`pplab.rank.checkpoint.export_pretrained`). A rank
builds only its stages: on the
meta device, then allocated, then either filled from the directory's safetensors files
(reading only the stage's tensors) or initialised by the model's own `_init_weights`,
module by module, each under a seed drawn from (seed, module path). So every cut holds
exactly the weights the whole model holds on one device.

What a stage cannot see is computed on it: rotary position embeddings on every stage
that holds blocks (the full model computes them once and hands them to every layer),
learned positions (GPT-2) with the embedding. Attention is causal; padding goes on the
right with IGNORE_INDEX targets, which causal attention makes exact without a mask (a
real token never attends to a later pad). An attention mask is not carried.

Floor 1: `transformers` is imported here only, when an HF model is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from pplab.models.dropout_streams import draw_alike, has_dropout
from pplab.models.llama import check_token_ids, parameter_seed

__all__ = ["Layout", "HFModel", "LAYOUTS"]


@dataclass(frozen=True)
class Layout:
    """Where a decoder keeps its parts: module paths in the causal-LM model."""

    embed: str                    # token embedding (first stage)
    blocks: str                   # the list of decoder blocks
    norm: str                     # final norm (last stage)
    head: str                     # LM head (last stage)
    rotary: str | None = None     # rotary position embeddings, computed on every stage with blocks
    positions: str | None = None  # learned position embeddings, added on the first stage (GPT-2)
    dropout: str | None = None    # dropout after the embeddings (GPT-2's `drop`)

    def parts(self) -> dict[str, str]:
        """Every path this layout names, by role."""
        return {role: path for role, path in vars(self).items() if path is not None}


LLAMA_LAYOUT = Layout(embed="model.embed_tokens", blocks="model.layers", norm="model.norm",
                      head="lm_head", rotary="model.rotary_emb")
GPT2_LAYOUT = Layout(embed="transformer.wte", blocks="transformer.h", norm="transformer.ln_f",
                     head="lm_head", positions="transformer.wpe", dropout="transformer.drop")
LAYOUTS = {"llama": LLAMA_LAYOUT, "mistral": LLAMA_LAYOUT, "qwen2": LLAMA_LAYOUT,
           "qwen3": LLAMA_LAYOUT, "gpt2": GPT2_LAYOUT}

RECORD_PREFIX = "hf_config."  # a checkpoint manifest's keys for an HF model's settings
# Keys of a config's dict that say nothing about the model's shape (left out of checkpoint manifests).
_VOLATILE_KEYS = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
                  "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("Hugging Face models need the transformers package: pip install "
                          "'pplab[hf]'") from None
    return transformers


@dataclass(frozen=True, eq=False)
class HFModel:
    """A `transformers` causal LM, described for pplab (picklable: its config travels as a dict).

    Make one with `HFModel.of(config_or_directory)`; `lab.pipeline(...)` does it for you.
    `sum_tied_gradients=False` leaves tied weights' gradients unsummed: wrong on purpose,
    for the lesson where parity names the tied weight.
    """

    config_dict: dict
    path: str | None = None           # a directory with config.json and, optionally, *.safetensors
    layout: Layout | None = None      # None: the known layout of config_dict's model_type
    sum_tied_gradients: bool = True
    _config: object = field(default=None, repr=False, compare=False)

    # --- making one ---------------------------------------------------------------------

    @classmethod
    def of(cls, model, layout: Layout | None = None, sum_tied_gradients: bool = True) -> "HFModel":
        """An HFModel from a `transformers` config, a local directory holding `config.json`, or an HFModel."""
        if isinstance(model, HFModel):
            return replace(model, layout=layout or model.layout, sum_tied_gradients=sum_tied_gradients,
                           _config=None)
        path = None
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not (path / "config.json").is_file():
                raise ValueError(f"{str(model)!r} holds no config.json: give a directory written by "
                                 f"save_pretrained (config.json, optionally *.safetensors), or a config")
            config_dict = json.loads((path / "config.json").read_text())
            path = str(path.resolve())
        elif hasattr(model, "to_dict") and hasattr(model, "model_type"):
            config_dict = model.to_dict()
        else:
            raise TypeError(f"cannot make a Hugging Face model of a {type(model).__name__}: "
                            "give a transformers config (e.g. LlamaConfig(...)) or a "
                            "directory that holds config.json")
        described = cls(config_dict, path, layout, sum_tied_gradients)
        described.check()
        return described

    def check(self) -> None:
        """Refuse, on the client, a model pplab cannot cut: an unknown layout, or paths it lacks."""
        model_type = self.config_dict.get("model_type")
        if self.layout is None and model_type not in LAYOUTS:
            raise ValueError(f"model_type={model_type!r} has no known layout (known: "
                             f"{', '.join(sorted(LAYOUTS))}). Its modules: {self._module_outline()}. "
                             f"Describe where its parts are: HFModel.of(config, "
                             f"layout=pplab.models.hf.Layout("
                             f"embed=..., blocks=..., norm=..., head=..., rotary=... or positions=...))")
        model = self.meta_model()
        for role, path in self.layout_.parts().items():
            if _submodule(model, path) is None:
                raise ValueError(f"layout {role}={path!r}: {model_type!r} has no module there. Its modules: "
                                 f"{self._module_outline()}; give the path of its {role}")
        if not isinstance(_submodule(model, self.layout_.blocks), (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"layout blocks={self.layout_.blocks!r} is not a list of modules; give "
                             f"the path of the list of decoder blocks")
        owned = {path for path in self.layout_.parts().values()}
        stray = [name for name, _ in model.named_parameters()
                 if not any(name.startswith(path + ".") for path in owned)]
        if stray:
            raise ValueError(f"parameters {stray[:3]} lie outside every part of the layout "
                             f"{self.layout_}; add their modules to it")

    def _module_outline(self) -> str:
        model = self.meta_model()
        lines = []
        for name, module in model.named_modules():
            depth = name.count(".")
            if name and depth <= 1:
                lines.append(f"{name} ({type(module).__name__})")
        return ", ".join(lines)

    # --- the config, its sizes and its layout -------------------------------------------

    @property
    def hf_config(self):
        """The `transformers` config, with sdpa attention (causal when no mask is given)."""
        if self._config is None:
            transformers = _transformers()
            values = dict(self.config_dict)
            model_type = values.pop("model_type")
            config = transformers.AutoConfig.for_model(model_type, **values)
            config._attn_implementation = "sdpa"
            object.__setattr__(self, "_config", config)
        return self._config

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_config"] = None  # rebuilt from config_dict where it lands
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def layout_(self) -> Layout:
        """The layout in use: the given one, or the known one of this model type."""
        return self.layout or LAYOUTS[self.config_dict.get("model_type")]

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.hf_config.max_position_embeddings

    @property
    def tied(self) -> tuple[tuple[str, str], ...]:
        """(first stage's name, last stage's name) of each weight the two share."""
        text = (self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config")
                else self.hf_config)
        if not getattr(text, "tie_word_embeddings", False):
            return ()
        return ((f"{self.layout_.embed}.weight", f"{self.layout_.head}.weight"),)

    @property
    def sliding_window(self) -> int | None:
        """The attention window when some layer attends to a window only (then
        longer sequences are refused)."""
        config = self.hf_config
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return window if "sliding_attention" in layer_types else None
        return window

    def record(self) -> dict:
        """What a checkpoint manifest says about this model: its config's settings, each under its own
        key (so that a mismatch names the setting), as JSON holds them; not where it was read from."""
        settings = json.loads(json.dumps(self.hf_config.to_dict()))
        return {f"{RECORD_PREFIX}{key}": value for key, value in sorted(settings.items())
                if key not in _VOLATILE_KEYS and not key.startswith("_")}

    @classmethod
    def of_record(cls, record: dict) -> "HFModel":
        """The model a manifest's record describes."""
        return cls({key[len(RECORD_PREFIX):]: value for key, value in record.items()
                    if key.startswith(RECORD_PREFIX)})

    def parameter_names(self) -> list[str]:
        """The full model's parameter names, each tied weight once (as one device lists them)."""
        return [name for name, _ in self.meta_model().named_parameters()]

    def part_of(self, name: str):
        """'embed', 'head' or the block index that holds parameter `name`."""
        layout = self.layout_
        if name.startswith(layout.blocks + "."):
            return int(name[len(layout.blocks) + 1:].split(".")[0])
        if any(name.startswith(path + ".") for path in (layout.embed, layout.positions) if path):
            return "embed"
        return "head"

    # --- building ---------------------------------------------------------------------------

    def meta_model(self) -> nn.Module:
        """The whole causal LM on the meta device (no memory): what the stages are cut from."""
        transformers = _transformers()
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(self.hf_config, attn_implementation="sdpa")

    def build_model(self, seed: int = 0, device="cpu") -> nn.Module:
        """The whole `transformers` model on one device, with the weights every cut of it holds."""
        model = self.meta_model()
        model.to_empty(device="cpu")
        if self.tied:
            model.tie_weights()
        if self.layout_.rotary:
            _attach(model, self.layout_.rotary, self._rotary(model))
        self._fill(model, seed, model, range(self.num_hidden_layers), embed=True, head=True)
        self._draw_dropout_alike(model, model, range(self.num_hidden_layers), embed=True)
        return model.to(device)

    def build_stage(self, layers: range, embed: bool, head: bool, seed: int = 0, device="cpu") -> "HFStage":
        """The stage holding blocks `layers`, and the embedding and/or head: the model's own modules."""
        model = self.meta_model()
        layout = self.layout_
        stage = HFStage(self, layers, embed, head)
        paths = [layout.embed, layout.positions, layout.dropout] if embed else []
        if head:
            paths += [layout.norm, layout.head]
        for path in filter(None, paths):
            _attach(stage, path, _submodule(model, path))
        blocks = _submodule(model, layout.blocks)
        _attach(stage, layout.blocks, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        stage.to_empty(device="cpu")
        if layout.rotary and layers:  # its buffers are computed when it is made: make it for real
            stage.rotary = self._rotary(model)
        if embed and head and self.tied:
            _submodule(stage, layout.head).weight = _submodule(stage, layout.embed).weight
        self._fill(stage, seed, model, layers, embed, head)
        self._draw_dropout_alike(stage, model, layers, embed)
        return stage.to(device)

    def _draw_dropout_alike(self, module: nn.Module, model: nn.Module, layers, embed: bool) -> None:
        """Where the model drops, its units draw their masks from their own streams (see
        `pplab.models.dropout_streams`): one device and every cut of it drop the same elements."""
        if has_dropout(model):
            layout = self.layout_
            draw_alike(module, [*([layout.dropout] if embed and layout.dropout else []),
                                *(f"{layout.blocks}.{i}" for i in layers)])

    def _rotary(self, model: nn.Module) -> nn.Module:
        """A fresh rotary module on the CPU (its frequencies are computed when it is made, not on meta)."""
        return type(_submodule(model, self.layout_.rotary))(config=self.hf_config)

    @torch.no_grad()
    def _fill(self, module: nn.Module, seed: int, model: nn.Module, layers, embed: bool, head: bool) -> None:
        """Weights from the directory's safetensors files if it has them, else the model's own init."""
        if self.path is not None and _safetensors_files(self.path):
            module.loaded = _load_safetensors(module, self.path, dict((b, a) for a, b in self.tied))
            return
        layout = self.layout_
        owned = ([layout.embed, layout.positions] if embed else []) + \
                [f"{layout.blocks}.{i}" for i in layers] + ([layout.norm, layout.head] if head else [])
        tied_head = {b.rsplit(".", 1)[0] for _, b in self.tied}
        for path in filter(None, owned):
            target = _submodule(module, path)
            if path in tied_head:  # holds the embedding's weight: drawn as the embedding draws it
                if embed:
                    continue  # the very same Parameter, already drawn
                source = _submodule(model, layout.embed)
                source = type(source)(source.num_embeddings, source.embedding_dim, source.padding_idx)
                _init_tree(model, source, seed, layout.embed)
                target.weight.copy_(source.weight)
                continue
            _init_tree(model, target, seed, path)


class HFStage(nn.Module):
    """One pipeline stage of an HF decoder: its modules at the model's paths, and a forward that
    takes token ids (first stage) or hidden states and returns hidden states or logits."""

    def __init__(self, model: HFModel, layers: range, embed: bool, head: bool):
        super().__init__()
        self.description, self.layer_ids = model, layers
        self._embed, self._head = embed, head
        self.rotary = None
        self.loaded: list[str] = []  # the tensor names read from safetensors files, if any

    @property
    def is_first(self) -> bool:
        return self._embed

    @property
    def is_last(self) -> bool:
        return self._head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden states [b, s, h] -> hidden states or logits."""
        layout = self.description.layout_
        if self.is_first:
            check_token_ids(x)
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            hidden = _submodule(self, layout.embed)(x)
            if layout.positions:
                hidden = hidden + _submodule(self, layout.positions)(positions)
            if layout.dropout:
                hidden = _submodule(self, layout.dropout)(hidden)
        elif x.dim() != 3 or not x.is_floating_point():
            raise TypeError(f"this stage starts at block {self.layer_ids.start} and expects hidden "
                            f"states [batch, seq, hidden], got {x.dtype} of shape {tuple(x.shape)}")
        else:
            hidden = x
        blocks = _submodule(self, layout.blocks)
        if len(blocks):
            hidden = self._blocks(blocks, hidden)
        if self.is_last:
            hidden = _submodule(self, layout.head)(_submodule(self, layout.norm)(hidden))
        return hidden

    def _blocks(self, blocks: nn.ModuleDict, hidden: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        window = self.description.sliding_window
        if window is not None and seq > window:
            raise ValueError(f"sequence length {seq} exceeds the model's "
                             f"sliding_window={window}: pplab's stages attend causally without a "
                             f"window mask; use sequences of at most {window}")
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        extra = {"position_ids": position_ids}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(hidden, position_ids)
        for block in blocks.values():
            out = block(hidden, attention_mask=None, **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


# --- module paths ----------------------------------------------------------------------------


def _submodule(module: nn.Module, path: str):
    """The module at dotted `path`, or None."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at dotted `path` under `root`, making plain containers on the way."""
    *parents, name = path.split(".")
    for parent in parents:
        if not hasattr(root, parent) or getattr(root, parent) is None:
            root.add_module(parent, nn.Module())
        root = getattr(root, parent)
    root.add_module(name, module)


def _init_tree(model: nn.Module, module: nn.Module, seed: int, path: str) -> None:
    """The model's own `_init_weights` on `module` and everything under it, children first, each
    submodule under a seed of its own path: the same numbers however the model is cut."""
    for name, sub in reversed(list(module.named_modules())):
        torch.manual_seed(parameter_seed(seed, f"{path}.{name}" if name else path))
        model._init_weights(sub)


# --- safetensors -------------------------------------------------------------------------------


def _safetensors_files(path: str) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def _load_safetensors(module: nn.Module, path: str, tied_sources: dict[str, str]) -> list[str]:
    """Copy each of `module`'s parameters and persistent buffers from the files, reading only those
    tensors; a tied head reads the embedding's. The names read, in order."""
    from safetensors import safe_open

    where = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            where.update({key: file for key in handle.keys()})
    wanted = dict(module.named_parameters())
    wanted.update({name: buffer for name, buffer in module.named_buffers()
                   if name.rsplit(".", 1)[-1] not in _non_persistent(module, name)})
    read = []
    for name, tensor in wanted.items():
        key = name if name in where else tied_sources.get(name)
        if key not in where:
            raise ValueError(f"{path}: no safetensors file holds {name!r}; the directory's weights are "
                             f"not this config's model (save it again with save_pretrained)")
        with safe_open(str(where[key]), framework="pt") as handle:
            value = handle.get_tensor(key)
        if value.shape != tensor.shape:
            raise ValueError(f"{path}: {key!r} has shape {tuple(value.shape)} but the config's model "
                             f"has {tuple(tensor.shape)}; the weights are not this config's model")
        with torch.no_grad():
            tensor.copy_(value)
        read.append(key)
    return read


def _non_persistent(module: nn.Module, name: str) -> set[str]:
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return owner._non_persistent_buffers_set
