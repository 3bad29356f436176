"""A user's script with learning-rate schedulers of its own on the optimizer it made (probe 11): a ``StepLR`` made
before ``baft.initialize`` and stepped before each ``train_batch`` call, and a warm-up ``LinearLR`` the loop replaces
by a ``CyclicLR`` (which cycles Adam's betas too) as the warm-up ends, stepped after each call; the learning rate a
tensor, which torch's schedulers fill in place."""

import argparse
import random

import deepspeed
import numpy
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft
from user_data import Samples

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
layers = [LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.ReLU), LayerSpec(nn.Dropout, 0.1), LayerSpec(nn.Linear, 32, 1)]
model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), foreach=False)  # the schedulers fill it
# both there as baft.initialize restores
decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
WARMUP = 3
sched = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP)
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "baft": {"period": 1}}
data = Samples()
engine, *_ = baft.initialize(model=model, optimizer=optimizer, config=config, data_iterator=data)
while engine.global_steps < args.steps:
    if engine.global_steps >= WARMUP and not isinstance(sched, torch.optim.lr_scheduler.CyclicLR):
        # the warm-up's scheduler freed as this one takes its place: as many references to the optimizer as before
        sched = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-4, max_lr=1e-3, step_size_up=2)
    if engine.global_steps > 0:
        decay.step()  # before the call: the resumed loop does this again for the restored step's next
    loss = engine.train_batch(data_iter=data)
    sched.step()
print(f"rank {engine.global_rank} final step {engine.global_steps} loss {float(loss)!r}", flush=True)
