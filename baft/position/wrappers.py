"""A wrapper of the script's around the iterator ``train_batch`` reads (the usual cast to bf16, ``class Cast: def
__next__(self): return tuple(t.bfloat16() for t in next(self.it))``, ``map(cast, batches)``, a generator ``for batch
in batches: yield cast(batch)``): the iterator it wraps, whose position baft keeps as if ``train_batch`` read it, and
what else the wrapper holds, which no snapshot does."""

from __future__ import annotations

import inspect
import sys
from typing import Optional

from deepspeed.runtime.dataloader import RepeatingLoader

from baft.script.source import library


def wrapped(data_iter) -> Optional[tuple[object, list[str]]]:
    """The iterator ``data_iter`` reads where it is a wrapper of the script's around one: a ``map`` of one iterator, a
    generator over one ``RepeatingLoader``, or an iterator of a class of the script's that holds one iterator in its
    attributes; with the names of its other attributes (its own state). None where it is no such wrapper (a
    library's iterator, one holding none or several)."""
    if type(data_iter) is map:
        iterators = data_iter.__reduce__()[1][1:]  # (function, *iterators)
        return (iterators[0], []) if len(iterators) == 1 else None
    if inspect.isgenerator(data_iter):  # over a RepeatingLoader (one over a DataLoader is found as such: loader_read)
        named = data_iter.gi_frame.f_locals.values() if data_iter.gi_frame is not None else ()
        repeating = [value for value in named if isinstance(value, RepeatingLoader)]
        return (repeating[0], []) if len(repeating) == 1 else None
    module = sys.modules.get(type(data_iter).__module__)
    if (not hasattr(type(data_iter), "__next__") or not hasattr(data_iter, "__dict__")
            or library(getattr(module, "__file__", None) or "<none>")):
        return None
    iterators = [name for name, value in vars(data_iter).items() if hasattr(type(value), "__next__")]
    if len(iterators) != 1:
        return None
    return vars(data_iter)[iterators[0]], [name for name in vars(data_iter) if name != iterators[0]]


def held_iterators(data_iter) -> list[str]:
    """The attributes of an iterator of the script's that hold iterators (``self.a``, ``self.b`` of a mixer), where it
    holds several and so is not read through."""
    module = sys.modules.get(type(data_iter).__module__)
    if not hasattr(data_iter, "__dict__") or library(getattr(module, "__file__", None) or "<none>"):
        return []
    return [name for name, value in vars(data_iter).items() if hasattr(type(value), "__next__")]
