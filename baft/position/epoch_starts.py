"""DeepSpeed's ``RepeatingLoader`` of a loader, noting what each epoch's iterator was made from: the engine's own
loader (:mod:`baft.position.engine_loader`) and a script's plain ``DataLoader`` (:mod:`baft.position.repeated_loader`)
are repeated through it."""

from __future__ import annotations

import copy
import itertools
import sys
from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader

from baft.position.deepspeed_loader import epoch_iterator
from baft.position.samplers import GLOBALS
from baft.position.settings import data_attributes
from baft.position.stream_carried import carried_values, streamed_here
from baft.position.stream_files import file_positions, seek_files
from baft.script.rng import data_objects, generator_state, held_by, same_state, set_generator_state


class EpochStarts(RepeatingLoader):
    """DeepSpeed's ``RepeatingLoader``, noting what each epoch's iterator was made from: the states of torch's
    generator and of the loader's ``generator`` as its ``iter()`` began, and the settings its dataset held then,
    which its workers copy (:attr:`made_from`: the base seed its workers are seeded from is drawn there; None for the
    iterator it held when baft took it over), and how many it has made since (:attr:`epoch`); :attr:`first` is the
    iterator it held then (of torch's loader: :func:`~baft.position.deepspeed_loader.epoch_iterator`)."""

    epoch: int
    made_from: Optional[dict]
    first: object

    @classmethod
    def take_over(cls, repeating: RepeatingLoader) -> "EpochStarts":
        """``repeating``, made one (its class becomes this; its loader and the iterator it holds stay)."""
        from baft.position.first_iterators import made_from as noted

        if not isinstance(repeating, cls):
            repeating.__class__ = cls
            # a DeepSpeedEpochs notes what its latest iterator was made from: the first's too, where
            # engine.deepspeed_io made it one; a torch loader's, where made after baft.initialize
            made_from = getattr(repeating.loader, "made_from", None) or noted(repeating.data_iter)
            repeating.epoch, repeating.made_from, repeating.first = 0, made_from, epoch_iterator(repeating.data_iter)
        return repeating

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.new_epoch()
            return next(self.data_iter)

    def new_epoch(self) -> None:
        """Make the next epoch's iterator, from the generators as they stand."""
        self.epoch += 1
        self.made_from = generator_states(self.loader)
        self.data_iter = iter(self.loader)

    def remake(self, made_from: Optional[dict]) -> None:
        """Make the iterator of an epoch again, from the generators as ``made_from`` says (torch's left as it was)."""
        self.data_iter = made_again(self.loader, made_from)
        self.made_from = made_from


def generator_states(loader) -> dict:
    """The states of torch's generator and of ``loader``'s ``generator`` (None where it has none), and the settings
    its dataset and ``collate_fn`` hold (:func:`~baft.position.settings.data_attributes`: its workers copy them as
    the iterator is made). Of a stream read in this process, python's and numpy's global generators too
    (``"globals"``): its ``__iter__`` may draw its order from them (``random.shuffle``), as a sampler of the
    script's may (:mod:`baft.position.samplers`); and what it draws and carries itself (:func:`stream_began`)."""
    generator = getattr(loader, "generator", None)
    states = {"torch": torch.get_rng_state(),
              "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
              "attributes": data_attributes(loader)}
    if streamed_here(loader):
        states["globals"] = {name: generator_state(held) for name, held in GLOBALS.items()}
        states.update(stream_began(loader))
    return states


def stream_began(loader) -> dict:
    """Of a stream ``loader`` reads in this process, as a pass begins: the states of the generators it holds itself
    (``"held"``, :func:`held_states`: ``self.rng = np.random.RandomState(7)`` drawn in its ``__iter__``), which a
    snapshot holds as they stand mid-pass, and the values it carries from one pass to the next (``"carried"``,
    :func:`carried_values`), and where the files it holds open stand (``"files"``, :func:`file_positions`: a pass
    reading on from where the last stopped). A pass read again after a fault begins from them
    (:func:`begin_stream_as`)."""
    if not streamed_here(loader):
        return {}
    return {"held": held_states(loader), "carried": carried_values(loader), "files": file_positions(loader)}


def begin_stream_as(loader, began: dict) -> None:
    """Set what :func:`stream_began` gave, before a pass is read again: reading it draws the generators on to where
    the snapshot had them, and reads the files on from where they stood."""
    seek_files(loader, began.get("files", {}))
    held = held_by(loader)
    for name, state in began.get("held", {}).items():
        if name in held:
            set_generator_state(held[name], state)
    objects = dict(data_objects(loader))
    for path, value in began.get("carried", {}).items():
        where, name = path.rsplit(".", 1)
        holds = vars(objects[where]).get(name) if where in objects else value
        if holds == value:
            continue
        # into the object it holds (replaced, it would be said replaced: baft.position.settings), else a copy: the
        # pass read again changes it, and a later restore begins from what was kept
        if type(holds) is type(value):
            holds.clear()
            holds.extend(value)
        else:
            setattr(objects[where], name, copy.copy(value))


def held_states(loader) -> dict:
    """The states of the generators a stream ``loader`` reads in this process holds itself (:func:`held_by`), by
    where they are; {} for another loader."""
    return {name: generator_state(held) for name, held in held_by(loader).items()} if streamed_here(loader) else {}


def drawn_as_kept(loader, kept: dict) -> None:
    """After a stream's pass was read again to a restored position: each generator the stream holds itself set where
    the snapshot had it (``kept``, :func:`held_states`). One the reading left elsewhere is drawn by other code too
    while a pass reads (the same object as a global the loop draws from), or its pass began before baft kept the
    loader: the stream's samples since are not the uninterrupted run's, said once."""
    held = held_by(loader)
    for name, state in kept.items():
        if name not in held:
            continue
        if not same_state(generator_state(held[name]), state) and name not in _SAID:
            _SAID.add(name)
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print(f"baft: the stream's {name} ({type(held[name]).__name__}) is drawn from outside the stream's "
                      f"__iter__ too (or its pass began before baft.initialize): the pass read again after a fault "
                      f"draws otherwise than the uninterrupted run's did, and its samples differ; give the stream a "
                      f"generator only its __iter__ draws from", file=sys.stderr, flush=True)
        set_generator_state(held[name], state)


_SAID: set = set()  # the stream's generators said drawn otherwise


def made_again(loader, made_from: Optional[dict], make=iter):
    """An iterator of ``loader`` made again by ``make`` from the generators as :func:`generator_states` gave them
    (``made_from``; None: as they stand), torch's left as it was. Its settings are the caller's to set
    (:func:`~baft.position.settings.as_made`): its sampler draws the epoch's order at its first batch. A stream
    read in this process begins its ``__iter__`` here, from the generators as its epoch began: the uninterrupted
    run's began it at once, the restore reads it later (python's and numpy's set back after; those it holds itself
    left to the restore's reading, which draws them on to where the snapshot had them)."""
    globals_before = {name: generator_state(held) for name, held in GLOBALS.items()}
    with torch.random.fork_rng(devices=[]):
        if made_from is not None:
            torch.set_rng_state(made_from["torch"])
            if made_from["generator"] is not None:
                loader.generator.set_state(made_from["generator"])
            for name, state in made_from.get("globals", {}).items():
                set_generator_state(GLOBALS[name], state)
            begin_stream_as(loader, made_from)
        made = make(loader)
        if made_from is not None and "globals" in made_from:
            _begin_stream(made)
    for name, state in globals_before.items():
        set_generator_state(GLOBALS[name], state)
    return made


def _begin_stream(iterator) -> None:
    """Run the ``__iter__`` of the stream ``iterator`` reads to its first sample (a generator function's body runs
    at its first ``next()``), that sample given first again."""
    fetcher = getattr(iterator, "_dataset_fetcher", None)
    if fetcher is None:
        return
    first = next(fetcher.dataset_iter, _END)
    fetcher.dataset_iter = itertools.chain(() if first is _END else (first,), fetcher.dataset_iter)


_END = object()
