"""A user's script with learning-rate schedulers of its own on the optimizer it made (probe 11): a ``StepLR`` made
before ``baft.initialize`` and stepped before each ``train_batch`` call, and a warm-up ``LinearLR`` the loop replaces
by a ``CyclicLR`` (which cycles Adam's betas too) as the warm-up ends, stepped after each call; the learning rate a
tensor, which torch's schedulers fill in place. Probe 17: a weight-decay schedule of a class of the script's own (a
plain class, as timm's ``Scheduler`` is), and the biases given their own param group at the first step
(``add_param_group``), which a process resumed past it does not add again."""

import argparse
import random

import deepspeed
import numpy
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft
from user_data import Samples


class WeightDecayWarmup:
    """Weight decay ramped up over the first steps: a scheduler of the script's own, neither torch's nor DeepSpeed's,
    stepped by the loop after each call."""

    def __init__(self, optimizer, steps):
        self.optimizer, self.steps, self.t = optimizer, steps, 0

    def step(self):
        self.t += 1
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.01 * min(1.0, self.t / self.steps)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


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
weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
optimizer = torch.optim.AdamW(weights, lr=torch.tensor(1e-3), foreach=False)  # the schedulers fill it
# both there as baft.initialize restores
decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
WARMUP = 3
sched = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP)
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "baft": {"period": 1}}
data = Samples()
engine, *_ = baft.initialize(model=model, optimizer=optimizer, config=config, data_iterator=data)
decay_warmup = WeightDecayWarmup(optimizer, steps=6)
while engine.global_steps < args.steps:
    if engine.global_steps == 0:
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        optimizer.add_param_group({"params": biases, "lr": torch.tensor(1e-3), "weight_decay": 0.0})
    if engine.global_steps >= WARMUP and not isinstance(sched, torch.optim.lr_scheduler.CyclicLR):
        # the warm-up's scheduler freed as this one takes its place: as many references to the optimizer as before
        sched = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-4, max_lr=1e-3, step_size_up=2)
    if engine.global_steps > 0:
        decay.step()  # before the call: the resumed loop does this again for the restored step's next
    loss = engine.train_batch(data_iter=data)
    sched.step()
    decay_warmup.step()
print(f"rank {engine.global_rank} final step {engine.global_steps} loss {float(loss)!r}", flush=True)
