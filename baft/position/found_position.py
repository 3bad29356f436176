"""The data position where ``baft.initialize`` was given none (no ``data_iterator=``, no ``training_data=``): found as
the loop's first ``train_batch`` reads its data. DeepSpeed's ``RepeatingLoader`` of a plain ``DataLoader`` (or of
DeepSpeed's own that the script made, ``engine.deepspeed_io``'s) is kept as
:class:`~baft.position.repeated_loader.RepeatedLoaderPosition`; a plain loader whose iterators the loop takes
itself, as :class:`~baft.position.plain_loader.PlainLoaderPosition`; torchdata's ``StatefulDataLoader`` not given to
``baft.initialize``, as :class:`~baft.position.resumable.ResumableLoader`.
"""

from __future__ import annotations

from typing import Optional

from torch.utils.data.dataloader import _BaseDataLoaderIter

from baft.position.iterators import loader_read
from baft.position.plain_loader import PlainLoaderPosition, notes_its_iterators
from baft.position.repeated_loader import RepeatedLoaderPosition, plain_repeating
from baft.position.resumable import ResumableLoader
from baft.position.wrappers import held_iterators, wrapped


class PositionFoundLater:
    """Stands for the data position until the loop's first ``train_batch`` call shows what it reads
    (:meth:`find`), then becomes that position (this object's class and state: every holder of it, the snapshot
    policy's, the digests', sees the position). A restore before then is kept (:attr:`pending`) and put back then."""

    loader = None  # (a position's loader: none found yet)

    def __init__(self, engine):
        self.engine = engine
        self.pending: Optional[dict] = None
        self.resumed = False  # whether this process was restored before the position was found

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, saved: Optional[dict]) -> None:
        self.pending = saved

    def find(self, data_iter) -> Optional[str]:
        """Become the position of what ``data_iter`` reads, where baft keeps one: a ``RepeatingLoader`` of a plain
        ``DataLoader`` or of DeepSpeed's, an iterator of a plain one the script holds or a generator over one, or
        torchdata's ``StatefulDataLoader`` read either way, or any of these read through a wrapper of the script's
        (:func:`~baft.position.wrappers.wrapped`); a line to say, or None: a restore whose snapshot held no data
        position (the data would go on from its start), a wrapper's own attributes, which no snapshot holds."""
        through = wrapped(data_iter)
        if through is not None:  # a wrapper of the script's (a cast): the position of the iterator it reads
            inner, attributes = through
            what = "DataLoader's iterator" if isinstance(inner, _BaseDataLoaderIter) else type(inner).__name__
            said = self.find(inner)
            own = [name for name in attributes if getattr(data_iter, name) is not self.loader]  # (not: the loader)
            if said or not own or isinstance(self, PositionFoundLater):
                return said
            return (f"train_batch reads a {type(data_iter).__name__}, a wrapper of the script's around the {what} "
                    f"whose position baft keeps, and its own attributes ({', '.join(own)}) are in no snapshot: a "
                    f"resumed run has them as the script makes them, not as at the restored step; keep in the wrapper "
                    f"only the iterator it reads, or do what it does in the dataset or collate_fn")
        if plain_repeating(data_iter):
            return self._become(RepeatedLoaderPosition(data_iter, self.engine))
        loader = loader_read(data_iter)
        if hasattr(loader, "load_state_dict"):
            return self._become(ResumableLoader(loader, self.engine))
        if notes_its_iterators(loader):
            return self._become(PlainLoaderPosition(loader, data_iter, self.engine))
        return None

    def _become(self, position) -> Optional[str]:
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
            self._become(ResumableLoader(before.loader, self.engine))

    def caveat(self, data_iter=None) -> str:
        """Why no data position is kept, where the loop's first call read ``data_iter``."""
        through = wrapped(data_iter)
        if through is not None:
            return self.caveat(through[0])
        hidden = [name for name in held_iterators(data_iter) if _kept(getattr(data_iter, name))]
        if hidden:
            return (f"train_batch reads a {type(data_iter).__name__}, an iterator of the script's that hides from baft "
                    f"the iterator whose position it would keep ({', '.join('self.' + n for n in hidden)}) among "
                    f"others it holds: its position is in no snapshot, and a resumed run reads its data from the "
                    f"start; do what it does in the dataset or collate_fn, so that train_batch reads that iterator, "
                    f"or give baft.initialize a data_iterator= whose state_dict() keeps each one's position")
        loader = loader_read(data_iter)
        if loader is not None and not hasattr(loader, "load_state_dict"):  # a subclass with an __iter__ of its own
            return (f"train_batch reads an iterator of {type(loader).__name__}, whose own __iter__ baft does not "
                    f"follow: its position is in no snapshot, and a resumed run reads its data from the start; read "
                    f"it through deepspeed.utils.RepeatingLoader, or give baft.initialize torchdata's "
                    f"StatefulDataLoader (a drop-in) as data_iterator=")
        if isinstance(data_iter, _BaseDataLoaderIter) and not type(data_iter).__module__.startswith("torchdata."):
            return ("train_batch reads an iterator of torch's DataLoader that the script no longer holds (iter("
                    "DataLoader(...))), which baft cannot make again: its position is in no snapshot, and a resumed "
                    "run reads its data from the start; keep the loader (loader = DataLoader(...); iter(loader)), read "
                    "it through deepspeed.utils.RepeatingLoader, or give baft.initialize torchdata's "
                    "StatefulDataLoader (a drop-in) as data_iterator=")
        if isinstance(data_iter, _COLLECTED):  # probe 28: the loop took them with next(), mixed them, gave iter(list)
            return (f"train_batch reads an iterator over a {type(data_iter).__name__.split('_')[0]} the loop made of "
                    f"the batches it took itself (iter([...])): baft keeps the position of what train_batch reads, and "
                    f"a resumed run reads its data from the start; take and mix them in a generator over the loader "
                    f"(def batches(): for batch in RepeatingLoader(loader): yield mix(batch)) that train_batch reads, "
                    f"or give baft.initialize a data_iterator= whose state_dict() keeps the position")
        return ("the data position will not be restored after a restart (a resumed run would read its data from the "
                "start): read a DataLoader through deepspeed.utils.RepeatingLoader, or pass data_iterator= an iterator "
                "with state_dict() and load_state_dict(), such as torchdata's StatefulDataLoader")


_COLLECTED = (type(iter([])), type(iter(())))  # list_iterator, tuple_iterator


def _kept(data_iter) -> bool:
    """Whether baft keeps the position of ``data_iter`` where ``train_batch`` reads it."""
    loader = loader_read(data_iter)
    return plain_repeating(data_iter) or hasattr(loader, "load_state_dict") or notes_its_iterators(loader)
