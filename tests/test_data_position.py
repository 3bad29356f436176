"""A restored data position reads the same batches as the uninterrupted loader, in every epoch after it.

torchdata 0.11's ``StatefulDataLoader`` alone does not: given ``shuffle=True, generator=g`` its
state misses the base seed each iterator draws from ``g``, so every epoch after a restored one comes
out in another order. The position baft saves (:func:`baft.position.kept.data_position`) keeps the
generator beside the loader's state; these tests restore it at every batch of three epochs.
"""

import functools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.utils import RepeatingLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from baft.cli.launch import launch_env
from baft.errors import BaftError
from baft.recovery.digests import DIGESTS_ENV, redone_differ
from baft.position.first_iterators import note_until_first_call, stop_noting
from baft.position.resumable import ResumableLoader
from baft.position.kept import data_position, not_restored
from baft.script.rng import same_state

SAMPLES, BATCH = 14, 2  # 7 batches an epoch


class Noisy(torch.utils.data.Dataset):
    """Each sample draws from torch's generator: in a worker, seeded from the loader's base seed."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item()])


class OwnDraws(Noisy):
    """Each sample draws from generators the dataset holds (a random crop's offset), not from torch's."""

    def __init__(self):
        self.crops = np.random.default_rng(1)
        self.flips = random.Random(2)
        self.noise = torch.Generator().manual_seed(3)

    def __getitem__(self, i):
        draw = self.crops.random() + self.flips.random() + torch.rand((), generator=self.noise).item()
        return torch.tensor([float(i), draw])


class Counting(Noisy):
    """A curriculum by the samples served, counted as the loader reads (in a worker: its own copy's count)."""

    def __getitem__(self, i):
        self.seen = getattr(self, "seen", 0) + 1
        return torch.tensor([float(i), 1 + 0.001 * self.seen])


class CountingCollate:
    """A collate_fn object that counts the batches it made."""

    def __call__(self, samples):
        self.made = getattr(self, "made", 0) + 1
        return torch.utils.data.default_collate(samples) * self.made


class Masking:
    """A collate_fn with a torch.Generator of its own (BERT-style masking)."""

    def __init__(self):
        self.masks = torch.Generator().manual_seed(4)

    def __call__(self, samples):
        batch = torch.utils.data.default_collate(samples)
        batch[:, 1] += torch.rand(len(batch), generator=self.masks)
        return batch


class Buckets(torch.utils.data.Sampler):
    """A batch sampler of a script's own: each epoch a permutation from a generator it names as it likes."""

    def __init__(self, rng=None):
        self.rng = rng

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=self.rng).tolist()
        return iter([order[i:i + BATCH] for i in range(0, SAMPLES - BATCH + 1, BATCH)])

    def __len__(self):
        return SAMPLES // BATCH


LOADERS = {
    "shuffle, generator": lambda workers: StatefulDataLoader(
        Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers,
        generator=torch.Generator().manual_seed(3)),
    "sampler with its generator": lambda workers: StatefulDataLoader(
        Noisy(), batch_size=BATCH, drop_last=True, num_workers=workers,
        sampler=RandomSampler(Noisy(), generator=torch.Generator().manual_seed(4)),
        generator=torch.Generator().manual_seed(5)),
    "shuffle, no generator": lambda workers: StatefulDataLoader(  # its draws from torch's generator, which baft sets
        Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers),
    "torch's RandomSampler with its generator": lambda workers: StatefulDataLoader(  # drawn on in no loader state
        Noisy(), batch_size=BATCH, drop_last=True, num_workers=workers,
        sampler=torch.utils.data.RandomSampler(Noisy(), generator=torch.Generator().manual_seed(8)),
        generator=torch.Generator().manual_seed(9)),
    "torch's RandomSampler, no generator": lambda workers: StatefulDataLoader(  # it draws from torch's
        Noisy(), batch_size=BATCH, drop_last=True, num_workers=workers,
        sampler=torch.utils.data.RandomSampler(Noisy())),
    "distributed sampler, generator": lambda workers: StatefulDataLoader(
        Noisy(), batch_size=BATCH, drop_last=True, num_workers=workers,
        sampler=StatefulDistributedSampler(Noisy(), num_replicas=1, rank=0, shuffle=True, seed=6),
        generator=torch.Generator().manual_seed(7)),
    "torch's BatchSampler over its RandomSampler with a generator": lambda workers: StatefulDataLoader(
        Noisy(), num_workers=workers, batch_sampler=torch.utils.data.BatchSampler(
            torch.utils.data.RandomSampler(Noisy(), generator=torch.Generator().manual_seed(10)), BATCH, True),
        generator=torch.Generator().manual_seed(11)),
    "a batch sampler of the script's with a generator": lambda workers: StatefulDataLoader(
        Noisy(), num_workers=workers, batch_sampler=Buckets(torch.Generator().manual_seed(12)),
        generator=torch.Generator().manual_seed(13)),
    "a batch sampler of the script's, no generator": lambda workers: StatefulDataLoader(  # it draws from torch's
        Noisy(), num_workers=workers, batch_sampler=Buckets()),
    # drawn in this process (no workers) from generators no loader state holds: kept beside it (before, a resumed run
    # drew other crops and masks, silently; probe 11)
    "a dataset and collate_fn with generators of their own": lambda workers: StatefulDataLoader(
        OwnDraws(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers, collate_fn=Masking(),
        generator=torch.Generator().manual_seed(14)),
}


def read(make, batches, restore_at=None, workers=0):
    """``batches`` batches through ``RepeatingLoader`` (as a DeepSpeed script reads them), the position
    saved after ``restore_at`` of them and restored into a new loader and process-wide generator state."""
    torch.manual_seed(0)
    loader = make(workers)
    position = data_position(None, loader)  # as baft.initialize makes it, before the script's iter()
    feed, out = RepeatingLoader(loader), []
    for i in range(batches):
        if i == restore_at:
            saved, rng = position.state_dict(), torch.get_rng_state()
            torch.manual_seed(99)  # a new process: its own draws until baft sets the RNG states
            loader = make(workers)
            data_position(None, loader).load_state_dict(saved)
            torch.set_rng_state(rng)  # baft's RngRestore, at the first resumed iteration
            feed = RepeatingLoader(loader)
        out.append(next(feed))
    return torch.stack(out)


@pytest.mark.parametrize("name", LOADERS)
def test_a_restore_at_any_batch_reads_every_later_epoch_as_the_uninterrupted_loader(name):
    make = LOADERS[name]
    assert isinstance(data_position(None, make(0)), ResumableLoader)
    reference = read(make, 21)
    if "distributed" not in name:  # a DistributedSampler repeats its order until the script calls set_epoch
        assert not torch.equal(reference[:7, :, 0], reference[7:14, :, 0]), "each epoch in its own order"
    for restore_at in range(1, 21):
        assert torch.equal(read(make, 21, restore_at), reference), f"restored after batch {restore_at}"


# (not the loader without a generator: its later epochs draw from torch's, which this test does not set as baft does)
@pytest.mark.parametrize("name", [name for name in LOADERS if "no generator" not in name])
def test_a_position_saved_again_before_the_restored_loader_reads_restores_it_too(name):
    """A resumed run snapshots the restored step again before it reads a batch; a second fault restores that copy
    (torchdata's distributed sampler says it has yielded nothing until its restored iterator is read)."""
    make = LOADERS[name]
    reference = read(make, 14)
    for restore_at in (3, 7, 9):
        loader = make(0)
        position = data_position(None, loader)
        feed = RepeatingLoader(loader)
        for _ in range(restore_at):
            next(feed)
        once = data_position(None, make(0))  # one per run, as baft.initialize makes it
        once.load_state_dict(position.state_dict())
        twice = make(0)
        data_position(None, twice).load_state_dict(once.state_dict())
        resumed = RepeatingLoader(twice)
        samples = torch.stack([next(resumed) for _ in range(14 - restore_at)])[:, :, 0]  # the noise: RngRestore's
        assert torch.equal(samples, reference[restore_at:, :, 0]), f"restored twice after batch {restore_at}"


class Scaled(torch.utils.data.Dataset):
    """A dataset with settings the loop changes once (an augmentation's strength, turned down as a warm-up ends; an
    option in a dict of them) or before each batch (a curriculum's noise)."""

    def __init__(self):
        self.scale, self.noise, self.opts, self.transform = 1.0, 0.0, {"half": False}, None

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        sample = torch.tensor([float(i), self.scale * (0.5 if self.opts["half"] else 1.0) + self.noise])
        return sample if self.transform is None else self.transform(sample)


class Shift:
    """A collate_fn with a setting of its own (a masking rate a curriculum raises)."""

    def __init__(self):
        self.shift = 0

    def __call__(self, samples):
        return torch.utils.data.default_collate(samples) + self.shift


@pytest.mark.parametrize("workers", [0, 2])
def test_the_settings_a_loop_changes_once_in_its_dataset_and_collate_fn_come_back_with_the_position(workers):
    """Probe 23: the loop sets ``dataset.scale`` and ``collate_fn.shift`` once, after batch 4; a loader restored after
    it (a new process's, made with the first values) read on with those, silently. The position keeps the plain
    values they hold that changed since, and a survivor restored to before the change gets the first ones back. With
    workers, the restored iterator is built with the settings its epoch's was (probe 25: with those the resumed loop
    had set before each batch, and without a dict's item, silently)."""
    def make():
        return StatefulDataLoader(Scaled(), batch_size=BATCH, shuffle=True, drop_last=True, collate_fn=Shift(),
                                  generator=torch.Generator().manual_seed(3), num_workers=workers)

    def run(restore_at=None):
        loader = make()
        position, feed, out = data_position(None, loader), RepeatingLoader(loader), []
        for i in range(10):
            loader.dataset.noise = 0.01 * i
            if i == 4:
                loader.dataset.scale, loader.collate_fn.shift = 0.5, 2
                loader.dataset.opts["half"] = True
            if i == restore_at:
                saved = position.state_dict()
                loader = make()
                loader.dataset.noise = 0.01 * i  # the resumed loop's, before the call that restores
                position = data_position(None, loader)
                position.load_state_dict(saved)
                feed = RepeatingLoader(loader)
            out.append(next(feed))
        return torch.stack(out)

    reference = run()
    for restore_at in (2, 6, 9):
        assert torch.equal(run(restore_at), reference), f"restored after batch {restore_at}"
    loader = make()
    position, feed = data_position(None, loader), RepeatingLoader(loader)
    next(feed)
    before = position.state_dict()  # a snapshot before the change
    loader.dataset.scale, loader.collate_fn.shift = 0.5, 2
    next(feed)
    data_position(None, loader).load_state_dict(before)  # as a survivor recovering in place makes it again
    assert (loader.dataset.scale, loader.collate_fn.shift) == (1.0, 0)
    # a count a stream keeps, set once torchdata has read it again up to the position (not counted twice)
    stream = StatefulDataLoader(CountedStream(), batch_size=2)
    position, batches = data_position(None, stream), iter(stream)
    for _ in range(3):
        next(batches)
    stream = StatefulDataLoader(CountedStream(), batch_size=2)
    data_position(None, stream).load_state_dict(position.state_dict())
    batches = iter(stream)
    next(batches)
    assert stream.dataset.given == 8


def test_with_workers_the_order_resumes_anywhere_and_their_draws_from_an_epoch_boundary():
    """A worker's generator is seeded from the loader's base seed at each epoch and is in no state_dict: the
    numbers drawn in workers resume exactly from an epoch boundary only (baft warns of it at initialize)."""
    make = LOADERS["shuffle, generator"]
    reference = read(make, 10, workers=2)
    assert torch.equal(read(make, 10, 7, workers=2), reference)  # restored at the end of the first epoch
    assert torch.equal(read(make, 10, 3, workers=2)[:, :, 0], reference[:, :, 0])  # inside it: the samples


class Stream(torch.utils.data.IterableDataset):
    """A stream with no state of its own: torchdata restores its position by reading it again."""

    def __iter__(self):
        return iter(torch.arange(80.0).view(40, 2))


class CountedStream(Stream):
    """A stream that counts the samples it gave (the tokens a run has seen)."""

    def __init__(self):
        self.given = 0

    def __iter__(self):
        for sample in super().__iter__():
            self.given += 1
            yield sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_restored_again_and_again_in_one_epoch_reads_on_as_the_uninterrupted_loader(workers):
    """torchdata 0.11 restores an ``IterableDataset`` without state by reading it again up to the position, and
    counts those batches twice: the position saved next said twice as far, and a second restore in the same epoch
    skipped as many batches (probe 8's R2, with or without workers). Three restores, each after three batches."""
    def loader():
        return StatefulDataLoader(Stream(), batch_size=2, num_workers=workers)

    uninterrupted = iter(loader())
    expected = [next(uninterrupted) for _ in range(12)]
    kept = ResumableLoader(loader())
    batches = iter(kept.loader)
    read = [next(batches) for _ in range(3)]
    for _ in range(3):
        saved = kept.state_dict()
        kept = ResumableLoader(loader())
        kept.load_state_dict(saved)
        batches = iter(kept.loader)
        read += [next(batches) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))


def test_a_position_saved_before_baft_kept_the_generator_still_restores_the_loader():
    old = StatefulDataLoader(Noisy(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    batches = iter(old)
    next(batches), next(batches)
    loader = StatefulDataLoader(Noisy(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    ResumableLoader(loader).load_state_dict(old.state_dict())
    assert torch.equal(next(iter(loader))[:, 0], next(batches)[:, 0])


def test_initialize_names_what_a_restore_will_not_bring_back():
    unfound = not_restored(data_position(None, None))  # until the loop's first call finds a loader it repeats
    assert "read a DataLoader through deepspeed.utils.RepeatingLoader, or pass data_iterator=" in unfound
    assert not_restored(data_position(None, LOADERS["shuffle, generator"](0))) is None
    said = not_restored(data_position(None, LOADERS["shuffle, generator"](2)))
    assert "loader's 2 workers are in no saved state: a resume inside an epoch, draws others" in said, said
    persistent = StatefulDataLoader(Noisy(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    said = not_restored(data_position(None, persistent))  # its workers are seeded once: every epoch after differs
    assert "a resume anywhere: its persistent workers are seeded once, as they start, draws others" in said, said
    # a stream with no state of its own is read again to the position, its own generators' draws anew (probe 8's R3)
    stream = not_restored(data_position(None, StatefulDataLoader(Stream(), batch_size=2)))
    assert stream.startswith("the Stream the loader streams has no state_dict(): a restore reads it again"), stream

    class Mixer:
        """A data iterator of the script's that mixes two shuffled loaders, its state_dict() theirs (probe 11: a
        resumed run read their later epochs in another order, silently); with ``kept``, their generators' too."""

        def __init__(self, kept=False):
            self.loaders, self.kept = [LOADERS["shuffle, generator"](0), LOADERS["sampler with its generator"](0)], kept
            self.iters = [iter(loader) for loader in self.loaders]

        def state_dict(self):
            own = {"loaders": [loader.state_dict() for loader in self.loaders]}
            return {**own, "generators": [l.generator.get_state() for l in self.loaders]} if self.kept else own

        def load_state_dict(self, state):
            pass

    said = not_restored(data_position(None, Mixer()))
    assert said.startswith("the data iterator Mixer holds torchdata loaders (loaders[0], loaders[1]) whose "
                           "state_dict() leaves out the generator"), said
    assert not_restored(data_position(None, Mixer(kept=True))) is None


class Stream16(torch.utils.data.IterableDataset):
    """A stream of 16 samples an epoch, each drawing from torch's generator (in a worker: each its own share)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = range(16) if info is None else range(info.id, 16, info.num_workers)
        return (torch.tensor([float(i), torch.rand(()).item()]) for i in mine)


PLAIN = {  # torch's own DataLoader, no state of its own: DeepSpeedExamples' iter(RepeatingLoader(loader))
    "shuffle": lambda workers: torch.utils.data.DataLoader(
        Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers),
    "shuffle, generator": lambda workers: torch.utils.data.DataLoader(
        Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers,
        generator=torch.Generator().manual_seed(3)),
    "in order": lambda workers: torch.utils.data.DataLoader(Noisy(), batch_size=BATCH, num_workers=workers),
    "a stream": lambda workers: torch.utils.data.DataLoader(Stream16(), batch_size=BATCH, num_workers=workers),
}


def seed_all(seed):
    """Torch's, python's and numpy's global generators seeded, as a script does at its top."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def read_repeated(make, batches, workers, restore_at=None, resumed_seed=0):
    """``batches`` batches of ``RepeatingLoader(make(workers))``, the position saved after ``restore_at`` of them
    and restored into a new process's: it runs the script's code up to its loop as the first did (its first
    iterator made from the same generators; ``resumed_seed``: from others), then baft restores, then sets the RNG
    states as the step starts."""
    seed_all(0)
    feed = RepeatingLoader(make(workers))
    position, out = data_position(None, feed), []
    for i in range(batches):
        if i == restore_at:
            saved, rng = position.state_dict(), (torch.get_rng_state(), random.getstate(), np.random.get_state())
            seed_all(resumed_seed)
            feed = RepeatingLoader(make(workers))
            data_position(None, feed).load_state_dict(saved)
            torch.set_rng_state(rng[0])  # (python's and numpy's too, as baft sets every generator)
            random.setstate(rng[1])
            np.random.set_state(rng[2])
        out.append(next(feed))
    return torch.stack(out)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_loaders_repeating_loader_restored_at_any_batch_reads_as_the_uninterrupted_one(name, workers):
    """Every later batch and its random draws, in this process or the workers' (before, a resumed run read from the
    first epoch's start, said at start; DeepSpeedExamples' shape). Restored after every batch of three epochs: inside
    an epoch, at its end (7 batches each), in the first epoch (read on from the new process's own iterator)."""
    make = PLAIN[name]
    reference = read_repeated(make, 21, workers)
    if name.startswith("shuffle"):
        assert not torch.equal(reference[:7, :, 0], reference[7:14, :, 0]), "each epoch in its own order"
    for restore_at in range(1, 21, 1 if workers == 0 else 3):
        assert torch.equal(read_repeated(make, 21, workers, restore_at), reference), f"restored after {restore_at}"


class Shuffled(torch.utils.data.IterableDataset):
    """A stream of 8 samples a pass in an order it draws as each pass begins: from python's and numpy's global
    generators, or from a count of its passes it keeps itself."""

    def __init__(self, order):
        self.order, self.passes = order, 0

    def __iter__(self):
        order = list(range(8))
        if self.order == "global":
            random.shuffle(order)
            order = [order[i] for i in np.random.permutation(8)]
        else:
            random.Random(self.passes).shuffle(order)
        self.passes += 1
        yield from (torch.tensor(float(i)) for i in order)


@pytest.mark.parametrize("order", ["global", "counted"])
def test_a_stream_that_draws_each_pass_order_itself_restored_at_any_batch_reads_as_the_uninterrupted_one(order):
    """Probe 26 G5 and G4: a stream read in this process (no workers) that shuffles each pass with python's global
    generator, or from its own count of passes: a restore reads the restored pass again, which drew its order from
    the generators (its count) as the new process held them, not as that pass began; the order resumed was
    another, silently. Restored after every batch of three passes."""
    make = lambda workers: torch.utils.data.DataLoader(Shuffled(order), batch_size=BATCH, num_workers=workers)
    reference = read_repeated(make, 12, 0)
    assert not torch.equal(reference[:4].sort().values, reference[:4]), "each pass in an order of its own"
    for restore_at in range(1, 12):
        assert torch.equal(read_repeated(make, 12, 0, restore_at), reference), f"restored after {restore_at}"


class Packed(torch.utils.data.IterableDataset):
    """A stream packing runs of random lengths, drawn from a generator it holds itself (numpy's, torch's or python's
    kind), into samples of 4: six runs a pass, the remainder dropped or carried to the next pass (``self.rest``)."""

    def __init__(self, kind, carry=False):
        self.rng = {"numpy": lambda: np.random.RandomState(7), "torch": lambda: torch.Generator().manual_seed(7),
                    "python": lambda: random.Random(7)}[kind]()
        self.kind, self.carry, self.rest = kind, carry, []

    def run(self):
        if self.kind == "numpy":
            return self.rng.randn(self.rng.randint(1, 7)).tolist()
        if self.kind == "torch":
            return torch.randn(int(torch.randint(1, 7, (), generator=self.rng)), generator=self.rng).tolist()
        return [self.rng.gauss(0, 1) for _ in range(self.rng.randint(1, 6))]

    def __iter__(self):
        packing = self.rest if self.carry else []
        for _ in range(6):
            packing.extend(self.run())
            while len(packing) >= 4:
                yield torch.tensor(packing[:4])
                del packing[:4]
        if self.carry:
            self.rest = list(packing)


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("kind", ["numpy", "torch", "python"])
def test_a_stream_drawing_from_its_own_generator_restored_at_any_batch_reads_as_the_uninterrupted_one(kind, carry,
                                                                                                     capsys):
    """Probe 27 H3: a stream read in this process drawing its samples from a generator it holds itself
    (``self.rng = np.random.RandomState(7)``): a restore reads the restored pass again from its start, which drew from
    that generator as the snapshot held it, mid-pass (relaunched), or as the survivor's had moved on (in place, the
    same stream object); the samples resumed were others, silently. Restored after every batch of five passes, and
    through torchdata's ``StatefulDataLoader``, which reads the pass again itself."""
    def read_packed(restore_at=None, survivor=None):
        make = lambda workers: torch.utils.data.DataLoader(survivor or Packed(kind, carry), batch_size=BATCH,
                                                           drop_last=True)
        return read_repeated(make, 12, 0, restore_at)

    reference = read_packed()
    for restore_at in range(1, 12):
        assert torch.equal(read_packed(restore_at), reference), f"relaunched after {restore_at}"
    for restore_at in range(3, 12):  # in place: the stream the loop read on from, its generator and remainder moved on
        in_place = read_packed(restore_at, survivor=Packed(kind, carry))
        assert torch.equal(in_place, reference), f"in place after {restore_at}"
    stateful = lambda workers: StatefulDataLoader(Packed(kind, carry), batch_size=BATCH, drop_last=True)
    for restore_at in range(1, 12):  # torchdata's loader, which reads the pass again itself
        assert torch.equal(read(stateful, 12, restore_at), reference), f"stateful after {restore_at}"
    assert "baft: the stream's" not in capsys.readouterr().err


class Wrapping(torch.utils.data.IterableDataset):
    """A stream reading another (a shuffle buffer's shape, its order its own): the stream held as an attribute."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        yield from self.stream


def test_a_wrapped_stream_drawing_from_its_own_generators_restored_at_any_batch_reads_as_the_uninterrupted_one(
        capsys):
    """Probe 27 H3, wrapped: streams that draw from generators of their own read through torch's ``ChainDataset`` and
    through a stream of the script's holding one; restored after every batch, relaunched, and nothing said of them."""
    make = lambda workers: torch.utils.data.DataLoader(
        torch.utils.data.ChainDataset([Packed("numpy", carry=True), Wrapping(Packed("torch"))]), batch_size=BATCH,
        drop_last=True)
    reference = read_repeated(make, 12, 0)
    for restore_at in range(1, 12):
        assert torch.equal(read_repeated(make, 12, 0, restore_at), reference), f"restored after {restore_at}"
    assert "baft: the stream's" not in capsys.readouterr().err


class Chunked(torch.utils.data.IterableDataset):
    """A stream of a corpus's lines through a file it opens once: each pass reads the next 6 lines from where the last
    stopped (``readline()``), back to the file's start at its end (an epoch of a large corpus)."""

    def __init__(self, path):
        self.f = open(path)

    def __iter__(self):
        for _ in range(6):
            line = self.f.readline()
            if not line:
                self.f.seek(0)
                line = self.f.readline()
            yield torch.tensor(float(line))


def test_a_stream_reading_on_through_a_file_it_holds_open_restored_at_any_batch_reads_as_the_uninterrupted_one(
        tmp_path):
    """Probe 28 K3: a stream reading each pass on from where its file (opened once, in ``__init__``) stood: a restore
    reads the restored pass again, through the new process's file at its start (relaunched) or the survivor's past what
    it read (in place); the lines resumed were others, silently. Restored after every batch of five passes, relaunched,
    in place and through torchdata's ``StatefulDataLoader``."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"{i}\n" for i in range(10)))

    def read_lines(restore_at=None, survivor=None):
        make = lambda workers: torch.utils.data.DataLoader(survivor or Chunked(path), batch_size=BATCH)
        return read_repeated(make, 15, 0, restore_at)

    reference = read_lines()
    assert reference.flatten().tolist()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    for restore_at in range(1, 15):
        assert torch.equal(read_lines(restore_at), reference), f"relaunched after {restore_at}"
    for restore_at in range(4, 15):  # in place, past the first pass (made before this stub notes what from)
        assert torch.equal(read_lines(restore_at, survivor=Chunked(path)), reference), f"in place after {restore_at}"
    stateful = lambda workers: StatefulDataLoader(Chunked(path), batch_size=BATCH)
    for restore_at in range(1, 15):
        assert torch.equal(read(stateful, 15, restore_at), reference), f"stateful after {restore_at}"


def test_a_stream_whose_generator_the_loop_draws_from_too_is_said_once_restored(capsys):
    """Probe 27 H3: a stream drawing from the generator the loop draws from between its batches (one object, a global
    of the script's too): the pass read again draws otherwise than the uninterrupted run's, which no restore can
    make exact. Said once, naming the generator, and the generator set where the snapshot had it."""
    def read(restore_at):
        stream = Packed("numpy")
        feed = RepeatingLoader(torch.utils.data.DataLoader(stream, batch_size=BATCH, drop_last=True))
        position = data_position(None, feed)
        for i in range(restore_at):
            next(feed)
            stream.rng.rand()  # the loop's draw, between batches
        return position, stream.rng

    position, kept = read(7)
    saved = position.state_dict()
    for _ in range(2):
        restored, generator = read(0)
        restored.load_state_dict(saved)
        assert same_state(generator.get_state(), kept.get_state())
    said = capsys.readouterr().err
    assert said.count("baft: the stream's dataset.rng (RandomState) is drawn from outside") == 1, said


def deepspeed_io(sampler=None):
    """DeepSpeed's own loader of ``Noisy()`` as ``engine.deepspeed_io`` makes it on a launched rank (local_rank 0):
    over a DistributedSampler unless given ``sampler()``, with DeepSpeed's default of 2 workers where the test asks
    for 2 (``num_local_io_workers=None``)."""
    return lambda workers: DeepSpeedDataLoader(
        Noisy(), batch_size=BATCH, pin_memory=False, local_rank=0, tput_timer=None,
        num_local_io_workers=None if workers == 2 else workers, data_sampler=sampler() if sampler else None,
        data_parallel_world_size=1, data_parallel_rank=0)


DEEPSPEED = {  # the script's iter(RepeatingLoader(engine.deepspeed_io(dataset))): a torch DataLoader made each epoch
    "DeepSpeed's, its DistributedSampler": deepspeed_io(),  # seeded by its epoch, which nothing sets: one order
    "DeepSpeed's over torch's RandomSampler with its generator": deepspeed_io(
        lambda: torch.utils.data.RandomSampler(Noisy(), generator=torch.Generator().manual_seed(5))),
    "DeepSpeed's over torch's RandomSampler, no generator": deepspeed_io(  # it draws from torch's
        lambda: torch.utils.data.RandomSampler(Noisy())),
}
REPEATED = {**PLAIN, **DEEPSPEED}  # the loaders without a state of their own that baft keeps the position of


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", DEEPSPEED)
def test_deepspeeds_own_loader_that_the_script_repeats_restored_at_any_batch_reads_as_the_uninterrupted_one(
        name, workers):
    """DeepSpeed's loader the script makes itself (``engine.deepspeed_io``) and repeats, given to ``baft.initialize``
    or found at the loop's first call, is kept as a plain loader's: each epoch's iterator of the torch loader it
    makes, what that was made from, how far it read (before, no position: a resumed run read from the data's
    start). Restored after every batch of three epochs, with DeepSpeed's default 2 workers after every third: every
    later batch and the random numbers drawn for it in the workers."""
    make = DEEPSPEED[name]
    reference = read_repeated(make, 21, workers)
    if "RandomSampler" in name:
        assert not torch.equal(reference[:7, :, 0], reference[7:14, :, 0]), "each epoch in its own order"
    for restore_at in range(1, 21, 1 if workers == 0 else 3):
        assert torch.equal(read_repeated(make, 21, workers, restore_at), reference), f"restored after {restore_at}"


@pytest.mark.parametrize("name", REPEATED)
def test_a_survivors_repeating_loader_reads_again_from_the_restored_position(name):
    """In place: the survivor's repeating loader read on, into the next epoch; the restored position (by a position
    made again, as the survivor's initialize makes it) makes the restored epoch's iterator again. With workers, a
    position in the first epoch, whose iterator was made before baft found it, cannot be: an error, not another
    order."""
    torch.manual_seed(0)
    feed = RepeatingLoader(REPEATED[name](0))
    position = data_position(None, feed)
    for restore_at, read_on in ((3, 6), (9, 9)):  # in the first epoch, then in the second
        for _ in range(restore_at - (3 if restore_at == 9 else 0)):
            next(feed)
        saved, rng = position.state_dict(), torch.get_rng_state()
        reference = torch.stack([next(feed) for _ in range(read_on)])
        data_position(None, feed).load_state_dict(saved)
        torch.set_rng_state(rng)
        assert torch.equal(torch.stack([next(feed) for _ in range(read_on)]), reference), f"restored at {restore_at}"
    torch.manual_seed(0)
    feed = RepeatingLoader(REPEATED[name](2))
    position = data_position(None, feed)
    next(feed)
    saved = position.state_dict()
    next(feed)
    with pytest.raises(BaftError, match="in the first epoch of a DataLoader with workers"):
        data_position(None, feed).load_state_dict(saved)


def test_a_plain_loader_found_as_the_loop_first_reads_it_takes_a_restore_made_before():
    """Not given to ``baft.initialize``: the position is restored before the loop's first call finds the repeating
    loader, and put back then; a persistent-worker loader's caveat is said."""
    torch.manual_seed(0)
    feed = RepeatingLoader(PLAIN["shuffle"](0))
    position = data_position(None, feed)
    for _ in range(9):
        next(feed)
    saved, rng = position.state_dict(), torch.get_rng_state()
    reference = [next(feed) for _ in range(5)]
    torch.manual_seed(0)
    later = data_position(None, None)
    later.load_state_dict(saved)
    resumed = RepeatingLoader(PLAIN["shuffle"](0))
    assert later.find(resumed) is None and later.loader is resumed.loader
    torch.set_rng_state(rng)
    assert all(torch.equal(next(resumed), batch) for batch in reference)
    unsaved = data_position(None, None)
    unsaved.resumed = True  # restored from a snapshot with no position of such a loader
    assert "holds no position of the data the loop reads" in unsaved.find(RepeatingLoader(PLAIN["shuffle"](0)))
    persistent = torch.utils.data.DataLoader(Noisy(), batch_size=BATCH, num_workers=2, persistent_workers=True)
    said = not_restored(data_position(None, RepeatingLoader(persistent)))
    assert "in the loader's 2 persistent workers are in no saved state" in said, said
    # a count its persistent workers' copies of the dataset or collate_fn keep: named, not said as random draws
    # (probe 28's K7: said so, and that the samples resume exactly, and the batches differed)
    for dataset, collate, named in (
            (Counting(), None, r"Counting.seen, set in Counting.__getitem__ \(test_data_position.py:\d+\)\)"),
            (Noisy(), CountingCollate(), r"CountingCollate.made, set in CountingCollate.__call__ \(test_data_position"),
            (Counting(), CountingCollate(), r"Counting.seen, .*\); CountingCollate.made, set in CountingCollate")):
        for make in (torch.utils.data.DataLoader, StatefulDataLoader):
            persistent = make(dataset, batch_size=BATCH, num_workers=2, persistent_workers=True, collate_fn=collate)
            said = not_restored(data_position(None, persistent if make is StatefulDataLoader
                                              else RepeatingLoader(persistent)))
            assert re.match(r"what the loader's 2 persistent workers keep in their own copies of its dataset and "
                            r"collate_fn, changed as they read \(" + named + r".* compute it from the sample index, or "
                            r"set persistent_workers=False$", said), said
    assert not_restored(data_position(None, RepeatingLoader(PLAIN["shuffle"](2)))) is None
    # so for one whose iterators the loop takes: its restore reads to the position through its workers (before: said
    # that their draws were in no saved state, which they resume from)
    loader, found = PLAIN["shuffle"](2), data_position(None, None)
    batches = iter(loader)
    assert found.find(batches) is None and not_restored(found) is None


@pytest.mark.parametrize("workers", [0, 2])
def test_deepspeeds_own_loader_made_after_initialize_resumes_in_its_first_epoch_as_the_uninterrupted_one(workers):
    """The script makes it after ``baft.initialize``, which sets the generators as the restored step's loop left them
    between its steps (where it draws there): a new process makes the first epoch's iterator from another state of
    torch's generator than the uninterrupted run did (its sampler's order, its workers' base seed). The engine baft
    returns notes what each epoch's iterator, the first too, was made from (``engine.deepspeed_io``: keep_epochs),
    and a restore in the first epoch makes it again (before, it read on from the new process's own: another order,
    other draws in the workers, silently), a survivor's in place too."""
    from baft.position.repeated_loader import keep_epochs

    make = DEEPSPEED["DeepSpeed's over torch's RandomSampler, no generator"]

    def made(workers):  # by the engine baft.initialize returned
        return keep_epochs(make(workers))

    reference = read_repeated(made, 10, workers)
    for restore_at in (2, 5, 9):
        assert torch.equal(read_repeated(made, 10, workers, restore_at, resumed_seed=1), reference), restore_at
    # so can a survivor's in place, with workers too (a torch DataLoader's cannot: every rank is replaced)
    feed = RepeatingLoader(made(workers))
    position = data_position(None, feed)
    next(feed)
    saved, rng = position.state_dict(), torch.get_rng_state()
    read_on = torch.stack([next(feed) for _ in range(3)])
    data_position(None, feed).load_state_dict(saved)
    torch.set_rng_state(rng)
    assert torch.equal(torch.stack([next(feed) for _ in range(3)]), read_on)


def read_made_after_initialize(make, workers, restore_at=None):
    """10 batches of ``RepeatingLoader(loader)``, a shuffled torch loader whose first iterator the script takes after
    ``baft.initialize`` returns (noted, until the loop's first call); the position saved after ``restore_at`` batches
    and restored into a new process's, whose ``baft.initialize`` set torch's generator as the restored step's loop
    left it (another state than the first process's there); the state it set must come out of the ``iter()`` as it
    went in (the loop draws from it before its first call)."""
    def first_iterator(resumed):
        note_until_first_call(set_between=resumed)
        try:
            return RepeatingLoader(make(workers))
        finally:
            stop_noting()

    torch.manual_seed(0)
    feed = first_iterator(resumed=False)
    position, out = data_position(None, feed), []
    for i in range(10):
        if i == restore_at:
            saved, rng = position.state_dict(), torch.get_rng_state()
            set_by_initialize = torch.manual_seed(1).get_state()
            feed = first_iterator(resumed=True)
            assert torch.equal(torch.get_rng_state(), set_by_initialize)
            data_position(None, feed).load_state_dict(saved)
            torch.set_rng_state(rng)
        out.append(next(feed))
    return torch.stack(out)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_loader_made_after_initialize_resumes_in_its_first_epoch_as_the_uninterrupted_one(workers):
    """Its first iterator made after ``baft.initialize``, from the generators as it set them in a resumed process (the
    loop's between its steps, where it draws there): noted as made, and made again by a restore in that epoch (before,
    with workers, read on from the new process's own: another order and other draws in the workers, silently); so is
    its sampler's state where it draws from a generator of its own, which that process's iterator drew on."""
    def own(workers):
        return torch.utils.data.DataLoader(Noisy(), batch_size=BATCH, drop_last=True, num_workers=workers, sampler=(
            torch.utils.data.RandomSampler(Noisy(), generator=torch.Generator().manual_seed(3))))

    for make in (PLAIN["shuffle"], own):
        reference = read_made_after_initialize(make, workers)
        for restore_at in (2, 5, 9):
            assert torch.equal(read_made_after_initialize(make, workers, restore_at), reference), restore_at


class Cast:
    """The usual cast of a loop's batches (to bf16 for a bf16 pipeline; to float64 here) around the iterator it reads,
    with attributes of its own where given."""

    def __init__(self, batches, **own):
        self.batches = batches
        self.__dict__.update(own)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.batches).double()


def cast_each(batches):
    for batch in batches:
        yield batch.double()


def test_a_wrapper_of_the_scripts_around_the_iterator_baft_keeps_is_read_through_and_its_own_state_said():
    """A cast the loop wraps its ``RepeatingLoader`` in (a class of its own, ``map``, a generator) hid it: no position,
    and the line said to read the loader through ``RepeatingLoader``, as the script did. Now the position of what it
    wraps is kept, restored through the wrapper as read (a plain loader's iterator too); a wrapper with attributes of
    its own, which no snapshot holds, is said; one holding several iterators is not read through, said so."""
    wrappers = {"class": Cast, "map": lambda batches: map(torch.Tensor.double, batches), "generator": cast_each,
                "class with a count": functools.partial(Cast, count=0)}
    for name, wrap in wrappers.items():
        torch.manual_seed(0)
        feed = RepeatingLoader(PLAIN["shuffle"](0))
        position, reads = data_position(None, None), wrap(feed)
        said = position.find(reads)
        assert position.loader is feed.loader, name
        if name == "class with a count":
            assert said.startswith("train_batch reads a Cast, a wrapper of the script's around the RepeatingLoader "
                                   "whose position baft keeps, and its own attributes (count) are in no snapshot"), said
        else:
            assert said is None, name
        for _ in range(9):
            next(reads)
        saved, rng = position.state_dict(), torch.get_rng_state()
        reference = [next(reads) for _ in range(5)]
        torch.manual_seed(0)
        later = data_position(None, None)
        later.load_state_dict(saved)
        resumed = wrap(RepeatingLoader(PLAIN["shuffle"](0)))
        later.find(resumed)
        torch.set_rng_state(rng)
        assert all(torch.equal(next(resumed), batch) for batch in reference), name
    loader = PLAIN["shuffle"](0)
    position = data_position(None, None)
    assert position.find(Cast(iter(loader), loader=loader)) is None and position.loader is loader  # (its own loader)

    class Mix(Cast):
        def __init__(self, batches, other):
            self.batches, self.other = batches, other

    position, mix = data_position(None, None), Mix(RepeatingLoader(PLAIN["shuffle"](0)), iter(range(3)))
    assert position.find(mix) is None
    assert position.caveat(mix).startswith("train_batch reads a Mix, an iterator of the script's that hides from baft "
                                           "the iterator whose position it would keep (self.batches) among others")


@pytest.mark.parametrize("workers", [0, 2])
def test_deepspeeds_own_loader_found_as_the_loop_first_reads_it_takes_a_restore_made_before(workers):
    """``engine.deepspeed_io`` is a method of the engine ``baft.initialize`` returns: the script makes its loader
    after that, so baft finds the RepeatingLoader of it at the loop's first call (or as ``set_dataiterator`` gave it),
    the restore made before put back then. Nothing is said of it (before: that the data position would not be
    restored, though it is read through RepeatingLoader)."""
    make = DEEPSPEED["DeepSpeed's over torch's RandomSampler with its generator"]
    torch.manual_seed(0)
    feed = RepeatingLoader(make(workers))
    position = data_position(None, None)
    assert position.find(feed) is None and not_restored(position) is None
    for _ in range(9):
        next(feed)
    saved, rng = position.state_dict(), torch.get_rng_state()
    reference = torch.stack([next(feed) for _ in range(8)])
    torch.manual_seed(0)
    later = data_position(None, None)
    later.load_state_dict(saved)
    resumed = RepeatingLoader(make(workers))
    assert later.find(resumed) is None and later.loader is resumed.loader
    torch.set_rng_state(rng)
    assert torch.equal(torch.stack([next(resumed) for _ in range(8)]), reference)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_settings_a_loop_changes_come_back_with_a_plain_repeating_loaders_position(workers, capsys):
    """As a StatefulDataLoader's (above): DeepSpeedExamples' RepeatingLoader of torch's own loader, whose dataset's
    settings, collate_fn's and sampler's weights the loop changes after batch 4 and whose dataset's noise it sets
    before each batch, restored after the change in a new process and before it in a survivor. With workers an
    epoch's reads the settings its iterator was made with, and each epoch's order is drawn from the weights it began
    with (probe 25: a restored one was made with those the resumed loop had set; a dict's item and the weights were not
    kept, silently). Another object the loop puts in place of one is said once."""
    def make():
        weights = torch.ones(SAMPLES, dtype=torch.double)
        sampler = torch.utils.data.WeightedRandomSampler(weights, SAMPLES, generator=torch.Generator().manual_seed(3))
        return RepeatingLoader(torch.utils.data.DataLoader(Scaled(), batch_size=BATCH, sampler=sampler, drop_last=True,
                                                           collate_fn=Shift(), num_workers=workers))

    def run(restore_at=None):
        feed = make()
        position, out = data_position(None, feed), []
        for i in range(10):
            feed.loader.dataset.noise = 0.01 * i
            if i == 4:
                feed.loader.dataset.scale, feed.loader.collate_fn.shift = 0.5, 2
                feed.loader.dataset.opts["half"] = True
                feed.loader.sampler.weights = torch.linspace(0.1, 1.0, SAMPLES, dtype=torch.double)
            if i == restore_at:
                saved = position.state_dict()
                feed = make()
                feed.loader.dataset.noise = 0.01 * i  # the resumed loop's, before the call that restores
                position = data_position(None, feed)
                position.load_state_dict(saved)
            out.append(next(feed))
        return torch.stack(out)

    reference = run()
    for restore_at in (2, 6, 9):
        assert torch.equal(run(restore_at), reference), f"restored after batch {restore_at}"
    feed = make()
    position, weights = data_position(None, feed), feed.loader.sampler.weights
    for _ in range(8):  # into the second epoch, whose iterator a survivor with workers can make again
        next(feed)
    before = position.state_dict()
    feed.loader.dataset.scale, feed.loader.collate_fn.shift, feed.loader.dataset.opts["half"] = 0.5, 2, True
    feed.loader.sampler.weights = torch.linspace(0.1, 1.0, SAMPLES, dtype=torch.double)
    next(feed)
    data_position(None, feed).load_state_dict(before)
    assert (feed.loader.dataset.scale, feed.loader.collate_fn.shift, feed.loader.dataset.opts) == (1.0, 0, {
        "half": False})
    assert feed.loader.sampler.weights is weights
    capsys.readouterr()
    feed.loader.collate_fn, feed.loader.dataset.transform = functools.partial(mask, rng=None), Jitter(0)
    position.state_dict()
    position.state_dict()
    said = capsys.readouterr().err.splitlines()
    assert sorted(line.split(":")[1] for line in said) == [
        " the loop replaced the data loader's collate_fn (now a partial)",
        " the loop replaced the data loader's dataset.transform (now a Jitter)"]


class Jitter:
    """A transform object of the script's (torchvision's style) drawing from a generator it holds."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, sample):
        return sample + float(self.rng.normal())


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, sample):
        for transform in self.transforms:
            sample = transform(sample)
        return sample


CACHE = {}  # Cached's, where it keeps its samples in a global of its module


class Cached(torch.utils.data.Dataset):
    """Makes each sample at its first read with a draw from torch's global generator (a crop chosen at tokenization)
    and serves it from a cache after: one it holds (``self.cache``), or the global ``CACHE``; ``width`` floats a
    sample (the first two read)."""

    def __init__(self, own=True, width=2):
        self.cache, self.own, self.width = {}, own, width

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        cache = self.cache if self.own else CACHE
        if i not in cache:
            cache[i] = self.make(i)
        return cache[i][:2]

    def make(self, i):
        return torch.cat([torch.tensor([float(i)]), torch.rand(self.width - 1)])


class Tokenized(Cached):
    """As :class:`Cached`, each sample drawn from a generator seeded by its index."""

    def make(self, i):
        return torch.cat([torch.tensor([float(i)]), torch.rand(self.width - 1, generator=torch.Generator().manual_seed(i))])


class Rest(torch.utils.data.IterableDataset):
    """A stream that carries what a pass leaves over to the next in an attribute it sets itself (plain numbers, or
    ``tensors``)."""

    def __init__(self, tensors=False):
        self.rest, self.tensors = [], tensors

    def __iter__(self):
        buf = self.rest + [float(i) for i in range(5)]
        while len(buf) >= 2:
            yield torch.tensor(buf[:2])
            del buf[:2]
        self.rest = [torch.tensor(x) for x in buf] if self.tensors else list(buf)


@pytest.mark.parametrize("kind", ["own", "global", "stateful"])
def test_a_cache_the_dataset_fills_at_first_reads_from_a_random_draw_comes_back_with_the_position(kind, capsys):
    """A dataset making each sample at its first read with a draw from torch's global generator and serving it from a
    cache after (its own dict, or a global one), read through RepeatingLoader (of torch's loader, or of torchdata's
    StatefulDataLoader), restored in a new process (its cache empty) in the first epoch and in the second, and in a
    survivor that read on: it reads what the uninterrupted loader read (probe 27, H4: the restored process drew the
    samples again, other values, and moved the generator the restore set, silently). Nothing is said: the dataset
    filled its dict, nothing replaced it (before: "the loop replaced the data loader's dataset.cache")."""
    def make():
        CACHE.clear()
        if kind == "stateful":
            return StatefulDataLoader(Cached(), batch_size=BATCH, shuffle=True, drop_last=True,
                                      generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(Cached(kind == "own"), batch_size=BATCH, shuffle=True, drop_last=True)

    def run(restore_at=None, survivor=False):
        torch.manual_seed(0)
        loader = make()
        feed = RepeatingLoader(loader)
        position, out = data_position(None, loader if kind == "stateful" else feed), []
        for i in range(12):
            if i == restore_at:
                saved, rng = position.state_dict(), torch.get_rng_state()
                if survivor:
                    next(feed), next(feed)
                else:
                    loader = make()
                    feed = RepeatingLoader(loader)
                data_position(None, loader if kind == "stateful" else feed).load_state_dict(saved)
                torch.set_rng_state(rng)
            out.append(next(feed))
        return torch.stack(out)

    reference = run()
    for restore_at, survivor in ((3, False), (9, False), (3, True), (9, True)):
        assert torch.equal(run(restore_at, survivor), reference), f"restored at {restore_at}, survivor {survivor}"
    assert capsys.readouterr().err == ""


def test_a_cache_too_large_to_keep_is_said_where_filled_from_a_global_generator(capsys):
    """A cache over the size a snapshot keeps is said once where the dataset's code draws its samples from a global
    generator (the file and line of the draw), not where it draws them from a generator seeded by the index."""
    for kind in (Cached, Tokenized):
        position, feed = None, RepeatingLoader(torch.utils.data.DataLoader(kind(width=8192), batch_size=BATCH))
        position = data_position(None, feed)
        for _ in range(8):
            next(feed)
        position.state_dict()
        position.state_dict()
    said = capsys.readouterr().err.splitlines()
    line = Cached.make.__code__.co_firstlineno + 1
    assert said == [f"baft: the data loader's dataset.cache that Cached fills holds over 256 KiB in {SAMPLES} items, "
                    f"more than a snapshot keeps, and its items are made with a draw from a global generator "
                    f"(test_data_position.py:{line}): a run resumed after a fault starts with it empty and draws them "
                    f"again, other values; draw from a generator seeded by the item's index "
                    f"(torch.Generator().manual_seed(i)), or fill the cache before baft.initialize"], said


def test_an_attribute_a_stream_sets_itself_is_said_as_the_streams(capsys):
    """A stream's ``__iter__`` setting its own attribute (what a pass leaves over, for the next) is said as the
    dataset's doing (before: "the loop replaced the data loader's dataset.rest ... set it before each call from the
    engine's step", advice the loop cannot follow), where no snapshot keeps it: a remainder of tensors. One of plain
    numbers, which each pass read again begins from (probe 27's H3), is not said."""
    for tensors in (False, True):
        dataset = Rest(tensors)
        first = dataset.rest  # alive: a list made later at its address would be taken for it (said by identity)
        feed = RepeatingLoader(torch.utils.data.DataLoader(dataset, batch_size=1))
        position = data_position(None, feed)
        for _ in range(8):  # into the fourth pass: the third left one over
            next(feed)
        position.state_dict()
        assert dataset.rest is not first and len(dataset.rest) == 1
    line = Rest.__iter__.__code__.co_firstlineno + 5
    assert capsys.readouterr().err.splitlines() == [
        f"baft: Rest.__iter__ (test_data_position.py:{line}) sets the data loader's dataset.rest (now a list) itself: "
        f"no snapshot holds that object, so a run restored past this step reads with the one the script first made, "
        f"and its batches may differ from the uninterrupted run's; make it again from what each read gets (the "
        f"sample index, the pass), not kept from one read to the next"]


class Transformed(Noisy):
    def __init__(self, transform):
        self.transform = transform

    def __getitem__(self, i):
        return self.transform(torch.tensor([float(i), 0.0]))


def mask(samples, rng):
    batch = torch.utils.data.default_collate(samples)
    batch[:, 1] += torch.from_numpy(rng.random(len(batch)))
    return batch


def test_generators_a_datasets_transforms_and_a_partial_collate_fn_hold_resume_with_the_position():
    """Probe 25: a generator held by a transform object of the dataset (``Compose([Jitter(seed)])``) or bound by a
    ``functools.partial`` collate_fn drew anew after a restore, silently (baft read only datasets' attributes and a
    collate object's own): they are among the generators kept now, beside a StatefulDataLoader's state (restored at
    any batch as the uninterrupted loader reads) and among the script's for a plain loader."""
    from baft.script.rng import held_by

    def make(workers, kind=StatefulDataLoader):
        return kind(Transformed(Compose([Jitter(1)])), batch_size=BATCH, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(2),
                    collate_fn=functools.partial(mask, rng=np.random.default_rng(3)))

    assert set(held_by(make(0, torch.utils.data.DataLoader))) == {"dataset.transform.transforms[0].rng",
                                                                  "collate_fn.keywords.rng"}
    reference = read(make, 16)
    for restore_at in (3, 7, 10):
        assert torch.equal(read(make, 16, restore_at), reference), restore_at


class OwnOrder(torch.utils.data.Sampler):
    """A sampler of the script's that shuffles from state it keeps itself: a numpy ``RandomState`` of its own,
    python's global generator, or a count of its passes it seeds a generator from."""

    def __init__(self, kind):
        self.kind, self.rng, self.passes = kind, np.random.RandomState(0), 0

    def __len__(self):
        return SAMPLES

    def __iter__(self):
        if self.kind == "numpy":
            return iter(self.rng.permutation(SAMPLES).tolist())
        if self.kind == "python":
            order = list(range(SAMPLES))
            random.shuffle(order)
            return iter(order)
        self.passes += 1
        return iter(torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.passes)).tolist())


@pytest.mark.parametrize("kind", ["numpy", "python", "passes"])
def test_a_sampler_of_the_scripts_that_shuffles_from_its_own_state_resumes_at_any_batch(kind):
    """Probe 25: such a sampler's state was not recorded as each epoch began (only a ``torch.Generator`` it holds,
    else torch's generator): torch's loader makes the sampler's iterator at the first batch, so a new process's restore
    made its first, epoch 1's order, for the restored epoch, silently. Its generators of any kind, its plain values and
    (holding no ``torch.Generator``) python's and numpy's global generators are recorded now."""
    def make(workers):
        random.seed(0)  # the script seeds python's generator at its top
        return torch.utils.data.DataLoader(Noisy(), batch_size=BATCH, sampler=OwnOrder(kind), drop_last=True)

    reference = read_repeated(make, 21, 0)
    for restore_at in (3, 9, 16):
        assert torch.equal(read_repeated(make, 21, 0, restore_at)[:, :, 0], reference[:, :, 0]), restore_at


def test_a_generator_over_the_loader_that_counts_in_its_own_variables_is_said():
    """Probe 25: DDP's ``epoch = 0; while True: sampler.set_epoch(epoch); yield from loader; epoch += 1`` in a
    generator of the script's: its variables are in no snapshot, and a resumed run set an epoch of its first values
    again, silently. Said now, by name; one that counts in nothing of its own (its loop's variables aside) is not."""
    from baft.position.kept import foreign_iterator

    loader = PLAIN["shuffle"](0)

    def batches():
        epoch = 0
        while True:
            loader.sampler.epoch = epoch
            yield from loader
            epoch += 1

    def warmed():
        n = 0
        for batch in loader:
            n = n + 1
            yield batch * min(1.0, n / 20)

    def cast():
        while True:
            for batch in loader:
                batch = batch.double()
                yield batch

    said = foreign_iterator(None, batches())
    assert said.startswith("train_batch reads a generator of the script's, batches(), that counts in its own "
                           "variables (epoch): no snapshot holds a generator's variables"), said
    assert "(n)" in foreign_iterator(None, warmed())
    assert foreign_iterator(None, cast()) is None


def test_a_generator_over_the_loader_that_holds_a_batch_back_is_said():
    """Probe 26 G8: a prefetcher of the script's (``yield prev`` before ``prev = batch``) holds the batch the data
    position counts read while train_batch trains the one before: a resumed run skipped it, silently (relaunched and
    in place). Said now, by name; one that yields what it makes of each batch as it reads it is not."""
    from baft.position.kept import foreign_iterator

    loader = PLAIN["shuffle"](0)

    def prefetched():
        prev = None
        while True:
            for batch in loader:
                if prev is not None:
                    yield prev
                prev = batch

    def moved():
        for batch in loader:
            moved = batch.double()
            yield moved

    said = foreign_iterator(None, prefetched())
    assert said.startswith("train_batch reads a generator of the script's, prefetched(), that holds a batch back in "
                           "its own variables (prev)"), said
    assert foreign_iterator(None, moved()) is None


def test_a_second_repeating_loader_the_loop_reads_is_said():
    """Two tasks, each a RepeatingLoader of a plain loader, read in turn: the position kept is the first's (found at
    the first call); the second's would resume from its start."""
    from baft.position.kept import foreign_iterator

    first, second = RepeatingLoader(PLAIN["shuffle"](0)), RepeatingLoader(PLAIN["in order"](0))
    position = data_position(None, None)
    position.find(first)
    assert foreign_iterator(position, first) is None
    assert foreign_iterator(position, second).startswith("train_batch reads another RepeatingLoader than the one it "
                                                         "read first")


def read_own_iterators(make, shape, workers, restore_at=None, counting=False):
    """21 batches of a plain loader the loop takes iterators of itself (``epochs``: ``iter(loader)`` each epoch;
    ``generator``: a generator of the script's over it), found at its first read; the position saved after
    ``restore_at`` batches and restored into a new process's, which runs the script's code up to its loop again. A
    ``counting`` loop replays its calls up to the restored one (its ``iter()`` of each epoch before, reading
    nothing); one on the engine's step reads on from the iterator it takes first. Returns the batches and the position
    as each batch is read (as a snapshot there would keep it)."""
    def start():
        torch.manual_seed(0)
        loader = make(workers)
        if shape == "generator":
            def forever():
                while True:
                    yield from loader
            reader = forever()
        else:
            reader = iter(loader)
        return loader, reader, data_position(None, None)

    loader, reader, position = start()
    position.find(reader)
    out, states, per_epoch = [], [], len(loader) if shape == "epochs" else None
    while len(out) < 21:
        if per_epoch and out and len(out) % per_epoch == 0:  # the loop's iter() of its next epoch
            reader = iter(loader)
        if len(out) == restore_at:  # saved as the next step begins, after the loop's code before its call
            saved, rng = position.state_dict(), torch.get_rng_state()
            loader, reader, position = start()
            position.load_state_dict(saved)  # (before the loop's first call: kept, put back as it finds the loader)
            position.find(reader)
            if counting:
                for epoch in range(1, len(out) // per_epoch + 1):  # the replay's iter() of each epoch up to its own
                    reader = iter(loader)
            torch.set_rng_state(rng)
        states.append(as_values(position.state_dict()))
        out.append(next(reader))
    return torch.stack(out), states


def as_values(state):
    """``state`` with its tensors as their bytes, to compare with ``==``."""
    if torch.is_tensor(state):
        return state.numpy().tobytes()
    if isinstance(state, dict):
        return {key: as_values(value) for key, value in state.items()}
    return [as_values(value) for value in state] if isinstance(state, (list, tuple)) else state


def test_a_stateful_loader_given_after_the_script_took_an_iterator_with_workers_restores_its_first_epoch():
    """``RepeatingLoader(loader)`` taken before ``baft.initialize`` (its iterator drew the first epoch's order through
    two workers as it was made, before baft recorded the sampler's state): restored inside that epoch, the samples
    come in the uninterrupted order (before: another, from where that draw left the sampler's generator, silently)."""
    def start():
        torch.manual_seed(0)
        loader = LOADERS["torch's RandomSampler with its generator"](2)
        feed = RepeatingLoader(loader)
        return feed, data_position(None, loader)

    feed, position = start()
    reference = torch.stack([next(feed) for _ in range(10)])
    feed, position = start()
    read = [next(feed) for _ in range(3)]
    saved, rng = position.state_dict(), torch.get_rng_state()
    feed, later = start()
    later.load_state_dict(saved)
    torch.set_rng_state(rng)
    read += [next(feed) for _ in range(7)]
    assert torch.equal(torch.stack(read)[:, :, 0], reference[:, :, 0])  # (what workers draw: from an epoch's start)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shape", ["repeating", "generator"])
def test_a_stateful_loader_not_given_is_found_as_the_loop_first_reads_it_and_restored_there(shape, workers):
    """torchdata's ``StatefulDataLoader`` read through ``RepeatingLoader`` or a generator of the script's over it
    (``iter()`` each epoch), not given to ``baft.initialize``: found at the loop's first read (before: no position,
    said, and the data from its start), a restore made before put back then; each later batch as the uninterrupted
    loader's. With workers, an iterator taken before draws its epoch's order as it is made, before baft found the
    loader: a restore in that epoch reads on from the new process's own (before, rebuilt, it drew another order from
    where that draw left the sampler's generator, silently; given to ``baft.initialize`` after such an iterator too).
    What cannot come back is said."""
    def feed(loader):
        if shape == "repeating":
            return RepeatingLoader(loader)

        def epochs():
            while True:
                yield from loader
        return epochs()

    drawing = ("torch's RandomSampler, no generator", "a batch sampler of the script's, no generator")
    names = ("shuffle, generator", "torch's RandomSampler with its generator",
             "a dataset and collate_fn with generators of their own", *(drawing if shape == "generator" else ()))
    for name in names if not workers else names[:2]:  # (workers: slow)
        torch.manual_seed(0)
        position, reader = data_position(None, None), feed(LOADERS[name](workers))
        assert position.find(reader) is None and isinstance(position, ResumableLoader), name
        reference = [next(reader) for _ in range(21)]
        for restore_at in (1, 6, 7, 12) if not workers else (3, 12):
            torch.manual_seed(0)
            position, reader = data_position(None, None), feed(LOADERS[name](workers))
            position.find(reader)
            read = [next(reader) for _ in range(restore_at)]
            saved, rng = position.state_dict(), torch.get_rng_state()
            torch.manual_seed(0)  # a new process runs the script's code up to its loop as the uninterrupted run did
            later, reader = data_position(None, None), feed(LOADERS[name](workers))
            later.load_state_dict(saved)
            assert later.find(reader) is None
            torch.set_rng_state(rng)
            read += [next(reader) for _ in range(21 - restore_at)]
            # (with workers, the samples: what the dataset draws there resumes from an epoch boundary only)
            assert all(torch.equal(a[:, 0], b[:, 0]) if workers else torch.equal(a, b)
                       for a, b in zip(read, reference, strict=True)), f"{name}, {restore_at}"
    # one whose sampler draws from torch's generator, its first iterator taken before baft found it (a generator's is
    # taken as it first reads, after), drew that epoch's order unrecorded: said
    for name in drawing if shape == "repeating" and not workers else ():
        position = data_position(None, None)
        position.find(feed(LOADERS[name](0)))
        assert not_restored(position).startswith("the loader's sampler draws each epoch's order from torch's "
                                                 "generator, and the script took the first epoch's iterator before "
                                                 "baft kept the loader's position"), name


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shape", ["epochs", "counting epochs", "generator"])
def test_a_plain_loader_whose_iterators_the_loop_takes_resumes_at_any_batch(shape, workers, monkeypatch):
    """Found among the loop's variables (an iterator of it) or a generator's (over it) as the loop first reads it; its
    later iterators' making noted. Before, a resumed run read its data from the start (said at the first call)."""
    from baft.script.loop import THIS_PROCESS

    counting = shape == "counting epochs"
    monkeypatch.setattr(THIS_PROCESS, "counts_calls", counting)
    for name in ("shuffle", "shuffle, generator") if not workers else ("shuffle, generator",):  # (workers: slow)
        make = PLAIN[name]
        reference, kept = read_own_iterators(make, shape.split()[-1], workers)
        for restore_at in range(1, 21) if not workers else (3, 9, 14):
            resumed, kept_resumed = read_own_iterators(make, shape.split()[-1], workers, restore_at, counting)
            assert torch.equal(resumed, reference), f"{name}: restored after {restore_at}"
            # kept as the uninterrupted run's from the restore on (where nothing of the restored epoch was read, the
            # sampler's record of its epoch's start too: the restore had set it back to none)
            assert kept_resumed[restore_at:] == kept[restore_at:], f"{name}: restored after {restore_at}"


def test_a_plain_loader_is_found_wherever_the_script_holds_it_and_said_where_it_holds_none():
    """An iterator does not hold its loader: found as what holds its sampler (a closure of the script's here, none of the
    loop's variables); one made of a loader the script dropped (``iter(DataLoader(...))``) keeps no position, said
    with how to keep one; so is a subclass's with an ``__iter__`` of its own."""
    def epochs_of(loader):
        return lambda: iter(loader)

    next_epoch = epochs_of(PLAIN["shuffle"](0))
    position = data_position(None, None)
    assert position.find(next_epoch()) is None and position.loader is next_epoch.__closure__[0].cell_contents
    dropped, position = iter(PLAIN["shuffle"](0)), data_position(None, None)
    assert position.find(dropped) is None and position.loader is None
    assert position.caveat(dropped).startswith("train_batch reads an iterator of torch's DataLoader that the script no "
                                               "longer holds (iter(DataLoader(...))), which baft cannot make again")
    # a subclass of the script's that keeps torch's __iter__ is kept as torch's own (restored exactly); one with an
    # __iter__ of its own is said by its name
    class Batches(torch.utils.data.DataLoader):
        description = "a subclass that adds an attribute"

    class Own(torch.utils.data.DataLoader):
        def __iter__(self):
            return super().__iter__()

    def make(workers):
        return Batches(Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3))

    reference, _ = read_own_iterators(make, "epochs", 0)
    assert torch.equal(read_own_iterators(make, "epochs", 0, restore_at=9)[0], reference)
    own, position = Own(Noisy(), batch_size=BATCH), data_position(None, None)
    assert position.find(iter(own)) is None and position.loader is None
    assert position.caveat(iter(own)).startswith("train_batch reads an iterator of Own, whose own __iter__ baft does "
                                                 "not follow")
    # batches the loop took itself and gives as a list (probe 28: told to use the RepeatingLoader it already read)
    repeating = RepeatingLoader(PLAIN["shuffle"](0))
    collected, position = iter([next(repeating), next(repeating)]), data_position(None, None)
    assert position.find(collected) is None
    assert position.caveat(collected).startswith("train_batch reads an iterator over a list the loop made of the "
                                                 "batches it took itself (iter([...])): ")


def test_the_engines_loader_position_counts_each_step_at_the_batch_size_it_had():
    """``set_train_batch_size`` mid-run (a batch-size ramp): the position is what the loader gave, not the step times
    the micro-batches of now; a restore goes on counting from it."""
    from types import SimpleNamespace

    from baft.position.engine_loader import EngineLoaderPosition

    engine = SimpleNamespace(global_steps=0, micro_batches=2, training_dataloader=None)
    position = EngineLoaderPosition(engine)
    engine.global_steps = 3
    position.batch_size_changes()
    engine.micro_batches, engine.global_steps = 4, 5
    assert position.state_dict() == {"micro_batches": 3 * 2 + 2 * 4}
    restored = EngineLoaderPosition(SimpleNamespace(global_steps=5, micro_batches=4, training_dataloader=None))
    restored.load_state_dict(position.state_dict())
    restored.engine.global_steps = 6
    assert restored.state_dict() == {"micro_batches": 3 * 2 + 3 * 4}


def test_an_iterator_that_would_not_resume_with_the_kept_position_is_named():
    """itertools.cycle repeats its cached first pass; an iterator of another loader than the one given reads on from
    its own start. The given loader's iterators, a RepeatingLoader of it and iterators of no loader pass."""
    import itertools

    from baft.position.kept import foreign_iterator

    given = StatefulDataLoader(list(range(8)), batch_size=2)
    other = StatefulDataLoader(list(range(6)), batch_size=2)
    position = data_position(None, given)
    assert "itertools.cycle" in foreign_iterator(position, itertools.cycle(given))
    assert "another loader than the data_iterator given to baft.initialize (over another list)" in foreign_iterator(
        position, iter(other))
    for fine in (iter(given), RepeatingLoader(given), iter([1, 2]), None):
        assert foreign_iterator(position, fine) is None
    assert foreign_iterator(None, iter(other)) is None  # nothing given: said once at initialize


def test_an_iterator_of_a_new_loader_over_the_kept_loaders_dataset_is_named():
    """Probe 26 G17: a loop that makes a new DataLoader each epoch (over the same dataset) read batches the position
    of the first one's did not bring back; it was said only as a count it carries (the epoch), as a risk to a
    learning rate. Said now as what differs, the data; the kept loader's own iterators pass."""
    from baft.position.kept import foreign_iterator
    from baft.position.plain_loader import PlainLoaderPosition

    dataset = Noisy()
    first = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
    position = PlainLoaderPosition(first, iter(first))
    said = foreign_iterator(position, iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)))
    assert said.startswith("train_batch reads an iterator of another DataLoader over the Noisy than the one whose "
                           "position baft keeps (a new DataLoader each epoch?)"), said
    assert "a resumed run reads other batches" in said
    assert foreign_iterator(position, iter(first)) is None


class Task:
    """A data iterator of the script's own with a restorable position."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return self.position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_resumable_iterator_of_the_scripts_that_baft_was_not_given_is_named():
    """Task mixing: each step the loop picks one of two data iterators with state_dict(), and gives baft.initialize
    the first. The second's position is in no snapshot: resumed, it read its batches from the start again, silently
    (probe 13). One the given data_iterator holds (a mixer whose state_dict() keeps each one's) passes."""
    from baft.position.kept import foreign_iterator

    class Mixer(Task):
        def __init__(self, tasks):
            super().__init__()
            self.tasks = tasks

    first, second = Task(), Task()
    assert "reads a Task that is not the data_iterator given to baft.initialize" in foreign_iterator(
        data_position(None, first), second)
    assert foreign_iterator(data_position(None, first), first) is None
    assert foreign_iterator(data_position(None, Mixer([first, second])), second) is None
    assert foreign_iterator(None, second) is None  # nothing given: said once at initialize


def test_an_iterator_of_the_scripts_given_by_set_dataiterator_is_checked_as_train_batch_reads_it(capsys):
    """A second data phase through ``engine.set_dataiterator(phase2)``, then ``train_batch()`` with no argument: it
    reads the engine's iterator, whose position baft was not given; resumed after the switch, it read the second phase
    from its start, silently (probe 13)."""
    from types import SimpleNamespace

    from baft.position.reads import TrainBatchReads

    phase1, phase2 = Task(), Task()
    engine = SimpleNamespace(global_steps=0, global_rank=0, data_iterator=phase1)
    reads = TrainBatchReads(engine)
    reads.position = data_position(None, phase1)
    reads.call(None)
    assert "not the data_iterator given" not in capsys.readouterr().err
    engine.data_iterator = phase2
    reads.call(None)
    assert "train_batch reads a Task that is not the data_iterator given" in capsys.readouterr().err


@pytest.mark.parametrize("name", LOADERS)
def test_an_iterator_taken_before_the_restore_reads_on_from_the_restored_position(name):
    """One the script took before baft.initialize (or a survivor's in place) is made the restored one."""
    torch.manual_seed(0)
    loader = LOADERS[name](0)
    position = data_position(None, loader)  # the run saved from took its iterator after baft.initialize
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    saved, rng = position.state_dict(), torch.get_rng_state()
    reference = [next(batches) for _ in range(4)]  # to the epoch's end
    torch.manual_seed(99)
    restored = LOADERS[name](0)
    taken = iter(restored)
    data_position(None, restored).load_state_dict(saved)
    torch.set_rng_state(rng)
    assert all(torch.equal(next(taken), batch) for batch in reference)


@pytest.mark.parametrize("name", LOADERS)
def test_a_survivor_that_read_on_into_the_next_epoch_reads_again_from_the_restored_position(name):
    """In place, a survivor's loader has read on past the restored position, here into the next epoch, its
    sampler drawing that epoch's order: restored (by a position made again, as the survivor's initialize is),
    its iterator reads the restored epoch on and every later one as the uninterrupted loader did (before, torch's
    samplers drew another order: torchdata rebuilds the restored iterator from the sampler as it stands)."""
    torch.manual_seed(0)
    loader = LOADERS[name](0)
    position = data_position(None, loader)
    feed = RepeatingLoader(loader)
    for _ in range(3):
        next(feed)
    saved, rng = position.state_dict(), torch.get_rng_state()
    reference = [next(feed) for _ in range(12)]  # the first epoch's end, the second, into the third
    data_position(None, loader).load_state_dict(saved)
    torch.set_rng_state(rng)
    assert all(torch.equal(next(feed), batch) for batch in reference)


@pytest.mark.parametrize("sampler", [torch.utils.data.DistributedSampler, StatefulDistributedSampler])
def test_a_distributed_sampler_restores_as_the_epoch_its_script_set_when_the_restored_epoch_began(sampler):
    """``set_epoch`` seeds each epoch's order (in no sampler's state, torchdata's included); the survivor's sampler
    stands at a later epoch than the restored one, a new process's at the first."""
    def loader():
        return StatefulDataLoader(Noisy(), batch_size=BATCH, drop_last=True,
                                  sampler=sampler(Noisy(), num_replicas=1, rank=0, shuffle=True, seed=6))

    def epoch(data, position, e):  # the script's loop, each epoch
        data.sampler.set_epoch(e)
        return iter(data)

    survivor = loader()
    position = data_position(None, survivor)
    batches = epoch(survivor, position, 0)
    next(batches)
    batches = epoch(survivor, position, 1)
    next(batches)
    saved = position.state_dict()
    reference = list(batches)
    live = epoch(survivor, position, 2)  # the survivor's loop went on to the next epoch
    data_position(None, survivor).load_state_dict(saved)
    samples = [b[:, 0].tolist() for b in reference]  # (not the noise: torch's generator, which baft sets)
    assert [b[:, 0].tolist() for b in live] == samples, "the survivor's"
    fresh = loader()
    data_position(None, fresh).load_state_dict(saved)
    assert [b[:, 0].tolist() for b in iter(fresh)] == samples, "a new process's"


@pytest.mark.parametrize("name", ["shuffle, generator", "torch's RandomSampler with its generator"])
def test_an_iterator_taken_again_before_the_restored_one_read_is_made_the_restored_one(name):
    """A trainer takes iter() of its loader as it is made and again as its loop starts, as the run it resumes did:
    the first, the restored one, is left unread, and train_batch reads the second; that one goes on from the restored
    position (before, it read the epoch from its start). Once the restored position is an epoch's end, a new
    iterator is the next epoch's."""
    torch.manual_seed(0)
    loader = LOADERS[name](0)
    position = data_position(None, loader)
    iter(loader)  # the trainer's __init__
    batches = iter(loader)  # its loop
    for _ in range(3):
        next(batches)
    saved, rng = position.state_dict(), torch.get_rng_state()
    reference = [next(batches) for _ in range(4)]  # to the epoch's end
    with pytest.raises(StopIteration):
        next(batches)
    next_epoch = next(iter(loader))[:, 0]
    torch.manual_seed(99)
    restored = LOADERS[name](0)
    again = data_position(None, restored)
    again.load_state_dict(saved)
    iter(restored)
    taken = iter(restored)
    again.reads(taken)  # train_batch's first call
    torch.set_rng_state(rng)
    assert all(torch.equal(next(taken), batch) for batch in reference)
    with pytest.raises(StopIteration):
        next(taken)
    following = iter(restored)  # the next epoch's: the restored one has read
    again.reads(following)
    assert torch.equal(next(following)[:, 0], next_epoch)


def test_a_loop_that_takes_its_batches_from_the_kept_loader_itself_is_said_to_skip_them_when_resumed(capsys):
    """``for batch in loader: engine.train_batch(iter([batch]))``: the position baft saves as the next step begins is
    past the batch the loop took for it, so a resumed run would skip it; said once. An iterator of the loader read
    by train_batch, a wrapper of the loader train_batch reads (DeepSpeed's RepeatingLoader, as README's *Resumable
    data* gives it), or the loop's own batches from elsewhere, are not."""
    from deepspeed.utils import RepeatingLoader
    from types import SimpleNamespace

    from baft.position.reads import TrainBatchReads

    def calls(feed) -> str:
        engine = SimpleNamespace(global_steps=0, global_rank=0)
        reads = TrainBatchReads(engine)
        loader = LOADERS["shuffle, generator"](0)
        reads.position = data_position(None, loader)
        feed(reads, loader, engine)
        return capsys.readouterr().err

    def train_batch(reads, data_iter, engine, micro_batches: int):  # what the engine's train_batch does with them
        reads.call(data_iter)
        for _ in range(micro_batches):
            next(data_iter)
        engine.global_steps += 1
        reads.ended()

    def own_batches(reads, loader, engine):
        for batch in loader:
            train_batch(reads, iter([batch]), engine, 1)

    def the_loaders_iterator(reads, loader, engine):
        batches = iter(loader)
        for _ in range(3):
            train_batch(reads, batches, engine, 1)

    def a_wrapper(reads, loader, engine):
        batches = RepeatingLoader(loader)
        for _ in range(2 * len(loader)):
            train_batch(reads, batches, engine, 1)

    def elsewhere(reads, loader, engine):
        for batch in [torch.zeros(2)] * 3:
            train_batch(reads, iter([batch]), engine, 1)

    said = calls(own_batches)
    assert said.count("the loop takes its batches from the data loader itself") == 1, said
    assert "takes its batches" not in calls(the_loaders_iterator) + calls(a_wrapper) + calls(elsewhere)


class CycleIterator:
    """litgpt's (litgpt/utils.py): the loader, again each epoch, counted."""

    def __init__(self, iterable):
        self.iterable = iterable
        self.epoch = 0
        self._iterator = None

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self.iterable)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.iterable)
            self.epoch += 1
            return next(self._iterator)

    def __iter__(self):
        return self


def test_the_counts_of_a_wrapper_of_the_script_around_the_loader_come_back_where_train_batch_reads_it():
    """litgpt's ``CycleIterator`` over the loader, read by ``train_batch``: the loader's position was kept, not the
    wrapper's ``epoch``, and a resumed run logged "Epoch 2" where the uninterrupted one logged "Epoch 4", silently
    (probe 22). A wrapper of the script's own that holds the kept loader has its numbers kept with the position, and
    set as a new process's ``train_batch`` first reads it (or at once where it read it already: a survivor in place);
    a library's wrapper (DeepSpeed's ``RepeatingLoader``) or the loader's own iterator keeps nothing of its own."""
    from types import SimpleNamespace

    from baft.position.reads import TrainBatchReads

    def reads_of(loader):
        reads = TrainBatchReads(SimpleNamespace(global_steps=0, global_rank=0))
        reads.position = data_position(None, loader)
        return reads

    loader = LOADERS["shuffle, generator"](0)
    reads = reads_of(loader)
    wrapper = CycleIterator(loader)
    reads.call(wrapper)
    for _ in range(len(loader) * 2 + 1):
        next(wrapper)
    kept = reads.reader_state()
    assert kept == {"type": "CycleIterator", "counts": {"epoch": 2}}, kept
    again = reads_of(LOADERS["shuffle, generator"](0))
    again.restore_reader(kept)
    resumed = CycleIterator(again.position.loader)
    assert resumed.epoch == 0
    again.call(resumed)
    assert resumed.epoch == 2
    survivor = reads_of(loader)
    survivor.call(wrapper)
    wrapper.epoch = 3
    survivor.restore_reader(kept)
    assert wrapper.epoch == 2
    for other in (RepeatingLoader(loader), iter(loader)):
        reads.call(other)
        assert reads.reader_state() is None


def test_with_persistent_workers_an_iter_that_resets_the_restored_iterator_reads_on_from_the_restored_position():
    """With ``persistent_workers`` the loader's ``iter()`` resets the one iterator it keeps (its sampler draws the
    epoch's order) rather than make a new one. A loop that counts its calls and takes ``iter()`` each epoch, resumed
    in the second, replays the first epoch's ``iter()`` (the restored iterator) and the second's, which reset it:
    that one is made the restored one, as a new iterator is (``Protection.replayed``); so is a trainer's second
    ``iter()`` before its loop (read by ``train_batch``). Before, both read a third epoch's order, silently, and an
    epoch's reset iterator was not told from the last (probe 11: in place, a survivor that took it trained on)."""
    from types import SimpleNamespace

    from baft.position.reads import TrainBatchReads

    def make():
        return StatefulDataLoader(Noisy(), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=2,
                                  persistent_workers=True, generator=torch.Generator().manual_seed(3))

    torch.manual_seed(0)
    loader = make()
    position = data_position(None, loader)
    engine = SimpleNamespace(global_steps=0, global_rank=0)
    reads = TrainBatchReads(engine)
    reads.position = position
    for epoch in range(2):
        batches = iter(loader)
        reads.call(batches)  # train_batch: each epoch's reset iterator a new reader
        assert reads.epoch_began == (None if epoch == 0 else 2) and position.new_reader == (epoch == 1)
        next(batches)
        engine.global_steps += 1
    for _ in range(2):
        next(batches)
    saved = position.state_dict()
    samples = [b[:, 0].tolist() for b in batches]  # the second epoch's rest (not the noise: drawn in workers)
    for replay in (True, False):
        restored = make()
        again = data_position(None, restored)
        again.load_state_dict(saved)
        iter(restored)  # the replayed first epoch's, or the trainer's __init__
        taken = iter(restored)  # the second epoch's, or its loop's: resets the restored iterator
        if replay:
            assert again.taken_since_restore()
            again.load_state_dict(saved)  # what Protection.replayed does
        else:
            again.reads(taken)  # train_batch's first call
        assert [b[:, 0].tolist() for b in taken] == samples, "replayed" if replay else "taken again"
        restored._iterator._shutdown_workers()
    loader._iterator._shutdown_workers()


CROPS = np.random.default_rng(8)  # a collate function's generator, a global of its module


def crop_collate(batch):
    return torch.stack(batch) * float(CROPS.uniform(0.5, 1.5))


def test_the_generators_a_script_names_and_its_collate_function_reads_are_kept_with_the_rng_states(monkeypatch):
    """Probe 16: a generator of the script's own (``rng = np.random.default_rng(0)`` at its top), drawn by its loop
    between steps or by a collate function reading it as a global, was in no state: a resumed run drew from it as
    first seeded, silently. Named at ``baft.initialize``, it is among the RNG states a snapshot keeps."""
    from baft.script import rng

    monkeypatch.setattr(rng, "_NAMED", {})
    flips = random.Random(9)  # a variable of the script's call of baft.initialize
    loader = StatefulDataLoader(Noisy(), batch_size=BATCH, collate_fn=crop_collate)
    rng.hold_script_generators(sys._getframe(), RepeatingLoader(loader))
    assert {"test_the_generators_a_script_names_and_its_collate_function_reads_are_kept_with_the_rng_states.flips",
            "collate_fn.CROPS"} <= set(rng._NAMED)
    kept = rng.from_json(json.loads(json.dumps(rng.to_json(rng.rng_states()))))
    first = (flips.random(), [batch[0, 0].item() for batch in loader])
    assert rng.drawn_between(kept, rng.rng_states()) == ["torch", "modules"]
    rng.set_rng_states(kept)
    assert (flips.random(), [batch[0, 0].item() for batch in loader]) == first


def killed_once_trains_the_same(tmp_path, script: str, step: int, resumed: int) -> subprocess.CompletedProcess:
    """``baft train`` of ``tests/scripts/<script>`` on 2 ranks, rank 1 killed in step ``step``'s backward and the job
    relaunched: it resumes from step ``resumed`` and trains each step again as it first trained it (the ranks' state
    digests); the run."""
    digests = tmp_path / "digests"
    run = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "1",
                          "--run-dir", str(tmp_path / "run"), "--fault", f"rank=1,step={step},phase=backward", "--",
                          str(Path(__file__).parent / "scripts" / script)],
                         capture_output=True, text=True, env=launch_env({DIGESTS_ENV: str(digests)}), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resumed from step {resumed}" in run.stdout + run.stderr, run.stdout[-3000:]
    assert redone_differ(digests) == []
    return run


@pytest.mark.slow
def test_the_scripts_own_generators_resume_where_its_loop_its_collate_function_and_its_dataset_draw(tmp_path):
    """Probe 16: a generator the script names (a variable its loop drew a learning rate from, a module global its
    collate function read) was in no state, and one its dataset held, kept with the loader's state as the next
    iteration began, was drawn by the loop before that: resumed, each drew anew or once more, silently."""
    killed_once_trains_the_same(tmp_path, "script_generators.py", step=6, resumed=4)


@pytest.mark.slow
def test_settings_the_loop_changes_resume_in_the_workers_of_the_restored_epoch_and_a_replaced_collate_fn_is_said(
        tmp_path):
    """Probe 25: a curriculum's noise the loop sets on its dataset before each call and a dict's item it sets once,
    read in a plain DataLoader's workers: the restored epoch's iterator was made with the dataset as the resumed loop
    had it (the restored step's noise, the dict's first item), not as that epoch began, silently; a collate_fn the
    loop replaced was in no snapshot, silently. Killed inside the second epoch: its steps trained again are the same
    as first trained, and the collate_fn is said."""
    run = killed_once_trains_the_same(tmp_path, "data_settings.py", step=7, resumed=5)
    assert "baft: the loop replaced the data loader's collate_fn (now a partial)" in run.stderr, run.stderr[-3000:]


def test_a_stream_that_reads_a_file_it_holds_open_is_named_where_its_position_cannot_be_kept(tmp_path):
    """Probe 16: an ``IterableDataset`` that opens its file once (in ``__init__``) and reads it in ``__iter__`` was
    restored in a survivor by reading on from where that file stood, not from its start: other batches, silently.
    Probe 28 K3: a seekable file's position is kept as each pass begins (above), and such a stream is not named; one
    whose position cannot be kept (a pipe, a text file read part-way by ``for line in f``) is, and every rank is
    replaced in place. A stream that opens its file in ``__iter__`` is not named."""
    from baft.position.kept import open_file_stream

    path = tmp_path / "lines.txt"
    path.write_text("".join(f"{i}\n" for i in range(8)))

    class Held(torch.utils.data.IterableDataset):
        def __init__(self, handle):
            self.handle = handle

        def __iter__(self):
            return (torch.tensor([float(line)]) for line in self.handle)

    class Opened(torch.utils.data.IterableDataset):
        def __iter__(self):
            with open(path) as handle:
                yield from (torch.tensor([float(line)]) for line in handle)

    named = lambda dataset: open_file_stream(ResumableLoader(StatefulDataLoader(dataset, batch_size=2)))
    held = Held(open(path))
    assert named(held) is None
    next(held.handle)  # part-way through a for loop: its tell() is refused
    assert named(held) == (
        "the Held the loader streams reads a file it holds open whose position cannot be kept, dataset.handle "
        "(telling position disabled by next() call: read it with readline()): a restore reads the stream again from "
        "where that file stands, not from where the pass began")
    held.handle.close()
    assert named(held) is None
    read_end, write_end = os.pipe()
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        assert "dataset.handle (not seekable)" in named(Held(pipe))
    assert named(Opened()) is None


def test_a_stream_whose_pass_leaves_its_file_part_way_through_a_for_loop_is_said_once(tmp_path, capsys):
    """Probe 28 K3: a text file a pass leaves part-way through ``for line in f`` (a break) refuses ``tell()`` as the
    next pass begins: its position cannot be kept there, said once, by name."""
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"{i}\n" for i in range(8)))

    class Broken(torch.utils.data.IterableDataset):
        def __init__(self):
            self.f = open(path)

        def __iter__(self):
            for i, line in enumerate(self.f):
                yield torch.tensor(float(line))
                if i % 2:
                    break

    feed = RepeatingLoader(torch.utils.data.DataLoader(Broken(), batch_size=1))
    data_position(None, feed)
    for _ in range(6):
        next(feed)
    said = capsys.readouterr().err
    assert said.count("baft: the stream's dataset.f cannot tell where it stands as a pass begins") == 1, said


def test_a_stream_holding_a_pipe_open_that_the_loop_reads_is_said_once_as_train_batch_first_reads_it(capsys):
    """Probe 28 K3: a loader baft finds at the loop's first call (not given to baft.initialize, K3's shape) whose
    stream holds a file whose position cannot be kept was not said at all; said once, by rank 0."""
    from types import SimpleNamespace

    from baft.position.found_position import PositionFoundLater
    from baft.position.reads import TrainBatchReads

    class Piped(torch.utils.data.IterableDataset):
        def __init__(self, handle):
            self.handle = handle

        def __iter__(self):
            return (torch.tensor([float(line)]) for line in self.handle)

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as sink:
        sink.write("".join(f"{i}\n" for i in range(8)))
    with os.fdopen(read_end) as pipe:
        engine = SimpleNamespace(global_steps=0, global_rank=0, baft=SimpleNamespace(config=SimpleNamespace(
            policy="baft")))
        reads = TrainBatchReads(engine)
        reads.position = PositionFoundLater(engine)
        feed = RepeatingLoader(torch.utils.data.DataLoader(Piped(pipe), batch_size=2))
        for _ in range(2):
            reads.call(feed)
            next(feed)
            engine.global_steps += 1
            reads.ended()
    said = capsys.readouterr().err
    assert said.count("reads a file it holds open whose position cannot be kept, dataset.handle (not seekable)") == 1, \
        said
