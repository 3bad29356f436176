"""DeepSpeed's ``DeepSpeedDataLoader`` (what ``engine.deepspeed_io(dataset)`` makes) read by the script itself through
``RepeatingLoader``: each ``iter()`` of it makes a torch ``DataLoader`` over its ``data_sampler`` and reads that, so
its position is kept as a plain ``DataLoader``'s (:mod:`baft.position.repeated_loader`).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from deepspeed.runtime.dataloader import DeepSpeedDataLoader

from baft.position.settings import data_attributes


class DeepSpeedEpochs(DeepSpeedDataLoader):
    """A ``DeepSpeedDataLoader`` that answers to the names of torch's ``DataLoader`` for what its epochs are made
    from (``sampler``, ``num_workers``, ``generator``...), and holds each epoch's iterator of the torch loader it
    made as its ``data`` (DeepSpeed's is a generator over it, which hides how far it has read). :attr:`made_from`: the
    state of torch's generator its latest ``iter()`` began from (its iterator's base seed is drawn from it, and the
    order of a sampler without a generator), None where that ``iter()`` came before it was made one."""

    batch_sampler = None
    generator = None  # the loaders it makes have none: each iterator draws its base seed from torch's
    persistent_workers = False
    made_from: Optional[dict] = None  # (as EpochStarts.made_from)

    @classmethod
    def take_over(cls, loader: DeepSpeedDataLoader) -> "DeepSpeedEpochs":
        """``loader``, made one (its class becomes this; the epoch's iterator it holds reads on)."""
        if not isinstance(loader, cls):
            loader.__class__ = cls
            loader.data = _read_by(loader.data)
        return loader

    @property
    def sampler(self):
        return self.data_sampler

    @property
    def num_workers(self) -> int:
        return self.num_local_io_workers

    def __iter__(self):
        self.made_from = {"torch": torch.get_rng_state(), "generator": None, "attributes": data_attributes(self)}
        return super().__iter__()

    def _create_dataloader(self):
        made = super()._create_dataloader()
        self.data = _read_by(self.data)
        return made


def keeps_no_state(loader) -> bool:
    """Whether ``loader`` is a ``DeepSpeedDataLoader`` whose epochs baft can make again: not curriculum learning's
    (its batch sampler, DeepSpeed's data sampler, keeps a state of its own)."""
    return isinstance(loader, DeepSpeedDataLoader) and not loader.curriculum_learning_enabled


def epoch_iterator(data_iter):
    """The iterator of torch's ``DataLoader`` that ``data_iter`` (an epoch's iterator of a loader) reads: itself, or
    where it is a :class:`DeepSpeedEpochs` (its own iterator), the one it holds."""
    return data_iter.data if isinstance(data_iter, DeepSpeedEpochs) else data_iter


def _read_by(data):
    """The iterator DeepSpeed's generator ``data`` (``x for x in dataloader``) reads; ``data`` where it is none (not
    made yet) or has ended."""
    if inspect.isgenerator(data) and data.gi_frame is not None:
        return data.gi_frame.f_locals[".0"]
    return data
