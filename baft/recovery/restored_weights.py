"""The model's weights as a restore set them, kept as checksums, to set back those a resumed script changes before its
first iteration.

A snapshot of step k is taken as step k + 1 starts, after the loop's code before its ``train_batch`` call, which a
resumed process runs again on the restored weights (probe 21: weight noise the loop adds there was added twice to the
first resumed step, silently). The restore keeps, per parameter and buffer, the checksums of its bytes computed where
it lives (on the device on a GPU: no copy of the weights anywhere) and the snapshot's shared-memory maps it read them
from; as the first resumed iteration starts, the checksums are computed again and only the tensors whose differ are
read again from those maps, their chunks checked against the snapshot's commit record. Of a tensor part of which a
data-parallel replica on another node sent at the restore (not in this node's slots) a host copy is kept instead.

The snapshot's slots still hold it then: no writer (a trainer's, or the manager's as it rebuilds a snapshot) begins
one in either of its rank's two newest committed slots (:meth:`baft.snapshot.slots.SnapshotWriter.begin`), which hold
the restored step unless that rank had committed two steps past the one every rank held; and this rank's own writer
begins its first in the policy's hook, after the one that sets the weights back (:class:`baft.pipeline.hook.Hooks`).
A slot reused all the same fails its chunks' checksums: a ``BaftError`` then, not a silent resume on the script's
weights.
"""

from __future__ import annotations

import mmap

import torch

from baft.errors import BaftError
from baft.snapshot.checksum import BLOCK_WORDS, TorchSums
from baft.snapshot.layout import CommitRecord, checksum
from baft.snapshot.state import byte_view, module_tensors

_CHUNK_BYTES = BLOCK_WORDS * 8  # a tensor is summed 1 MiB at a time: the checksum's weights stay that long


class RestoredWeights:
    """The module's parameters and buffers as :func:`baft.recovery.restore.restore` set them from ``shards``
    (data-parallel shard -> its verified record and open map, which this object keeps and closes)."""

    def __init__(self, engine, shards: dict[int, tuple[CommitRecord, mmap.mmap]]):
        self._shards = list(shards.values())
        num_shards = self._shards[0][0].layout.num_shards
        self._sums = TorchSums()
        self._kept = {name: (t.shape, t.dtype, self._of(t)) for name, _, t in module_tensors(engine)}
        # the name the restore filled each from: a buffer, replica 0's where the snapshot had another number of
        # replicas (restore._views)
        self._sources = {name: source for (name, _, _), (source, _, _) in
                         zip(module_tensors(engine), module_tensors(engine, replica=0, replicas=num_shards))}
        self._index = self._chunks_by_tensor()
        # those part of which a replica on another node sent at the restore, not in this node's slots: a host copy
        self._copies = {name: t.detach().to("cpu", copy=True) for name, _, t in module_tensors(engine)
                        if sum(chunk.nbytes for _, _, chunk, _ in self._index.get(self._sources[name], ())) <
                        byte_view(t).numel()}

    def _of(self, t: torch.Tensor) -> torch.Tensor:
        """The checksums of ``t``'s bytes, 1 MiB by 1 MiB, on its device."""
        data = byte_view(t)
        return self._sums.of_chunks(data, _CHUNK_BYTES) if data.numel() else data.new_zeros(0, dtype=torch.int64)

    def set_back(self, engine) -> list[str]:
        """Set the module's parameters and buffers whose bytes changed since the restore back to the snapshot's; their
        names. A ``BaftError`` where the snapshot no longer holds one of them here."""
        try:
            changed = self._changed(engine)
            for name, t in changed:
                copy = self._copies.get(name)
                t.copy_(copy if copy is not None else
                        self._snapshot_value(engine, name, t, self._index.get(self._sources[name], [])))
            return [name for name, _ in changed]
        finally:
            self.close()

    def _changed(self, engine) -> list[tuple[str, torch.Tensor]]:
        """The tensors whose checksums differ from the restore's (of the shape and type they had then)."""
        same = [(name, t) for name, _, t in module_tensors(engine)
                if name in self._kept and self._kept[name][:2] == (t.shape, t.dtype)]
        if not same:
            return []
        kept = [self._kept[name][2] for name, _ in same]
        differ = (torch.cat([self._of(t) for _, t in same]) != torch.cat(kept)).cpu()  # one wait for the device
        bounds = torch.tensor([0] + [len(k) for k in kept]).cumsum(0).tolist()
        return [entry for entry, start, end in zip(same, bounds, bounds[1:]) if differ[start:end].any()]

    def _chunks_by_tensor(self) -> dict[str, list]:
        """Each tensor's chunks in the snapshot's shards here: (record, map, chunk, its checksum)."""
        index: dict[str, list] = {}
        for record, data in self._shards:
            for chunk, expected in zip(record.layout.chunks, record.checksums):
                index.setdefault(chunk.tensor, []).append((record, data, chunk, expected))
        return index

    def _snapshot_value(self, engine, name: str, t: torch.Tensor, chunks: list) -> torch.Tensor:
        """``t``'s value in the snapshot, read again from its shared-memory slots, in host memory."""
        value = torch.empty(byte_view(t).numel(), dtype=torch.uint8)
        for record, data, chunk, expected in chunks:
            piece = value[chunk.start:chunk.start + chunk.nbytes]
            piece.copy_(torch.frombuffer(data, dtype=torch.uint8, count=chunk.nbytes, offset=chunk.offset))
            if checksum(piece.numpy(), record.version) != expected:  # the bytes copied: a writer may be at the slot
                raise BaftError(f"rank {engine.global_rank}: the script changed the model's {name} after the restore, "
                                f"before the first resumed iteration, and the snapshot of step {record.step} (rank "
                                f"{record.rank}'s shared-memory slot) no longer holds it: chunk {chunk.index} fails "
                                f"its checksum (the slot was reused); resumed so, the run would differ from the "
                                f"uninterrupted one")
        return value.view(t.dtype).reshape(t.shape)

    def close(self) -> None:
        """Close the snapshot's maps (nothing to set back any more)."""
        for _, data in self._shards:
            data.close()
        self._shards.clear()
        self._index.clear()
