"""Small language models of a user's own, for the traced-model tests (importable by the ranks)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS = 128, 32, 4


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, s, 3, HEADS, WIDTH // HEADS).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Token ids -> logits: learned positions, four blocks, a head."""

    def __init__(self, n_blocks: int = 4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(64, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class BranchyLM(TinyLM):
    """A forward with data-dependent Python control flow, which the tracer cannot follow."""

    def forward(self, ids):
        if ids.sum() > 0:
            return super().forward(ids)
        return super().forward(ids + 1)


class TwoStreamLM(TinyLM):
    """Passes two tensors across its middle: not one activation per boundary."""

    def forward(self, ids):
        x = self.tokens(ids)
        side = self.positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x + side)
        return self.head(self.norm(x))
