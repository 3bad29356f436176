"""The data position of the engine's own loader (``training_data=`` given to ``initialize``): how far into its epoch
DeepSpeed's repeating loader has read, and the state of torch's generator each epoch's iterator drew its workers'
seeds from."""

from __future__ import annotations

from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader


class EngineLoaderPosition:
    """The data position of the engine's own loader (``training_data=`` given to ``initialize``).

    DeepSpeed reads that dataset through a ``DistributedSampler`` without shuffling, repeated
    (``RepeatingLoader``), on the first and last stages; each optimizer step takes
    ``micro_batches`` of it (``set_train_batch_size`` changes how many: :meth:`batch_size_changes`). A
    restore makes the epoch's iterator again and skips as far into it (reading the skipped batches). That
    iterator's loader workers draw from generators seeded by a base seed it drew from torch's as it was made (a
    random crop of torchvision's in the dataset): :class:`_EpochSeeds` keeps the state it was drawn from.
    """

    def __init__(self, engine):
        self.engine = engine
        self.read_before, self.since_step = 0, 0  # micro-batches read up to step since_step, at earlier sizes
        # the engine's, held: its eval_batch() sets training_dataloader to None (a middle stage's is None)
        self.repeating = getattr(engine, "training_dataloader", None)
        if isinstance(self.repeating, RepeatingLoader):
            self.repeating.__class__ = _EpochSeeds
            self.repeating.new_epoch(torch.default_generator.get_state())  # deepspeed.initialize's: not kept

    def read(self) -> int:
        """The micro-batches the loader has given by the engine's step."""
        return self.read_before + (self.engine.global_steps - self.since_step) * self.engine.micro_batches

    def batch_size_changes(self) -> None:
        """Before the engine's batch size changes: the steps so far read at the size until now."""
        self.read_before, self.since_step = self.read(), self.engine.global_steps

    def state_dict(self) -> dict:
        if not isinstance(self.repeating, _EpochSeeds):
            return {"micro_batches": self.read()}
        return {"micro_batches": self.read(), "epoch_rng": self.repeating.rng_state}

    def load_state_dict(self, saved: dict) -> None:
        """Make the saved epoch's iterator again, its base seed drawn as it was, and skip it to the saved position.

        At an epoch's end the uninterrupted run holds a spent iterator: the next read makes a new
        one, drawing its base seed from torch's generator inside that iteration. So a position at
        an epoch's end reads the epoch to its end rather than stay at its start."""
        self.read_before, self.since_step = saved["micro_batches"], self.engine.global_steps
        if self.repeating is None:
            return
        if "epoch_rng" in saved:
            self.repeating.new_epoch(saved["epoch_rng"])
        position, epoch = saved["micro_batches"], len(self.repeating.loader)
        for _ in range(position % epoch or (epoch if position else 0)):
            next(self.repeating)


class _EpochSeeds(RepeatingLoader):
    """DeepSpeed's ``RepeatingLoader`` of the engine's own loader, keeping the state of torch's generator that each
    epoch's iterator drew its base seed from (:attr:`rng_state`).

    Without it a restore inside a later epoch read on from an iterator made at ``initialize``, whose workers drew
    other random numbers (probe 16: a dataset's ``torch.rand`` augmentation; an in-place survivor's, made from its
    generator as it stood, in the first epoch too)."""

    rng_state: torch.Tensor

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.new_epoch()
            return next(self.data_iter)

    def new_epoch(self, rng_state: Optional[torch.Tensor] = None) -> None:
        """Make the next epoch's iterator: from torch's generator as it stands, or from ``rng_state`` (torch's
        generator left as it was)."""
        if rng_state is None:
            self.rng_state = torch.default_generator.get_state()
            self.data_iter = iter(self.loader)
            return
        held = torch.default_generator.get_state()
        self.rng_state = rng_state
        torch.default_generator.set_state(rng_state)
        self.data_iter = iter(self.loader)
        torch.default_generator.set_state(held)
