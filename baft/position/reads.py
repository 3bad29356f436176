"""What ``train_batch`` reads, call by call, against the loader baft keeps the position of.

baft saves a data position as each step begins (:mod:`baft.position`). The loop's way of giving
``train_batch`` its data decides whether that position is where a resumed run must read on from:
:class:`TrainBatchReads` watches each call's iterator and says, once and in one line, where it is not (an
iterator baft keeps no position of; batches the loop took from the loader itself between the calls), notes the
step an epoch's new iterator first trained (a survivor in place cannot go back past it), and has every rank
replaced after a fault where each call reads an iterator of its own.
"""

from __future__ import annotations

import numbers
import sys
from typing import Optional

from baft.position.first_iterators import stop_noting
from baft.position.found_position import PositionFoundLater
from baft.position.iterators import epoch_mark
from baft.position.kept import foreign_iterator, not_restored, say_open_file_stream
from baft.position.repeated_loader import keep_epochs
from baft.position.resumable import ResumableLoader
from baft.script.loop import THIS_PROCESS
from baft.script.source import library
from baft.snapshot.build import warn


class TrainBatchReads:
    """The iterators ``engine.train_batch`` was given; :attr:`position`: the data position baft keeps (what
    :func:`baft.position.kept.data_position` gave), or None."""

    def __init__(self, engine):
        self.engine = engine
        self.position = None
        self.epoch_began: Optional[int] = None  # the step the loop first trained from its latest iterator of the loader
        self._read = set()  # the ids of the iterators train_batch was given, each checked once
        self._last_read = None  # the iterator train_batch was given at its last call
        self._last_mark = None  # and its epoch_mark where it was the kept loader's
        self._kept_at_last_read = (None, 0)  # the loader's iterator as train_batch last returned, and what it had read
        self._said_pulled = False
        self._said_foreign: set[str] = set()  # what foreign_iterator said of the iterators read
        self._last_evaluated = (None, 0)  # the iterator eval_batch last read, and the step it was called after
        self._said_evaluated = False
        self._reader_restored: Optional[dict] = None  # a wrapper's counts a restore set, until train_batch reads it

    def made(self, loader) -> None:
        """The engine made ``loader`` for the script (``engine.deepspeed_io``), before its first ``iter()``: what each
        of its epochs is made from is noted (:func:`~baft.position.repeated_loader.keep_epochs`), for its position
        where the loop repeats it."""
        keep_epochs(loader)

    def call(self, data_iter) -> None:
        """``train_batch`` reads ``data_iter``: said once where it would not resume with the data position kept;
        where it is another iterator than at the last call, and not one of the loader baft keeps (an epoch's), the
        call's own (``train_batch(iter(batches))``): a survivor in place would train the steps since the restored
        one from it, so a fault replaces every rank."""
        stop_noting()
        if isinstance(self.position, PositionFoundLater) and self._last_read is None:
            self._find_position(data_iter if data_iter is not None else getattr(self.engine, "data_iterator", None))
        if isinstance(self.position, ResumableLoader):
            self.position.reads(data_iter)
        self._put_reader_back(data_iter)
        kept = self.kept_iterator()
        before, read_before = self._kept_at_last_read
        if data_iter is not kept and kept is before and getattr(kept, "_num_yielded", 0) != read_before:
            self._pulled_by_the_loop()
        last, self._last_read = self._last_read, data_iter
        # with persistent workers the loader's iter() resets the one iterator it keeps: the same object, a new epoch
        mark = epoch_mark(kept) if data_iter is kept else None
        last_mark, self._last_mark = self._last_mark, mark
        another = last is not None and (data_iter is not last or (mark is not None and mark is not last_mark))
        if isinstance(self.position, ResumableLoader):  # a reader of its own each epoch, or one kept across epochs
            self.position.new_reader = another
        if another:
            if data_iter is kept:  # an epoch's
                self.epoch_began = self.engine.global_steps + 1
            else:
                THIS_PROCESS.no_survivors(self.engine, "train_batch reads another iterator than at its last call (one "
                                                       "made for each call?): a survivor would train the steps since "
                                                       "the restored one from the latest call's",
                                          "Pass train_batch the same iterator every call, or one of the data iterator "
                                          "given to baft.initialize, for its survivors to recover in place")
        read = data_iter if data_iter is not None else getattr(self.engine, "data_iterator", None)  # set_dataiterator's
        if read is None or id(read) in self._read:
            return
        self._read.add(id(read))
        why = foreign_iterator(None if isinstance(self.position, PositionFoundLater) else self.position, read)
        if why and why not in self._said_foreign and self.engine.global_rank == 0:
            self._said_foreign.add(why)  # (one loop may read a new such iterator each epoch)
            warn(self.engine, why)

    def _find_position(self, read) -> None:
        """The loop's first call reads ``read``: the position kept is of the loader it reads, where baft keeps one
        (:class:`PositionFoundLater`); what a restore of it cannot bring back is said, or that no position is kept."""
        position = self.position
        said = [position.find(read)]
        said.append(position.caveat(read) if isinstance(position, PositionFoundLater) else not_restored(position))
        if not isinstance(position, PositionFoundLater) and self.engine.baft.config.policy != "none":
            say_open_file_stream(self.engine, position)
        for message in said:
            if message and self.engine.global_rank == 0 and self.engine.baft.config.policy != "none":
                warn(self.engine, message)

    def carry_on(self, before: "TrainBatchReads") -> None:
        """In a survivor recovered in place, whose new engine's calls go on from its earlier one's (``before``): the
        calls that one saw, as if this one had (the iterator the last read, the step its epoch began): a survivor's
        next epoch's iterator is another reader, as the uninterrupted run's was, and a later fault's restore is checked
        against that epoch's start."""
        self.epoch_began, self._read, self._last_read, self._last_mark = (before.epoch_began, before._read,
                                                                          before._last_read, before._last_mark)
        self._said_pulled, self._last_evaluated, self._said_evaluated = (before._said_pulled, before._last_evaluated,
                                                                         before._said_evaluated)
        self._said_foreign = before._said_foreign
        if isinstance(self.position, PositionFoundLater):  # (first: the loader it keeps, to tell what is its epoch's)
            self.position.carry_on(before.position)
        kept = self.kept_iterator()
        if kept is not None and self._last_read is kept:
            # the one it read last, made the restored one (another epoch mark): read on, not another reader (probe 19:
            # the snapshots of the step the survivor trained again said one came, unlike the uninterrupted run's)
            self._last_mark = epoch_mark(kept)
        self._put_reader_back(self._last_read)  # before its call trains the steps since the restored one again

    def reader_state(self) -> Optional[dict]:
        """The counts of the iterator ``train_batch`` reads where it is a wrapper of the script's own around the loader
        baft keeps (litgpt's ``CycleIterator``, its ``epoch``): its attributes that are numbers or strings, with its
        type's name; None where it is no such wrapper. The loader's position is kept, not the wrapper's own counts
        (probe 22: a resumed run logged "Epoch 1" where the uninterrupted one logged "Epoch 4", silently)."""
        read = self._last_read
        loader = self.position.loader if isinstance(self.position, ResumableLoader) else None
        if loader is None or read is None or read is loader or not hasattr(read, "__dict__"):
            return None
        module = sys.modules.get(type(read).__module__)
        if library(getattr(module, "__file__", None) or "<none>") or not any(v is loader for v in vars(read).values()):
            return None
        counts = {k: v for k, v in vars(read).items() if isinstance(v, (bool, numbers.Number, str))}
        return {"type": type(read).__qualname__, "counts": counts} if counts else None

    def restore_reader(self, state: dict) -> None:
        """Set the wrapper's counts :meth:`reader_state` kept: now where ``train_batch`` read it already (a survivor in
        place), else as it first reads it."""
        self._reader_restored = state
        self._put_reader_back(self._last_read)

    def _put_reader_back(self, read) -> None:
        state = self._reader_restored
        if state is None or read is None or type(read).__qualname__ != state["type"]:
            return
        self._reader_restored = None
        for name, value in state["counts"].items():
            setattr(read, name, value)

    def evaluated(self, data_iter) -> None:
        """``eval_batch`` read ``data_iter`` in a loop on the engine's step: said once where an evaluation after an
        earlier step read it too (an iterator kept from one evaluation to the next, DeepSpeedExamples'
        ``RepeatingLoader`` over held-out data). No snapshot holds where it stands, so a resumed run's evaluations
        would read other batches than the uninterrupted run's, silently (README: Limits)."""
        last, step = self._last_evaluated
        self._last_evaluated = (data_iter, self.engine.global_steps)  # held: an id could be a later iterator's
        if data_iter is None or data_iter is not last or step == self.engine.global_steps or self._said_evaluated:
            return
        self._said_evaluated = True
        if self.engine.global_rank == 0 and data_iter is not self.kept_iterator():
            warn(self.engine, f"eval_batch reads the iterator an evaluation after step {step} read: where it stands "
                              f"between evaluations is in no snapshot, so after a restore the evaluations would read "
                              f"other batches than the uninterrupted run's. Make it anew at each evaluation, or keep "
                              f"its position in client_state= of baft.initialize")

    def ended(self) -> None:
        """``train_batch`` returned: what the kept loader's latest iterator has read by now, for the next call to
        tell batches the loop took between the calls (:meth:`call`) from those the call read through a wrapper of
        the loader (``RepeatingLoader``, ``itertools.cycle``)."""
        kept = self.kept_iterator()
        self._kept_at_last_read = (kept, getattr(kept, "_num_yielded", 0))

    def kept_iterator(self):
        """The latest iterator of the loader baft keeps the position of, or None (no such loader, or no iterator
        taken yet)."""
        return self.position.loader._iterator if isinstance(self.position, ResumableLoader) else None

    def _pulled_by_the_loop(self) -> None:
        """The loop read batches of the loader baft keeps between two calls, and gives ``train_batch`` iterators of
        its own (``for batch in loader: engine.train_batch(iter([batch]))``): said once."""
        if self._said_pulled or self.engine.global_rank != 0:
            return
        self._said_pulled = True
        warn(self.engine, "the loop takes its batches from the data loader itself and gives train_batch an iterator of "
                   "them at each call: baft saves the loader's position as the next step begins, after the loop took "
                   "that step's batches, so a resumed run would skip them. Give train_batch an iterator of the loader "
                   "(batches = iter(loader)), from which it reads the micro-batches itself")
