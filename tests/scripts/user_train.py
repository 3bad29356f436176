"""A user's own training script: an MLP pipeline, its own data, ``baft.initialize`` instead of ``deepspeed.initialize``."""

import argparse
import hashlib
import json
import math

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import baft
import user_data
from user_data import AverageMeter, MetricLogger, Samples, log_step


NOISE = 0.01  # the noise's scale, a setting of the script's its loop may turn off once (--noise-off-once)
# with --statistics: a shift the loss reads, which the loop updates in place after each call, and a tilt the noise
# layers read, which it rebinds (probe 26: neither in a snapshot, each resumed from its first value, silently)
SHIFT = torch.zeros(())
TILT = torch.zeros(())


class Noise(nn.Module):
    """Noise drawn from a generator the layer holds, in no state of torch's own; scaled by a factor every such layer
    reads from its class (on both stages), which the loop may change once (--class-once)."""

    scale = 1.0

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)
        # with --statistics, a running mean kept in a plain tensor attribute, not a buffer, and a list the forward
        # appends to (probe 26: neither in a snapshot, each resumed from its first value, silently)
        self.running, self.seen = torch.zeros(()), []

    def forward(self, x):
        if args.statistics and self.training:
            self.running = 0.9 * self.running + 0.1 * x.detach().mean()
            self.seen.append(round(float(self.running), 4))
            x = (x - self.running + TILT) * (1 + 0.01 * len(self.seen))
        return x + NOISE * Noise.scale * torch.randn(x.shape, generator=self.gen) if self.training else x


class LazyScale(nn.Module):
    """A scale kept in a buffer the layer registers as it first runs forward (a cache, as rotary embeddings' tables
    often are), not in ``__init__`` (probe 15: a restore, which comes before, refused every snapshot)."""

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.linspace(0.5, 1.5, x.shape[-1]), persistent=False)
        return x * self.scale * user_data.GAIN


class WarmedLoss(nn.Module):
    """A mean squared error weighted up over its first calls: a count kept in a plain attribute, not a buffer (probe
    15: not kept, a resumed run trained on with the weight its count started again from)."""

    def __init__(self, warmup=20):
        super().__init__()
        self.calls, self.warmup = 0, warmup

    def forward(self, output, target):
        self.calls += 1
        return min(1.0, self.calls / self.warmup) * nn.functional.mse_loss(output + SHIFT, target)


HOOKED = {"calls": 0}  # with --statistics, a forward hook's count in a global dict's item (probe 28)


def halved_late(module, inputs, output):
    """A forward hook halving its layer's output after its 18th call: torch calls it, never the loop."""
    HOOKED["calls"] += 1
    return output * 0.5 if HOOKED["calls"] > 18 else output


class Tempered:
    """A forward hook object scaling its layer's output up with its calls, counted in its own attribute (probe 28:
    neither hook's count was in a snapshot, each resumed from 0 relaunched and moved on in place, silently)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1
        return output * (1 + 0.01 * self.calls)


class Plateau:
    """A callback of the script's own in a list the loop goes through, a score to maximize its best, started at
    ``-math.inf`` (probe 28: neither kept nor named, relaunched and in place): the rate lower where a step's loss did
    not improve on it."""

    def __init__(self):
        self.best = -math.inf

    def on_step_end(self, engine, loss):
        if -loss > self.best:
            self.best = -loss
        else:
            for group in engine.optimizer.param_groups:
                group["lr"] *= 0.8


parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--node-per-rank", action="store_true", help="each rank its own node: node_id = rank")
parser.add_argument("--stateless", choices=("scheduler", "data"), nargs="*", default=(),
                    help="hand baft parts it cannot save")
parser.add_argument("--batch-once", type=int, default=0, help="at this step double the batch size, once")
parser.add_argument("--freeze-once", type=int, default=0, help="at this step freeze the first layer, once")
parser.add_argument("--dropout-off-once", type=int, default=0, help="at this step turn the dropout off, once")
parser.add_argument("--noise-off-once", type=int, default=0, help="at this step turn the layers' noise off, once")
parser.add_argument("--gain-once", type=int, default=0, help="at this step halve user_data.GAIN, once")
parser.add_argument("--class-once", type=int, default=0, help="at this step set Noise.scale, once")
parser.add_argument("--perturb", action="store_true", help="add noise to the weights before each call")
parser.add_argument("--statistics", action="store_true",
                    help="running statistics in plain attributes of the noise layers and in globals the loop updates")
parser.add_argument("--evaluate", choices=("kept", "anew"),
                    help="eval_batch every 2 steps, from one held-out iterator kept across evaluations, or a new one")
args = parser.parse_args()
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
layers = [LayerSpec(nn.Linear, 32, 64), LayerSpec(nn.ReLU), LayerSpec(nn.Dropout, 0.1), LayerSpec(Noise),
          LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.ReLU), LayerSpec(Noise), LayerSpec(LazyScale),
          LayerSpec(nn.Linear, 64, 1)]
model = PipelineModule(layers=layers, num_stages=2, loss_fn=WarmedLoss(), partition_method="uniform")
data = Samples()
config = args.config
if args.node_per_rank:  # as on a cluster, where each node's config names that node
    config = json.loads(open(args.config).read())
    config["baft"]["node_id"] = torch.distributed.get_rank()
class Halving:
    """An LR schedule with no state_dict: baft cannot save where it is."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, **_):
        for group in self.optimizer.param_groups:
            group["lr"] /= 2


extra = {"lr_scheduler": Halving} if "scheduler" in args.stateless else {}
if "data" in args.stateless:
    data = (batch for batch in Samples())  # a generator: no state_dict
factors = np.random.default_rng(3)  # a generator of the script's own, which its loop draws from between steps
engine, *_ = baft.initialize(model=model, config=config, data_iterator=data, **extra)
if args.statistics:  # inputs scaled as the engine loads them (probe 29: a survivor in place dropped it, silently)
    engine.set_batch_fn(lambda batch: (batch[0] * 1.1, batch[1] * 1.1) if isinstance(batch, tuple) else batch)


class Shadow:
    """A timm-style EMA of the stage's weights, defined after ``baft.initialize`` (probe 28: a relaunched process
    unpickled the loop's carried copy of it in baft.initialize's restore, before this class existed, and died)."""

    def __init__(self, module):
        self.weights = {name: p.detach().clone() for name, p in module.named_parameters()}

    def update(self, module):
        with torch.no_grad():
            for name, p in module.named_parameters():
                self.weights[name].mul_(0.9).add_(p.detach(), alpha=0.1)


if args.statistics:  # the hooks, and an EMA of the stage's linear layers kept with torch's AveragedModel (probe 28)
    linears = nn.ModuleList(m for m in engine.module.modules() if isinstance(m, nn.Linear))
    tempered = Tempered()
    linears[0].register_forward_hook(halved_late)
    linears[-1].register_forward_hook(tempered)
    averaged = AveragedModel(linears, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    shadow = Shadow(engine.module)
held_out = Samples(first_seed=1000)  # an iterator kept across evaluations, its position in no snapshot
previous = None  # the last step's loss, which a schedule of the script's own compares with: carried by the loop
losses = AverageMeter()  # the loss's average over the run, whose sum and count the loop carries in the meter's update
metrics = MetricLogger()  # and the loss's and rate's meters, made in its first update, kept whole
callbacks = [Plateau()] if args.statistics else []
while engine.global_steps < args.steps:
    if args.batch_once and engine.global_steps == args.batch_once:  # a resumed run past it does not set it again
        engine.set_train_batch_size(2 * engine.train_batch_size())
    if args.freeze_once and engine.global_steps == args.freeze_once:  # nor does it freeze it again
        next(engine.module.parameters()).requires_grad_(False)
    if args.noise_off_once and engine.global_steps == args.noise_off_once:  # a global the layers read, set once
        NOISE = 0.0
    if args.gain_once and engine.global_steps == args.gain_once:  # a config module's setting, read by a layer
        user_data.GAIN = 0.5
    if args.class_once and engine.global_steps == args.class_once:  # a class attribute the layers read, set once
        Noise.scale = 0.75
    if args.dropout_off_once and engine.global_steps == args.dropout_off_once:  # early dropout: torch's p, once
        for module in engine.module.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    if args.perturb:  # weight noise before each call (probe 21: added twice to the first resumed step)
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
    if args.statistics:  # the layers' running means damped in place before each call: set again as it started
        for module in engine.module.modules():
            if isinstance(module, Noise):
                module.running.mul_(0.99)
    factor = 0.97 + 0.02 * factors.random()  # a decay of the script's own, by a factor drawn before each call
    for group in engine.optimizer.param_groups:
        group["lr"] *= factor
    loss = engine.train_batch(data_iter=data)
    if previous is not None:  # halved where the loss went up, else a little higher
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.5 if float(loss) > previous else 1.02
    previous = float(loss)
    losses.update(float(loss))
    metrics.update(loss=float(loss), lr=engine.get_lr()[0])
    mean = log_step(float(loss))
    if args.statistics:
        SHIFT.mul_(0.5).add_(0.1 * float(loss))
        TILT = 0.5 * TILT + 0.1 * float(loss)
        averaged.update_parameters(linears)
        shadow.update(engine.module)
    for callback in callbacks:
        callback.on_step_end(engine, float(loss))
    if args.evaluate and engine.global_steps % 2 == 0:
        engine.eval_batch(data_iter=held_out if args.evaluate == "kept" else Samples(first_seed=1000))
weights = [*engine.module.parameters(), *(averaged.parameters() if args.statistics else ()),
           *(shadow.weights.values() if args.statistics else ())]
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in weights)).hexdigest()
print(f"rank {engine.global_rank} final step {engine.global_steps} loss {float(loss)!r} params {digest} "
      f"average loss {losses.avg!r} engine {type(engine).__name__} metrics {metrics} logged {mean!r}", flush=True)
