"""Generators of the script's own, in no state of torch's: a module global its collate function reads (a random
scale), a variable its loop draws from between steps (a learning rate), and one its dataset holds, drawn by the
dataset and by the loop. tests/test_data_position.py kills a rank and checks each step trained again against its
first training."""

import random

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from torchdata.stateful_dataloader import StatefulDataLoader

import baft

SCALES = np.random.default_rng(5)


class Samples(torch.utils.data.Dataset):
    def __init__(self):
        self.noise = np.random.default_rng(7)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i)) * float(self.noise.uniform(0.5, 1.5))
        return x, x.sin().sum(dim=0, keepdim=True)


def scaled(batch):
    x, y = torch.utils.data.default_collate(batch)
    return x * float(SCALES.uniform(0.5, 1.5)), y


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 16, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
loader = StatefulDataLoader(Samples(), batch_size=2, shuffle=True, drop_last=True, collate_fn=scaled,
                            generator=torch.Generator().manual_seed(4))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
          "baft": {"policy": "baft", "period": 1}}
rates = random.Random(6)
engine, *_ = baft.initialize(model=model, config=config, data_iterator=loader)
batches = iter(loader)
while engine.global_steps < 8:
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2 * rates.uniform(0.5, 1.5) * float(loader.dataset.noise.uniform(0.5, 1.5))
    loss = engine.train_batch(data_iter=batches)
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {float(loss)!r}", flush=True)
