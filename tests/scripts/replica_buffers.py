"""A pipeline whose first stage keeps a BatchNorm, each data-parallel replica reading its own batches (so its
running statistics are its own). Prints every rank's running mean as it starts and ends; trains to the step the
argument names. tests/test_data_parallel.py restarts it with fewer replicas."""

import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft


class Samples:
    """Batches of one replica's own, at a restorable position."""

    def __init__(self, replica):
        self.replica, self.position = replica, 0

    def __iter__(self):
        return self

    def __next__(self):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1000 * self.replica + self.position))
        self.position += 1
        return x, x.sum(dim=1, keepdim=True)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.BatchNorm1d, 8), LayerSpec(nn.Linear, 8, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "baft": {"policy": "baft", "period": 1}}
data = Samples(replica=0)
engine, *_ = baft.initialize(model=model, config=config, data_iterator=data)
data.replica = engine.grid.get_data_parallel_rank()


def running_mean():
    return [b.tolist() for name, b in engine.module.named_buffers() if name.endswith("running_mean")]


print(f"rank {engine.global_rank} replica {data.replica} starts at step {engine.global_steps}: {running_mean()}",
      flush=True)
while engine.global_steps < int(sys.argv[1]):
    engine.train_batch(data_iter=data)
print(f"rank {engine.global_rank} replica {data.replica} ends at step {engine.global_steps}: {running_mean()}",
      flush=True)
