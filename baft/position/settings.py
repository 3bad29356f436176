"""The plain settings a loop changes in its dataset or ``collate_fn`` (``dataset.scale = 0.5`` once a warm-up ends,
``dataset.noise`` set before each call) and the tensors it replaces in the loader's sampler (``sampler.weights``),
kept with the data position: no loader state holds them. And the other objects of the data pipeline the loop may
replace (``loader.collate_fn = partial(...)``), which no restore can make again: said once, where a snapshot sees one
replaced."""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Optional

import torch

from baft.position.caches import filled_caches, filled_in_place, note_caches, set_caches
from baft.position.dataset_source import sets_itself
from baft.position.stream_carried import carries
from baft.script.attributes import setting
from baft.script.rng import GENERATORS, data_objects


_AT_START: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> _read(loader), as first kept
_SAID: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> the paths said replaced


def data_attributes(loader) -> dict:
    """The plain values (numbers, strings, None) and small dicts of them (``dataset.opts = {"half": False}``) that
    the dataset of ``loader``, its ``collate_fn`` and the objects they hold (:func:`~baft.script.rng.data_objects`)
    hold as attributes, by where they are (``dataset.scale``, ``dataset.opts``): a setting the loop changed once
    between steps (probe 23: a dataset's augmentation turned off at a step was back on in a run resumed after it,
    silently), or sets before each call. Read in this process where the loader has no workers; each worker reads
    the copy made as its epoch's iterator was made (a persistent one's, as the first was). And the tensors the
    loader's sampler holds that the loop replaced since :func:`data_attributes_at_start` (``sampler.weights = ...``,
    hard-example mining), as they are: not copied, nor compared by their contents (as long as the dataset, they are
    in every snapshot only once replaced; a dataset's may be its samples, and are not kept)."""
    start = data_attributes_at_start(loader)
    return {path: value for path, value in _read(loader)[0].items()
            if not isinstance(value, torch.Tensor) or (path in start and value is not start[path])}


def _read(loader) -> tuple[dict, dict]:
    """The settings and tensors of :func:`data_attributes` (every tensor of the sampler's), and what else the data
    pipeline holds (a transform object, a dataset's tensor, the loader's ``collate_fn``), by path: its identity and
    type (not its contents: a table of samples may be large). Its generators are kept otherwise
    (:func:`~baft.script.rng.held_by`). One walk of the objects, each snapshot."""
    values, held = {}, {}
    for path, obj in _holders(loader).items():
        for name, value in vars(obj).items():
            # a sampler's plain values are its own state's (baft.position.samplers)
            if isinstance(value, torch.Tensor) if path == "sampler" else setting(value):
                values[f"{path}.{name}"] = dict(value) if isinstance(value, dict) else value
            elif not setting(value) and not isinstance(value, GENERATORS) and not name.startswith("_baft"):
                held[f"{path}.{name}"] = (id(value), type(value))
    for name in ("collate_fn", "worker_init_fn"):  # the loader's others torch does not let a script set once made
        value = vars(loader).get(name)
        if value is not None:
            held[name] = (id(value), type(value))
    return values, held


def _holders(loader) -> dict:
    """The objects whose attributes :func:`_read` reads, by path: :func:`~baft.script.rng.data_objects`, and the
    loader's sampler."""
    sampler = getattr(loader, "sampler", None)
    return {**dict(data_objects(loader)), **({"sampler": sampler} if hasattr(sampler, "__dict__") else {})}


def data_attributes_at_start(loader) -> dict:
    """:func:`data_attributes` of ``loader`` as this process first kept its position, every tensor (a survivor
    recovering in place makes its position again)."""
    if loader not in _AT_START:
        _AT_START[loader] = _read(loader)
        note_caches(loader)
    return _AT_START[loader][0]


def changed_data_attributes(loader) -> dict:
    """Those of :func:`data_attributes` that changed since :func:`data_attributes_at_start`, and the caches the data
    pipeline filled since (:func:`~baft.position.caches.filled_caches`). Another object of the data pipeline the
    loop replaced since (``loader.collate_fn = partial(...)``, ``dataset.transform = Scale(0.5)``) is said once, on
    stderr: no snapshot holds it, so a run restored after the change reads with the script's first (probe 25,
    silently)."""
    start = data_attributes_at_start(loader)
    values, held = _read(loader)
    _say_replaced(loader, held)
    return {**{path: value for path, value in values.items() if path in start and not _same(start[path], value)
               or path not in start and not isinstance(value, torch.Tensor)}, **filled_caches(loader)}


def _same(kept, value) -> bool:
    if isinstance(kept, torch.Tensor) or isinstance(value, torch.Tensor):
        return kept is value
    return kept == value and type(kept) is type(value)


def _say_replaced(loader, held: dict) -> None:
    plain, start = _AT_START[loader]
    said = _SAID.setdefault(loader, set())
    for path, (identity, kind) in held.items():
        # one made since that held no value then (a cache a dataset makes as it first reads) was not replaced
        if (path in said or start.get(path, (identity, kind) if path not in plain else None) == (identity, kind)
                or filled_in_place(loader, path)):  # a dict the dataset fills (a cache), not another one
            continue
        said.add(path)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            continue
        where, _, name = path.rpartition(".")
        holder = _holders(loader).get(where)
        itself = holder is not None and sets_itself(type(holder), name)
        if itself and carries(loader, path):  # a stream's remainder, which each pass read again begins from
            continue
        if itself:  # the dataset's own code, not the loop's: no step of the loop can set it again
            print(f"baft: {itself} sets the data loader's {path} (now a {kind.__name__}) itself: no snapshot holds "
                  f"that object, so a run restored past this step reads with the one the script first made, and "
                  f"its batches may differ from the uninterrupted run's; make it again from what each read gets "
                  f"(the sample index, the pass), not kept from one read to the next", file=sys.stderr, flush=True)
            continue
        print(f"baft: the loop replaced the data loader's {path} (now a {kind.__name__}): no snapshot holds "
              f"that object, so a run restored past this step reads with the one the script first made; set it "
              f"before each call from the engine's step (if engine.global_steps >= N: ...), which a resumed loop "
              f"does again", file=sys.stderr, flush=True)


def set_data_attributes(loader, changed: dict) -> None:
    """Set the attributes :func:`data_attributes` read as they started, less those ``changed`` (a snapshot's), and the
    caches as it holds them."""
    _set(loader, {**data_attributes_at_start(loader), **changed})
    set_caches(loader, changed)


def _set(loader, values: dict) -> None:
    """Set the attributes ``values`` holds by path (a dict's items into the dict the object holds)."""
    objects = _holders(loader)
    for path, value in values.items():
        where, name = path.rsplit(".", 1)
        if where not in objects:
            continue
        held = vars(objects[where]).get(name)
        if isinstance(value, dict) and isinstance(held, dict):
            held.clear()
            held.update(value)
        else:
            setattr(objects[where], name, dict(value) if isinstance(value, dict) else value)


@contextmanager
def as_made(loader, values: Optional[dict]):
    """Within: the attributes of :func:`data_attributes` as ``values`` (those an epoch's iterator was made with,
    which its workers copied and its sampler drew from; a tensor not among them, as it started); after, as they were
    before."""
    if values is not None:
        values = {**{path: value for path, value in data_attributes_at_start(loader).items()
                     if isinstance(value, torch.Tensor)}, **values}
    objects = _holders(loader) if values else {}
    before = {}
    for path in values or ():
        where, name = path.rsplit(".", 1)
        held = vars(objects[where]) if where in objects else {}
        if name in held:
            before[path] = dict(held[name]) if isinstance(held[name], dict) else held[name]
    _set(loader, {path: values[path] for path in before})
    try:
        yield
    finally:
        _set(loader, before)
