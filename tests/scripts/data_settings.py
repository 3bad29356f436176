"""Settings of the data pipeline the loop changes, read in a plain DataLoader's 2 workers (each epoch's copy the
dataset as its iterator is made) through RepeatingLoader, in a loop on the engine's step: a curriculum's noise set
before each call, an item of a dict of options set once (at step 2, read from the second epoch), and a collate_fn
replaced once (at step 6, read from the third). 4 steps an epoch, 8 steps. tests/test_data_position.py kills a rank
inside the second epoch and checks each step trained again against its first training, and that the replaced
collate_fn is said."""

import functools
import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader

import baft


class Samples(torch.utils.data.Dataset):
    def __init__(self):
        self.noise, self.opts = 0.0, {"half": False}

    def __len__(self):
        return 32

    def __getitem__(self, i):  # no random draws: the noise is seeded by the sample's index
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        x = x * (0.5 if self.opts["half"] else 1.0) + self.noise * torch.randn(
            8, generator=torch.Generator().manual_seed(1000 + i))
        return x, x.sin().sum(dim=0, keepdim=True)


def truncated(items, keep):
    xs, ys = torch.utils.data.default_collate(items)
    xs[:, keep:] = 0
    return xs, ys


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 16, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "baft": {"period": 1, "policy": sys.argv[1] if len(sys.argv) > 1 else "baft"}}
dataset = Samples()
loader = torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True, num_workers=2)
engine, *_ = baft.initialize(model=model, config=config, model_parameters=model.parameters())
batches = iter(RepeatingLoader(loader))
while engine.global_steps < 8:
    dataset.noise = 0.05 * engine.global_steps  # noisier inputs as training goes on
    loss = engine.train_batch(data_iter=batches)
    if engine.global_steps == 2:
        dataset.opts["half"] = True
    if engine.global_steps == 6:  # shorter inputs from the next epoch on
        loader.collate_fn = functools.partial(truncated, keep=4)
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {float(loss)!r}", flush=True)
