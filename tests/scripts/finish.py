"""A protected job that runs to completion: a few steps, metrics averaged over ranks for logging, then exit.

Its last acts before the interpreter exits are collectives on fresh tensors, as in most training loops. With
``--raise-once-at K`` rank 0's loop raises after step K's call in the job's first launch (a transient error of the
script's own code: a logger's, a save's).
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

import baft

parser = argparse.ArgumentParser()
parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
parser.add_argument("--zero-stage", type=int, default=0)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--unwaited", action="store_true", help="reduce the last metric without waiting for it")
parser.add_argument("--raise-once-at", type=int, default=None, metavar="K")
args = parser.parse_args()
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
dp = dist.get_world_size() // 2
model = PipelineModule(layers=[LayerSpec(nn.Linear, 32, 64), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 64, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8 * dp,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10 ** 9,
          "bf16": {"enabled": args.precision == "bf16"}, "zero_optimization": {"stage": args.zero_stage},
          "baft": {"policy": "baft", "period": 1}}  # baft train gives each run its own run id
engine, *_ = baft.initialize(model=model, config=config)
dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32  # DeepSpeed does not cast inputs to bf16
batches = iter(lambda: (torch.randn(4, 32, dtype=dtype), torch.randn(4, 1, dtype=dtype)), None)
while engine.global_steps < args.steps:
    metrics = {"loss": engine.train_batch(data_iter=batches).detach().float(), "samples": torch.tensor(8.0),
               "grad norm": torch.tensor(float(engine.get_global_grad_norm() or 0.0))}
    if engine.global_steps == args.raise_once_at and engine.global_rank == 0:
        print(f"step {engine.global_steps} code after the call", flush=True)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise OSError("the logger's disk is full")
    for name, value in metrics.items():
        dist.all_reduce(value, async_op=args.unwaited and name == "grad norm")
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} " + "  ".join(f"{k} {v.item() / dist.get_world_size():.4f}"
                                                       for k, v in metrics.items()), flush=True)
