"""The caches the data pipeline fills as it first reads each sample: a dict the dataset holds (``self.cache[i] = ...``
in ``__getitem__``) or a global dict of its module that one of its methods fills. An item made with a random draw
at its first read and served cached after (a crop or mask chosen at tokenization) came back different in a run
restored from a snapshot: its process started with the cache empty, drew the items again and moved the global
generator the restore had set (probe 27, H4: silently, relaunched and in place). One that grew since the process
first kept the data position is kept with the position, where it holds up to
:data:`~baft.script.carry.MOST_ITEMS` items and :data:`~baft.script.held.MOST_BYTES` (its items are not copied: the
snapshot pickles them), and set back by a restore; a larger one that the dataset fills from a global generator is
said once. A cache each worker of the loader fills stays in that worker: not seen here."""

from __future__ import annotations

import itertools
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from baft.position.dataset_source import draws_globally
from baft.script.attributes import setting
from baft.script.carry import MOST_ITEMS
from baft.script.held import MOST_BYTES
from baft.script.rng import data_objects


@dataclass
class _Cache:
    """One dict the data pipeline may fill: where it is held by name (an object's ``__dict__``, a module's globals)
    and by which class's code, its items as first kept (a copy, where small), and its size as last measured."""

    holder: dict
    name: str
    named: str  # as a message names it
    owner: type
    first: Optional[dict]  # the dict as first kept; None where it was made since
    started: Optional[dict]
    length: int
    measured: int = 0  # its first items that ``size`` counts
    size: int = 0
    said: bool = False

    def value(self) -> Optional[dict]:
        value = self.holder.get(self.name)
        return value if isinstance(value, dict) else None

    def small(self, value: dict) -> bool:
        """Whether ``value`` (this cache now) is small enough to keep: counted from the items measured before where
        it only grew since (a cache adds items), else again."""
        if len(value) > MOST_ITEMS:
            return False
        if len(value) == self.measured:
            return self.size <= MOST_BYTES
        if len(value) < self.measured:
            self.measured, self.size = 0, 0
        for item in itertools.islice(value.values(), self.measured, None):
            self.size += _nbytes(item)
            if self.size > MOST_BYTES:
                break
        self.measured = len(value)
        return self.size <= MOST_BYTES


_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> {path: _Cache}


def note_caches(loader) -> None:
    """Note the dicts ``loader``'s data pipeline holds, and the global dicts its classes' methods read, as this
    process first keeps its position (a survivor recovering in place keeps its first)."""
    if loader in _FOUND:
        return
    found = {}
    for path, obj in data_objects(loader):
        for name, value in vars(obj).items():
            if isinstance(value, dict):
                found[f"{path}.{name}"] = _noted(vars(obj), name, f"the data loader's {path}.{name}", type(obj))
        for function in _methods(type(obj)):
            for name in _names(function.__code__):
                if isinstance(function.__globals__.get(name), dict):
                    found.setdefault(f"{function.__module__}.{name}", _noted(
                        function.__globals__, name, f"the global {name} of {function.__module__}", type(obj)))
    _FOUND[loader] = found


def _noted(holder: dict, name: str, named: str, owner: type) -> _Cache:
    value = holder[name]
    return _Cache(holder, name, named, owner, value, dict(value) if len(value) <= MOST_ITEMS else None, len(value))


def filled_in_place(loader, path: str) -> bool:
    """Whether the data pipeline's ``path`` holds the dict it held as first kept (its items set since, not
    replaced)."""
    cache = _FOUND.get(loader, {}).get(path)
    return cache is not None and cache.first is not None and cache.value() is cache.first


def filled_caches(loader) -> dict:
    """The caches of ``loader``'s data pipeline that grew since :func:`note_caches`, by path (``dataset.cache``,
    ``__main__.CACHE``), each a copy of the dict (its items not copied), where small; a dict a dataset made since (an
    attribute it sets as it first reads) among them. One too large that its class fills from a global generator is
    said once by rank 0. A cache of plain values only is a setting the position keeps already."""
    found = _FOUND.get(loader)
    if found is None:
        return {}
    for path, obj in data_objects(loader):
        for name, value in vars(obj).items():
            if isinstance(value, dict) and f"{path}.{name}" not in found:
                found[f"{path}.{name}"] = _Cache(vars(obj), name, f"the data loader's {path}.{name}", type(obj),
                                                 None, {}, 0)
    kept = {}
    for path, cache in found.items():
        value = cache.value()
        if value is None or len(value) == cache.length or setting(value):
            continue
        if cache.small(value):
            kept[path] = dict(value)
        elif not cache.said:
            cache.said = True
            _say_too_large(cache, value)
    return kept


def set_caches(loader, kept: dict) -> None:
    """Fill the caches :func:`filled_caches` found with the items ``kept`` (a snapshot's) holds, the others as they
    started: the same dicts, which the dataset's code holds."""
    for path, cache in _FOUND.get(loader, {}).items():
        value, items = cache.value(), kept.get(path, cache.started)
        if value is not None and items is not None and value is not items:
            value.clear()
            value.update(items)


def _say_too_large(cache: _Cache, value: dict) -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    draw = draws_globally(cache.owner)
    if draw is None:
        return
    held = (f"{len(value):,} items (over {MOST_ITEMS:,})" if len(value) > MOST_ITEMS
            else f"over {MOST_BYTES >> 10} KiB in {len(value):,} items")
    print(f"baft: {cache.named} that {cache.owner.__qualname__} fills holds {held}, more than a snapshot keeps, and "
          f"its items are made with a draw from a global generator ({draw}): a run resumed after a fault starts with "
          f"it empty and draws them again, other values; draw from a generator seeded by the item's index "
          f"(torch.Generator().manual_seed(i)), or fill the cache before baft.initialize", file=sys.stderr, flush=True)


def _methods(cls: type) -> list[types.FunctionType]:
    return [value for owner in cls.__mro__ if not owner.__module__.startswith(("torch", "deepspeed", "builtins"))
            for value in vars(owner).values() if isinstance(value, types.FunctionType)]


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and the code it defines) reads or sets."""
    names, codes = set(), [code]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return names


def _nbytes(item, depth: int = 0) -> int:
    """About the bytes a cached item holds: its tensors' and arrays' data, 8 a plain value."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, (str, bytes)):
        return len(item)
    if isinstance(item, (list, tuple, dict)) and depth < 4:
        return sum(_nbytes(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return 8
