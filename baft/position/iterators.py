"""A loader's iterator as the loop holds it: the loader it reads, what marks its epoch, and a restored iterator's
state moved into the one the loop holds."""

from __future__ import annotations

import gc
import inspect
from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader
from torch.utils.data._utils import signal_handling


def loader_read(data_iter) -> Optional[torch.utils.data.DataLoader]:
    """The ``DataLoader`` (torch's, torchdata's) ``data_iter`` reads: the loader an iterator of it was made from,
    wherever the script holds it (a variable of the loop's, an attribute, a closure), that a ``RepeatingLoader``
    repeats, or that a generator of the script's names, not yet started (``for batch in loader: yield batch``) or
    reading it (``yield from loader``); None where the script dropped it (``iter(DataLoader(...))``)."""
    if isinstance(data_iter, RepeatingLoader):
        return loader_read(data_iter.data_iter)
    if inspect.isgenerator(data_iter) and data_iter.gi_frame is not None:
        if data_iter.gi_yieldfrom is not None:
            return loader_read(data_iter.gi_yieldfrom)
        code, frame = data_iter.gi_code, data_iter.gi_frame
        named = [*frame.f_locals.values(), *(frame.f_globals.get(n) for n in code.co_names)]
        return next((v for v in named if isinstance(v, torch.utils.data.DataLoader)), None)
    sampler = getattr(data_iter, "_index_sampler", None)
    if sampler is None:
        return None
    # an iterator does not hold its loader; the loader holds the sampler the iterator reads
    for holder in gc.get_referrers(sampler):
        if isinstance(holder, dict):  # the loader's instance dict, where it has one of its own
            holder = next((o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder), None)
        if isinstance(holder, torch.utils.data.DataLoader) and holder._index_sampler is sampler:
            return holder
    return None


def batches_read(iterator) -> int:
    """The batches of its epoch a loader's iterator has given."""
    return iterator._num_yielded


def read_to(iterator, read: int, loader) -> None:
    """Read ``iterator`` on to the ``read``-th batch of its epoch: through its sampler where the loader reads a
    map-style dataset in this process (none fetched), else by reading the batches."""
    batches = read - batches_read(iterator)
    if not loader.num_workers and not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        for _ in range(batches):
            next(iterator._sampler_iter)
        iterator._num_yielded += batches
        return
    for _ in range(batches):
        next(iterator)


def epoch_mark(iterator):
    """What changes as ``iterator`` begins another epoch: the iterator of its sampler (with ``persistent_workers`` a
    loader's ``iter()`` resets the one iterator it keeps, with a new one)."""
    return getattr(iterator, "_sampler_iter", None)


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
