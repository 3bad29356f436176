"""Which data position baft keeps of what the script reads (:func:`data_position`), and what it says where a position
cannot bring the data back as it was."""

from __future__ import annotations

import ast
import inspect
import os
import itertools
from typing import Iterator, Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader
from torchdata.stateful_dataloader import Stateful

from baft.config import STORE_ENV
from baft.position.engine_loader import EngineLoaderPosition
from baft.position.resumable import ResumableLoader
from baft.script.loop import THIS_PROCESS
from baft.script.source import defined_at
from baft.snapshot.build import warn


def data_position(engine, data_iterator=None, training_data=None):
    """What baft saves and restores the data position with."""
    from baft.position.found_position import PositionFoundLater
    from baft.position.repeated_loader import RepeatedLoaderPosition, plain_repeating

    if plain_repeating(data_iterator):  # a plain DataLoader's: what its iterators were made from, kept by baft
        return RepeatedLoaderPosition(data_iterator, engine)
    if isinstance(data_iterator, RepeatingLoader):  # DeepSpeed's: each epoch an iter() of the loader it wraps
        return data_position(engine, data_iterator.loader, training_data)
    if isinstance(data_iterator, torch.utils.data.DataLoader) and hasattr(data_iterator, "load_state_dict"):
        return ResumableLoader(data_iterator, engine)
    if data_iterator is None and training_data is not None:  # train_batch() reads the engine's loader
        return EngineLoaderPosition(engine)
    if data_iterator is None:  # found as the loop first reads it
        return PositionFoundLater(engine)
    return data_iterator


def not_restored(position) -> Optional[str]:
    """What a restore from ``position`` does not bring back, to say once at initialize; None when nothing."""
    from baft.position.found_position import PositionFoundLater
    from baft.position.plain_loader import PlainLoaderPosition
    from baft.position.repeated_loader import RepeatedLoaderPosition

    if isinstance(position, (RepeatedLoaderPosition, PlainLoaderPosition, PositionFoundLater)):
        return position.caveat()
    held = _held_loaders(position)
    if held:
        return (f"the data iterator {type(position).__name__} holds torchdata loaders ({', '.join(held)}) whose "
                f"state_dict() leaves out the generator each of their iterators draws from (torchdata 0.11): a resumed "
                f"run reads their epochs after the restored one in another order; keep each one's generator state in "
                f"your state_dict() (loader.generator.get_state(), set again after its iter()), or give "
                f"baft.initialize one loader, which baft keeps whole")
    if isinstance(position, ResumableLoader) and position.draws_first_epoch_from_torch():
        return ("the loader's sampler draws each epoch's order from torch's generator, and the script took the first "
                "epoch's iterator before baft kept the loader's position: a run resumed in that epoch reads the rest "
                "of it in another order; give the sampler a generator of its own (generator=torch.Generator()."
                "manual_seed(seed)), or give baft.initialize the loader as data_iterator= before taking an iterator")
    loader = getattr(position, "loader", position)
    workers = getattr(loader, "num_workers", 0) if isinstance(loader, torch.utils.data.DataLoader) else 0
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and not isinstance(dataset, Stateful):
        # torchdata's restore of such a stream: the batches up to the position read again from its start
        return (f"the {type(dataset).__name__} the loader streams has no state_dict(): a restore reads it again from "
                f"its start up to the saved position, and what it draws from generators of its own (not torch's "
                f"global one) comes out anew; give it state_dict() and load_state_dict() (its position in the "
                f"stream, its generators') to resume it exactly and at once")
    if workers:  # each worker's generators are seeded from the loader's base seed as the workers start
        from baft.position.repeated_loader import persistent_state

        kept = persistent_state(loader)
        if kept is not None:
            return kept
        where = ("anywhere: its persistent workers are seeded once, as they start" if
                 getattr(loader, "persistent_workers", False) else "inside an epoch")
        return (f"random numbers your dataset or collate_fn draws in the loader's {workers} workers are in no saved "
                f"state: a resume {where}, draws others (the samples and their order resume exactly); draw them "
                f"from a generator seeded by the sample index to make them resume too")
    return None


def open_file_stream(position) -> Optional[str]:
    """Where the loader of ``position`` streams an ``IterableDataset`` with no state of its own that holds a file open
    (``self.f = open(path)`` in its ``__init__``) whose position cannot be kept (a pipe, a socket, a text file read by
    ``for line in f``; :func:`~baft.position.stream_files.unkept_file`): why a restore would read it wrongly. A
    seekable file's position is kept as each pass begins (:mod:`baft.position.stream_files`). None otherwise."""
    from baft.position.stream_files import unkept_file

    loader = getattr(position, "loader", position)
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, torch.utils.data.IterableDataset) or isinstance(dataset, Stateful):
        return None
    held = unkept_file(loader)
    if held is None:
        return None
    return (f"the {type(dataset).__name__} the loader streams reads a file it holds open whose position cannot be "
            f"kept, {held}: a restore reads the stream again from where that file stands, not from where the pass "
            f"began")


def say_open_file_stream(engine, position) -> None:
    """Where the stream ``position`` reads holds a file open whose position cannot be kept (:func:`open_file_stream`):
    with recovery in place every rank is replaced on a fault, said once; else said once, by rank 0."""
    stream = open_file_stream(position)
    if stream is None:
        return
    if STORE_ENV in os.environ:  # recovery in place (baft.recovery.world.available)
        THIS_PROCESS.no_survivors(engine, stream, "Read the file with readline(), or open it in the dataset's "
                                                  "__iter__, for its survivors to recover in place")
    elif engine.global_rank == 0 and stream not in _SAID:
        _SAID.add(stream)
        warn(engine, stream)


_SAID: set = set()  # the unkept files said


def _held_loaders(position) -> list[str]:
    """Where a data iterator of the script's own (not one baft keeps whole) holds torchdata loaders that shuffle
    with a generator (``self.loaders[0]``): their ``state_dict()`` leaves that generator out."""
    if position is None or isinstance(position, (ResumableLoader, EngineLoaderPosition, torch.utils.data.DataLoader)):
        return []
    found = []
    for name, value in getattr(position, "__dict__", {}).items():
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            items = [(None, value)]
        for key, item in items:
            if (isinstance(item, torch.utils.data.DataLoader) and hasattr(item, "load_state_dict")
                    and isinstance(item.generator, torch.Generator)):
                found.append((name if key is None else f"{name}[{key!r}]", item.generator.get_state()))
    if not found:
        return []
    kept = list(_tensors(position.state_dict()))  # a script's that keeps each generator's state is not said
    return [name for name, state in found if not any(t.shape == state.shape and torch.equal(t, state) for t in kept)]


def _tensors(state) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state."""
    if torch.is_tensor(state):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def foreign_iterator(position, data_iter) -> Optional[str]:
    """Why the iterator ``train_batch`` reads would not resume with the data position baft keeps (``position``,
    :func:`data_position`'s), where that can be told; None otherwise."""
    counted = _counted_in_locals(data_iter)
    if counted:
        return (f"train_batch reads a generator of the script's, {data_iter.__name__}(), that counts in its own "
                f"variables ({', '.join(counted)}): no snapshot holds a generator's variables, so a resumed run starts "
                f"them again from their first values (a DistributedSampler's set_epoch(epoch) from epoch 0: the "
                f"orders of earlier epochs again); derive them from the engine's step (epoch = engine.global_steps "
                f"// steps_per_epoch) or keep them in the loop, whose counts baft keeps")
    held = _held_back(data_iter)
    if held:
        return (f"train_batch reads a generator of the script's, {data_iter.__name__}(), that holds a batch back in "
                f"its own variables ({', '.join(held)}) while train_batch trains the one before: the data position "
                f"counts that batch read, and no snapshot holds it, so a resumed run skips it and reads each later "
                f"batch one step early; yield each batch as the loader gives it (for batch in loader: yield batch), "
                f"or prefetch in the loader (num_workers=, prefetch_factor=)")
    if isinstance(data_iter, itertools.cycle):
        return ("train_batch reads an itertools.cycle: after its first pass it repeats the batches it cached, which "
                "no snapshot holds, so a resumed run reads others; use deepspeed.utils.RepeatingLoader, which takes a "
                "new iterator of the loader each epoch")
    repeated = getattr(position, "repeating", None)  # a RepeatedLoaderPosition's: the loader found at the first call
    if repeated is not None and isinstance(data_iter, RepeatingLoader) and data_iter is not repeated:
        return ("train_batch reads another RepeatingLoader than the one it read first, whose position baft keeps: "
                "this one's is in no snapshot, and a resumed run reads it from its start; give baft.initialize one "
                "data_iterator whose state_dict() keeps each one's position")
    given = getattr(getattr(position, "loader", position), "dataset", None)
    read = getattr(data_iter, "_dataset", None)  # a DataLoader's iterator
    if given is not None and read is not None and read is not given:
        return (f"train_batch reads an iterator of another loader than the data_iterator given to baft.initialize "
                f"(over another {type(read).__name__}): its position is in no snapshot, and a resumed run reads it "
                f"from its start")
    kept = getattr(position, "loader", None)  # a plain one's: torchdata's iterator may hold a restored sampler
    if (read is not None and read is given and isinstance(kept, torch.utils.data.DataLoader)
            and not hasattr(kept, "load_state_dict")
            and getattr(data_iter, "_index_sampler", None) is not kept._index_sampler):
        return (f"train_batch reads an iterator of another DataLoader over the {type(read).__name__} than the one "
                f"whose position baft keeps (a new DataLoader each epoch?): its position is in no snapshot, so a "
                f"resumed run reads other batches from the restored step on; make the DataLoader once, before the "
                f"loop, and take a new iter() of it each epoch")
    if (position is not None and read is None and callable(getattr(data_iter, "state_dict", None))
            and callable(getattr(data_iter, "load_state_dict", None)) and not _holds(position, data_iter)):
        return (f"train_batch reads a {type(data_iter).__name__} that is not the data_iterator given to "
                f"baft.initialize, nor held by it: its position is in no snapshot, so a resumed run reads it from where "
                f"the script starts it, not where the uninterrupted run had it (a second task's data?). Give "
                f"baft.initialize one data_iterator whose state_dict() holds the position of every iterator "
                f"train_batch reads")
    return None


def _counted_in_locals(data_iter) -> list[str]:
    """The variables a generator of the script's counts in, as its source reads (``epoch += 1``, ``n = n + 1``), its
    loops' own variables aside; empty where it counts in none or its source cannot be read."""
    tree = defined_at(data_iter.gi_code) if inspect.isgenerator(data_iter) else None
    if tree is None:
        return []
    looped = {n.id for loop in ast.walk(tree) if isinstance(loop, (ast.For, ast.comprehension))
              for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    counted = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            counted.append(node.target.id)
        elif isinstance(node, ast.Assign):
            read = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            counted += [t.id for t in node.targets if isinstance(t, ast.Name) and t.id in read]
    return sorted(set(counted) - looped)


def _held_back(data_iter) -> list[str]:
    """The variables a generator of the script's holds a batch back in, as its source reads: yielded inside a loop
    over the loader before that loop sets them from its batch (``yield prev`` ... ``prev = batch``: a prefetcher);
    empty where it holds none or its source cannot be read."""
    tree = defined_at(data_iter.gi_code) if inspect.isgenerator(data_iter) else None
    if tree is None:
        return []
    held = set()
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For):
            continue
        batch = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        yielded = {n.id: node.lineno for node in ast.walk(loop) if isinstance(node, (ast.Yield, ast.YieldFrom))
                   for n in ast.walk(node) if isinstance(n, ast.Name)}
        for node in ast.walk(loop):
            if isinstance(node, ast.Assign) and batch & {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}:
                held |= {t.id for t in node.targets if isinstance(t, ast.Name) and t.id not in batch
                         and yielded.get(t.id, node.lineno) < node.lineno}
    return sorted(held)


def _holds(holder, obj, depth: int = 2) -> bool:
    """Whether ``obj`` is ``holder``, or what its attributes, or their items, hold, ``depth`` levels down (a mixer
    of the script's given to ``baft.initialize`` whose ``state_dict()`` keeps each of its iterators' positions)."""
    if obj is holder:
        return True
    if depth == 0:
        return False
    if isinstance(holder, dict):
        items = list(holder.values())
    elif isinstance(holder, (list, tuple)):
        items = list(holder)
    else:
        items = list(vars(holder).values()) if hasattr(holder, "__dict__") and not isinstance(holder, type) else []
    return any(_holds(item, obj, depth - 1) for item in items)
