"""Training loops shaped as popular scripts write theirs, ported to a DeepSpeed pipeline under baft (probe 19).

``--shape nanogpt``: nanoGPT's train.py, at the module's level: ``iter_num = 0``, a ``while True`` that breaks once
``iter_num`` passes ``max_iters``, a learning rate set by hand into every param group from ``get_lr(iter_num)``, an
``estimate_loss()`` before the step every ``eval_interval`` (its first at step 0, before any call to train), batches
drawn with ``torch.randint`` from torch's global generator, a best validation loss and an EMA of a rate.
``--shape megatron``: Megatron-DeepSpeed's ``train()``: ``iteration = args.iteration`` (0: the script loads no
checkpoint of its own), ``while iteration < args.train_iters``, consumed samples and a loss dict averaged over log
intervals. ``--shape steps``: nanoGPT's loop on the engine's step (``while engine.global_steps < max_iters``), as the
README advises. ``--shape titan``: torchtitan's, its ``TrainState`` the ``client_state``, counted at the loop's top
(``while train_state.step < steps: train_state.step += 1`` before its call).
"""

import argparse
import hashlib
import math
import random
import sys

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--shape", choices=("nanogpt", "megatron", "steps", "titan"), default="nanogpt")
parser.add_argument("--iters", type=int, default=10)
args = parser.parse_args()
VOCAB, BLOCK, BATCH = 32, 8, 4
eval_interval, eval_iters, learning_rate, min_lr, warmup_iters, lr_decay_iters = 3, 2, 3e-3, 3e-4, 2, 10
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(1337)
random.seed(1337)  # (nanoGPT seeds torch's alone: the digests compare every generator)
np.random.seed(1337)


def tokens(seed, n=600):
    """A token stream with a pattern to learn: mostly the next of ``3 t + 1``, else noise."""
    gen = torch.Generator().manual_seed(seed)
    noise, pick = torch.randint(VOCAB, (n,), generator=gen), torch.rand(n, generator=gen) < 0.8
    out = [int(noise[0])]
    for i in range(1, n):
        out.append((3 * out[-1] + 1) % VOCAB if pick[i] else int(noise[i]))
    return torch.tensor(out)


data = {"train": tokens(1), "val": tokens(2)}


def get_batch(split):
    ix = torch.randint(len(data[split]) - BLOCK - 1, (BATCH,))  # torch's global generator, as nanoGPT's
    return (torch.stack([data[split][i:i + BLOCK] for i in ix]), torch.stack([data[split][i + 1:i + 1 + BLOCK]
                                                                               for i in ix]))


class Batches:
    def __init__(self, split):
        self.split = split

    def __iter__(self):
        return self

    def __next__(self):
        return get_batch(self.split)


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


model = PipelineModule(layers=[LayerSpec(nn.Embedding, VOCAB, 16), LayerSpec(nn.Linear, 16, 16), LayerSpec(nn.GELU),
                               LayerSpec(nn.Linear, 16, VOCAB)], num_stages=2, loss_fn=lm_loss,
                       partition_method="uniform")


class TrainState:  # torchtitan's: the loop's count, given to baft.initialize as its client_state
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


train_state = TrainState()
engine, optimizer, _, _ = baft.initialize(model=model, config=args.config,
                                          client_state=train_state if args.shape == "titan" else None)
rank = engine.global_rank
train_iter = Batches("train")


@torch.no_grad()
def estimate_loss():
    out = {}
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            losses[k] = engine.eval_batch(data_iter=Batches(split)).item()
        out[split] = losses.mean()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / (lr_decay_iters - warmup_iters)))
    return min_lr + coeff * (learning_rate - min_lr)


def finish(counter):
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in engine.module.parameters())).hexdigest()
    print(f"rank {rank} final {counter} step {engine.global_steps} params {digest}", flush=True)


best_val_loss = 1e9
local_iter_num = 0
running_mfu = -1.0


def log(loss, lr):
    global local_iter_num, running_mfu
    if local_iter_num >= 2:
        mfu = 0.1 + 0.01 * (engine.global_steps % 3)
        running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
    local_iter_num += 1
    print(f"rank {rank} iter {engine.global_steps}: loss {loss.item()!r}, lr {lr!r}, best {float(best_val_loss)!r}, "
          f"mfu {running_mfu!r}", flush=True)


if args.shape == "nanogpt":
    max_iters = args.iters - 1
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
        loss = engine.train_batch(data_iter=train_iter)
        log(loss, lr)
        iter_num += 1
        if iter_num > max_iters:
            break
    finish(iter_num)
elif args.shape == "titan":
    while train_state.step < args.iters:
        train_state.step += 1
        lr = get_lr(train_state.step - 1)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        loss = engine.train_batch(data_iter=train_iter)
        print(f"rank {rank} iter {train_state.step}: loss {loss.item()!r}, lr {lr!r}", flush=True)
    finish(train_state.step)
elif args.shape == "steps":
    while engine.global_steps < args.iters:
        lr = get_lr(engine.global_steps)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if engine.global_steps % eval_interval == 0:
            losses = estimate_loss()
        log(engine.train_batch(data_iter=train_iter), lr)
    finish(engine.global_steps)
else:
    args.iteration, args.consumed_train_samples = 0, 0

    def train():
        total_loss_dict = {}
        iteration = args.iteration
        while iteration < args.iters:
            lr = get_lr(iteration)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            loss = engine.train_batch(data_iter=train_iter)
            iteration += 1
            args.iteration = iteration
            args.consumed_train_samples += BATCH * engine.gradient_accumulation_steps()
            total_loss_dict["lm loss"] = total_loss_dict.get("lm loss", 0.0) + loss.item()
            if iteration % 2 == 0:
                print(f"rank {rank} iteration {iteration} consumed {args.consumed_train_samples} lm loss "
                      f"{total_loss_dict['lm loss'] / 2!r}", flush=True)
                total_loss_dict["lm loss"] = 0.0
            if iteration % eval_interval == 0:
                print(f"rank {rank} validation at {iteration}: {estimate_loss()['val'].item()!r}", flush=True)
        return iteration

    finish(train())
sys.stdout.flush()
