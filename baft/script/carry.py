"""The values of the script's own a loop on the engine's step carries from one iteration to the next (the previous
loss a hand-made schedule compares with, a patience count, a loss meter: :class:`Carried`, read from the loop's
source by :mod:`baft.script.carried_source`), kept with every snapshot (:meth:`baft.script.loop.Loop.carried_values`)
and set again in a resumed process at its loop's first call, where the snapshot was taken: the code after each call
reads them as the uninterrupted run did. (A loop that counts its calls needs none of this: its replay computes them
again.)

Kept where they are plain data (numbers, strings, None, small tensors, and lists, tuples, dicts, sets and deques of
them, up to :data:`MOST_ITEMS`); a list, dict, set or deque is refilled in place, so that what else holds it sees it.
An object of the script's own a loop carries (a writer it makes at its first step, an iterator) is not: a resumed
process makes it again as it first did.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import numbers
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from baft.script.source import library, value_in

MOST_ITEMS = 10_000  # a container longer than this (a list of every step's loss) is not copied at every snapshot
MOST_TENSOR_ELEMENTS = 1 << 16
CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)


@dataclass(frozen=True)
class Carried:
    """A value of the script's own a loop carries from one iteration to the next: the variable ``name`` of the
    loop's ``frame`` (or of its module; or a path of attributes from one, ``self.losses``), or its attribute
    ``attr``; ``where``: ``file:line (text)`` of the statement that carries it. The frame is held as long as this is
    (a snapshot at exit reads it after the loop has returned)."""

    where: str
    name: str
    attr: Optional[str] = None
    frame: object = field(default=None, compare=False, repr=False)
    # the loop reads it before its call to train_batch in an iteration (``best = min(best, engine.train_batch())``,
    # a check at the loop's top): set at that call, a resumed process's first iteration would have read it already
    read_before_call: bool = False
    module_global: bool = False  # ``name`` is a global of the frame's module (``global best`` in a function)
    # an object of the script's own, kept whole (:func:`baft.script.carried_attributes.changed_within`)
    whole: bool = False
    module: Optional[str] = None  # ``name`` is a global of this module of the script's (not the frame's)
    cell: bool = False  # ``attr`` is a variable of the closure of the function ``name`` holds (``nonlocal best``)
    # ``name`` holds an ``nn.Module`` the loop updates from the model's weights (torch's ``AveragedModel``), kept by its
    # ``state_dict()`` and set by its ``load_state_dict()``
    stateful: bool = False
    # ``file:line (text)`` of a start that is no literal and not the script's own resume (``np.float32(np.inf)``):
    # not kept, but named (probe 28 K6)
    start: str = ""

    @property
    def key(self) -> str:
        own = self.name if self.attr is None else f"{self.name}.{self.attr}"
        return own if self.module is None else f"{self.module}:{own}"


def read(carried: Carried):
    """The value now; :data:`UNREADABLE` where its owner or variable is gone."""
    if carried.stateful:
        module = _owner(carried)
        return module.state_dict() if isinstance(module, torch.nn.Module) else UNREADABLE
    if carried.attr is None:
        return _names(carried).get(carried.name, UNREADABLE)
    if carried.cell:
        cell = _cell(carried)
        return UNREADABLE if cell is None else cell.cell_contents
    return getattr(_owner(carried), carried.attr, UNREADABLE)


def write(carried: Carried, value) -> None:
    """Set it to ``value``: a container of the same type refilled in place, else the variable or attribute bound."""
    if carried.stateful:
        _owner(carried).load_state_dict(value)
        return
    current = read(carried)
    if type(current) is type(value) and _refill(current, value):
        return
    if carried.cell:
        cell = _cell(carried)
        if cell is not None:
            cell.cell_contents = value
        return
    if carried.attr is not None:
        setattr(_owner(carried), carried.attr, value)
        return
    frame = carried.frame
    names = _names(carried)
    names[carried.name] = value
    if carried.module is None and names is not frame.f_globals and sys.version_info < (3, 13):  # a function's frame: its fast locals
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def _names(carried: Carried) -> dict:
    """The variables ``carried`` is one of: another module's, its frame's module's, or the frame's own."""
    if carried.module is not None:
        return vars(sys.modules[carried.module])
    return carried.frame.f_globals if carried.module_global else carried.frame.f_locals


def is_data(value, depth: int = 0) -> bool:
    """Whether ``value`` is data a computation reads (numbers, strings, None, tensors, and containers of them: their
    first items looked at), not an object of the script's own (a writer, an iterator, a timer), which a resumed
    process makes again as it first did."""
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes, torch.Tensor)):
        return True
    if depth >= 3 or not isinstance(value, CONTAINERS):
        return False
    items = itertools.islice(itertools.chain.from_iterable(value.items()) if isinstance(value, dict) else value, 100)
    return all(is_data(item, depth + 1) for item in items)


def object_data(value) -> bool:
    """Whether ``value`` is an object of a class of the script's own (not a library's) without ``state_dict()``, whose
    attributes are data, objects of the script's own among them (a meter in a dict of meters): one kept whole."""
    module = sys.modules.get(type(value).__module__)
    if not hasattr(value, "__dict__") or callable(getattr(value, "state_dict", None)) or isinstance(value, type):
        return False
    file = getattr(module, "__file__", None)
    return file is not None and not library(file) and all(
        is_data(item) or object_data(item) or isinstance(item, CONTAINERS) and all(
            object_data(v) or is_data(v) for v in itertools.islice(item.values() if isinstance(item, dict) else item,
                                                                  100))
        for item in vars(value).values())


def why_not_kept(carried: Carried, value) -> Optional[str]:
    """Why ``carried``, data now ``value`` (:func:`is_data`), is not kept with every snapshot, or None where it is."""
    if carried.start:
        return (f"it starts at {carried.start}, which baft cannot tell from a resume of the script's own: start it "
                f"at a literal, float(\"inf\") or math.inf")
    if carried.read_before_call:
        return "the loop reads it before it calls train_batch, where a resumed process would set it"
    if not fits(value):
        return f"over {MOST_ITEMS} items, or a tensor of over {MOST_TENSOR_ELEMENTS} elements or with a gradient"
    return None


def fits(value) -> bool:
    """Whether ``value`` (data: :func:`is_data`) is small enough to copy at every snapshot (:data:`MOST_ITEMS`,
    :data:`MOST_TENSOR_ELEMENTS`)."""
    return _plain(value)


def _plain(value, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() <= MOST_TENSOR_ELEMENTS and not value.requires_grad
    if not isinstance(value, CONTAINERS) and hasattr(value, "__dict__"):  # an object kept whole (object_data)
        value = vars(value)
    if depth >= 4 or not isinstance(value, CONTAINERS) or len(value) > MOST_ITEMS:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_plain(item, depth + 1) for item in items)


def _refill(current, value) -> bool:
    if isinstance(current, (list, collections.deque)):
        current.clear()
        current.extend(value)
    elif isinstance(current, (dict, set)):
        current.clear()
        current.update(value)
    elif hasattr(current, "__dict__") and not isinstance(current, torch.Tensor):  # kept whole: what holds it sees it
        vars(current).clear()
        vars(current).update(vars(value))
    else:
        return False
    return True


def _owner(carried: Carried):
    return value_in(carried.frame, carried.name)


def _cell(carried: Carried):
    """The cell of the closure variable ``carried`` is (``attr`` of the function its owner is), or None where it is
    gone or was never set."""
    function = getattr(_owner(carried), "__func__", _owner(carried))
    code = getattr(function, "__code__", None)
    if code is None or carried.attr not in code.co_freevars:
        return None
    cell = function.__closure__[code.co_freevars.index(carried.attr)]
    try:
        cell.cell_contents
    except ValueError:
        return None
    return cell


class _Unreadable:
    def __repr__(self) -> str:
        return "UNREADABLE"


UNREADABLE = _Unreadable()
