"""Host snapshot buffers in shared memory, with commit records written last.

Each rank owns a directory ``<root>/rank<R>/`` holding ``SLOTS`` buffer files
(``slot<i>.bin``; ``FEWEST_SLOTS`` where memory allows no more) and, for each committed one, a
commit record (``slot<i>.commit.json``). The files live in shared memory (``/dev/shm`` by
default), so a trainer killed with SIGKILL loses nothing already committed: the node's
manager, or the restarted trainer, reads them back. A slot being filled or sealed never is
the newest committed one, nor the one before it, so the two newest snapshots survive a crash
in the middle of a copy. A slot's old commit record is deleted before the slot is
overwritten, and a reader that finds no commit record, or one whose checksums fail, ignores
that slot.

Why four: snapshot k+1 is copied while snapshot k is still being sealed (its checksums
gathered, its record written), so both are in flight beside the two newest committed. With
three, snapshot k+1 cannot begin until k is committed: the trainer waits for the seal.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from baft.config import DEFAULT_SHM_ROOT
from baft.errors import BaftError
from baft.jsonfile import read_json, write_text_atomic
from baft.snapshot.layout import CommitRecord, Layout

if TYPE_CHECKING:
    import torch

SLOTS = 4  # the two newest committed, the one being sealed, the one being filled
FEWEST_SLOTS = 3  # the two newest committed and one in flight: each snapshot waits for the previous seal
DEFAULT_ROOT = DEFAULT_SHM_ROOT
HEADROOM = 0.05  # of the host's memory, kept free for the trainers beside their snapshots


def host_room(root, rank: int) -> int:
    """Bytes of snapshot slots ``rank`` can have under ``root`` on this host: what its filesystem (shared
    memory's tmpfs, which the kernel never swaps out here) and the memory available less :data:`HEADROOM`
    both still take, plus the slot files the rank already has there (a restarted rank maps them again).
    Shared memory past it is an OOM kill, not an error: the slots are sized to it where no limit is set."""
    import shutil

    import psutil

    existing = rank_dir(root, rank)
    held = sum(p.stat().st_size for p in existing.glob("slot*.bin")) if existing.is_dir() else 0
    where = Path(root)
    while not where.exists():
        where = where.parent
    memory = psutil.virtual_memory()
    free = min(shutil.disk_usage(where).free, memory.available - int(HEADROOM * memory.total))
    return max(0, free) + held


def slot_count(nbytes: int, room: int, where: str) -> int:
    """:data:`SLOTS` slots of ``nbytes`` where they fit in ``room`` bytes, :data:`FEWEST_SLOTS` where only
    those do (said in one line: each snapshot then waits for the previous one's seal); a BaftError naming
    ``where`` the room came from where not even those fit."""
    if SLOTS * nbytes <= room:
        return SLOTS
    if FEWEST_SLOTS * nbytes > room:
        raise BaftError(f"{where}: {FEWEST_SLOTS} snapshot slots of {nbytes / 2**30:.2f} GiB do not fit the "
                        f"{room / 2**30:.2f} GiB this host has free for them; free host memory, or snapshot fewer "
                        f"bytes per rank (more pipeline stages or ZeRO-1)")
    print(f"baft: {where}: room for {FEWEST_SLOTS} snapshot slots of {nbytes / 2**30:.2f} GiB, not {SLOTS}: each "
          f"snapshot waits for the previous one's seal", file=sys.stderr, flush=True)
    return FEWEST_SLOTS


def rank_dir(root, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def rank_of(path) -> Optional[int]:
    """The rank whose directory ``path`` is (``rank<R>``), or None when it is none's."""
    path = Path(path)
    digits = path.name.removeprefix("rank")
    return int(digits) if path.name.startswith("rank") and digits.isdigit() and path.is_dir() else None


def rank_ids(root) -> list[int]:
    """The ranks with a directory under the node root ``root``."""
    return sorted(rank for p in Path(root).glob("rank*") if (rank := rank_of(p)) is not None)


def slot_path(directory: Path, slot: int) -> Path:
    """The buffer file of slot ``slot`` in a rank's directory (:func:`rank_dir`)."""
    return directory / f"slot{slot}.bin"


def _commit_path(directory: Path, slot: int) -> Path:
    return directory / f"slot{slot}.commit.json"


def map_file(path: Path, nbytes: int, create: bool, populate: bool = False) -> mmap.mmap:
    """Map ``path`` (grown to ``nbytes`` when ``create``) read-write into memory.

    ``populate`` faults every page in now, so that the first snapshots into the slot do not pay
    for it inside the iteration (tens of ms per 100 MB: a stall the plan does not know of).
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create and os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        size = os.fstat(fd).st_size
        mapping = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, max(size, 1), flags=mapping)
    finally:
        os.close(fd)


_register_failed: list[int] = []  # warn once per process


def register_with_cuda(buffer: torch.Tensor) -> bool:
    """Page-lock a shared-memory buffer for CUDA (``cudaHostRegister``), so device-to-host copies
    into it are asynchronous DMA at the link's speed. False, with one warning, where that fails:
    the copies then still land, synchronously and slower. Nothing to do without CUDA."""
    import torch

    if not torch.cuda.is_available() or not buffer.numel():
        return False
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), portable))
    if error and not _register_failed:
        _register_failed.append(error)
        print(f"baft: cudaHostRegister of a {buffer.numel()}-byte snapshot slot failed (cudaError {error}); "
              f"device-to-host copies into the slots are synchronous", file=sys.stderr, flush=True)
    return not error


def unregister_from_cuda(buffer: torch.Tensor) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


@dataclass
class SlotInfo:
    slot: int
    record: Optional[CommitRecord]


class SnapshotWriter:
    """The trainer's side: fill a slot chunk by chunk, then commit it.

    ``begin(step)`` picks a slot to fill, invalidates it and returns a uint8 tensor view of its
    shared memory; ``commit(record, slot)`` writes the commit record. Of ``slots`` slots, two hold
    the newest committed snapshots; the others (:attr:`in_flight`) may be begun and not yet
    committed at once.
    """

    def __init__(self, root, rank: int, layout: Layout, slots: int = SLOTS):
        import torch  # here, not at the top: the manager process reads slots without loading torch

        self.directory = rank_dir(root, rank)
        self.layout = layout
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BaftError(f"{self.directory}: cannot create snapshot directory ({err.strerror})") from None
        if not FEWEST_SLOTS <= slots <= SLOTS:
            raise ValueError(f"{slots} snapshot slots: baft uses {FEWEST_SLOTS} to {SLOTS}")
        self.slots = slots
        nbytes = max(layout.nbytes, 1)
        try:
            self._maps = [map_file(slot_path(self.directory, s), nbytes, create=True, populate=True)
                          for s in range(slots)]
        except OSError as err:
            raise BaftError(f"{self.directory}: cannot allocate {slots} x {nbytes} bytes of shared memory "
                            f"({err.strerror})") from None
        self.buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._registered = [b for b in self.buffers if register_with_cuda(b)]
        # this writer is its rank's only writer: read the slots' steps once, then keep them here
        self._steps = {info.slot: info.record.step if info.record else None
                       for info in read_slots(self.directory)[:slots]}
        self._begun: set[int] = set()  # being filled or sealed

    @property
    def in_flight(self) -> int:
        """How many snapshots may be begun and not yet committed at once."""
        return self.slots - 2

    def begin(self, step: int) -> torch.Tensor:
        """Choose a slot for ``step``'s snapshot, drop its old commit record, return its buffer (its index is
        :attr:`slot`). Raises when :attr:`in_flight` snapshots are already begun and not committed."""
        if len(self._begun) >= self.in_flight:
            raise RuntimeError(f"begin() with {len(self._begun)} snapshots in flight in {self.slots} slots")
        free = [s for s in self._steps if s not in self._begun]
        self.slot = min(free, key=lambda s: -1 if self._steps[s] is None else self._steps[s])
        self._steps[self.slot] = None  # empty or oldest committed: never the two newest
        self._begun.add(self.slot)
        _commit_path(self.directory, self.slot).unlink(missing_ok=True)
        return self.buffers[self.slot]

    def commit(self, record: CommitRecord, slot: int) -> Path:
        """Make the filled ``slot`` a committed snapshot. Must be called after every chunk is copied."""
        if slot not in self._begun:
            raise RuntimeError(f"commit() of slot {slot}, which is not begun")
        path = write_text_atomic(_commit_path(self.directory, slot), record.to_text())
        self._steps[slot] = record.step
        self._begun.discard(slot)
        return path

    def close(self) -> None:
        for buffer in self._registered:
            unregister_from_cuda(buffer)
        self._registered.clear()
        self.buffers.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor view is still alive; the OS unmaps at exit
                pass


def read_slots(directory: Path) -> list[SlotInfo]:
    """Every slot of one rank with its commit record, or None where it has none or an unreadable one."""
    out = []
    for slot in range(SLOTS):
        record = None
        path = _commit_path(directory, slot)
        if path.exists() and slot_path(directory, slot).exists():
            try:
                record = CommitRecord.from_json(read_json(path))
            except (BaftError, KeyError, TypeError):
                record = None
        out.append(SlotInfo(slot, record))
    return out


def committed(root, rank: int) -> list[SlotInfo]:
    """The committed slots of ``rank``, newest step first (checksums not yet verified)."""
    slots = [s for s in read_slots(rank_dir(root, rank)) if s.record is not None]
    return sorted(slots, key=lambda s: -s.record.step)


def open_slot(root, rank: int, slot: int) -> mmap.mmap:
    """Map one slot of ``rank`` for reading."""
    return map_file(slot_path(rank_dir(root, rank), slot), 0, create=False)


def map_verified(root, rank: int, step: Optional[int] = None, log=None,
                 accept=lambda record: True) -> Optional[tuple[CommitRecord, mmap.mmap]]:
    """The newest committed snapshot of ``rank`` (or exactly ``step``) that ``accept`` takes and whose
    checksums all pass, verified in place in shared memory; the caller closes the map.

    A snapshot that fails a checksum is reported through ``log`` with the chunk it failed on,
    and the next older one is tried.
    """
    for info in committed(root, rank):
        if step is not None and info.record.step != step or not accept(info.record):
            continue
        m = open_slot(root, rank, info.slot)
        problem = info.record.verify(m)
        if problem is None:
            return info.record, m
        m.close()
        if log:
            log(f"{rank_dir(root, rank)}/slot{info.slot}: snapshot of step {info.record.step} refused: {problem}")
    return None


def load_verified(root, rank: int, step: Optional[int] = None, log=None) -> Optional[tuple[CommitRecord, bytes]]:
    """Like :func:`map_verified`, copied out of shared memory (safe to keep after the slot is reused)."""
    found = map_verified(root, rank, step, log)
    if found is None:
        return None
    record, m = found
    with m:
        return record, bytes(m[:record.layout.nbytes])
