"""Where the training data stands: the data position a snapshot saves and a restore puts back.

:func:`data_position` gives the object whose ``state_dict()``/``load_state_dict()`` baft uses: the
``data_iterator`` a script passed to ``baft.initialize``, a torchdata ``StatefulDataLoader`` with
its ``generator`` beside it, DeepSpeed's ``RepeatingLoader`` of a loader with no state of its own
(:mod:`baft.snapshot.repeated_loader`), or the engine's own loader (``training_data=``:
:mod:`baft.snapshot.engine_loader`).
"""

from __future__ import annotations

import copy
import inspect
import io
import itertools
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader
from torch.utils.data._utils import signal_handling
from torchdata.stateful_dataloader import Stateful

from baft.script.attributes import PLAIN
from baft.script.rng import data_objects, generator_state, held_by, set_generator_state
from baft.snapshot.engine_loader import EngineLoaderPosition


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
    (``dataset.scale = 0.5``, an augmentation turned off as a warm-up ends), a count a stream keeps.
    An ``IterableDataset`` without state of its own torchdata restores by reading its stream again up to the
    position, and counts those batches a second time (0.11, with or without workers): the state this iterator then
    gives says twice the position, and a second restore in the same epoch would skip as many batches; those counters
    are given less what the fast-forward added.
    """

    def __init__(self, loader):
        self.loader = loader
        self.sampler = drawing_sampler(loader)
        record_epoch_starts(self.sampler)
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
        return state

    def load_state_dict(self, saved: dict) -> None:
        if "loader" not in saved:  # saved before baft kept the generator: the loader's state alone
            self.loader.load_state_dict(saved)
            return
        live = self.loader._iterator  # the script's, where this process recovers in place: it goes on reading it
        kept = copy.deepcopy(saved)  # torchdata's samplers consume the state they load
        self.loader.load_state_dict(saved["loader"])
        with as_epoch_started(self.sampler, saved.get("sampler")):
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


def _held_generators(loader) -> dict:
    """The generators that the dataset of ``loader`` or its ``collate_fn`` hold (:func:`held_by`), where they draw in
    this process: the loader has no workers (each worker draws from its own copy, in no state)."""
    return {} if getattr(loader, "num_workers", 0) else held_by(loader)


_ATTRIBUTES_AT_START: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> _data_attributes


def _data_attributes(loader) -> dict:
    """The plain values (numbers, strings, None) that the dataset of ``loader`` or its ``collate_fn`` hold as
    attributes (:func:`~baft.script.rng.data_objects`), by where they are (``dataset.scale``), where they are read in
    this process: the loader has no workers (each worker holds a copy made as its epoch began, a persistent one as
    the first did). A setting the loop changed once between steps (probe 23: a dataset's augmentation turned off at a
    step was back on in a run resumed after it, silently)."""
    if getattr(loader, "num_workers", 0):
        return {}
    return {f"{path}.{name}": value for path, obj in data_objects(loader) for name, value in vars(obj).items()
            if isinstance(value, PLAIN)}


def data_attributes_at_start(loader) -> dict:
    """:func:`_data_attributes` of ``loader`` as this process first kept its position (a survivor recovering in place
    makes its position again)."""
    return _ATTRIBUTES_AT_START.setdefault(loader, _data_attributes(loader))


def changed_data_attributes(loader) -> dict:
    """Those of :func:`_data_attributes` that changed since :func:`data_attributes_at_start`."""
    start = data_attributes_at_start(loader)
    return {path: value for path, value in _data_attributes(loader).items()
            if path not in start or start[path] != value or type(start[path]) is not type(value)}


def set_data_attributes(loader, changed: dict) -> None:
    """Set the attributes :func:`_data_attributes` read as they started, less those ``changed`` (a snapshot's)."""
    objects = dict(data_objects(loader))
    for path, value in {**data_attributes_at_start(loader), **changed}.items():
        where, name = path.rsplit(".", 1)
        if where in objects:
            setattr(objects[where], name, value)


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


def epoch_mark(iterator):
    """What changes as ``iterator`` begins another epoch: the iterator of its sampler (with ``persistent_workers`` a
    loader's ``iter()`` resets the one iterator it keeps, with a new one)."""
    return getattr(iterator, "_sampler_iter", None)


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
    return {"generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
            "torch": torch.get_rng_state() if generator is None else None,
            "epoch": getattr(sampler, "epoch", None)}


def _set_sampler_state(sampler, saved: dict) -> None:
    sampler = _inner(sampler)
    if saved["generator"] is not None:
        _generator(sampler).set_state(saved["generator"])
    if saved["torch"] is not None:
        torch.set_rng_state(saved["torch"])
    if saved["epoch"] is not None:
        sampler.epoch = saved["epoch"]


@contextmanager
def as_epoch_started(sampler, saved: Optional[dict]):
    """Within: each iterator ``sampler`` makes is made as it stood when the restored iterator's epoch began (``saved``,
    :data:`EPOCH_START`'s); torch's generator is set back afterwards (a restore sets it as the next iteration
    starts). After, the sampler's record of its epoch's start is ``saved``, as the uninterrupted run's was: a restored
    iterator read nothing of draws its order at its first batch, from the generators as restored, as that run did."""
    if saved is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        setattr(sampler, RESTORING, saved)
        try:
            yield
        finally:
            delattr(sampler, RESTORING)
            setattr(sampler, EPOCH_START, saved)


class _Handed:
    """What an iterator becomes once another took its state: nothing left to shut down when it is collected."""


def take_over(live, restored) -> None:
    """Make the iterator the script holds (``live``) the ``restored`` one: ``live``'s own loader workers shut
    down, ``restored``'s workers and queues its own (``restored``, collected, would shut them down under it)."""
    if hasattr(live, "_shutdown_workers"):
        live._shutdown_workers()
    live.__class__, live.__dict__ = type(restored), restored.__dict__
    restored.__class__, restored.__dict__ = _Handed, {}
    if getattr(live, "_worker_pids_set", False):  # torch's SIGCHLD handler knows the workers by their iterator's id
        signal_handling._remove_worker_pids(id(restored))
        signal_handling._set_worker_pids(id(live), tuple(w.pid for w in live._workers))


def data_position(engine, data_iterator=None, training_data=None):
    """What baft saves and restores the data position with."""
    from baft.snapshot.found_position import PositionFoundLater
    from baft.snapshot.repeated_loader import RepeatedLoaderPosition, plain_repeating

    if plain_repeating(data_iterator):  # a plain DataLoader's: what its iterators were made from, kept by baft
        return RepeatedLoaderPosition(data_iterator, engine)
    if isinstance(data_iterator, RepeatingLoader):  # DeepSpeed's: each epoch an iter() of the loader it wraps
        return data_position(engine, data_iterator.loader, training_data)
    if isinstance(data_iterator, torch.utils.data.DataLoader) and hasattr(data_iterator, "load_state_dict"):
        return ResumableLoader(data_iterator)
    if data_iterator is None and training_data is not None:  # train_batch() reads the engine's loader
        return EngineLoaderPosition(engine)
    if data_iterator is None:  # found as the loop first reads it
        return PositionFoundLater(engine)
    return data_iterator


def not_restored(position) -> Optional[str]:
    """What a restore from ``position`` does not bring back, to say once at initialize; None when nothing."""
    from baft.snapshot.found_position import PositionFoundLater
    from baft.snapshot.repeated_loader import RepeatedLoaderPosition

    if isinstance(position, (RepeatedLoaderPosition, PositionFoundLater)):
        return position.caveat()
    held = _held_loaders(position)
    if held:
        return (f"the data iterator {type(position).__name__} holds torchdata loaders ({', '.join(held)}) whose "
                f"state_dict() leaves out the generator each of their iterators draws from (torchdata 0.11): a resumed "
                f"run reads their epochs after the restored one in another order; keep each one's generator state in "
                f"your state_dict() (loader.generator.get_state(), set again after its iter()), or give "
                f"baft.initialize one loader, which baft keeps whole")
    loader = getattr(position, "loader", position)
    workers = getattr(loader, "num_workers", 0) if isinstance(loader, torch.utils.data.DataLoader) else 0
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and not isinstance(dataset, Stateful):
        # torchdata's restore of such a stream: the batches up to the position read again from its start
        return (f"the {type(dataset).__name__} the loader streams has no state_dict(): a restore reads it again from "
                f"its start up to the saved position, and what it draws from generators of its own (not torch's "
                f"global one) comes out anew; give it state_dict() and load_state_dict() (its position in the "
                f"stream, its generators') to resume it exactly and at once")
    if workers:  # each worker's generators are seeded from the loader's base seed as the workers start
        where = ("anywhere: its persistent workers are seeded once, as they start" if
                 getattr(loader, "persistent_workers", False) else "inside an epoch")
        return (f"random numbers your dataset or collate_fn draws in the loader's {workers} workers are in no saved "
                f"state: a resume {where}, draws others (the samples and their order resume exactly); draw them "
                f"from a generator seeded by the sample index to make them resume too")
    return None


def open_file_stream(position) -> Optional[str]:
    """Where the loader of ``position`` streams an ``IterableDataset`` with no state of its own that reads a file it
    holds open (``self.f = open(path)`` in its ``__init__``): why a survivor's restore would read it wrongly. torchdata
    restores such a stream by reading it again through a new ``iter()`` from its start, and that reads on from where
    the file stands: a new process's at its start, a survivor's past what it read. None otherwise."""
    loader = getattr(position, "loader", position)
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, torch.utils.data.IterableDataset) or isinstance(dataset, Stateful):
        return None
    held = next((name for name, value in vars(dataset).items() if isinstance(value, io.IOBase) and not value.closed),
                None)
    if held is None:
        return None
    return (f"the {type(dataset).__name__} the loader streams reads a file it holds open (dataset.{held}): a "
            f"survivor's restore reads the stream again from where that file stands, past what it read, not from its "
            f"start")


def _held_loaders(position) -> list[str]:
    """Where a data iterator of the script's own (not one baft keeps whole) holds torchdata loaders that shuffle
    with a generator (``self.loaders[0]``): their ``state_dict()`` leaves that generator out."""
    if position is None or isinstance(position, (ResumableLoader, EngineLoaderPosition, torch.utils.data.DataLoader)):
        return []
    found = []
    for name, value in getattr(position, "__dict__", {}).items():
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            items = [(None, value)]
        for key, item in items:
            if (isinstance(item, torch.utils.data.DataLoader) and hasattr(item, "load_state_dict")
                    and isinstance(item.generator, torch.Generator)):
                found.append((name if key is None else f"{name}[{key!r}]", item.generator.get_state()))
    if not found:
        return []
    kept = list(_tensors(position.state_dict()))  # a script's that keeps each generator's state is not said
    return [name for name, state in found if not any(t.shape == state.shape and torch.equal(t, state) for t in kept)]


def _tensors(state) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state."""
    if torch.is_tensor(state):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def foreign_iterator(position, data_iter) -> Optional[str]:
    """Why the iterator ``train_batch`` reads would not resume with the data position baft keeps (``position``,
    :func:`data_position`'s), where that can be told; None otherwise."""
    if isinstance(data_iter, itertools.cycle):
        return ("train_batch reads an itertools.cycle: after its first pass it repeats the batches it cached, which "
                "no snapshot holds, so a resumed run reads others; use deepspeed.utils.RepeatingLoader, which takes a "
                "new iterator of the loader each epoch")
    repeated = getattr(position, "repeating", None)  # a RepeatedLoaderPosition's: the loader found at the first call
    if repeated is not None and isinstance(data_iter, RepeatingLoader) and data_iter is not repeated:
        return ("train_batch reads another RepeatingLoader than the one it read first, whose position baft keeps: "
                "this one's is in no snapshot, and a resumed run reads it from its start; give baft.initialize one "
                "data_iterator whose state_dict() keeps each one's position")
    given = getattr(getattr(position, "loader", position), "dataset", None)
    read = getattr(data_iter, "_dataset", None)  # a DataLoader's iterator
    if given is not None and read is not None and read is not given:
        return (f"train_batch reads an iterator of another loader than the data_iterator given to baft.initialize "
                f"(over another {type(read).__name__}): its position is in no snapshot, and a resumed run reads it "
                f"from its start")
    if (position is not None and read is None and callable(getattr(data_iter, "state_dict", None))
            and callable(getattr(data_iter, "load_state_dict", None)) and not _holds(position, data_iter)):
        return (f"train_batch reads a {type(data_iter).__name__} that is not the data_iterator given to "
                f"baft.initialize, nor held by it: its position is in no snapshot, so a resumed run reads it from where "
                f"the script starts it, not where the uninterrupted run had it (a second task's data?). Give "
                f"baft.initialize one data_iterator whose state_dict() holds the position of every iterator "
                f"train_batch reads")
    return None


def _holds(holder, obj, depth: int = 2) -> bool:
    """Whether ``obj`` is ``holder``, or what its attributes, or their items, hold, ``depth`` levels down (a mixer
    of the script's given to ``baft.initialize`` whose ``state_dict()`` keeps each of its iterators' positions)."""
    if obj is holder:
        return True
    if depth == 0:
        return False
    if isinstance(holder, dict):
        items = list(holder.values())
    elif isinstance(holder, (list, tuple)):
        items = list(holder)
    else:
        items = list(vars(holder).values()) if hasattr(holder, "__dict__") and not isinstance(holder, type) else []
    return any(_holds(item, obj, depth - 1) for item in items)
