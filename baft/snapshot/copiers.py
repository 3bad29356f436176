"""How a snapshot's chunks leave the live tensors before the fence: the host copies them, or a copy stream.

The policy decides *when* (which steps are snapshotted, and the fence before the optimizer step
changes the state; the module's buffers, which a forward changes, are copied before the iteration's
first forward: :meth:`~baft.snapshot.copy.Snapshot.copy_first`); a :class:`Copier` decides *how*
the other chunks are copied until then:

- :class:`HostCopier` — the host copies while the engine waits in a bubble (on CPU a receive,
  or the stages' meeting before the optimizer step, blocks the host), chunk by chunk in layout
  order until the wait is over; the fence copies what is left.
- :class:`StreamCopier` — a bubble's planned chunks are queued on a copy stream where the bubble
  begins (on a GPU the host does not wait: the device idles); the fence queues what is left and
  makes the compute wait for the stream.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol

import torch

from baft.snapshot.copy import Snapshot
from baft.snapshot.streams import CopyStream, copy_stream_for


class Copier(Protocol):
    """Copies a snapshot's chunks between its start and its fence."""

    stream: Optional[CopyStream]  # where a snapshot queues its copies; None: the host copies them

    def started(self, snapshot: Snapshot, placement: dict[int, range]) -> None:
        """``snapshot`` has begun; ``placement``: the chunks the plan puts in the bubble at each instruction."""

    def bubble_begins(self, snapshot: Snapshot, chunks: range) -> int:
        """A bubble the plan gives ``chunks`` begins: the bytes this starts copying."""

    def bubble_work(self, snapshot: Snapshot) -> Optional[Callable[[threading.Event], int]]:
        """Work for the host while the engine waits in a bubble (until the event is set): the bytes it copied."""

    def fence_wait(self) -> float:
        """Seconds the device waited at the latest fence for the copies (0 where the host waits)."""

    def close(self) -> None:
        """Wait for every copy queued."""


class HostCopier:
    """The host copies in the bubbles, as long as each wait lasts."""

    stream = None

    def started(self, snapshot, placement):
        pass

    def bubble_begins(self, snapshot, chunks):
        return 0

    def bubble_work(self, snapshot):
        if snapshot.done:
            return None
        return lambda landed: snapshot.copy_while(lambda: not landed.is_set())

    def fence_wait(self):
        return 0.0

    def close(self):
        pass


class StreamCopier:
    """Queues each bubble's planned chunks on ``stream`` where the bubble begins; what no bubble holds is
    queued at the fence, or with ``leftovers="start"`` as the snapshot starts, to copy beside the compute
    (a GPU's copy engine runs while its compute stream works)."""

    def __init__(self, stream: CopyStream, leftovers: str = "fence"):
        self.stream, self.leftovers = stream, leftovers

    def started(self, snapshot, placement):
        if self.leftovers == "start":
            placed = {i for chunks in placement.values() for i in chunks}
            snapshot.queue([i for i in snapshot.pending if i not in placed])

    def bubble_begins(self, snapshot, chunks):
        return snapshot.queue(chunks)

    def bubble_work(self, snapshot):
        return None

    def fence_wait(self):
        return self.stream.fence_wait()

    def close(self):
        self.stream.synchronize()


def copier_for(executor: str, device: Optional[torch.device], leftovers: str = "fence") -> Copier:
    """The copier ``baft.executor`` names for an engine on ``device`` (DeepSpeed's CPU accelerator may say
    None): ``receive`` the host's, ``stream`` a copy stream's, ``auto`` a copy stream on a GPU and the
    host's otherwise."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if executor == "stream" or executor == "auto" and device.type == "cuda":
        return StreamCopier(copy_stream_for(device), leftovers)
    return HostCopier()
