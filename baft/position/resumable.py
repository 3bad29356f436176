"""A resumable loader's position (torchdata's ``StatefulDataLoader``, given as ``data_iterator=``): its own state,
and what baft keeps beside it so that every later epoch reads as the uninterrupted run's."""

from __future__ import annotations

import copy
import inspect
from typing import Optional

import torch

from baft.position.epoch_starts import begin_stream_as, stream_began
from baft.position.iterators import take_over
from baft.position.samplers import (EPOCH_START, as_epoch_started, draws_from_torch, drawing_sampler,
                                    record_epoch_starts, records)
from baft.position.settings import (as_made, changed_data_attributes, data_attributes, data_attributes_at_start,
                                    set_data_attributes)
from baft.script.loop import THIS_PROCESS
from baft.script.rng import generator_state, held_by, set_generator_state


class ResumableLoader:
    """A resumable loader (torchdata's ``StatefulDataLoader``), the state of its ``generator`` where it has one,
    and the iterator the script holds.

    Every iterator of a loader draws its base seed from the loader's ``generator``; given
    ``shuffle=True, generator=g``, the sampler draws each epoch's permutation from ``g`` too. The
    loader's own state holds ``g`` as it stood before the epoch's permutation, and a restore
    replays the permutation but not the base seed drawn after it: the restored epoch reads right
    and every later epoch in another order (torchdata 0.11; ``tests/test_data_position.py``).
    Saving ``g`` as it stands at the capture, and setting it once the restored iterator is built, puts both draws back.
    A sampler of torch's own keeps its state outside the loader's: it is saved as each epoch's iterator is made
    (:func:`record_epoch_starts`; a ``batch_sampler``'s, or its sampler's: :func:`drawing_sampler`). torchdata's
    own restore builds a new iterator for the next ``iter()``; one the script already holds (taken before
    ``baft.initialize``, a survivor's in place, the epoch's own in a loop that counts its calls) is made that one.
    With ``persistent_workers`` an ``iter()`` of the loader gives the same iterator each epoch, reset (its sampler
    draws the epoch's order): one that resets the restored iterator (the loop's next epoch, or a second ``iter()``
    before the restored one read) is taken as a new iterator would be (:attr:`reset_after`).
    A generator the dataset or the ``collate_fn`` holds (``np.random.default_rng(seed)``, ``random.Random(seed)``, a
    ``torch.Generator``: a random crop, BERT-style masking) draws in this process where the loader has no workers;
    no loader state holds it, so its state is kept beside the loader's (:func:`_held_generators`). So are the plain
    values they hold as attributes that changed since (:func:`changed_data_attributes`): a setting the loop changes once
    (``dataset.scale = 0.5``, an augmentation turned off as a warm-up ends), a count a stream keeps. The restored
    iterator's workers copy the dataset with the settings it held as the loader made that iterator
    (:func:`_note_settings`).
    An ``IterableDataset`` without state of its own torchdata restores by reading its stream again up to the
    position, and counts those batches a second time (0.11, with or without workers): the state this iterator then
    gives says twice the position, and a second restore in the same epoch would skip as many batches; those counters
    are given less what the fast-forward added.
    """

    def __init__(self, loader, engine=None):
        self.loader = loader
        self.sampler = drawing_sampler(loader)
        record_epoch_starts(self.sampler)
        _note_settings(loader)
        if engine is not None and self._first_epoch_unrecorded():
            THIS_PROCESS.no_survivors(engine, "the script took an iterator of its StatefulDataLoader before baft kept "
                                              "the loader, whose first epoch's order a survivor cannot draw again",
                                      "Take iter(loader) after baft.initialize")
        self.unread: Optional[tuple] = None  # (what was restored, the iterator it built) until that iterator reads
        self.restored = None  # the iterator the latest restore built
        # what it had read when an iter() of the loader reset it (persistent workers: the next epoch's), or None
        self.reset_after: Optional[int] = None
        self.yielded: Optional[int] = 0  # and the batches of its epoch it had read (None: its state does not say)
        # the restored iterator's counters torchdata's fast-forward added to (path -> by how much), and its batches
        self.recounted: dict = {}
        self.recount = 0
        self.new_reader = False  # whether train_batch's latest call read another iterator than the call before
        self.next_epoch = False  # whether the restored position is an epoch's end the uninterrupted run left
        data_attributes_at_start(loader)

    def state_dict(self) -> dict:
        if self.unread is not None:
            # a restored iterator that has read nothing states itself wrongly (torchdata 0.11's distributed
            # sampler says it has yielded nothing): the position is the one restored
            saved, restored = self.unread
            if self._is_restored(self.loader._iterator) and self._yielded_by(restored) == _yielded(saved["loader"]):
                return saved
            self.unread = None
        generator = self.loader.generator
        state = {"loader": self._loader_state(),
                 "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
                 "sampler": getattr(self.sampler, EPOCH_START, None), "new_reader": self.new_reader}
        held = _held_generators(self.loader)
        if held:
            state["held"] = {name: generator_state(g) for name, g in held.items()}
        changed = changed_data_attributes(self.loader)
        if changed:
            state["attributes"] = changed
        made_with = vars(self.loader).get(MADE_WITH)
        if made_with:
            state["epoch_attributes"] = made_with
        began = vars(self.loader).get(STREAM_BEGAN)
        if began:
            state["stream_began"] = began
        return state

    def load_state_dict(self, saved: dict) -> None:
        if "loader" not in saved:  # saved before baft kept the generator: the loader's state alone
            self.loader.load_state_dict(saved)
            return
        live = self.loader._iterator  # the script's, where this process recovers in place: it goes on reading it
        kept = copy.deepcopy(saved)  # torchdata's samplers consume the state they load
        if saved.get("sampler") is None and self._first_epoch_unrecorded() and live._num_yielded == 0:
            # in the first epoch, whose order the sampler drew unrecorded from this process's own iterator, made by
            # the same code as the uninterrupted run's: it holds that order (rebuilt, the sampler would draw another
            # from where that draw left its generator), read on to the position
            for _ in range(_yielded(saved["loader"]) or 0):
                next(live)
        else:
            self.loader.load_state_dict(saved["loader"])
            with as_epoch_started(self.sampler, saved.get("sampler")), as_made(self.loader,
                                                                                saved.get("epoch_attributes")):
                begin_stream_as(self.loader, saved.get("stream_began", {}))  # torchdata reads its pass again
                self.loader.state_dict()  # builds the restored iterator now: the script's next iter() returns this one
            restored = self.loader._iterator
            if live is not None and restored is not None and live is not restored:
                take_over(live, restored)
                self.loader._iterator = live
                self.loader._initial_iter_for_state_dict = False  # the script's next iter() is for its next epoch
        self.recounted, self.recount = {}, 0
        if isinstance(self.loader.dataset, torch.utils.data.IterableDataset):
            built = self.loader.state_dict()
            self.recounted = _added(kept["loader"], built)
            self.recount = (_yielded(built) or 0) - (_yielded(kept["loader"]) or 0)
        if saved["generator"] is not None and isinstance(self.loader.generator, torch.Generator):
            self.loader.generator.set_state(saved["generator"])
        held = _held_generators(self.loader)
        for name, state in saved.get("held", {}).items():  # after the restored iterator is built (a stream read again)
            if name in held:
                set_generator_state(held[name], state)
        set_data_attributes(self.loader, saved.get("attributes", {}))  # so too
        self.yielded = _yielded(kept["loader"])
        self.next_epoch = bool(saved.get("new_reader")) and self.spent()
        if self.yielded is not None:
            self.unread = (kept, self.loader._iterator)
        self.restored = self.loader._iterator
        self.reset_after = None
        _watch_resets(self)

    def reads(self, data_iter) -> None:
        """``train_batch`` reads ``data_iter``: where it is an iterator of this loader made since the restore while the
        restored one has read nothing (a script that takes ``iter()`` again before its loop, as the run it resumes
        did), that one is made the restored one; an iterator taken once the restored position is an epoch's end is
        the next epoch's. So is the first ``iter()`` taken once ``train_batch`` is called (a generator of the
        script's over the loader made each epoch, ``for batch in loader: yield batch``, takes it as ``train_batch``
        first reads it) where the restored position is an epoch's end that the uninterrupted run left for another
        reader (:attr:`next_epoch`) and no ``iter()`` took the restored iterator before: that run took it past the
        snapshot, of the spent epoch's iterator, and made a new one. A reader it kept (``while True: for batch in
        loader``) read the spent one to its end first, as the restored one is read: where the script took an
        ``iter()`` before (and read nothing of it), a generator not yet started that ``train_batch`` reads takes the
        restored iterator again at its own."""
        if self._is_restored(self.loader._iterator):
            if self.next_epoch and getattr(self.loader, "_initial_iter_for_state_dict", False):
                self.loader._initial_iter_for_state_dict = False
            elif (not self.next_epoch and inspect.isgenerator(data_iter)
                  and inspect.getgeneratorstate(data_iter) == inspect.GEN_CREATED
                  and self._yielded_by(self.restored) == self.yielded):
                self.loader._initial_iter_for_state_dict = True
        if self.unread is None or data_iter is None or data_iter is not self.loader._iterator:
            return
        saved, restored = self.unread
        if data_iter is restored and self.reset_after is None:
            return
        # what the restored iterator had read before the script's iter() made another, or reset it
        read = self.reset_after if data_iter is restored else self._yielded_by(restored)
        if read != _yielded(saved["loader"]) or self.spent():
            return
        self.load_state_dict(saved)

    def _loader_state(self) -> dict:
        """The loader's state, less what torchdata's fast-forward of the restored iterator added to its counters."""
        state = self.loader.state_dict()
        return _less(state, self.recounted) if self.recounted and self._is_restored(self.loader._iterator) else state

    def _first_epoch_unrecorded(self) -> bool:
        """Whether the script took an iterator of the loader before baft kept its position: its sampler drew that
        epoch's order unrecorded (with workers as the iterator was made, else at its first batch, as it was made)."""
        return (self.loader._iterator is not None and records(self.sampler)
                and getattr(self.sampler, EPOCH_START, None) is None)

    def draws_first_epoch_from_torch(self) -> bool:
        """Whether that unrecorded draw was from torch's generator: a new process restored in that epoch draws it from
        the generator as it then stands."""
        return self._first_epoch_unrecorded() and draws_from_torch(self.sampler)

    def _yielded_by(self, iterator) -> int:
        """The batches of its epoch ``iterator`` has given, those of a restore's fast-forward not counted twice."""
        return iterator._num_yielded - (self.recount if self._is_restored(iterator) else 0)

    def _is_restored(self, iterator) -> bool:
        """Whether ``iterator`` is the one the latest restore built, as built: not reset by an ``iter()`` since."""
        return iterator is not None and iterator is self.restored and self.reset_after is None

    def taken_since_restore(self) -> bool:
        """Whether the script's latest ``iter()`` of the loader built an iterator other than the restored one."""
        return self.restored is not None and not self._is_restored(self.loader._iterator)

    def spent(self) -> bool:
        """Whether the position restored last is an epoch's end: every batch read, the next ``iter()`` not yet
        taken (a snapshot taken as a step ended; baft's own are taken as the next begins, past that ``iter()``)."""
        return (self.yielded or 0) >= len(self.loader)


MADE_WITH = "_baft_made_with"  # the settings of a loader's dataset as its latest iterator was made
STREAM_BEGAN = "_baft_stream_began"  # and what a stream it reads in this process drew from and carried then
_NOTING: dict[type, type] = {}


def _note_settings(loader) -> None:
    """Make ``loader`` note the settings of its dataset and ``collate_fn`` (:func:`data_attributes`) as it makes each
    iterator (:data:`MADE_WITH`), which that iterator's workers copy: a restore builds the restored one with them
    (probe 25: built with the resumed loop's, its workers read a curriculum's later value, silently). Its class
    becomes a subclass that notes them and is otherwise its own."""
    own = type(loader)
    if own.__dict__.get("_baft_notes_settings"):
        return
    if own not in _NOTING:
        def _get_iterator(self):
            self.__dict__[MADE_WITH] = data_attributes(self)
            self.__dict__[STREAM_BEGAN] = stream_began(self)
            return own._get_iterator(self)
        _NOTING[own] = type(own.__name__, (own,), {"_get_iterator": _get_iterator, "__module__": own.__module__,
                                                   "__qualname__": own.__qualname__, "_baft_notes_settings": True})
    loader.__class__ = _NOTING[own]


def _held_generators(loader) -> dict:
    """The generators that the dataset of ``loader`` or its ``collate_fn`` hold (:func:`held_by`), where they draw in
    this process: the loader has no workers (each worker draws from its own copy, in no state)."""
    return {} if getattr(loader, "num_workers", 0) else held_by(loader)


def _watch_resets(position: ResumableLoader) -> None:
    """Note in ``position.reset_after`` what its restored iterator had read when an ``iter()`` of the loader first
    reset it: with ``persistent_workers``, torch's loader keeps one iterator and resets it for each epoch (drawing the
    epoch's order) rather than make a new one."""
    iterator = position.restored
    if iterator is None or not getattr(position.loader, "persistent_workers", False):
        return

    def _reset(loader, *args, **kwargs):
        reset = loader._iterator  # torch's loader resets its own iterator: the restored one, this wrapper its own
        if position.reset_after is None and reset is position.restored:
            position.reset_after = position._yielded_by(reset)
        return type(reset)._reset(reset, loader, *args, **kwargs)

    iterator._reset = _reset


def _yielded(state: dict) -> Optional[int]:
    """The batches of its epoch a loader's state says its iterator has given (torchdata 0.11: at the top with no
    workers, in the main process's snapshot and the steps since with workers); None where it does not say."""
    if "_num_yielded" in state:
        return state["_num_yielded"]
    if "_snapshot" in state:
        return state["_snapshot"]["_snapshot_step"] + state.get("_steps_since_snapshot", 0)
    return None


def _added(before: dict, after: dict, path: tuple = ()) -> dict:
    """The integer counters of a loader's state that grew from ``before`` to ``after`` (path -> by how much)."""
    added = {}
    for key, value in after.items():
        old = before.get(key) if isinstance(before, dict) else None
        if isinstance(value, dict):
            added.update(_added(old if isinstance(old, dict) else {}, value, (*path, key)))
        elif isinstance(value, int) and not isinstance(value, bool) and isinstance(old, int) and value > old:
            added[(*path, key)] = value - old
    return added


def _less(state: dict, added: dict) -> dict:
    """``state`` with each counter of ``added`` less what was added to it."""
    state = copy.copy(state)
    for path, by in added.items():
        inner = state
        for key in path[:-1]:
            inner[key] = copy.copy(inner.get(key))
            inner = inner[key]
        if isinstance(inner, dict) and isinstance(inner.get(path[-1]), int):
            inner[path[-1]] -= by
    return state
