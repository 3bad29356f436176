"""What the positions of a plain ``DataLoader`` read epoch by epoch share
(:class:`~baft.position.repeated_loader.RepeatedLoaderPosition`,
:class:`~baft.position.plain_loader.PlainLoaderPosition`): besides which epoch's iterator reads and what it was made
from, what decides that epoch's batches, kept with every snapshot and set as it was by a restore.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from baft.errors import BaftError
from baft.position.epoch_starts import drawn_as_kept, held_states
from baft.position.iterators import batches_read, read_to
from baft.position.samplers import EPOCH_START, as_epoch_started, drawing_sampler, record_epoch_starts
from baft.position.settings import as_made, changed_data_attributes, data_attributes_at_start, set_data_attributes
from baft.script.rng import hold_loader_generators


class EpochPosition:
    """The state its sampler drew the epoch's order from (:func:`~baft.position.samplers.record_epoch_starts`), the
    loader's ``generator``, and the settings the loop changed in its dataset (:mod:`baft.position.settings`), of
    ``loader``; a subclass says which epoch reads, through which iterator, made from what."""

    loader: torch.utils.data.DataLoader

    def keep(self, loader: torch.utils.data.DataLoader) -> None:
        """From now on, note what decides ``loader``'s epochs."""
        self.sampler = drawing_sampler(loader)
        record_epoch_starts(self.sampler)
        hold_loader_generators(loader)
        data_attributes_at_start(loader)

    def position(self, epoch: int, reading, made_from: Optional[dict]) -> dict:
        """The saved position: epoch ``epoch``, read by ``reading`` (None: not yet), made from ``made_from``."""
        generator = self.loader.generator
        return {"epoch": epoch, "read": batches_read(reading) if reading is not None else 0, "made_from": made_from,
                "sampler": getattr(self.sampler, EPOCH_START, None),
                "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
                "attributes": changed_data_attributes(self.loader), "held": held_states(self.loader)}

    def restore_epoch(self, saved: dict, own, make: Callable[[Optional[dict]], object]):
        """The saved epoch's iterator read to the saved position: ``own``, the first epoch's as this process made it
        (None: not so), or one ``make(made_from)`` makes again, its sampler's order drawn and its dataset set as that
        epoch began (which its workers copy). The first epoch's, made before baft could note what from, is made again
        by none with workers."""
        loader = self.loader
        if own is None and saved["made_from"] is None and loader.num_workers:
            raise BaftError("the restored position is in the first epoch of a DataLoader with workers, whose iterator "
                            "this process cannot make again as it was made: give baft.initialize torchdata's "
                            "StatefulDataLoader as data_iterator=")
        began = (saved["made_from"] or {}).get("attributes")
        with as_epoch_started(self.sampler, saved["sampler"]), as_made(loader, began):
            restored = own if own is not None else make(saved["made_from"])
            read_to(restored, saved["read"], loader)
        drawn_as_kept(loader, saved.get("held", {}))
        return restored

    def set_back(self, saved: dict) -> None:
        """The loader's ``generator`` and its dataset's settings as saved."""
        if saved["generator"] is not None:
            self.loader.generator.set_state(saved["generator"])
        set_data_attributes(self.loader, saved["attributes"])  # a setting the loop changed once (dataset.scale = 0.5)
