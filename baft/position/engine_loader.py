"""The data position of the engine's own loader (``training_data=`` given to ``initialize``): how far into its epoch
DeepSpeed's repeating loader has read, the state of torch's generator each epoch's iterator drew its workers'
seeds from, and the settings of its dataset."""

from __future__ import annotations

from deepspeed.runtime.dataloader import RepeatingLoader

from baft.position.epoch_starts import EpochStarts, generator_states
from baft.position.settings import as_made, changed_data_attributes, data_attributes_at_start, set_data_attributes


class EngineLoaderPosition:
    """The data position of the engine's own loader (``training_data=`` given to ``initialize``).

    DeepSpeed reads that dataset through a ``DistributedSampler`` without shuffling, repeated
    (``RepeatingLoader``), on the first and last stages; each optimizer step takes
    ``micro_batches`` of it (``set_train_batch_size`` changes how many: :meth:`batch_size_changes`). A
    restore makes the epoch's iterator again and skips as far into it (reading the skipped batches). That
    iterator's loader workers draw from generators seeded by a base seed it drew from torch's as it was made (a
    random crop of torchvision's in the dataset): :class:`~baft.position.epoch_starts.EpochStarts` keeps the state it
    was drawn from (without it a restore inside a later epoch read on from an iterator made at ``initialize``, whose
    workers drew other random numbers: probe 16, a dataset's ``torch.rand`` augmentation; an in-place survivor's,
    made from its generator as it stood, in the first epoch too), and the settings its dataset held then, which its
    workers copied (probe 25: made with those the resumed loop had set, they read a curriculum's later value). The
    settings the loop changed are kept as a plain loader's (:mod:`baft.position.settings`).
    """

    def __init__(self, engine):
        self.engine = engine
        self.read_before, self.since_step = 0, 0  # micro-batches read up to step since_step, at earlier sizes
        # the engine's, held: its eval_batch() sets training_dataloader to None (a middle stage's is None)
        self.repeating = getattr(engine, "training_dataloader", None)
        if isinstance(self.repeating, RepeatingLoader):
            self.repeating = EpochStarts.take_over(self.repeating)
            self.repeating.remake(generator_states(self.repeating.loader))  # deepspeed.initialize's: not kept
            data_attributes_at_start(self.repeating.loader)

    def read(self) -> int:
        """The micro-batches the loader has given by the engine's step."""
        return self.read_before + (self.engine.global_steps - self.since_step) * self.engine.micro_batches

    def batch_size_changes(self) -> None:
        """Before the engine's batch size changes: the steps so far read at the size until now."""
        self.read_before, self.since_step = self.read(), self.engine.global_steps

    def state_dict(self) -> dict:
        if not isinstance(self.repeating, EpochStarts):
            return {"micro_batches": self.read()}
        made_from = self.repeating.made_from
        return {"micro_batches": self.read(), "epoch_rng": made_from["torch"],
                "epoch_attributes": made_from.get("attributes"),
                "attributes": changed_data_attributes(self.repeating.loader)}

    def load_state_dict(self, saved: dict) -> None:
        """Make the saved epoch's iterator again, its base seed drawn as it was, and skip it to the saved position.

        At an epoch's end the uninterrupted run holds a spent iterator: the next read makes a new
        one, drawing its base seed from torch's generator inside that iteration. So a position at
        an epoch's end reads the epoch to its end rather than stay at its start."""
        self.read_before, self.since_step = saved["micro_batches"], self.engine.global_steps
        if self.repeating is None:
            return
        position, epoch = saved["micro_batches"], len(self.repeating.loader)
        with as_made(self.repeating.loader, saved.get("epoch_attributes")):  # its workers copy them
            if "epoch_rng" in saved:
                self.repeating.remake({"torch": saved["epoch_rng"], "generator": None,
                                       "attributes": saved.get("epoch_attributes")})
            for _ in range(position % epoch or (epoch if position else 0)):
                next(self.repeating)
        set_data_attributes(self.repeating.loader, saved.get("attributes", {}))
