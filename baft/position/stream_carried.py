"""What a stream the loader reads in this process (no workers) carries from one pass to the next in lists of its
own (``self.rest = list(buf)`` as a pass ends: a packing stream's remainder), which a pass read again after a fault
begins from (:mod:`baft.position.epoch_starts`), so a stream setting one is not said as a setting no snapshot holds
(:mod:`baft.position.settings`)."""

from __future__ import annotations

import collections
import copy

import torch

from baft.script.held import PLAIN
from baft.script.rng import data_objects


def streamed_here(loader) -> bool:
    """Whether ``loader`` reads an ``IterableDataset`` in this process (no workers)."""
    return (isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
            and not getattr(loader, "num_workers", 0))


def carried_values(loader) -> dict:
    """Copies of the lists of plain values (numbers, strings; at most :data:`CARRIED_ITEMS`) that the objects of
    ``loader``'s data pipeline hold (:func:`data_objects`), by where they are: a remainder a packing stream carries
    from one pass to the next (``self.rest = list(buf)`` as a pass ends), which a pass read again begins from."""
    return {f"{path}.{name}": copy.copy(value) for path, obj in data_objects(loader)
            for name, value in vars(obj).items()
            if isinstance(value, (list, collections.deque)) and len(value) <= CARRIED_ITEMS
            and all(isinstance(item, PLAIN) for item in value)}


CARRIED_ITEMS = 4096  # longer lists (a stream's list of files) are what it reads, not a remainder it carries


def carries(loader, path: str) -> bool:
    """Whether the value at ``path`` (``dataset.rest``) is one the passes of the stream ``loader`` reads begin from."""
    return streamed_here(loader) and path in carried_values(loader)
