"""A training script in the GPT-NeoX / Megatron-DeepSpeed start-up pattern.

It loads its newest DeepSpeed checkpoint when the directory has one and reads its own
bookkeeping back from the ``client_state`` (iteration, consumed samples, data position, RNG
states), trains while its own iteration count is short of ``--steps``, and saves a checkpoint
every ``--save-every`` steps with that bookkeeping. With ``--register`` it hands baft the same
bookkeeping as ``client_state=``: the object, or a callable returning its state.
"""

import argparse
import os
import random

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import set_random_seed

import baft

WIDTH, MICRO_BATCH, MICRO_BATCHES = 16, 2, 2


class Samples:
    """An endless iterator of batches with a restorable position."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        x = torch.randn(MICRO_BATCH, WIDTH, generator=torch.Generator().manual_seed(self.position))
        self.position += 1
        return x, x.sin().sum(dim=1, keepdim=True)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, saved):
        self.position = saved["position"]


class Progress:
    """The script's own bookkeeping, saved as the checkpoint's client_state."""

    def __init__(self, data):
        self.data, self.iteration, self.consumed_samples = data, 0, 0

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "data": self.data.state_dict(),
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}

    def load_state_dict(self, client: dict) -> None:
        self.iteration, self.consumed_samples = client["iteration"], client["consumed_samples"]
        self.data.load_state_dict(client["data"])
        random.setstate(client["rng"]["python"])
        np.random.set_state(client["rng"]["numpy"])
        torch.set_rng_state(client["rng"]["torch"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True, help="the script's checkpoint directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--policy", default="baft")
    parser.add_argument("--period", type=int, default=1)
    parser.add_argument("--register", choices=("stateful", "callable"),
                        help="give baft.initialize client_state= this object, or its state_dict method")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    set_random_seed(7)
    model = PipelineModule(layers=[LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.GELU), LayerSpec(nn.Dropout, 0.1),
                                   LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Dropout, 0.1),
                                   LayerSpec(nn.Linear, WIDTH, 1)],
                           num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 6}},
              "baft": {"policy": args.policy, "period": args.period}}
    data = Samples()
    progress = Progress(data)
    engine, *_ = baft.initialize(model=model, config=config, data_iterator=data,
                                 client_state={"stateful": progress, "callable": progress.state_dict,
                                               None: None}[args.register])
    if os.path.exists(os.path.join(args.ckpt, "latest")):
        _, client = engine.load_checkpoint(args.ckpt)
        progress.load_state_dict(client)
    while progress.iteration < args.steps:
        engine.train_batch(data_iter=data)
        progress.iteration += 1
        progress.consumed_samples += MICRO_BATCH * MICRO_BATCHES
        if progress.iteration % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, client_state=progress.state_dict())
    # closed, baft gives the engine back as DeepSpeed made it: its load_checkpoint too, not baft's guard
    engine.baft.close()
    assert type(engine) is PipelineEngine and "load_checkpoint" not in vars(engine), type(engine)
    assert engine.load_checkpoint.__func__ is PipelineEngine.load_checkpoint, engine.load_checkpoint


if __name__ == "__main__":
    main()
