"""A small LLaMA-style decoder, written so that any slice of it is a pipeline stage.

One class, `LlamaModel`, is both the full model and a stage: it owns an optional
token embedding, a contiguous run of decoder layers, and an optional final norm
and LM head. Layers live in a `ModuleDict` keyed by their global index, so a
stage's parameter names are exactly the full model's (`layers.5.mlp.up_proj.weight`).

Initialisation is a pure function of (seed, parameter name): a stage built on
its own holds bit-for-bit the weights the full model holds.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pplab.base.arguments import check_positive_int

__all__ = ["loss_fn"]

IGNORE_INDEX = -100  # target value the loss skips (padding)
INIT_STD = 0.02
TOKEN_ID_DTYPES = (torch.int64, torch.int32)  # the index types an embedding lookup accepts


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-style decoder; validated on construction."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_positive_int(f"LlamaConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; choose heads so that hidden_size % heads == 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}; each KV head must serve a "
                f"whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim={self.head_dim} (hidden_size / num_attention_heads) is odd; "
                f"rotary position encoding rotates pairs of dimensions, so it must be even")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig: rope_theta={self.rope_theta} and "
                             f"rms_norm_eps={self.rms_norm_eps} must both be positive")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    # --- the model description every pipeline takes (pplab.models.hf.HFModel has the same) ---------

    tied = ()  # no weight is shared between the first and the last stage
    sum_tied_gradients = True

    def build_stage(self, layers: range, embed: bool, head: bool, seed: int = 0,
                    device="cpu") -> "LlamaModel":
        """The stage that holds `layers`, and the embedding and/or the final norm and head."""
        return materialise(self, seed, device, layers=layers, embed=embed, head=head)

    def build_model(self, seed: int = 0, device="cpu") -> "LlamaModel":
        """The whole model on one device, with the weights every cut of it holds."""
        return build_model(self, seed, device)

    def parameter_names(self) -> list[str]:
        """The full model's parameter names, in its order."""
        with torch.device("meta"):
            return [name for name, _ in LlamaModel(self).named_parameters()]

    @staticmethod
    def part_of(name: str):
        """'embed', 'head' or the layer index that holds parameter `name`."""
        if name.startswith("embed_tokens."):
            return "embed"
        if name.startswith("layers."):
            return int(name.split(".")[1])
        return "head"

    def record(self) -> dict:
        """What a checkpoint manifest says about this model."""
        return asdict(self)

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """8 layers, 64 wide: a CPU lesson model that can be split 1..8 ways."""
        return cls(**overrides)

    @classmethod
    def small(cls, **overrides) -> "LlamaConfig":
        """12 layers, 768 wide (~120M parameters with a 32k vocabulary): for GPU servers."""
        base = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                    num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    max_position_embeddings=1024)
        return cls(**{**base, **overrides})


# --- building blocks -------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotary position encoding: cos/sin tables for positions 0..seq_len-1."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.max_positions = config.max_position_embeddings
        # Derived, not learned: non-persistent so it never appears in a checkpoint.
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the frequencies (needed after `to_empty` from the meta device)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq.copy_(1.0 / (self.theta ** (exponents / self.head_dim)))

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings="
                             f"{self.max_positions}; use shorter sequences or a larger config")
        positions = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        angles = torch.outer(positions, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim], halves paired
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [batch, heads, seq, head_dim] by position angles."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # the tables are fp32; bf16 stages compute in bf16
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention (several query heads share a KV head)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, kv_width = config.hidden_size, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# --- the model (and every stage of it) ---------------------------------------------------


class LlamaModel(nn.Module):
    """A LLaMA decoder, or the slice of it that one pipeline stage owns.

    `layers` is the range of global layer indices this module holds; `embed` and
    `head` say whether it owns the token embedding (first stage) and the final
    norm + LM head (last stage). With all three it is the full model; with none
    it is a pass-through stage that returns its input.
    """

    def __init__(self, config: LlamaConfig, layers: range | None = None,
                 embed: bool = True, head: bool = True, seed: int = 0):
        super().__init__()
        self.config = config
        self.layer_ids = range(config.num_hidden_layers) if layers is None else layers
        if self.layer_ids and not (0 <= self.layer_ids[0] and self.layer_ids[-1] < config.num_hidden_layers):
            raise ValueError(f"layers {self.layer_ids} outside 0..{config.num_hidden_layers - 1}")
        # An explicit weight skips nn.Embedding's own normal_ draw (init_weights draws every
        # parameter from its name anyway): on the meta device that draw is a Python reference
        # that imports torch._dynamo, 1.3 s of CPU in every process that builds a model.
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size,
                                          _weight=torch.empty(config.vocab_size, config.hidden_size))
                             if embed else None)
        self.rotary_emb = RotaryEmbedding(config) if self.layer_ids else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in self.layer_ids})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        if not any(param.is_meta for param in self.parameters()):
            init_weights(self, seed)  # built directly (not via `materialise`): same weights anyway

    @property
    def is_first(self) -> bool:
        """True when this module takes token ids (it owns the embedding)."""
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        """True when this module returns logits (it owns the LM head)."""
        return self.lm_head is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden states [b, s, h] -> hidden states or logits."""
        if self.is_first:
            check_token_ids(x)
            x = self.embed_tokens(x)
        elif x.dim() != 3 or not x.is_floating_point():
            raise TypeError(f"this stage starts at layer {self.layer_ids.start} and expects hidden "
                            f"states [batch, seq, hidden], got {x.dtype} of shape {tuple(x.shape)}")
        if self.layers:
            cos, sin = self.rotary_emb(x.shape[1])
            for layer in self.layers.values():
                x = layer(x, cos, sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


@torch.no_grad()
def generate(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids` by a full model: the prompt and the new token ids."""
    if not (model.is_first and model.is_last):
        raise ValueError("generate needs the full model (embedding and LM head); load one with "
                         "pplab.rank.checkpoint.load_model(...)")
    check_positive_int("max_new_tokens", max_new_tokens)
    if not prompt_ids:
        raise ValueError("give a prompt of at least one token id")
    ids = list(prompt_ids)
    device = next(model.parameters()).device
    window = model.config.max_position_embeddings
    for _ in range(max_new_tokens):  # no KV cache: the tiny model recomputes the window each time
        logits = model(torch.tensor([ids[-window:]], dtype=torch.int64, device=device))
        ids.append(int(logits[0, -1].argmax()))
    return ids


def check_token_ids(input_ids: torch.Tensor) -> None:
    """Reject anything but an int64 or int32 [batch, seq] tensor of token ids (what nn.Embedding takes)."""
    if input_ids.dim() != 2 or input_ids.dtype not in TOKEN_ID_DTYPES:
        raise TypeError(f"the first stage expects token ids as an int64 or int32 tensor [batch, seq], "
                        f"got {input_ids.dtype} of shape {tuple(input_ids.shape)}")


def loss_fn(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the targets that are not IGNORE_INDEX."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target_ids.reshape(-1),
                           ignore_index=IGNORE_INDEX)


# --- deterministic, name-keyed initialisation -------------------------------------------


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed that depends on (seed, parameter name) only, stable across runs and hosts."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_std(name: str, config: LlamaConfig) -> float | None:
    """Init std for a parameter, or None for norm scales (which start at one)."""
    if name.endswith("layernorm.weight") or name == "norm.weight":
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Residual-branch outputs shrink with depth so the residual stream keeps its scale.
        return INIT_STD / math.sqrt(2 * config.num_hidden_layers)
    return INIT_STD


@torch.no_grad()
def init_weights(module: LlamaModel, seed: int = 0) -> None:
    """Fill every parameter from (seed, its name) alone, and recompute derived buffers."""
    for name, param in module.named_parameters():
        std = init_std(name, module.config)
        if std is None:
            param.fill_(1.0)
            continue
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
        if param.device.type == "cpu":
            param.normal_(0.0, std, generator=generator)
        else:  # draw on the CPU so every device gets the very same numbers
            param.copy_(torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=generator))
    if module.rotary_emb is not None:
        module.rotary_emb.reset_buffers()


def materialise(config: LlamaConfig, seed: int = 0, device="cpu", **slice_args) -> LlamaModel:
    """Build (a slice of) the model on the meta device, then allocate and initialise it on `device`."""
    with torch.device("meta"):
        module = LlamaModel(config, **slice_args)
    allocate(module, device)
    init_weights(module, seed)
    return module


def allocate(module: nn.Module, device) -> None:
    """`module.to_empty(device=device)` for a module built on the meta device, minus its cost: its
    `empty_like` works out the meta tensor's memory layout symbolically, and the first call imports
    sympy for that (0.6 s of CPU in every process that builds a stage). Tensors made on the meta
    device are contiguous, so each is allocated contiguous."""
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            setattr(owner, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                              requires_grad=param.requires_grad))
        for name, buffer in owner.named_buffers(recurse=False):
            setattr(owner, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))


def build_model(config: LlamaConfig, seed: int = 0, device="cpu") -> LlamaModel:
    """The whole model, initialised deterministically from `seed`."""
    return materialise(config, seed, device)
