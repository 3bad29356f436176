"""The data position of a plain ``torch.utils.data.DataLoader`` that the loop reads through DeepSpeed's
``RepeatingLoader`` (DeepSpeedExamples' ``train_batch(data_iter=iter(RepeatingLoader(loader)))``), given to
``baft.initialize`` or not, or of DeepSpeed's own loader made by the script (``engine.deepspeed_io(dataset)``, a torch
``DataLoader`` made each epoch: :mod:`baft.position.deepspeed_loader`): such a loader keeps no state of its own, so
baft keeps what decides its batches.
"""

from __future__ import annotations

from typing import Optional

import torch
from deepspeed.runtime.dataloader import RepeatingLoader

from baft.position.dataset_source import first_set
from baft.position.deepspeed_loader import DeepSpeedEpochs, epoch_iterator, keeps_no_state
from baft.position.iterators import batches_read
from baft.position.epoch_position import EpochPosition
from baft.position.epoch_starts import EpochStarts
from baft.position.samplers import drawing_sampler, record_epoch_starts
from baft.script.loop import THIS_PROCESS


class RepeatedLoaderPosition(EpochPosition):
    """Where a plain ``DataLoader`` that the loop repeats through ``RepeatingLoader`` stands (or DeepSpeed's, seen as
    the torch loader it makes each epoch: :class:`~baft.position.deepspeed_loader.DeepSpeedEpochs`): which of the
    epochs' iterators reads it, the batches that one has given, what it was made from (:class:`EpochStarts`), the
    state its sampler drew the epoch's order from (:func:`~baft.position.samplers.record_epoch_starts`), and the
    loader's ``generator``.

    Given to ``baft.initialize``, or found as the loop's first ``train_batch`` reads it
    (:class:`~baft.position.found_position.PositionFoundLater`). A restore makes the epoch's
    iterator again from what it was made from, its sampler's order drawn as it was, and skips the batches read:
    through the sampler where the loader reads in this process (nothing fetched: a skipped sample's random draws
    come again from the generators as a resumed step sets them), by reading them with workers (each worker's
    generators then stand as the uninterrupted run's; a restore's time grows with the batches read into the epoch, as
    for the engine's own loader). The first epoch's iterator was made before baft could note
    what from; a new process holds it as the uninterrupted run made it (the script's code up to its loop runs the
    same), a survivor in place does not: with workers, where it cannot be made again, every rank is replaced. Not so
    a loader ``engine.deepspeed_io`` made (:func:`keep_epochs`): its first epoch's is noted, and made again.
    """

    def __init__(self, repeating: RepeatingLoader, engine=None):
        if keeps_no_state(repeating.loader):
            DeepSpeedEpochs.take_over(repeating.loader)
        self.repeating = EpochStarts.take_over(repeating)
        loader = repeating.loader
        self.keep(loader)
        if loader.num_workers and engine is not None and self.repeating.made_from is None:
            THIS_PROCESS.no_survivors(engine, "the loop repeats a DataLoader with workers through RepeatingLoader, "
                                              "whose first epoch's iterator a survivor cannot make again as it was "
                                              "made",
                                      "Give baft.initialize torchdata's StatefulDataLoader as data_iterator= for its "
                                      "survivors to recover in place")

    @property
    def loader(self):
        """The plain ``DataLoader`` (or ``DeepSpeedEpochs``) this position keeps."""
        return self.repeating.loader

    def caveat(self) -> Optional[str]:
        """What a restore of the loader kept does not bring back, or None."""
        return workers_caveat(self.loader)

    def state_dict(self) -> dict:
        repeating = self.repeating
        return self.position(repeating.epoch, epoch_iterator(repeating.data_iter), repeating.made_from)

    def load_state_dict(self, saved: dict) -> None:
        repeating = self.repeating
        here = epoch_iterator(repeating.data_iter)
        # the first epoch's iterator, as made in this process, not read past the position: read on from it
        own = (saved["made_from"] is None and saved["epoch"] == repeating.epoch == 0 and here is repeating.first
               and batches_read(here) <= saved["read"])

        def remade(made_from: Optional[dict]):
            repeating.remake(made_from)
            return epoch_iterator(repeating.data_iter)

        self.restore_epoch(saved, here if own else None, remade)
        repeating.epoch, repeating.made_from = saved["epoch"], saved["made_from"]
        self.set_back(saved)


def workers_caveat(loader) -> Optional[str]:
    """What a restore of a plain ``loader`` whose epoch's iterator it makes again (and reads to the position through
    its workers) does not bring back: its persistent workers' draws and what else their copies of the dataset and
    collate_fn keep; None otherwise."""
    if loader.num_workers and loader.persistent_workers:
        return persistent_state(loader) or (
            f"random numbers your dataset or collate_fn draws in the loader's {loader.num_workers} persistent "
            f"workers are in no saved state: they are seeded once, as they start, so a resume draws others; draw them "
            f"from a generator seeded by the sample index to make them resume too")
    return None


def persistent_state(loader) -> Optional[str]:
    """Where the dataset or collate_fn of ``loader``, which has persistent workers, sets attributes of its own as it
    reads (a count of the samples it served; :func:`~baft.position.dataset_source.first_set`, each one's first): each
    worker changes its own copy, kept from epoch to epoch and in no snapshot, and a resume starts new workers from the
    main process's (probe 28: said as random draws, the samples claimed to resume exactly, and the batches differed).
    None where neither does, or the loader has none."""
    if not (loader.num_workers and getattr(loader, "persistent_workers", False)):
        return None
    found = ((type(held).__name__, first_set(type(held))) for held in (loader.dataset, loader.collate_fn))
    named = [f"{name}.{at[0]}, set in {at[1]}" for name, at in found if at is not None]
    if not named:
        return None
    return (f"what the loader's {loader.num_workers} persistent workers keep in their own copies of its dataset and "
            f"collate_fn, changed as they read ({'; '.join(named)}), is in no snapshot: a resume starts new workers "
            f"from the main process's copies, and the batches differ; compute it from the sample index, or set "
            f"persistent_workers=False")


def keep_epochs(loader):
    """``loader``, made by ``engine.deepspeed_io`` for the script: where it keeps no state of its own, a
    :class:`~baft.position.deepspeed_loader.DeepSpeedEpochs` before its first ``iter()``, so that what each epoch's
    iterator is made from is noted, the first's too. The script makes it after ``baft.initialize``, which sets the
    generators as the restored step's loop left them between its steps: a new process's first epoch is made from
    other states than the uninterrupted run's, and is made again as that one was."""
    if keeps_no_state(loader):
        record_epoch_starts(drawing_sampler(DeepSpeedEpochs.take_over(loader)))
    return loader


def plain_repeating(data_iter) -> bool:
    """Whether ``data_iter`` is DeepSpeed's ``RepeatingLoader`` of a loader with no state of its own: torch's
    ``DataLoader``, or DeepSpeed's (:func:`~baft.position.deepspeed_loader.keeps_no_state`)."""
    loader = getattr(data_iter, "loader", None)
    plain = isinstance(loader, torch.utils.data.DataLoader) and not hasattr(loader, "load_state_dict")
    return isinstance(data_iter, RepeatingLoader) and (plain or keeps_no_state(loader))
