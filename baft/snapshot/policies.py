"""Snapshot policies as engine hooks; the bubble-aware one is baft's executor.

Every in-memory policy takes the snapshot of step k during iteration k+1 and commits it
before optimizer step k+1 (the last step's, when training stops: :meth:`SnapshotPolicy.close`).
Parameters and optimizer state do not change until then; the module's buffers do, in the
forwards (BatchNorm's running statistics, a counter), so every policy copies them as the
iteration begins, in its stall. The policies differ in when the other chunks are copied:

* :class:`BubbleExecutor` (``baft``): inside the bubbles, whatever is left is flushed before
  the optimizer step changes the state (:meth:`~baft.pipeline.hook.InstructionHook.before_update`).
  On CPU the host copies while the stage waits in a receive, or for the other stages at the
  optimizer step, chunk by chunk, until the wait is over; with a copy stream (a GPU, where the
  host does not wait) each bubble's planned chunks are queued on the stream where the bubble
  begins (:mod:`baft.snapshot.copiers`).
* :class:`SyncCopy` (``sync-copy``): everything at the start of the iteration (CheckFreq's
  snapshot phase).
* :class:`ThreadCopy` (``thread-copy``): a background thread, ignoring bubbles.

Each records, per iteration, the *stall*: seconds the trainer spent in the policy outside
bubbles (flush, synchronous copy, join); the bubble executor also records where its copies
ran (:class:`CopySpans`). Checksums and the commit record are written after the fence, by a
:class:`~baft.snapshot.copy.Sealer` thread, off the trainer's path; with four slots the next
snapshot is copied while one seals, with three it waits for the seal (``seal_wait``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional

from baft.config import DEFAULT_CHUNK_BYTES
from baft.errors import script_raised
from baft.pipeline.hook import InstructionHook
from baft.script.loop import THIS_PROCESS
from baft.script.rng import rng_states
from baft.snapshot import state
from baft.snapshot.copiers import Copier, HostCopier
from baft.snapshot.copy import Sealer, Snapshot, StateSource
from baft.snapshot.layout import CommitRecord
from baft.snapshot.metrics import Periodic, PolicyMetrics
from baft.snapshot.planner import RankPlan
from baft.snapshot.slots import SnapshotWriter, host_room, rank_dir, slot_count
from baft.snapshot.streams import CopyStream


class SnapshotPolicy(InstructionHook, Periodic):
    """Takes a snapshot at every ``period``-th step boundary into the rank's shared-memory slots."""

    stream: Optional[CopyStream] = None  # where snapshots queue their copies; None: the host copies them

    def __init__(self, node_root: str, period: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES, data_iterator=None,
                 link=None):
        self.node_root, self.period, self.chunk_bytes = node_root, period, chunk_bytes
        self.data_iterator, self.link = data_iterator, link
        self.source: Optional[StateSource] = None
        self.writer: Optional[SnapshotWriter] = None
        self.snapshot: Optional[Snapshot] = None
        self.stall = 0.0  # this iteration's
        self.seal_wait = 0.0  # this iteration's wait for a slot the previous snapshots' seals held (in the stall)
        self.taken = 0  # snapshots fenced (their copies done); committed ones are in ``committed_steps``
        self.committed_steps: list[int] = []  # not the records: tens of KB each, one per step of a long run
        self.sealer = Sealer(self._committed)
        self.engine = None  # the engine of the latest iteration, and whether that iteration ended
        self.at_step_boundary = False
        self.last_step: Optional[int] = None  # of the newest snapshot begun
        self.taken_before = 0  # taken when this iteration started
        self.said_missing = False  # that the optimizer's state holds snapshots back
        self.rng_end: Optional[dict] = None  # the generators' states as the latest iteration ended
        self.rng_start: Optional[dict] = None  # and as it started, where the loop counts its calls
        self.restored_items: Optional[tuple[int, dict]] = None  # (step, its small state) as a restore found them

    def due(self, engine) -> bool:
        step = engine.global_steps
        if not (step > 0 and self.wanted(step)):
            return False
        missing = state.optimizer_state_missing(engine)
        if missing is not None and step > 1 and not self.said_missing:
            self.said_missing = True  # a fault now would restart from the start: say so, once
            print(f"baft: rank {engine.global_rank} takes no snapshot: {missing}", file=sys.stderr, flush=True)
        return missing is None

    def metrics(self) -> PolicyMetrics:
        """This policy's counters after the latest iteration."""
        return PolicyMetrics(snapshots=self.taken, snapshotted=self.taken > self.taken_before, stall=self.stall,
                             seal=self.sealer.seconds, seal_cpu=self.sealer.cpu_seconds, seal_wait=self.seal_wait)

    def prepare(self, engine) -> None:
        """Lay out the state and map the slots (once the optimizer state exists)."""
        if self.source is None:
            self.source = StateSource(engine, self.chunk_bytes)
            if self.link is not None:
                count = self.link.hello(self.source)  # the manager sizes the slots, or refuses
            else:
                rank = engine.global_rank
                count = slot_count(self.source.layout.nbytes, host_room(self.node_root, rank),
                                   str(rank_dir(self.node_root, rank)))
            self.writer = SnapshotWriter(self.node_root, engine.global_rank, self.source.layout, count)

    def iteration_start(self, engine):
        self.stall = self.seal_wait = 0.0
        self.taken_before = self.taken
        self.engine, self.at_step_boundary = engine, False
        # where the snapshot of the step this iteration trains tells a replay of the loop's calls up to it whether the
        # loop's code before the call left the generators as this run's did (RngRestore.between_steps)
        counted = THIS_PROCESS.counts_calls and self.wanted(engine.global_steps + 1)
        rng_now = rng_states() if counted else None  # no draw comes before the snapshot's: taken once for both
        if self.due(engine):
            self.prepare(engine)
            start = time.perf_counter()
            self.sealer.wait(leave=self.writer.in_flight - 1)  # a slot for this snapshot, beside those sealing
            self.seal_wait = time.perf_counter() - start
            self.stall += self.seal_wait
            self.begin(engine, rng_now=rng_now)
            self.started()
        self.rng_start = rng_now

    def iteration_end(self, engine):
        self.at_step_boundary = True
        # where the next iteration snapshots this step: the generators the script's loop draws from until then
        self.rng_end = rng_states() if self.wanted(engine.global_steps) else None

    def keep_items(self, step: int, items: dict) -> None:
        """The small state of ``step``, as a restore found it: the snapshot of the restored step, taken again by the
        first resumed iteration, holds what the first one held."""
        self.restored_items = (step, items)

    def begin(self, engine, at_exit: bool = False, rng_now: Optional[dict] = None) -> None:
        """Start the snapshot of the engine's current step: of the tensors the engine holds now, the module's
        buffers copied here, before a forward changes them (their time counted as stall); the rest follow.
        ``at_exit``: taken as the process ends (:meth:`snapshot_final`), not as an iteration starts. ``rng_now``: the
        generators' states now, where already taken."""
        self.prepare(engine)
        self.source.refresh()
        step = engine.global_steps
        if self.restored_items and self.restored_items[0] == step:
            items = self.restored_items[1]
        else:
            items = {**state.capture_items(engine, self.data_iterator),
                     **state.capture_rng(self.rng_end, self.rng_start, rng_now),
                     "ended_at": time.time()}  # the step's end: where a recovery's lost work (T0) starts
            if self.last_step is None and self.restored_items is None:
                items["first"] = True  # the run's first snapshot: without it every stage holds, a restart starts over
            if at_exit:
                # before the loop's code for the next step ran: a restore sets the state the loop reads there once,
                # not again as the first resumed iteration starts (state.restore_items)
                items["at_exit"] = True
        self.snapshot = Snapshot(self.source, self.writer, step, items, self.stream)
        self.last_step = step
        start = time.perf_counter()
        self.snapshot.copy_first()
        self.stall += time.perf_counter() - start

    def started(self) -> None:
        """Called once the snapshot of this iteration has begun."""

    def before_update(self, engine, index, waited):
        if self.snapshot is not None:
            self.meet_deadline()

    def meet_deadline(self) -> None:
        """Finish the snapshot in flight now, its time counted as stall."""
        start = time.perf_counter()
        self.finish()
        self.stall += time.perf_counter() - start

    def close(self) -> None:
        try:
            self.snapshot_final()
            self.drain()
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.link is not None:
                self.link.close()

    def snapshot_final(self) -> None:
        """When training stops: the state after the last step, copied now, so that a later launch goes on
        from it rather than redoing that step. Only at a step boundary: an iteration that raised leaves a
        state no step produced; and only where the script ended without an exception, not where the code after its
        call raised: a launch going on from that step would never run that code again, where the uninterrupted run
        stopped in it (probe 27's W3)."""
        engine = self.engine
        if engine is None or not self.at_step_boundary or self.snapshot is not None:
            return
        if engine.global_steps == self.last_step or state.optimizer_state_missing(engine) is not None:
            return
        error = script_raised()
        if error is not None:
            print(f"baft: rank {engine.global_rank} takes no snapshot of step {engine.global_steps} at exit: the "
                  f"script raised after that step's call ({type(error).__name__}); a relaunch trains that step "
                  f"again and runs the code after it again", file=sys.stderr, flush=True)
            return
        self.sealer.wait()
        self.begin(engine, at_exit=True)
        snapshot = self._fence()  # every chunk copied here, whatever the policy's own way
        self._committed(snapshot.seal(threads=1), snapshot.slot)  # at process exit: no thread starts

    def finish(self) -> None:
        """The snapshot's deadline: fence it before the optimizer step, and hand it to the sealer."""
        self.sealer.submit(self._fence())

    def _fence(self) -> Snapshot:
        """Copy what is left of the snapshot in flight out of the live tensors; the snapshot, now off the policy."""
        snapshot, self.snapshot = self.snapshot, None
        snapshot.fence()
        self.taken += 1
        return snapshot

    def drain(self) -> None:
        """Wait until every fenced snapshot is committed (raises what went wrong sealing one)."""
        self.sealer.wait()

    def _committed(self, record: CommitRecord, slot: int) -> None:
        self.committed_steps.append(record.step)
        if self.link is not None:
            self.link.commit(record, slot)


@dataclass
class CopySpans:
    """Where one iteration's snapshot copies ran, in host seconds since ``origin``.

    ``origin`` is ``time.perf_counter()`` at the start of the iteration, so another host clock
    can re-base the spans. ``bubbles`` holds (instruction index, start, end, bytes) for every
    bubble the executor copied in, ``flush`` the (start, end, bytes) of the fence (its time is
    the stall; None when no snapshot was taken), inside ``OptimizerStep`` once the stages met,
    before the step changes any state. With a copy stream a bubble's span is when its chunks
    were *queued*: the stream copies them later.
    """

    origin: float
    bubbles: list[tuple[int, float, float, int]] = field(default_factory=list)
    flush: Optional[tuple[float, float, int]] = None

    def since_origin(self, start: float, end: float) -> tuple[float, float]:
        return start - self.origin, end - self.origin


class BubbleExecutor(SnapshotPolicy):
    """baft: copy inside the bubbles; flush the rest before the optimizer step.

    ``copier`` says how (:mod:`baft.snapshot.copiers`): the host copies while each wait lasts,
    in layout order; or the chunks ``plan`` places in the bubble that begins at an instruction
    are queued on a copy stream there. ``spans`` says where this iteration's copies ran (two
    clock reads per bubble, none per chunk).
    """

    def __init__(self, *args, plan: Optional[RankPlan] = None, copier: Optional[Copier] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan, self.copier = plan, copier or HostCopier()
        self.placement: dict[int, range] = {}
        self.bubble_bytes: dict[int, int] = defaultdict(int)  # instruction index -> bytes copied there, this iteration
        self.flushed_bytes = 0
        self.spans = CopySpans(origin=time.perf_counter())

    @property
    def stream(self) -> Optional[CopyStream]:
        return self.copier.stream

    def iteration_start(self, engine):
        self.spans = CopySpans(origin=time.perf_counter())
        super().iteration_start(engine)

    def started(self):
        self.bubble_bytes.clear()
        self.flushed_bytes = 0
        self.placement = self.plan.placement() if self.plan is not None else {}
        self.copier.started(self.snapshot, self.placement)

    def before(self, engine, index, cmd):
        if self.snapshot is not None and index in self.placement:
            start = time.perf_counter()
            self._copied_in_bubble(index, start, self.copier.bubble_begins(self.snapshot, self.placement[index]))
        super().before(engine, index, cmd)

    def bubble(self, engine, index, cmd):
        work = self.copier.bubble_work(self.snapshot) if self.snapshot is not None else None
        if work is None:
            return None

        def copy_until(landed):
            start = time.perf_counter()
            self._copied_in_bubble(index, start, work(landed))
        return copy_until

    def _copied_in_bubble(self, index: int, start: float, nbytes: int) -> None:
        if nbytes:
            self.bubble_bytes[index] += nbytes
            self.spans.bubbles.append((index, *self.spans.since_origin(start, time.perf_counter()), nbytes))

    def finish(self):
        start = time.perf_counter()
        self.flushed_bytes = sum(self.source.layout.chunks[i].nbytes for i in self.snapshot.pending)
        super().finish()
        self.spans.flush = (*self.spans.since_origin(start, time.perf_counter()), self.flushed_bytes)

    def metrics(self) -> PolicyMetrics:
        """Also what this iteration's snapshot copied where (on a GPU: call once the iteration's device work
        is done, for the device's wait at the fence)."""
        mine = super().metrics()
        return replace(mine, bubble_bytes=sum(self.bubble_bytes.values()), flushed_bytes=self.flushed_bytes,
                       fence_wait=self.copier.fence_wait() if mine.snapshotted else 0.0)

    def close(self):
        super().close()
        self.copier.close()


class SyncCopy(SnapshotPolicy):
    """Copy the whole state at the start of the iteration, then commit."""

    def iteration_start(self, engine):
        super().iteration_start(engine)
        if self.snapshot is not None:
            self.meet_deadline()


class ThreadCopy(SnapshotPolicy):
    """Copy in a background thread that ignores bubbles; join before the optimizer step."""

    def started(self):
        snapshot = self.snapshot
        self.thread = threading.Thread(target=snapshot.copy_while, args=(lambda: True,), daemon=True)
        self.thread.start()

    def finish(self):
        self.thread.join()
        super().finish()

    def close(self):
        if self.snapshot is not None:  # a copy still in flight (the script stopped mid-iteration)
            self.thread.join()
        super().close()
