"""Copy streams: where a snapshot's copies are queued when the host does not wait in a receive.

On a GPU a receive does not block the host: NCCL makes the compute stream wait, and the
bubble is time the *device* idles. The executor therefore does not copy while it waits;
it queues each bubble's planned chunks on a :class:`CopyStream` at the instruction where
the bubble begins, and fences the stream before the optimizer step:

- :class:`CudaCopyStream` — a CUDA side stream. ``after_compute`` makes it wait on an event
  recorded on the compute stream (the copies read the state the last optimizer step wrote),
  ``copy`` queues each run's asynchronous device-to-host DMA into pinned memory and a few kernels
  that sum the same source bytes into a small int64 tensor on the device, ``fence`` makes the
  compute stream wait on the copy stream's last event. The host never waits on the hot path,
  and never reads the copied bytes: the seal gathers the checksums in one small copy.
- :class:`ThreadCopyStream` — the same contract played by one thread on CPU: copies and
  checksums run in queue order beside the trainer, and ``fence`` blocks the host until they
  are done (a CPU has no device queue the optimizer step could wait in). It runs the device
  executor's logic in the suite, on real DeepSpeed pipelines, without a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from baft.background import BackgroundThread
from baft.snapshot.checksum import TorchSums


@dataclass
class RunSums:
    """The checksums of a run of chunks (``chunks``: their layout indices), set once the stream has computed
    them: read ``sums`` only after :meth:`CopyStream.synchronize`."""

    chunks: list[int]
    sums: Optional[torch.Tensor] = None


@dataclass
class RunCopy:
    """A run's copy from the live state (``src``) into the slot (``dst``), and where the checksums of ``src``'s
    chunks go (None: the seal computes them from the slot)."""

    dst: torch.Tensor
    src: torch.Tensor
    sums: Optional[RunSums] = None


def run_copies(runs: list[RunCopy], sums: TorchSums, chunk_bytes: int, non_blocking: bool = False) -> None:
    """Each run's copy, then its checksums (``src`` cut into chunks of ``chunk_bytes``), in order."""
    for run in runs:
        run.dst.copy_(run.src, non_blocking=non_blocking)
        if run.sums is not None:
            run.sums.sums = sums.of_chunks(run.src, chunk_bytes)


class CopyStream(Protocol):
    """An ordered queue of copies beside the compute."""

    def after_compute(self) -> None:
        """Copies queued from now on start only after the compute queued so far."""

    def copy(self, runs: list[RunCopy], chunk_bytes: int) -> None:
        """Queue :func:`run_copies`."""

    def fence(self) -> None:
        """Compute queued from now on runs only after every copy queued so far."""

    def fence_wait(self) -> float:
        """Seconds the compute waited at the last fence for copies still running (device time; waits
        until the fence has run)."""

    def synchronize(self) -> None:
        """Block the calling thread until every copy queued so far is done."""


class CudaCopyStream:
    """A CUDA side stream fenced by events: no host synchronization until :meth:`synchronize`."""

    def __init__(self, device: Optional[torch.device] = None):
        self.stream = torch.cuda.Stream(device=device)
        self.sums = TorchSums()
        self.last: Optional[torch.cuda.Event] = None
        self.waited: Optional[tuple[torch.cuda.Event, torch.cuda.Event]] = None  # around the last fence

    def after_compute(self) -> None:
        self.stream.wait_event(torch.cuda.current_stream().record_event())

    def copy(self, runs: list[RunCopy], chunk_bytes: int) -> None:
        with torch.cuda.stream(self.stream):  # entered once per queue: its cost on the trainer's thread is per call
            run_copies(runs, self.sums, chunk_bytes, non_blocking=True)

    def fence(self) -> None:
        self.last = self.stream.record_event()
        compute = torch.cuda.current_stream()
        self.waited = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        compute.record_event(self.waited[0])
        compute.wait_event(self.last)
        compute.record_event(self.waited[1])

    def fence_wait(self) -> float:
        if self.waited is None:
            return 0.0
        start, end = self.waited
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        if self.last is not None:
            self.last.synchronize()


class ThreadCopyStream:
    """A copy stream on CPU: one :class:`~baft.background.BackgroundThread` runs the queued copies in order."""

    def __init__(self):
        self._thread = BackgroundThread("baft-copy-stream")
        self.sums = TorchSums()
        self._error: Optional[BaseException] = None

    def _run(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            return  # the stream failed: what follows is dropped, the error raised by synchronize()
        try:
            job()
        except BaseException as err:  # raised in the caller's thread by synchronize()
            self._error = err

    def after_compute(self) -> None:
        """Nothing to wait for: on CPU the compute queued so far has already run."""

    def copy(self, runs: list[RunCopy], chunk_bytes: int) -> None:
        self._thread.submit(lambda: self._run(lambda: run_copies(runs, self.sums, chunk_bytes)))

    def fence(self) -> None:
        self.synchronize()

    def fence_wait(self) -> float:
        """0: on CPU the host itself waits at the fence (the policy's stall holds it)."""
        return 0.0

    def synchronize(self) -> None:
        done = threading.Event()
        self._thread.submit(done.set)  # after every copy queued before it
        done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def copy_stream_for(device: torch.device) -> CopyStream:
    """The copy stream for state on ``device``: a CUDA side stream, or a thread on CPU."""
    return CudaCopyStream(device) if device.type == "cuda" else ThreadCopyStream()
