"""A small GPT as a DeepSpeed ``PipelineModule``, on deterministic synthetic tokens.

The tokens follow a fixed random bigram table, so the loss falls as the model learns it,
and sample ``i`` is the same on every run and every machine: no download, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    seq: int = 128
    d_model: int = 384
    layers: int = 8
    heads: int = 6
    dropout: float = 0.1

    def parameters(self) -> int:
        """Parameter count (embedding, blocks, final norm and untied head)."""
        block = 12 * self.d_model ** 2 + 13 * self.d_model
        return (self.vocab + self.seq) * self.d_model + self.layers * block + 2 * self.d_model + self.vocab * self.d_model


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.tokens(ids) + self.positions(pos))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.p = cfg.dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_pipeline(cfg: GPTConfig, num_stages: int, seed: int = 1234) -> PipelineModule:
    """The example GPT cut into ``num_stages`` stages balanced by parameter count."""
    torch.manual_seed(seed)
    specs = [LayerSpec(Embedding, cfg)] + [LayerSpec(Block, cfg) for _ in range(cfg.layers)] + [LayerSpec(Head, cfg)]
    return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=lm_loss, partition_method="parameters")


class SyntheticTokens(torch.utils.data.Dataset):
    """Sample ``i``: ``seq + 1`` tokens from a fixed random bigram chain seeded by ``(seed, i)``."""

    def __init__(self, cfg: GPTConfig, size: int = 1 << 20, seed: int = 0):
        self.cfg, self.size, self.seed = cfg, size, seed
        gen = torch.Generator().manual_seed(seed)
        # each token has 4 likely successors: learnable, but not trivially
        self.successors = torch.randint(cfg.vocab, (cfg.vocab, 4), generator=gen)

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        choice = torch.randint(4, (self.cfg.seq,), generator=gen)
        tokens = [int(torch.randint(self.cfg.vocab, (1,), generator=gen))]
        for c in choice.tolist():
            tokens.append(int(self.successors[tokens[-1], c]))
        tokens = torch.tensor(tokens)
        return tokens[:-1], tokens[1:]


class MicroBatches:
    """An iterator of micro-batches with a position that can be saved and restored exactly.

    ``position`` counts micro-batches handed out; ``shard``/``shards`` split samples between
    data-parallel replicas.
    """

    def __init__(self, dataset, micro_batch: int, shard: int = 0, shards: int = 1, position: int = 0):
        self.dataset, self.micro_batch, self.shard, self.shards = dataset, micro_batch, shard, shards
        self.position = position

    def __iter__(self):
        return self

    def __next__(self):
        base = (self.position * self.shards + self.shard) * self.micro_batch
        samples = [self.dataset[(base + j) % len(self.dataset)] for j in range(self.micro_batch)]
        self.position += 1
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def state_dict(self) -> dict:
        """Samples consumed by all replicas together, so a restart with fewer replicas resumes the stream."""
        return {"samples": self.position * self.shards * self.micro_batch}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["samples"]) // (self.shards * self.micro_batch)
