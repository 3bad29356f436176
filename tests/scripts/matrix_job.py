"""A user's training script whose features come from a case (``--case JSON``): the shapes real jobs combine.

optimizer (torch Adam, AdamW, SGD with momentum, DeepSpeed's own Adam), scheduler (DeepSpeed's
WarmupLR, WarmupDecayLR log and linear, WarmupCosineLR, OneCycle, a torch scheduler passed as
``lr_scheduler=``; and one the script makes and steps itself after each step), precision and ZeRO
(fp32, bf16, ZeRO-1 fp32 or bf16 at dp=2), data (the engine's own ``training_data=``, torchdata's
``StatefulDataLoader``, an iterator with ``state_dict``), dropout on either stage (from torch's
generator, or Megatron's way: from DeepSpeed's model-parallel tracker), activation checkpointing,
weights tied across the stages, a frozen block, gradient accumulation, the snapshot period and the
calling form of ``initialize``; buffers a forward changes on each stage (BatchNorm's statistics, or
a counter and an average updated in place, or rebound, with every parameter's ``.data`` rebound
after each step). Every run crosses an epoch of its data.
"""

import argparse
import json
import random
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import RepeatingLoader

import baft

WIDTH, SAMPLES, MICRO_BATCH = 16, 24, 2  # 24 samples: an epoch every 12 / micro-batches steps or sooner


class Samples(torch.utils.data.Dataset):
    dtype = torch.float32  # bf16 jobs feed bf16 (DeepSpeed's pipeline does not cast inputs)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x = torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))
        return x.to(self.dtype), x.sin().sum(dim=0, keepdim=True).to(self.dtype)


class Positioned:
    """An endless iterator of batches with a restorable position (a user's own data iterator)."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        first = self.position * MICRO_BATCH % SAMPLES
        self.position += 1
        batch = [Samples()[(first + i) % SAMPLES] for i in range(MICRO_BATCH)]
        return torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, saved):
        self.position = saved["position"]


class TrackedDropout(nn.Dropout):
    """Megatron's dropout: drawn from the generator DeepSpeed's model-parallel tracker forks to."""

    def forward(self, x):
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            return super().forward(x)


class Counted(nn.Module):
    """A linear layer scaled by a buffer counting its training forwards, its input centred by an average of the
    inputs kept in another: updated in place (``+=``, ``mul_``), or by giving the module new tensors."""

    def __init__(self, rebind: bool):
        super().__init__()
        self.rebind = rebind
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("average", torch.zeros(WIDTH))

    def forward(self, x):
        if self.training:
            if self.rebind:
                self.count = self.count + 1
                self.average = 0.9 * self.average + 0.1 * x.detach().mean(0)
            else:
                self.count += 1
                self.average.mul_(0.9).add_(0.1 * x.detach().mean(0))
        # bf16: DeepSpeed converts the parameters, not the buffers
        return self.lin(x - self.average.to(x.dtype)) * (1 + 0.01 * self.count.to(x.dtype))


class BatchNorm(nn.BatchNorm1d):
    """BatchNorm computed in float32 (DeepSpeed's bf16 converts its parameters, not its running statistics)."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return nn.functional.batch_norm(x.float(), self.running_mean, self.running_var, self.weight.float(),
                                        self.bias.float(), self.training, self.momentum, self.eps).to(x.dtype)


def buffer_layer(case):
    """The layer of ``case["buffers"]`` whose buffers a forward changes, or None."""
    kind = case["buffers"]
    if kind == "batchnorm":
        return LayerSpec(BatchNorm, WIDTH)
    return None if kind == "none" else LayerSpec(Counted, rebind=kind == "rebind")


def layers(case):
    def tied():
        return TiedLayerSpec("tied", nn.Linear, WIDTH, WIDTH) if case["tied"] else LayerSpec(nn.Linear, WIDTH, WIDTH)
    p0, p1 = (0.1 if on else 0.0 for on in case["dropout"])
    dropout = TrackedDropout if case["dropout_rng"] == "tracker" else nn.Dropout
    first = [tied(), LayerSpec(nn.GELU), LayerSpec(dropout, p0), LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.GELU)]
    second = [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.GELU), LayerSpec(dropout, p1), tied(),
              LayerSpec(nn.Linear, WIDTH, 1)]
    extra = buffer_layer(case)
    if extra is not None:  # one on each stage (the partition is uniform), the frozen block still layer 3
        first.insert(4, extra)
        second.insert(3, extra)
    return first + second


def config(case, policy, dp):
    optimizer = {"adam": ("Adam", {"torch_adam": True}), "adamw": ("AdamW", {"torch_adam": True, "weight_decay": 0.1}),
                 "sgd": ("SGD", {"momentum": 0.9}), "sgd-plain": ("SGD", {}), "ds-adam": ("Adam", {})}[case["optimizer"]]
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": case["micro_batches"],
           "train_batch_size": MICRO_BATCH * case["micro_batches"] * dp, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "optimizer": {"type": optimizer[0], "params": {"lr": 0.01, **optimizer[1]}},
           "baft": {"policy": policy, "period": case["period"]}}
    steps, lr = case["steps"], 0.01
    schedulers = {
        "WarmupLR": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": steps, "warmup_type": "log"},
        "WarmupDecayLR-log": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": steps // 2,
                              "total_num_steps": steps * 2, "warmup_type": "log"},
        "WarmupDecayLR-linear": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": steps // 2,
                                 "total_num_steps": steps * 2, "warmup_type": "linear"},
        "WarmupCosineLR": {"total_num_steps": steps * 2, "warmup_num_steps": steps // 2},
        "OneCycle": {"cycle_min_lr": lr / 10, "cycle_max_lr": lr, "cycle_first_step_size": steps // 2},
    }
    name = case["scheduler"]
    if name in schedulers:
        cfg["scheduler"] = {"type": name.split("-")[0], "params": schedulers[name]}
    if case["precision"] in ("bf16", "zero1-bf16"):
        cfg["bf16"] = {"enabled": True}
        Samples.dtype = torch.bfloat16
    if case["precision"].startswith("zero1"):
        cfg["zero_optimization"] = {"stage": 1}
        cfg["zero_allow_untested_optimizer"] = True  # SGD under ZeRO: DeepSpeed asks the user to say so
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, help="the case, as JSON")
    parser.add_argument("--policy", default="baft")
    parser.add_argument("--dir", required=True, help="where the config file of the 'path' and 'args' forms goes")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    case = json.loads(args.case)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    dp = 2 if case["precision"].startswith("zero1") else 1
    seed = case["seed"] + 1000 * torch.distributed.get_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(case["seed"])  # the same initial weights on every replica
    if case["dropout_rng"] == "tracker":  # Megatron's model-parallel seed (model_parallel_cuda_manual_seed)
        deepspeed.checkpointing.get_cuda_rng_tracker().add("model-parallel-rng", seed + 2718)
    model = PipelineModule(layers=layers(case), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform",
                           seed_layers=case["seed_layers"], base_seed=case["seed"],
                           activation_checkpoint_interval=1 if case["checkpointing"] else 0)
    for name, param in model.named_parameters():
        if case["frozen"] and name.startswith("3."):  # a frozen block on the first stage
            param.requires_grad_(False)
    cfg = config(case, args.policy, dp)
    kwargs = {"model": model}
    if case["scheduler"] == "torch":
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    form = case["form"]
    if form in ("path", "args"):
        path = Path(args.dir) / f"ds_config-{torch.distributed.get_rank()}.json"
        path.write_text(json.dumps(cfg))
        if form == "path":
            kwargs["config"] = str(path)
        else:
            kwargs["args"] = argparse.Namespace(deepspeed_config=str(path), local_rank=args.local_rank)
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    else:
        kwargs["config" if form == "dict" else "config_params"] = cfg
    feed = None
    if case["data"] == "engine":
        kwargs["training_data"] = Samples()
    elif case["data"] == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(Samples(), batch_size=MICRO_BATCH, shuffle=True, drop_last=True,
                                    generator=torch.Generator().manual_seed(case["seed"]))
        kwargs["data_iterator"] = loader
    else:
        kwargs["data_iterator"] = feed = Positioned()
    engine, *_ = baft.initialize(**kwargs)
    if case["data"] == "stateful":
        feed = RepeatingLoader(kwargs["data_iterator"])  # taken after initialize, as the README says
    elif case["data"] == "set":  # train_batch() reads what set_dataiterator() gave
        engine.set_dataiterator(feed)
        feed = None
    own = None
    if case["own_scheduler"]:  # made and stepped by the script, on top of DeepSpeed's: DeepSpeed does not know it
        optimizer = engine.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's bf16 or ZeRO wrapper: torch's inside it
            optimizer = optimizer.optimizer
        own = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
    meter = Meter()  # a loop on the engine's step carries its sum and count (in the digests: carried.meter.sum)
    if case["loop"] == "calls":  # DeepSpeedExamples' loop: it counts its own calls
        for _ in range(case["steps"]):
            meter.update(step(engine, feed, case, own))
    else:
        while engine.global_steps < case["steps"]:
            meter.update(step(engine, feed, case, own))


class Meter:
    """The loss's running average, as a script logs it: updated by the loop after each call."""

    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, loss):
        self.sum += loss
        self.count += 1


def step(engine, feed, case, own) -> float:
    if case["scheduler"] == "none":  # the script's own learning rate, drawn from python's generator before each step
        for group in engine.optimizer.param_groups:
            group["lr"] = 0.01 * (1 + random.random())
    if case["batch_ramp"]:  # a batch-size ramp: twice the micro-batches from step 3 on
        size = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * case["micro_batches"]
        engine.set_train_batch_size(size * (2 if engine.global_steps >= 2 else 1))
    loss = float(engine.train_batch(data_iter=feed))
    if own is not None:
        own.step()
    # weight clipping as WGAN scripts do it: each parameter given new data (in fp32 without ZeRO only: DeepSpeed's
    # bf16 and ZeRO optimizers update flat buffers the parameters view, which new data would leave behind)
    if case["buffers"] == "rebind" and case["precision"] == "fp32":
        with torch.no_grad():
            for param in engine.module.parameters():
                param.data = param.data.clamp(-0.3, 0.3)
    return loss


if __name__ == "__main__":
    main()
