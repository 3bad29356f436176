"""The data position of a plain ``torch.utils.data.DataLoader`` whose iterators the loop takes itself: ``it =
iter(loader)`` each epoch or once, or a generator of the script's over it (``while True: for batch in loader: yield
batch``), not given to ``baft.initialize``. Found as the loop's first ``train_batch`` reads it
(:class:`~baft.position.found_position.PositionFoundLater`).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from baft.position.epoch_position import EpochPosition
from baft.position.epoch_starts import generator_states, made_again
from baft.position.first_iterators import made_from
from baft.position.iterators import batches_read, take_over
from baft.position.repeated_loader import workers_caveat
from baft.script.loop import THIS_PROCESS


class PlainLoaderPosition(EpochPosition):
    """Where a plain ``DataLoader`` the loop takes iterators of stands: which of them reads (:attr:`epoch`: 0 the one
    the loop read first), the batches it has given, the generators' states it was made from, the state its sampler
    drew its order from, the loader's ``generator`` and the settings the loop changed in its dataset.

    From the loop's first call, the loader's ``iter()`` notes what each iterator is made from (its class becomes a
    subclass that does so). A restore makes the saved epoch's iterator again and skips to the position (as
    :class:`~baft.position.repeated_loader.RepeatedLoaderPosition` does), and hands it to the loop where the loop
    takes it: the iterator the loop reads now, where the saved one is the first (or the loop is on the engine's step
    and takes no other until its next epoch); in a loop that counts its calls, which replays its ``iter()`` of the
    epochs before, the ``iter()`` of the saved epoch; a generator over the loader, not yet started, its first.
    A survivor in place cannot go back to an iterator its loop no longer holds: every rank is replaced."""

    def __init__(self, loader: torch.utils.data.DataLoader, read, engine=None):
        self.loader, self.engine = loader, engine
        # the iterator that reads now, held weakly: one the loop drops shuts its workers down as torch's does (held,
        # it lives on to the next collection of the loader's cycle, and its workers' forks inherit it)
        self._latest = weakref.ref(read) if _is_iterator_of(read, loader) else None
        # epoch 0: the iterator the loop made before baft found the loader, noted where made after baft.initialize
        self.epoch, self.made_from = 0, made_from(read) if self._latest is not None else None
        # (the iter() that gets it, the restored iterator, the position restored) until the loop takes it
        self.handing: Optional[tuple[int, object, dict]] = None
        self.keep(loader)
        _NOTES[type(loader)] = _NOTES.get(type(loader)) or type(type(loader).__name__, (type(loader),), {
            "__iter__": lambda self: self._baft_position.iterator(), "__module__": type(loader).__module__,
            "__qualname__": type(loader).__qualname__})
        loader.__dict__["_baft_position"] = self
        loader.__class__ = _NOTES[type(loader)]
        if engine is not None:
            THIS_PROCESS.no_survivors(engine, "the loop takes its own iterators of a plain DataLoader, which a "
                                              "survivor cannot take back to the restored step's",
                                      "Give baft.initialize torchdata's StatefulDataLoader as data_iterator= for its "
                                      "survivors to recover in place")

    def iterator(self):
        """The loader's ``iter()``: the restored iterator where this is the ``iter()`` a restore hands it to, else a
        new one, noting what it was made from."""
        self.epoch += 1
        if self.handing is not None and self.handing[0] == self.epoch:
            restored, self.handing = self.handing[1], None
            self._latest = weakref.ref(restored)
            return restored
        if self.handing is not None:  # an epoch's before the restored one, whose calls a replay reads nothing of
            return iter(())  # (made, it would draw its order and base seed from the generators the restored reads)
        self.made_from = generator_states(self.loader)
        made = torch.utils.data.DataLoader.__iter__(self.loader)
        self._latest = weakref.ref(made)
        return made

    def caveat(self) -> Optional[str]:
        """What a restore of the loader does not bring back, or None."""
        return workers_caveat(self.loader)

    @property
    def latest(self):
        """The iterator that reads now, while the loop holds it."""
        return self._latest() if self._latest is not None else None

    def state_dict(self) -> dict:
        if self.handing is not None:  # restored, not yet handed to the loop: the position is the one restored
            return self.handing[2]
        return self.position(self.epoch, self.latest, self.made_from)

    def load_state_dict(self, saved: dict) -> None:
        loader, live = self.loader, self.latest
        # the first epoch's iterator, made before baft.initialize returned, as this process made it
        own = (saved["epoch"] == 0 == self.epoch and saved["made_from"] is None and live is not None
               and batches_read(live) <= saved["read"])
        restored = self.restore_epoch(saved, live if own else None,
                                      lambda made_from: made_again(loader, made_from, torch.utils.data.DataLoader.__iter__))
        self.made_from = saved["made_from"]
        self.set_back(saved)
        if own:
            self.epoch = 0
        elif live is not None and (saved["epoch"] == self.epoch or not THIS_PROCESS.counts_calls):
            # the loop reads on from the iterator it holds: of the saved epoch, or on the engine's step
            take_over(live, restored)
            self.epoch = saved["epoch"]
        elif live is None:  # a generator's first iter(), at its first read
            self.epoch, self.handing = saved["epoch"] - 1, (saved["epoch"], restored, saved)
        else:  # a counting loop's iter() of the saved epoch, replaying those before
            self.handing = (saved["epoch"], restored, saved)


_NOTES: dict[type, type] = {}


def _is_iterator_of(read, loader) -> bool:
    return getattr(read, "_index_sampler", None) is loader._index_sampler


def notes_its_iterators(loader) -> bool:
    """Whether ``loader`` is a plain ``DataLoader`` whose iterators :class:`PlainLoaderPosition` can note: torch's own
    class, or a subclass of the script's that keeps torch's ``__iter__`` (one with its own ``__iter__`` makes its
    iterators otherwise); not one with a state of its own (torchdata's)."""
    return (isinstance(loader, torch.utils.data.DataLoader) and not hasattr(loader, "load_state_dict")
            and type(loader).__iter__ is torch.utils.data.DataLoader.__iter__)
