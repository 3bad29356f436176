"""Where the files a stream the loader reads in this process (no workers) holds open stand (``self.f = open(path)``
in its ``__init__``, each pass reading on with ``readline()``): noted as each pass begins and set back before a pass
is read again after a fault (:mod:`baft.position.epoch_starts`), as a new process opens them at their start and a
survivor's stand past what it read."""

from __future__ import annotations

import io
import sys
from typing import Iterator, Optional

import torch

from baft.script.rng import data_objects


def held_files(loader) -> Iterator[tuple[str, io.IOBase]]:
    """The open files the objects of ``loader``'s data pipeline hold (:func:`data_objects`), by where they are."""
    for path, obj in data_objects(loader):
        for name, value in vars(obj).items():
            if isinstance(value, io.IOBase) and not value.closed:
                yield f"{path}.{name}", value


def file_positions(loader) -> dict:
    """Where each file ``loader``'s stream holds open stands (its ``tell()``: in text mode an opaque number ``seek()``
    takes), by where it is held; one whose position cannot be told (:func:`unkept_file`) left out."""
    positions = {}
    for path, held in held_files(loader):
        if _keepable(held):
            try:
                positions[path] = held.tell()
            except OSError as e:  # a text file a pass left part-way through a ``for line in f``
                _say_unkept(path, e)
    return positions


def _say_unkept(path: str, error: OSError) -> None:
    """Said once, by rank 0: the file at ``path`` a pass begins from cannot be told where it stands."""
    if path in _SAID:
        return
    _SAID.add(path)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"baft: the stream's {path} cannot tell where it stands as a pass begins ({error}): a pass read again "
              f"after a fault reads it on from where it stands then, not from where the uninterrupted run's began; "
              f"read it with readline()", file=sys.stderr, flush=True)


_SAID: set = set()  # the files said


def seek_files(loader, positions: dict) -> None:
    """Each file ``loader``'s stream holds open set where ``positions`` (:func:`file_positions`) had it."""
    for path, held in held_files(loader):
        if path in positions:
            held.seek(positions[path])


def unkept_file(loader) -> Optional[str]:
    """Where the stream ``loader`` reads holds a file open whose position cannot be kept (a pipe or socket, a file
    read mid-way by ``for line in f``), and why; None where there is none."""
    for path, held in held_files(loader):
        if not _keepable(held):
            return f"{path} ({'not readable' if not held.readable() else 'not seekable'})"
        try:
            held.tell()
        except OSError as e:
            return f"{path} ({e}: read it with readline())"
    return None


def _keepable(held: io.IOBase) -> bool:
    """Whether ``held`` is a file read whose position ``seek()`` can set back."""
    return held.readable() and held.seekable()
