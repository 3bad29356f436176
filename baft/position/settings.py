"""The plain settings a loop changes in its dataset or ``collate_fn`` (``dataset.scale = 0.5`` once a warm-up ends),
kept with the data position: no loader state holds them."""

from __future__ import annotations

import weakref

from baft.script.attributes import PLAIN
from baft.script.rng import data_objects


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
