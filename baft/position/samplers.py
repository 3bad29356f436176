"""A sampler's own state as it draws each epoch's order, kept where the loader's state leaves it out, and the
restored epoch's iterator made as that epoch began."""

from __future__ import annotations

import itertools
import random
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
from torchdata.stateful_dataloader import Stateful

from baft.script.attributes import PLAIN
from baft.script.rng import GENERATORS, generator_state, set_generator_state


EPOCH_START = "_baft_epoch_start"  # a sampler's own state as it made its latest iterator
RESTORING = "_baft_restoring"  # the state it makes the restored iterator from


def record_epoch_starts(sampler) -> None:
    """Make ``sampler`` keep its own state as it makes each epoch's iterator (:data:`EPOCH_START`), where the loader's
    state leaves it out: torch's samplers that draw from their ``generator`` (``RandomSampler``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``; without one, from torch's generator) or are seeded by their
    ``epoch`` (``DistributedSampler``). torchdata rebuilds a restored iterator from the sampler as it stands: a
    survivor's had drawn on, a new process's stands where the first epoch began. Its class becomes a subclass
    that records the state and is otherwise its own; torchdata's samplers keep their draws themselves, not the
    epoch a ``StatefulDistributedSampler`` is set to. Torch's ``BatchSampler`` over such a sampler keeps its
    sampler's state, and draws it as it makes its iterator: torchdata's restore of a batch sampler it has no state
    of (``islice`` of it) would draw at its first batch, after the restore."""
    if sampler is None or not _records(sampler):
        return
    own = type(sampler)
    if own.__dict__.get("_baft_records_epoch_starts"):
        return
    if own not in _RECORDING:
        def __iter__(self):
            restoring = self.__dict__.get(RESTORING)
            if restoring is not None:  # torchdata makes the restored iterator in three tries: each as the epoch began
                _set_sampler_state(self, restoring)
            state = _sampler_state(self)
            setattr(self, EPOCH_START, state)
            indices = own.__iter__(self)
            if state["torch"] is None and _inner(self) is self:
                return indices
            # a generator function draws at its first next(): from torch's generator or a batch sampler's sampler's
            # (as restored, where torchdata makes the restored iterator), that is now, as recorded
            first = next(indices, _END)
            return indices if first is _END else itertools.chain([first], indices)
        _RECORDING[own] = type(own.__name__, (own,), {"__iter__": __iter__, "__module__": own.__module__,
                                                       "__qualname__": own.__qualname__,
                                                       "_baft_records_epoch_starts": True})
    sampler.__class__ = _RECORDING[own]


_RECORDING: dict[type, type] = {}
_END = object()


def records(sampler) -> bool:
    """Whether ``sampler`` records its epochs' starts (:func:`record_epoch_starts` made it)."""
    return bool(type(sampler).__dict__.get("_baft_records_epoch_starts"))


def draws_from_torch(sampler) -> bool:
    """Whether ``sampler`` draws each epoch's order from torch's generator (one of its own it has none)."""
    return sampler is not None and _draws(_inner(sampler)) and _generator(_inner(sampler)) is None


def drawing_sampler(loader):
    """The sampler of ``loader`` whose state :func:`record_epoch_starts` keeps: the loader's ``sampler``, or where
    a script gave a ``batch_sampler=`` instead (the loader's sampler then a sequential one that draws nothing), that
    batch sampler or the sampler it batches (torch's ``BatchSampler(RandomSampler(data, generator=g))``)."""
    batches = getattr(loader, "batch_sampler", None)
    return batches if not _records(loader.sampler) and batches is not None and _records(batches) else loader.sampler


def _inner(sampler):
    """The sampler whose state stands for ``sampler``'s: the one torch's ``BatchSampler`` batches, else itself."""
    torchs = isinstance(sampler, torch.utils.data.BatchSampler) and type(sampler).__module__.startswith("torch.")
    return sampler.sampler if torchs else sampler  # (its class, recording, is a subclass of torch's own module)


def _records(sampler) -> bool:
    """Whether :func:`record_epoch_starts` keeps ``sampler``'s state: it draws, or is seeded by its ``epoch``."""
    inner = _inner(sampler)
    return _draws(inner) or isinstance(getattr(inner, "epoch", None), int)


def _draws(sampler) -> bool:
    """Whether ``sampler`` draws from a generator (its own, or torch's where it has none) in no saved state: one of
    torch's with a ``generator``, or one of the script's own (a bucketing batch sampler), whatever it names it."""
    module = type(sampler).__module__
    return (not isinstance(sampler, Stateful) and not module.startswith("torchdata.")
            and (hasattr(sampler, "generator") or not module.startswith("torch.")))


def _generator(sampler):
    """The generator ``sampler`` draws from: its ``generator``, or the first ``torch.Generator`` one of the
    script's own holds; None where it draws from torch's (has none); False where it draws nothing."""
    if not _draws(sampler):
        return False
    if hasattr(sampler, "generator"):
        return sampler.generator
    return next((value for value in vars(sampler).values() if isinstance(value, torch.Generator)), None)


def _sampler_state(sampler) -> dict:
    sampler = _inner(sampler)
    generator = _generator(sampler)
    state = {"generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
             "torch": torch.get_rng_state() if generator is None else None,
             "epoch": getattr(sampler, "epoch", None)}
    if not type(sampler).__module__.startswith(LIBRARIES):  # one of the script's: what else decides its order
        state["own"] = _own_state(sampler)
    return state


def _own_state(sampler) -> dict:
    """What a sampler of the script's own holds that may decide its order, by attribute: its generators of any kind
    and its plain values (a count of its passes), and where it holds no ``torch.Generator``, python's and numpy's
    global generators (``random.shuffle``) as ``"random"`` and ``"numpy.random"``."""
    own = {name: (generator_state(value) if isinstance(value, GENERATORS) else value)
           for name, value in vars(sampler).items() if isinstance(value, (*GENERATORS, *PLAIN))}
    if _generator(sampler) is None:
        own.update({"random": generator_state(GLOBALS["random"]), "numpy.random": generator_state(GLOBALS["numpy"])})
    return own


GLOBALS = {"random": random._inst, "numpy": np.random.mtrand._rand}  # python's and numpy's global generators
LIBRARIES = ("torch.", "torchdata.", "deepspeed.")  # whose samplers keep (or draw from) nothing else


def _set_sampler_state(sampler, saved: dict) -> None:
    sampler = _inner(sampler)
    if saved["generator"] is not None:
        _generator(sampler).set_state(saved["generator"])
    if saved["torch"] is not None:
        torch.set_rng_state(saved["torch"])
    if saved["epoch"] is not None:
        sampler.epoch = saved["epoch"]
    for name, value in saved.get("own", {}).items():
        held = GLOBALS["random"] if name == "random" else GLOBALS["numpy"] if name == "numpy.random" else \
            getattr(sampler, name, None)
        if isinstance(held, GENERATORS):
            set_generator_state(held, value)
        elif name in vars(sampler):
            setattr(sampler, name, value)


@contextmanager
def as_epoch_started(sampler, saved: Optional[dict]):
    """Within: each iterator ``sampler`` makes is made as it stood when the restored iterator's epoch began (``saved``,
    :data:`EPOCH_START`'s); torch's, python's and numpy's global generators are set back afterwards (a restore sets
    them as the next iteration starts). After, the sampler's record of its epoch's start is ``saved``, as the
    uninterrupted run's was: a restored iterator read nothing of draws its order at its first batch, from the
    generators as restored, as that run did."""
    if saved is None:  # the epoch began before the sampler recorded it (an iterator made before baft found it)
        try:
            yield
        finally:
            if sampler is not None:
                sampler.__dict__.pop(EPOCH_START, None)
        return
    globals_before = {name: generator_state(generator) for name, generator in GLOBALS.items()}
    with torch.random.fork_rng(devices=[]):
        setattr(sampler, RESTORING, saved)
        try:
            yield
        finally:
            delattr(sampler, RESTORING)
            setattr(sampler, EPOCH_START, saved)
            for name, state in globals_before.items():
                set_generator_state(GLOBALS[name], state)
