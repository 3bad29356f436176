"""Copying one snapshot of a rank's state into a shared-memory slot, chunk by chunk.

A :class:`Snapshot` is taken at a step boundary, of the small items its policy captured then
(:meth:`~baft.snapshot.policies.SnapshotPolicy.begin`): it picks a slot, its views those of the
tensors the engine holds then (:meth:`StateSource.refresh`: a buffer or optimizer state tensor
replaced, a parameter's ``.data`` rebound); ``copy_first`` copies the
module's buffers before the iteration's first forward changes them; ``copy`` moves one chunk
(and checksums its source, when the trainer has time to spare); ``queue`` puts runs of chunks
on a copy stream, each run's checksums computed there from the same source bytes (on a GPU by
the device); ``fence`` is the deadline: every chunk out of the live tensors before the optimizer
step changes them; ``seal`` gathers the checksums, computes those not yet done from the slot,
and writes the commit record. Only ``copy_first`` and the fence are on the trainer's path: a
:class:`Sealer` seals on a thread of its own, and a snapshot counts only once its commit
record, with every chunk's checksum, exists. The policies (bubble-aware executor, synchronous
copy, background thread) differ only in *when* they move the chunks; the executor's copier
(:mod:`baft.snapshot.copiers`) decides *how*: ``copy`` on the host, or ``queue`` on a copy stream.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from baft.snapshot import state
from baft.snapshot.checksum import TorchSums, hexdigest, hexdigests
from baft.snapshot.layout import CommitRecord, Layout, model_signature, plan_layout
from baft.snapshot.optimizers import dtype_name
from baft.snapshot.slots import SnapshotWriter
from baft.snapshot.streams import CopyStream, RunCopy, RunSums
from baft.background import BackgroundThread
from baft.errors import BaftError


# A run of chunks shorter than this is checksummed from the slot by the seal, not as it is copied: on a GPU a
# checksum is a few kernel launches on the trainer's thread, dearer than the seal's read of a few KB (a
# transformer's norms and biases: half its tensors, a thousandth of its bytes).
SEALER_SUMS_BELOW = 64 << 10


def seal_threads() -> int:
    """Threads that checksum a snapshot as it is sealed: this rank's share of the host's cores
    (torchrun's ``LOCAL_WORLD_SIZE`` ranks share them), 1 to 8. A GPU host has cores to spare;
    two ranks on two CPU cores get one each."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, len(os.sched_getaffinity(0)) // max(ranks, 1)))


def copy_runs(chunks: list, indices: list[int]) -> list:
    """``indices`` (in ascending order) as runs of chunks that are adjacent in one tensor and in the
    slot, each run one ``Chunk`` spanning them: a run is one copy call. Queuing a several-GB state
    chunk by chunk spends tens of microseconds of the trainer's thread per MiB."""
    runs, first, end = [], None, None  # the run being grown: its first chunk, and where it ends
    for i in indices:
        chunk = chunks[i]
        if first is not None and chunk.tensor == first.tensor and chunk.start == end \
                and chunk.offset == first.offset + (end - first.start):
            end += chunk.nbytes
            continue
        if first is not None:
            runs.append(dataclasses.replace(first, nbytes=end - first.start))
        first, end = chunk, chunk.start + chunk.nbytes
    if first is not None:
        runs.append(dataclasses.replace(first, nbytes=end - first.start))
    return runs


class StateSource:
    """The rank's state tensors as flat byte views, and the layout of this replica's shard.

    ``first_chunks``: the chunks of the module's buffers, which a snapshot copies as it begins (a forward
    changes them: BatchNorm's running statistics, a counter), the rest being unchanged until the optimizer step.
    """

    def __init__(self, engine, chunk_bytes: int):
        grid = engine.grid
        self.engine, self.chunk_bytes = engine, chunk_bytes
        self.sums = TorchSums()
        self.layout: Layout = plan_layout(state.tensor_entries(engine), chunk_bytes,
                                          shard=grid.get_data_parallel_rank(),
                                          num_shards=grid.get_data_parallel_world_size())
        self._entries = {t.name: t for t in self.layout.tensors}
        buffers = {t.name for t in self.layout.tensors if t.kind == "other"}
        self.first_chunks = [i for i, chunk in enumerate(self.layout.chunks) if chunk.tensor in buffers]
        self._live = state.live_tensors(engine)
        self.views: dict[str, torch.Tensor] = {}
        self._viewed: dict[str, int] = {}  # where each view's bytes are: a copy's differ from its tensor's
        self._runs: dict[tuple[int, ...], list] = {}
        self._run_views: dict[tuple, tuple] = {}  # (chunk set, slot buffer's id): the buffer, each run's views
        self.refresh()
        self.device = next((v.device for v in self.views.values() if v.is_cuda), torch.device("cpu"))

    def refresh(self) -> None:
        """View the tensors the engine holds now (a tensor replaced since, or a parameter whose ``.data`` was
        rebound, has a new one; a tensor that is not contiguous is viewed by a copy made now); a ``BaftError``
        naming a tensor whose shape or dtype is no longer the layout's, or that is gone."""
        seen = 0
        for name, t in self._live():
            seen += 1
            if self._viewed.get(name) != t.data_ptr():
                view = self.views[name] = self._view(name, t)
                self._viewed[name] = view.data_ptr()
                self._run_views.clear()
        if seen != len(self.views):
            gone = sorted(set(self.views) - {name for name, _ in self._live()})
            raise BaftError(f"the state tensors {gone} are gone since the first snapshot laid the state out")

    def _view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        laid_out = self._entries.get(name)
        now = f"{dtype_name(t)} {list(t.shape)}"
        if laid_out is None:
            raise BaftError(f"state tensor {name} ({now}) is new since the first snapshot laid the state out (the "
                            f"optimizer's state of a parameter trained only since: one unfrozen mid-run, or added "
                            f"with add_param_group?); a "
                            f"snapshot's layout is fixed for the run: train every parameter from the start")
        if (laid_out.dtype, laid_out.shape) != (dtype_name(t), tuple(t.shape)):
            raise BaftError(f"state tensor {name} is now {now}, was {laid_out.dtype} {list(laid_out.shape)} when the "
                            f"first snapshot laid the state out: a snapshot's layout is fixed for the run")
        return state.byte_view(t)

    def view(self, chunk) -> torch.Tensor:
        return self.views[chunk.tensor][chunk.start:chunk.start + chunk.nbytes]

    def runs(self, indices: list[int]) -> list:
        """:func:`copy_runs` of these chunks, worked out once per set: a plan queues the same sets every step,
        and a 10 GB state has ten thousand chunks."""
        key = tuple(indices)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = copy_runs(self.layout.chunks, indices)
        return runs

    def run_views(self, indices: list[int], buffer: torch.Tensor) -> list[tuple]:
        """Each of :meth:`runs` with its view in the slot ``buffer`` and in the state: made once per chunk set and
        slot, until :meth:`refresh` views a tensor anew (slicing is a few microseconds of the trainer's thread
        per run)."""
        chunks = tuple(indices)
        cached = self._run_views.get((chunks, id(buffer)))
        if cached is None or cached[0] is not buffer:
            cached = self._run_views[chunks, id(buffer)] = (
                buffer, [(run, buffer[run.offset:run.offset + run.nbytes], self.view(run)) for run in self.runs(chunks)])
        return cached[1]

    def topology(self) -> dict:
        grid = self.engine.grid
        return {"pipe": grid.get_pipe_parallel_world_size(), "data": grid.get_data_parallel_world_size(),
                "world": self.engine.world_size}


class Snapshot:
    """One snapshot of step ``step`` in flight: pending chunks, copied bytes, checksums.

    Without a ``stream`` the host copies (:meth:`copy`); with one, chunks are queued on it
    (:meth:`queue`) and only :meth:`seal` waits for them.
    """

    def __init__(self, source: StateSource, writer: SnapshotWriter, step: int, items: dict,
                 stream: Optional[CopyStream] = None):
        self.source, self.writer, self.step, self.items = source, writer, step, items
        self.buffer = writer.begin(step)
        self.slot = writer.slot
        self.pending = dict.fromkeys(range(len(source.layout.chunks)))  # in layout order
        self.sums: list[RunSums] = []  # computed from the source as the chunks were copied
        self.stream = stream

    @property
    def done(self) -> bool:
        return not self.pending

    def _slot_view(self, chunk) -> torch.Tensor:
        return self.buffer[chunk.offset:chunk.offset + chunk.nbytes]

    def copy(self, checksum_now: bool = True) -> int:
        """Copy the next pending chunk on the host; return its bytes."""
        return self._copy(next(iter(self.pending)), checksum_now)

    def _copy(self, i: int, checksum_now: bool) -> int:
        del self.pending[i]
        chunk = self.source.layout.chunks[i]
        src = self.source.view(chunk)
        self._slot_view(chunk).copy_(src)
        if checksum_now:
            self.sums.append(RunSums([i], self.source.sums.of(src).reshape(1)))
        return chunk.nbytes

    def copy_first(self) -> int:
        """Copy the source's ``first_chunks`` before any compute queued after this call (on the host now; on a
        stream, queued after the compute so far, the compute waiting for them); their bytes. Checksums wait for
        :meth:`seal`."""
        indices = self.source.first_chunks
        if self.stream is None:
            return sum(self._copy(i, checksum_now=False) for i in indices)
        queued = self.queue(indices)
        if queued:
            self.stream.fence()
        return queued

    def queue(self, indices) -> int:
        """Queue the pending chunks among ``indices`` on the stream, after the compute so far; their bytes."""
        chosen = [i for i in indices if i in self.pending]
        if not chosen:
            return 0
        self.stream.after_compute()
        if len(chosen) == len(self.pending):
            self.pending.clear()
        else:
            for i in chosen:
                del self.pending[i]
        chosen.sort()
        copies, first, nbytes = [], 0, 0
        for run, dst, src in self.source.run_views(chosen, self.buffer):
            count = -(-run.nbytes // self.source.chunk_bytes)
            sums = RunSums(chosen[first:first + count]) if run.nbytes >= SEALER_SUMS_BELOW else None
            copies.append(RunCopy(dst, src, sums))
            if sums is not None:
                self.sums.append(sums)
            first += count
            nbytes += run.nbytes
        self.stream.copy(copies, self.source.chunk_bytes)
        return nbytes

    def copy_while(self, keep_going: Callable[[], bool]) -> int:
        copied = 0
        while self.pending and keep_going():
            copied += self.copy()
        return copied

    def fence(self) -> None:
        """The deadline: copy what is left out of the live tensors (checksums wait for :meth:`seal`).

        With a CUDA stream the optimizer step, queued after this, waits for the copies on the
        device; the host does not wait.
        """
        if self.stream is None:
            while self.pending:
                self.copy(checksum_now=False)
            return
        self.queue(list(self.pending))
        self.stream.fence()

    def _gathered(self) -> list[Optional[str]]:
        """Every chunk's checksum computed as it was copied (one device-to-host copy of all of them), None for
        the rest. Call once the stream has run them."""
        checksums: list[Optional[str]] = [None] * len(self.source.layout.chunks)
        if self.sums:
            device = self.sums[0].sums.device
            values = torch.cat([run.sums.to(device) for run in self.sums]).cpu()
            for i, digest in zip((i for run in self.sums for i in run.chunks), hexdigests(values)):
                checksums[i] = digest
        return checksums

    def _checksum_slot(self, checksums: list[Optional[str]], indices: list[int]) -> None:
        for i in indices:  # torch's dot releases the GIL: the threads sum side by side
            checksums[i] = hexdigest(int(self.source.sums.of(self._slot_view(self.source.layout.chunks[i]))))

    def _sum_the_rest(self, checksums: list[Optional[str]], threads: int) -> None:
        """The checksums not computed as their chunks were copied, from the slot: the small chunks side by side
        (a transformer's norms and biases: a hundred chunks), the rest on ``threads`` threads."""
        chunks = self.source.layout.chunks
        small = [i for i, digest in enumerate(checksums) if digest is None and chunks[i].nbytes < SEALER_SUMS_BELOW]
        if small:
            for i, digest in zip(small, hexdigests(self.source.sums.of_many([self._slot_view(chunks[i])
                                                                             for i in small]))):
                checksums[i] = digest
        todo = [i for i, digest in enumerate(checksums) if digest is None]
        threads = min(threads, len(todo)) or 1
        if threads == 1:
            self._checksum_slot(checksums, todo)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="baft-checksum") as pool:
                list(pool.map(lambda part: self._checksum_slot(checksums, part),
                              [todo[k::threads] for k in range(threads)]))

    def seal(self, threads: Optional[int] = None) -> CommitRecord:
        """After the fence, off the trainer's path: gather the checksums computed as the chunks were copied,
        compute the rest from the slot (on ``threads`` threads, default :func:`seal_threads`; 1: this one, as
        at interpreter exit, where no pool starts), then commit."""
        if self.stream is not None:
            self.stream.synchronize()
        checksums = self._gathered()
        self._sum_the_rest(checksums, threads or seal_threads())
        engine = self.source.engine
        record = CommitRecord(step=self.step, rank=engine.global_rank, stage=engine.stage_id,
                              dp_rank=engine.grid.get_data_parallel_rank(), layout=self.source.layout,
                              checksums=checksums, items=self.items,
                              topology=self.source.topology(), run_id=engine.baft.config.run_id,
                              model=model_signature(self.source.layout.tensors), wall_time=time.time())
        self.writer.commit(record, self.slot)
        return record


class Sealer:
    """Seals fenced snapshots on a :class:`~baft.background.BackgroundThread`, in turn, and reports each commit.

    ``committed(record, slot)`` runs on that thread once the commit record is written.
    :meth:`submit` does not wait: the next snapshot is copied while this one seals, as far as the
    slots allow (the policy calls :meth:`wait` with what its slots leave before it begins one).
    An error while sealing is raised by the next :meth:`wait`, in the trainer's thread.
    """

    def __init__(self, committed: Callable[[CommitRecord, int], None]):
        self.committed = committed
        self.before_seal: Optional[Callable[[], None]] = None  # fault injection: runs before the next seal
        self.seconds = 0.0  # how long the latest finished seal took (copies awaited, checksums, commit)
        self.cpu_seconds = 0.0  # and the CPU time it took on its thread
        self._thread = BackgroundThread("baft-seal")
        self._changed = threading.Condition()
        self._outstanding = 0  # submitted, not yet sealed
        self._error: Optional[BaseException] = None

    def submit(self, snapshot: Snapshot) -> None:
        with self._changed:
            self._outstanding += 1
        self._thread.submit(lambda: self._seal(snapshot))

    def _seal(self, snapshot: Snapshot) -> None:
        try:
            if self.before_seal is not None:
                self.before_seal()
            start, cpu = time.perf_counter(), time.thread_time()
            self.committed(snapshot.seal(), snapshot.slot)
            self.seconds, self.cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu
        except BaseException as err:  # re-raised in the trainer's thread by wait()
            self._error = err
        finally:
            with self._changed:
                self._outstanding -= 1
                self._changed.notify_all()

    def wait(self, leave: int = 0) -> None:
        """Until at most ``leave`` submitted snapshots are still sealing (0: every one committed), or a seal's
        error is raised here."""
        with self._changed:
            self._changed.wait_for(lambda: self._outstanding <= leave or self._error is not None)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
