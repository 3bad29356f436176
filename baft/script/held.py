"""What a snapshot keeps of a value the script holds outside the model's state, where it changed since the process
first protected its model: a plain value (a number, a string, None), a tensor (changed where it is another object or
its version moved: holding the one it started with costs nothing) and a list, tuple or dict of plain values (changed
where it differs from a copy taken then; up to :data:`~baft.script.carry.MOST_ITEMS`). For
:mod:`baft.script.attributes` (a layer's running mean in a plain tensor attribute, not a buffer) and
:mod:`baft.script.main_globals` (class weights the loss reads from a global of the script's, which its loop updates
in place).

A changed tensor is kept by value, on CPU, up to :data:`MOST_BYTES`; a restore copies it into the tensor the holder
has where shape and dtype match, so that whatever else holds that tensor sees it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from baft.script.carry import MOST_ITEMS

PLAIN = (bool, int, float, str, type(None))
CONTAINERS = (list, tuple, dict)
KINDS = PLAIN + (torch.Tensor,) + CONTAINERS  # what a holder's values are looked at as
# A changed tensor over this (a carried tensor's 65,536 float32 elements) is not kept, and said once: the small state
# is pickled and written into the commit record's JSON on the trainer's thread at every snapshot (measured here: ~1.4
# ms at 256 KiB, ~8 ms at 1 MiB), where a buffer's bytes are copied in the bubbles. A running statistic is far smaller
MOST_BYTES = 1 << 18
NOT_KEPT = object()  # what :func:`kept` gives where a snapshot keeps nothing
_SAID: set = set()  # the values said to be too large to keep, by what names them


@dataclass
class Held:
    """A tensor or container as the process first protected its model: the object, a tensor's version then, and a
    copy of its value (CPU), for a survivor recovering in place to be set back to; ``ours``: a list, tuple or dict
    not of plain values (a list of modules) is neither compared nor kept."""

    value: object
    version: int = 0
    copy: object = None
    ours: bool = True


def hold(value):
    """``value`` as a snapshot compares with it later: a plain value itself, a tensor or container as :class:`Held`."""
    if isinstance(value, torch.Tensor):
        small = _nbytes(value) <= MOST_BYTES
        return Held(value, value._version, value.detach().to("cpu", copy=True) if small else None)
    if isinstance(value, CONTAINERS):  # one too large to compare at every snapshot is not ours
        ours = len(value) <= MOST_ITEMS and plain_container(value)
        return Held(value, copy=copy.copy(value)) if ours else Held(value, ours=False)
    return value


def differs(held, value) -> bool:
    """Whether ``value`` changed since it was ``held`` (:func:`hold`)."""
    if type(held) is not Held:
        return type(held) is not type(value) or held != value
    if not held.ours:
        return False
    if isinstance(value, torch.Tensor):
        return value is not held.value or value._version != held.version
    if value is held.value and type(value) is tuple:  # of plain values: as it was
        return False
    return type(value) is not type(held.copy) or value != held.copy


def plain_container(value) -> bool:
    """A list, tuple or dict of plain values (a dict's keys too)."""
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(isinstance(item, PLAIN) for item in items)


def data(value) -> bool:
    """Whether ``value`` is a plain value, a tensor or a plain container: what a digest of a holder reads."""
    return isinstance(value, PLAIN + (torch.Tensor,)) or isinstance(value, CONTAINERS) and plain_container(value)


def kept(value, rank: int, named: str, way_out: str):
    """What a snapshot keeps of ``value``, which changed: a tensor's value on CPU, a copy of a plain container, a plain
    value itself; :data:`NOT_KEPT` for another container, and for a tensor over :data:`MOST_BYTES` or a container of
    over :data:`~baft.script.carry.MOST_ITEMS`, said once by ``rank`` (``named``: what it is, ``the model's
    1.running``; ``way_out``: how to have it kept)."""
    if isinstance(value, CONTAINERS) and not plain_container(value):
        return NOT_KEPT
    large = _too_large(value)
    if large:
        if named not in _SAID:
            _SAID.add(named)
            print(f"baft: rank {rank}: {named} is {large} that changed since start: no snapshot keeps one so large, so "
                  f"a run resumed after a fault would start it again as the script makes it. {way_out}", flush=True)
        return NOT_KEPT
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.copy(value) if isinstance(value, CONTAINERS) else value


def _too_large(value) -> str:
    """What ``value`` is where a snapshot does not keep one so large, else ""."""
    if isinstance(value, torch.Tensor) and _nbytes(value) > MOST_BYTES:
        return f"a tensor of {_nbytes(value) / 2 ** 20:.1f} MiB (over {MOST_BYTES >> 10} KiB)"
    if isinstance(value, CONTAINERS) and len(value) > MOST_ITEMS:
        return f"a {type(value).__name__} of {len(value)} items (over {MOST_ITEMS:,})"
    return ""


def as_started(held, current, device: Optional[torch.device] = None):
    """What to set where ``current`` is not as ``held`` at start (a survivor's, moved past the restored step), as
    :func:`put` sets it, or :data:`NOT_KEPT` where it is, or cannot be (a tensor over :data:`MOST_BYTES`, a container
    not ours)."""
    if not differs(held, current):
        return NOT_KEPT
    if type(held) is not Held:
        return held
    return NOT_KEPT if held.copy is None else put(held.copy, current, device)


def put(value, current, device: Optional[torch.device] = None):
    """The object a holder is to hold to have ``value`` (a snapshot's): ``current`` filled in place where both are
    tensors of one shape and dtype (what else holds it sees it), else a tensor's copy on ``current``'s device (or
    ``device``), a container's copy, a plain value itself."""
    if not isinstance(value, torch.Tensor):
        return copy.copy(value) if isinstance(value, CONTAINERS) else value
    if isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
        with torch.no_grad():
            current.copy_(value)
        return current
    return value.to(current.device if isinstance(current, torch.Tensor) else device or "cpu", copy=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
