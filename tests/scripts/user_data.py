"""The user script's data, in a module of its own (as a script's model or data often is)."""

import json
import os
import time
from collections import defaultdict, deque

import torch

if os.environ.get("USER_DATA_IMPORTS"):  # tests/test_user_script.py: which process imported this module, and when
    with open(os.environ["USER_DATA_IMPORTS"], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")


class AverageMeter:
    """A running average, as PyTorch's ImageNet example keeps its loss's: updated by the loop after each call, in a
    module of the script's own (baft keeps its sum and count with every snapshot)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n
        self.avg = self.sum / self.count


GAIN = 1.0  # a setting of the script's, in a module of its own, that a layer reads and the loop may change once
logged, logged_total = 0, 0.0  # what log_step keeps between its calls


def log_step(loss):
    """A logging helper of the script's, its running mean in globals of its module (baft keeps them)."""
    global logged, logged_total
    logged += 1
    logged_total += loss
    return logged_total / logged


class SmoothedValue:
    """A meter as torchvision's reference scripts keep one: its last values, their total and count."""

    def __init__(self, window_size=4):
        self.deque = deque(maxlen=window_size)
        self.total, self.count = 0.0, 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def __str__(self):
        return f"{sum(self.deque) / len(self.deque)!r}/{self.total / self.count!r}"


class MetricLogger:
    """torchvision's: meters by name, made as first updated (its update changes them through their own update)."""

    def __init__(self):
        self.meters = defaultdict(SmoothedValue)

    def update(self, **values):
        for name, value in values.items():
            self.meters[name].update(value)

    def __str__(self):
        return " ".join(f"{name} {meter}" for name, meter in self.meters.items())


class Samples:
    """Deterministic regression batches with a restorable position."""

    def __init__(self, batch=8, width=32, position=0, first_seed=0):
        self.batch, self.width, self.position, self.first_seed = batch, width, position, first_seed

    def __iter__(self):
        return self

    def __next__(self):
        gen = torch.Generator().manual_seed(self.first_seed + self.position)
        self.position += 1
        x = torch.randn(self.batch, self.width, generator=gen)
        return x, x.sin().sum(dim=1, keepdim=True)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
