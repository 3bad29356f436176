"""The data position of a plain ``torch.utils.data.DataLoader`` that the loop reads through DeepSpeed's
``RepeatingLoader`` (DeepSpeedExamples' ``train_batch(data_iter=iter(RepeatingLoader(loader)))``), given to
``baft.initialize`` or not: such a loader keeps no state of its own, so baft keeps what decides its batches.
"""

from __future__ import annotations

from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader

from baft.errors import BaftError
from baft.script.rng import hold_loader_generators
from baft.snapshot.data import EPOCH_START, as_epoch_started, drawing_sampler, record_epoch_starts
from baft.snapshot.epoch_starts import EpochStarts


class RepeatedLoaderPosition:
    """Where a plain ``DataLoader`` that the loop repeats through ``RepeatingLoader`` stands: which of the epochs'
    iterators reads it, the batches that one has given, what it was made from (:class:`EpochStarts`), the state its
    sampler drew the epoch's order from (:func:`~baft.snapshot.data.record_epoch_starts`), and the loader's
    ``generator``.

    Made by ``baft.initialize`` before the loop runs, it finds the loader at the first ``train_batch`` that reads
    such a repeating loader (:meth:`bind`); a restore before then is put back then. A restore makes the epoch's
    iterator again from what it was made from, its sampler's order drawn as it was, and skips the batches read:
    through the sampler where the loader reads in this process (nothing fetched: a skipped sample's random draws
    come again from the generators as a resumed step sets them), by reading them with workers (each worker's
    generators then stand as the uninterrupted run's; a restore's time grows with the batches read into the epoch, as
    for the engine's own loader). The first epoch's iterator was made before baft could note
    what from; a new process holds it as the uninterrupted run made it (the script's code up to its loop runs the
    same), a survivor in place does not: with workers, where it cannot be made again, every rank is replaced.
    """

    def __init__(self, engine=None):
        self.engine = engine
        self.repeating: Optional[EpochStarts] = None
        self.sampler = None
        self.pending: Optional[dict] = None  # a position restored before the loader was found
        self.resumed = False  # whether this process was restored before the loader was found

    @property
    def loader(self):
        """The plain ``DataLoader`` this position keeps, or None before one is found."""
        return self.repeating.loader if self.repeating is not None else None

    def bind(self, data_iter) -> Optional[str]:
        """Take over ``data_iter`` where it is a ``RepeatingLoader`` of a plain ``DataLoader`` and none was taken
        yet, and put back a position restored before; what the run should hear of it, or None: a restore whose
        snapshot held no position (the data would go on from its start)."""
        if self.repeating is not None or not plain_repeating(data_iter):
            return None
        self._take(EpochStarts.take_over(data_iter))
        if self.pending is not None:
            self.load_state_dict(self.pending)
            return None
        if self.resumed:
            return ("the restored snapshot holds no position of the DataLoader the loop repeats (taken before baft "
                    "kept one): its data goes on from the start of its first epoch")
        return None

    def caveat(self) -> Optional[str]:
        """What a restore of the loader kept does not bring back, or None."""
        loader = self.loader
        if loader is None:
            return ("the data position will not be restored after a restart (a resumed run would read its data "
                    "from the start): read it through deepspeed.utils.RepeatingLoader of a DataLoader (found as "
                    "train_batch first reads it), or pass data_iterator= an iterator with state_dict() and "
                    "load_state_dict(), such as torchdata's StatefulDataLoader, and train on iter() of it")
        if loader.num_workers and loader.persistent_workers:
            return (f"random numbers your dataset or collate_fn draws in the loader's {loader.num_workers} "
                    f"persistent workers are in no saved state: they are seeded once, as they start, so a resume "
                    f"draws others (the samples and their order resume exactly); draw them from a generator seeded "
                    f"by the sample index to make them resume too")
        return None

    def carry_on(self, before: "RepeatedLoaderPosition") -> None:
        """In a survivor recovered in place: keep the loader the earlier engine's position kept, and put back the
        restored position in it now, before the call trains the steps since that one again."""
        if before.repeating is not None and self.repeating is None:
            self._take(before.repeating)
            if self.pending is not None:
                self.load_state_dict(self.pending)

    def _take(self, repeating: EpochStarts) -> None:
        self.repeating = repeating
        loader = repeating.loader
        self.sampler = drawing_sampler(loader)
        record_epoch_starts(self.sampler)
        hold_loader_generators(loader)
        if loader.num_workers and self.engine is not None:
            from baft.script.loop import THIS_PROCESS

            THIS_PROCESS.no_survivors(self.engine, "the loop repeats a DataLoader with workers through "
                                                   "RepeatingLoader, whose first epoch's iterator a survivor cannot "
                                                   "make again as it was made",
                                      "Give baft.initialize torchdata's StatefulDataLoader as data_iterator= for its "
                                      "survivors to recover in place")

    def state_dict(self) -> Optional[dict]:
        if self.repeating is None:
            return None
        generator = self.repeating.loader.generator
        return {"epoch": self.repeating.epoch, "read": _read(self.repeating.data_iter),
                "made_from": self.repeating.made_from, "sampler": getattr(self.sampler, EPOCH_START, None),
                "generator": generator.get_state() if isinstance(generator, torch.Generator) else None}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        if self.repeating is None:
            self.pending = saved
            return
        self.pending = None
        if saved is None:
            return
        repeating, loader = self.repeating, self.repeating.loader
        here = repeating.data_iter
        # the first epoch's iterator, as made in this process, not read past the position: read on from it
        own = saved["epoch"] == repeating.epoch == 0 and here is repeating.first and _read(here) <= saved["read"]
        if not own and saved["made_from"] is None and loader.num_workers:
            raise BaftError("the restored position is in the first epoch of a DataLoader with workers that "
                            "RepeatingLoader repeats, whose iterator this process cannot make again as it was "
                            "made: give baft.initialize torchdata's StatefulDataLoader as data_iterator=")
        with as_epoch_started(self.sampler, saved["sampler"]):
            if not own:
                repeating.remake(saved["made_from"])
            _skip(repeating.data_iter, saved["read"] - _read(repeating.data_iter), loader)
        repeating.epoch, repeating.made_from = saved["epoch"], saved["made_from"]
        if saved["generator"] is not None:
            loader.generator.set_state(saved["generator"])


def plain_repeating(data_iter) -> bool:
    """Whether ``data_iter`` is DeepSpeed's ``RepeatingLoader`` of a ``DataLoader`` with no state of its own."""
    loader = getattr(data_iter, "loader", None)
    return (isinstance(data_iter, RepeatingLoader) and isinstance(loader, torch.utils.data.DataLoader)
            and not hasattr(loader, "load_state_dict"))


def _read(iterator) -> int:
    """The batches of its epoch a loader's iterator has given."""
    return iterator._num_yielded


def _skip(iterator, batches: int, loader) -> None:
    """Read past ``batches`` batches of ``iterator``: through its sampler where the loader reads a map-style dataset
    in this process (none fetched), else by reading them."""
    if not loader.num_workers and not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        for _ in range(batches):
            next(iterator._sampler_iter)
        iterator._num_yielded += batches
        return
    for _ in range(batches):
        next(iterator)
