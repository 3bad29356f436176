"""A small GPT as a DeepSpeed ``PipelineModule``, on deterministic synthetic tokens.

The tokens follow a fixed random bigram table, so the loss falls as the model learns it,
and sample ``i`` is the same on every run and every machine: no download, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec


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


def tied_logits(embedding: Embedding, x):
    """The output head of a tied model: the last stage's copy of the token embedding, transposed.

    Scaled by ``d_model ** -0.5`` as in T5: the embedding's unit-variance rows would otherwise
    give logits of size ``d_model``.
    """
    return F.linear(x * x.shape[-1] ** -0.5, embedding.tokens.weight)


def forward_cost(spec, cfg: GPTConfig) -> int:
    """Multiply-adds of one layer's forward pass over one sequence: the weight the stages balance.

    A block: 12 d^2 per token in its projections and MLP, 2 seq d per token in attention; the
    output head (or a tied embedding used as one): vocab d per token; an embedding lookup or a
    norm: d per token.
    """
    d, seq = cfg.d_model, cfg.seq
    if spec.typename is Block:
        return seq * (12 * d * d + 2 * seq * d)
    if spec.typename is Head or getattr(spec, "forward_fn", None) is not None:
        return seq * cfg.vocab * d
    return seq * d


class ComputeBalancedPipeline(PipelineModule):
    """A ``PipelineModule`` whose stages balance estimated compute, as practitioners balance theirs.

    DeepSpeed's ``"parameters"`` method balances the weights ``_count_layer_params`` returns;
    here they are each layer's :func:`forward_cost`. By parameter count the output head and
    the loss (a vocab x d matmul per token) weigh the same as the embedding (a lookup), and
    the last stage becomes the pipeline's bottleneck, its bubble almost gone.
    """

    def __init__(self, layers, cfg: GPTConfig, **kwargs):
        self._layer_costs = [forward_cost(spec, cfg) for spec in layers]
        super().__init__(layers=layers, partition_method="parameters", **kwargs)

    def _count_layer_params(self):
        return list(self._layer_costs)


PARTITIONS = ("compute", "parameters")


def gpt_pipeline(cfg: GPTConfig, num_stages: int, seed: int = 1234, tie_embeddings: bool = False,
                 freeze: int = 0, checkpoint_interval: int = 0, partition: str = "compute") -> PipelineModule:
    """The example GPT cut into ``num_stages`` stages balanced by estimated compute (``partition``
    ``"compute"``, :class:`ComputeBalancedPipeline`) or by parameter count (``"parameters"``).

    ``tie_embeddings``: the token embedding is the output head too, as in GPT-NeoX and Megatron:
    a ``TiedLayerSpec`` on the first and the last stage, whose gradients DeepSpeed all-reduces.
    ``freeze``: the first ``freeze`` blocks do not train; they are frozen once placed, so the
    stages are those of the trainable model. ``checkpoint_interval``: activation checkpointing
    every that many layers; only blocks are checkpointed (DeepSpeed's reentrant checkpoint would
    leave the embedding, whose input is integer ids, without a gradient).
    """
    torch.manual_seed(seed)
    blocks = [LayerSpec(Block, cfg) for _ in range(cfg.layers)]
    if tie_embeddings:
        embedding = TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tokens.weight")
        head = [LayerSpec(nn.LayerNorm, cfg.d_model),
                TiedLayerSpec("embed", Embedding, cfg, forward_fn=tied_logits, tied_weight_attr="tokens.weight")]
    else:
        embedding, head = LayerSpec(Embedding, cfg), [LayerSpec(Head, cfg)]
    layers = [embedding, *blocks, *head]
    common = dict(num_stages=num_stages, loss_fn=lm_loss, activation_checkpoint_interval=checkpoint_interval,
                  checkpointable_layers=["Block"] if checkpoint_interval else None)
    if partition == "compute":
        model = ComputeBalancedPipeline(layers, cfg, **common)
    else:
        model = PipelineModule(layers=layers, partition_method="parameters", **common)
    layers = dict(model.named_children())  # this stage's own layers, by index: blocks are 1..cfg.layers
    for index in range(1, 1 + freeze):
        if str(index) in layers:
            layers[str(index)].requires_grad_(False)
    return model


class SyntheticTokens(torch.utils.data.Dataset):
    """Sample ``i``: ``seq + 1`` tokens from a fixed random bigram chain seeded by ``(seed, i)``."""

    def __init__(self, cfg: GPTConfig, size: int = 1 << 20, seed: int = 0):
        self.cfg, self.size, self.seed = cfg, size, seed
        gen = torch.Generator().manual_seed(seed)
        # each token has 4 likely successors: learnable, but not trivially
        self.successors = torch.randint(cfg.vocab, (cfg.vocab, 4), generator=gen).tolist()

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        choice = torch.randint(4, (self.cfg.seq,), generator=gen)
        tokens = [int(torch.randint(self.cfg.vocab, (1,), generator=gen))]
        for c in choice.tolist():  # Python lists: a tensor index per token made the data feed the host's bottleneck
            tokens.append(self.successors[tokens[-1]][c])
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


def stateful_loader(dataset, micro_batch: int, shard: int = 0, shards: int = 1, seed: int = 0):
    """A torchdata ``StatefulDataLoader`` of micro-batches: this replica's share of ``dataset``, shuffled
    by ``seed`` (the same order on every run), its position in ``state_dict()``. Iterate it once,
    after ``baft.initialize``: a restore calls its ``load_state_dict``, which the next ``iter()`` applies.

    It draws its base seed from its own generator: drawn from torch's global generator, as by
    default, the ``iter()`` after a restore would shift the dropout masks that follow.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    sampler = StatefulDistributedSampler(dataset, num_replicas=shards, rank=shard, shuffle=True, seed=seed)
    return StatefulDataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                              generator=torch.Generator().manual_seed(seed))
