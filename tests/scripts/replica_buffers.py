"""A pipeline whose first stage keeps a BatchNorm, each data-parallel replica reading its own batches (so its
running statistics are its own). Prints every rank's running mean as it starts and ends; trains to the step the
argument names. tests/test_data_parallel.py restarts it with fewer replicas."""

import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft
from user_data import Samples


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.BatchNorm1d, 8), LayerSpec(nn.Linear, 8, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "baft": {"policy": "baft", "period": 1}}
data = Samples(batch=2, width=8)
engine, *_ = baft.initialize(model=model, config=config, data_iterator=data)
replica = engine.grid.get_data_parallel_rank()
data.first_seed = 1000 * replica  # each replica its own batches


def running_mean():
    return [b.tolist() for name, b in engine.module.named_buffers() if name.endswith("running_mean")]


print(f"rank {engine.global_rank} replica {replica} starts at step {engine.global_steps}: {running_mean()}",
      flush=True)
while engine.global_steps < int(sys.argv[1]):
    engine.train_batch(data_iter=data)
print(f"rank {engine.global_rank} replica {replica} ends at step {engine.global_steps}: {running_mean()}",
      flush=True)
