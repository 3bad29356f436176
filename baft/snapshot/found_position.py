"""The data position where ``baft.initialize`` was given none (no ``data_iterator=``, no ``training_data=``): found as
the loop's first ``train_batch`` reads its data.

A plain ``torch.utils.data.DataLoader`` keeps no state. One the script holds as ``baft.initialize`` is called (a
variable of its frames, or an attribute of an object one holds: a trainer's ``self.train_loader``) and has not
iterated yet is made torchdata's ``StatefulDataLoader`` in place (:func:`made_resumable`): the same object, the
same batches (its sampler, generator and workers' seeds are the loader's own), now with a position baft keeps as it
keeps a given one's (:class:`~baft.snapshot.data.ResumableLoader`), whatever the loop's shape (``iter(loader)`` each
epoch, once, a generator of the script's over it). DeepSpeed's ``RepeatingLoader`` of a plain loader, whose first
iterator was made before, is kept as :class:`~baft.snapshot.repeated_loader.RepeatedLoaderPosition`.
"""

from __future__ import annotations

import gc
import inspect
from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torchdata.stateful_dataloader import StatefulDataLoader

from baft.snapshot.data import ResumableLoader, drawing_sampler, record_epoch_starts
from baft.snapshot.repeated_loader import RepeatedLoaderPosition, plain_repeating


class PositionFoundLater:
    """Stands for the data position until the loop's first ``train_batch`` call shows what it reads
    (:meth:`find`), then becomes that position (this object's class and state: every holder of it, the snapshot
    policy's, the digests', sees the position). A restore before then is kept (:attr:`pending`) and put back then."""

    loader = None  # (a position's loader: none found yet)

    def __init__(self, engine, loaders: list):
        self.engine = engine
        self.loaders = loaders  # the script's DataLoaders made resumable at baft.initialize
        self.pending: Optional[dict] = None
        self.resumed = False  # whether this process was restored before the position was found

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, saved: Optional[dict]) -> None:
        self.pending = saved

    def find(self, data_iter) -> Optional[str]:
        """Become the position of what ``data_iter`` reads, where it is one of the loaders kept; a line to say, or
        None: a restore whose snapshot held no data position (the data would go on from its start)."""
        position = self._position_of(data_iter)
        if position is None:
            return None
        pending, resumed = self.pending, self.resumed
        self.__class__, self.__dict__ = type(position), position.__dict__
        if pending is not None:
            self.load_state_dict(pending)
        elif resumed:
            return ("the restored snapshot holds no position of the data the loop reads (taken before baft found "
                    "it): its data goes on from the start")
        return None

    def carry_on(self, before) -> None:
        """In a survivor recovered in place: become a position of the loader the earlier engine's position kept
        (``before``), and put back the restored position now, before the call trains the steps since that one
        again."""
        if isinstance(before, RepeatedLoaderPosition):
            self.find(before.repeating)
        elif isinstance(before, ResumableLoader):
            self.loaders = [before.loader]
            self.find(before.loader._iterator)

    def caveat(self, data_iter=None) -> str:
        """Why no data position is kept, where the loop's first call read ``data_iter``."""
        if isinstance(data_iter, _BaseDataLoaderIter) and not type(data_iter).__module__.startswith("torchdata."):
            return ("train_batch reads an iterator of a DataLoader that baft did not find as baft.initialize was "
                    "called (made after it, or iterated before it): its position is in no snapshot, and a resumed "
                    "run reads its data from the start; make the loader before baft.initialize and its iterators "
                    "after, read it through deepspeed.utils.RepeatingLoader, or pass it as data_iterator= as "
                    "torchdata's StatefulDataLoader")
        return ("the data position will not be restored after a restart (a resumed run would read its data from the "
                "start): read a DataLoader made before baft.initialize, or deepspeed.utils.RepeatingLoader of one, "
                "or pass data_iterator= an iterator with state_dict() and load_state_dict(), such as torchdata's "
                "StatefulDataLoader")

    def _position_of(self, data_iter):
        if plain_repeating(data_iter):
            return RepeatedLoaderPosition(data_iter, self.engine)
        for loader in self.loaders:
            if _reads(data_iter, loader):
                return ResumableLoader(loader)
        return None


def _reads(data_iter, loader) -> bool:
    """Whether ``data_iter`` reads ``loader``: it is the loader's latest iterator, or a ``RepeatingLoader`` of it, or
    a generator whose frame or globals name it, or an object of the script's holding it (litgpt's ``CycleIterator``)."""
    if data_iter is None:
        return False
    if data_iter is loader._iterator or isinstance(data_iter, RepeatingLoader) and data_iter.loader is loader:
        return True
    if inspect.isgenerator(data_iter) and data_iter.gi_frame is not None:
        frame = data_iter.gi_frame
        named = [*frame.f_locals.values(), *(frame.f_globals.get(name) for name in data_iter.gi_code.co_names)]
        return any(value is loader for value in named)
    return hasattr(data_iter, "__dict__") and any(value is loader for value in vars(data_iter).values())


def script_loaders(frame) -> list:
    """The plain ``DataLoader`` objects the script holds at ``frame`` (its call of ``baft.initialize``) and its
    callers up to its module: their variables, and the attributes of the objects they hold."""
    found: dict[int, torch.utils.data.DataLoader] = {}
    while frame is not None:
        for value in list(frame.f_locals.values()):
            held = [value, *(vars(value).values() if _holds_attributes(value) else ())]
            found.update((id(v), v) for v in held if type(v) is torch.utils.data.DataLoader)
        if frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    return list(found.values())


def _holds_attributes(value) -> bool:
    return hasattr(value, "__dict__") and not inspect.ismodule(value) and not isinstance(value, type) \
        and not callable(value)


def made_resumable(loaders: list) -> list:
    """Those of ``loaders`` (plain ``DataLoader`` objects) not iterated yet, made torchdata's
    ``StatefulDataLoader`` in place. One with an iterator made (a ``RepeatingLoader``'s, taken before
    ``baft.initialize``) stays as it is: that iterator would read on outside the position."""
    if not loaders:
        return []
    iterated = {id(obj._index_sampler) for obj in gc.get_objects() if isinstance(obj, _BaseDataLoaderIter)}
    made = []
    for loader in loaders:
        if loader._iterator is not None or id(loader._index_sampler) in iterated:
            continue
        loader.__class__ = StatefulDataLoader  # the attributes its __init__ adds to a DataLoader's, as it sets them
        loader.snapshot_every_n_steps, loader.next_iter_state, loader._initial_iter_for_state_dict = 1, None, False
        record_epoch_starts(drawing_sampler(loader))  # from its first iterator on, as a given loader's from here
        made.append(loader)
    return made
