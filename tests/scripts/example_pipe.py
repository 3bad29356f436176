"""DeepSpeedExamples' ``training/pipeline_parallelism/train.py`` (its ``train_pipe`` path) in shape:
a small CNN as a ``PipelineModule`` on synthetic CIFAR-sized data, the config through
``--deepspeed_config``, the engine's own loader (``training_data=``), and ``deepspeed.initialize``
replaced by ``baft.initialize`` with the example's own call, in the example's own loop (``for step in
range(args.steps)``).
"""

import argparse
import functools
import random

import deepspeed
import numpy
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule

import baft

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--eval-every", type=int, default=0, help="eval_batch on held-out data every N steps")
parser.add_argument("--lr-jitter", action="store_true",
                    help="the loop sets each step's learning rate from a draw of python's, and draws from torch's")
parser.add_argument("--dropout", action="store_true", help="a Dropout layer: the training draws from torch's generator")
parser.add_argument("--seed-each-step", type=int, default=-1, metavar="RANK",
                    help="on this rank the loop seeds torch's generator from the step before its draws")
parser.add_argument("--ema", action="store_true",
                    help="the loop keeps an EMA of the stage's weights and a loss meter after each call, in client_state=")
parser.add_argument("--samples", type=int, default=256, help="the training set's size")
parser.add_argument("--augment", action="store_true",
                    help="each sample flipped at random, drawn from torch's generator in the engine's loader workers")
parser.add_argument("--no-baft", action="store_true", help="plain deepspeed.initialize (the reference run)")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
random.seed(0)  # every generator seeded: baft's state digests check each (an unseeded one differs run to run)
numpy.random.seed(0)
data = torch.Generator().manual_seed(0)
trainset = torch.utils.data.TensorDataset(torch.randn(args.samples, 3, 32, 32, generator=data),
                                          torch.randint(0, 10, (args.samples,), generator=data))


class Flipped(torch.utils.data.Dataset):
    """A random horizontal flip as torchvision's draws it: from torch's generator, in whichever process reads."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        image, label = self.samples[index]
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


if args.augment:
    trainset = Flipped(trainset)
layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
          nn.MaxPool2d(2), nn.Flatten(), *([nn.Dropout(0.1)] if args.dropout else []), nn.Linear(16 * 8 * 8, 10)]
net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")


class Averages:
    """The script's own state, updated by its loop after each call: an EMA of the stage's weights, a loss meter."""

    def __init__(self, module):
        self.ema, self.meter = [p.detach().clone() for p in module.parameters()], 0.0

    @torch.no_grad()
    def update(self, module, loss):
        for average, p in zip(self.ema, module.parameters()):
            average.lerp_(p, 0.1)
        self.meter = 0.9 * self.meter + 0.1 * float(loss)

    def state_dict(self):
        return {"ema": self.ema, "meter": self.meter}

    def load_state_dict(self, state):
        for average, saved in zip(self.ema, state["ema"]):
            average.copy_(saved)
        self.meter = state["meter"]


averages = Averages(net) if args.ema else None
initialize = (deepspeed.initialize if args.no_baft else
              functools.partial(baft.initialize, client_state=averages) if args.ema else baft.initialize)
engine, _, _, _ = initialize(args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                             training_data=trainset)
evalset = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32, generator=data),
                                         torch.randint(0, 10, (64,), generator=data))
held_out = deepspeed.utils.RepeatingLoader(torch.utils.data.DataLoader(
    evalset, batch_size=engine.train_micro_batch_size_per_gpu()))
for step in range(args.steps):  # the example's own loop: it counts its calls from 0 (baft.script.loop)
    # the script's own draws between steps: python's, which the step's training reads; torch's, which a replayed call
    # cannot draw as the uninterrupted run did where the training draws from it too, unless the loop seeds it first
    if engine.global_rank == args.seed_each_step:
        torch.manual_seed(1000 + step)
    jitter, noise = (random.random(), float(torch.rand(()))) if args.lr_jitter else (None, None)
    if engine.global_rank == 0:  # what the loop's code reads of the engine before each call
        drawn = f" draw {jitter!r}\ntorch draw before call {step + 1}: {noise!r}" if args.lr_jitter else ""
        print(f"call {step + 1} starts at step {engine.global_steps} lr {engine.get_lr()[0]!r}{drawn}", flush=True)
    if args.lr_jitter:
        for group in engine.optimizer.param_groups:
            group["lr"] = 1e-3 * (1 + jitter)
    loss = engine.train_batch()
    if averages is not None:
        averages.update(engine.module, loss)
    if engine.global_rank == 0:
        schedule = engine.lr_scheduler  # a config's: what it reads after each step
        said = f" schedule {schedule.last_batch_iteration} {schedule.get_last_lr()}" if schedule is not None else ""
        print(f"step {step + 1} loss {float(loss)!r} applied {engine.was_step_applied()}{said} "
              f"engine {type(engine).__name__}", flush=True)
    if args.eval_every and (step + 1) % args.eval_every == 0:
        evaluated = engine.eval_batch(iter(held_out))
        if engine.global_rank == 0:
            print(f"eval after step {step + 1} loss {float(evaluated)!r}", flush=True)
