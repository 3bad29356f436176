"""Curriculum learning: before each step the loop sets its data's difficulty from the engine's step
(``data.active``: the features past it zeroed), state baft does not keep; with the argument ``warm-up``, after a
first step from a loop of its own; with ``per-call``, it gives each call a new iterator at the step's position and
difficulty instead. The batches are the same in all three. tests/test_loop.py kills a rank in place."""

import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft
from user_data import Samples


class Curriculum(Samples):
    """Batches of ``active`` features, the rest zero; its position restorable, its difficulty not."""

    def __init__(self, position=0, active=2):
        super().__init__(batch=2, width=8, position=position)
        self.active = active

    def __next__(self):
        x, _ = super().__next__()
        x[:, self.active:] = 0
        return x, x.sin().sum(dim=1, keepdim=True)


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(25)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 16, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True}},
          "baft": {"policy": "baft", "period": 1}}
shape = sys.argv[1]
per_call = shape == "per-call"
data = Curriculum()
engine, *_ = baft.initialize(model=model, config=config, data_iterator=None if per_call else data)


def report(loss):
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {float(loss)!r}", flush=True)


if per_call:
    while engine.global_steps < 8:  # a step reads 2 micro-batches
        report(engine.train_batch(data_iter=Curriculum(2 * engine.global_steps, min(8, 2 + engine.global_steps))))
else:
    while shape == "warm-up" and engine.global_steps < 1:  # at the first step's difficulty (2)
        report(engine.train_batch(data_iter=data))
    while engine.global_steps < 8:
        data.active = min(8, 2 + engine.global_steps)
        report(engine.train_batch(data_iter=data))
