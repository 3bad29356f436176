"""The ranks of a manager's node: their shared-memory slot files, their commits and the verification of them.

A rank says ``hello`` with its snapshot size; :class:`NodeRanks` creates its slot files
(``<shm root>/rank<R>/slot<i>.bin``, see :mod:`baft.snapshot.slots`) and remembers it. Commits
are verified against their checksums off the trainers' path, and what verifies is what the
manager offers: the steps each rank holds in memory, the steps every rank holds (those it
packs into a bundle for parity and disk), and a rank's slot to restore from. A manager
started on a root a previous one left adopts the ranks it finds there.
"""

from __future__ import annotations

import logging
import shutil
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from baft.errors import BaftError
from baft.manager import erasure, persist
from baft.manager.config import ManagerConfig, human, memory_needed
from baft.manager.persist import Identity
from baft.snapshot import slots

log = logging.getLogger("baft.manager")

MEMORY_HELD = 2  # newest committed snapshot of each rank and the one before

_RECYCLED = object()


@dataclass
class RankState:
    """One rank of the node: its snapshot size, its run, and the verdict on each committed slot."""

    rank: int
    nbytes: int
    identity: Identity
    slots: int = slots.SLOTS
    results: dict[tuple[int, int], Optional[str]] = field(default_factory=dict)  # (slot, step) → None or why refused
    last_commit: Optional[int] = None


class NodeRanks:
    """The node's ranks and their slots; ``lock`` is the manager's, shared with its other parts."""

    def __init__(self, config: ManagerConfig, lock: threading.RLock):
        self.config = config
        self.root = config.shm_root
        self.ranks: dict[int, RankState] = {}
        self._lock = lock
        self._verify_lock = threading.Lock()

    def adopt(self) -> None:
        """Take over rank directories a previous manager of this root left (their commits are intact)."""
        for rank in slots.rank_ids(self.root):
            held = slots.committed(self.root, rank)
            if held:
                record = held[0].record
                self.ranks[record.rank] = RankState(record.rank, record.layout.nbytes, Identity.of(record))
                log.info("adopted rank %d (newest committed step %d)", record.rank, record.step)

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self.ranks)

    def identity(self, rank: int) -> Optional[Identity]:
        with self._lock:
            state = self.ranks.get(rank)
        return state.identity if state else None

    # ---- trainers' requests -----------------------------------------------------------------

    def hello(self, rank: int, nbytes: int, run_id: str = "", model: str = "", topology: Optional[dict] = None,
              node_ranks: int = 1) -> dict:
        """Register ``rank`` and create its slot files; refused over --memory-limit (or, without one, over the
        memory this host has free: :func:`baft.snapshot.slots.host_room`) or for another run.

        Four slots where every rank of the node (``node_ranks``; those not yet said hello taken to be this
        one's size) fits with four beside the slots the others have; three where not, refused where even
        three do not fit beside them.
        """
        if not isinstance(rank, int) or rank < 0:
            raise BaftError(f"hello: rank {rank!r} must be a non-negative integer")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BaftError(f"hello: rank {rank}: snapshot size {nbytes!r} must be a non-negative integer")
        identity = Identity(run_id or "", model or "", dict(topology or {}))
        with self._lock:
            for other in self.ranks.values():
                if other.rank != rank and run_id and other.identity.run_id and other.identity.run_id != run_id:
                    raise BaftError(f"hello: rank {rank} is from run {run_id!r}, rank {other.rank} on this "
                                    f"manager from run {other.identity.run_id!r}; 'baft manager stop' drops the old run")
            others = [r for r in self.ranks.values() if r.rank != rank]
            sizes = [r.nbytes for r in others] + [nbytes]
            counts = [r.slots for r in others]
            if self.config.memory_limit is not None:
                limit, limited_by = self.config.memory_limit, "memory_limit"
                bound = f"--memory-limit {human(limit)}"
            else:  # what the others hold, and what this host has free beside them
                limit = memory_needed(sizes[:-1], self.config.k, self.config.n, counts) + \
                    slots.host_room(self.root, rank)
                limited_by, bound = "this host's free memory", f"the {human(limit)} this host has free for them"
            coming = max(0, node_ranks - len(sizes))
            # four slots let a snapshot be copied while the previous one seals; three are the fewest that keep
            # the two newest committed snapshots through a crash mid-copy. Four only where the ranks still to
            # come can have four too: the node's ranks wait alike, and a rank served first leaves them room
            roomy = memory_needed(sizes + [nbytes] * coming, self.config.k, self.config.n,
                                  counts + [slots.SLOTS] * (1 + coming))
            count = slots.SLOTS if roomy <= limit else slots.FEWEST_SLOTS
            needed = memory_needed(sizes, self.config.k, self.config.n, counts + [count])
            if needed > limit:
                raise BaftError(f"rank {rank}: node {self.config.node_id} needs {human(needed)} of host memory "
                                f"({len(sizes)} ranks x {slots.FEWEST_SLOTS} slots"
                                f"{' + parity shares' if self.config.k else ''}), over {bound}")
            if count < slots.SLOTS:
                log.warning("rank %d: %s allows %d snapshot slots, not %d: each of its snapshots "
                            "waits for the previous one's seal", rank, bound, count, slots.SLOTS)
        if self.config.dir is not None:
            damaged = persist.damaged_newest(self.config.dir)
            if damaged:
                raise BaftError(f"{damaged}: the newest snapshot this node persisted cannot be read; put the file "
                                f"back, or move its step directory out of {self.config.dir} to go on from an older "
                                "step (or from step 0 where there is none)")
            newest = persist.list_steps(self.config.dir)
            if newest:
                persist.check_identity(newest[0], identity)
        directory = slots.rank_dir(self.root, rank)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for slot in range(count):
                slots.map_file(slots.slot_path(directory, slot), max(nbytes, 1), create=True).close()
        except OSError as err:
            raise BaftError(f"{directory}: cannot allocate {count} x {human(nbytes)} of shared memory "
                            f"({err.strerror})") from None
        with self._lock:
            state = self.ranks.get(rank)
            if state is None:
                self.ranks[rank] = state = RankState(rank, nbytes, identity)
            state.nbytes, state.identity, state.slots = nbytes, identity, count
        log.info("hello from rank %d (%s per snapshot, %d slots)", rank, human(nbytes), count)
        return {"node_id": self.config.node_id, "root": str(self.root),
                "slots": [str(slots.slot_path(directory, s)) for s in range(count)],
                "memory": {"reserved": needed, "limit": limit, "limited_by": limited_by}}

    def commit(self, rank: int, step: int) -> None:
        with self._lock:
            state = self.ranks.get(rank)
            if state is None:
                raise BaftError(f"commit: rank {rank} has not said hello to the manager of node {self.config.node_id}")
            state.last_commit = step

    def memory_steps(self) -> dict[int, list[int]]:
        """Per rank, the steps it holds verified in memory, newest first."""
        with self._lock:
            verified = {rank: {s for (_, s), bad in state.results.items() if bad is None}
                        for rank, state in self.ranks.items()}
        return {rank: sorted(steps, reverse=True)[:MEMORY_HELD] for rank, steps in verified.items()}

    def in_memory(self, rank: int) -> dict[int, slots.SlotInfo]:
        """``rank``'s committed slots by step, verified or not."""
        return {info.record.step: info for info in slots.committed(self.root, rank)}

    def restore_in_place(self, rank: int, info: slots.SlotInfo, refused: list[str]) -> Optional[dict]:
        """The restore reply for ``rank``'s slot ``info`` if it verifies; None (and why, in ``refused``) if not."""
        problem = self._check_in_place(rank, info)
        if problem is None:
            return self.restored("memory", rank, info.slot, info.record.step, refused)
        if problem is not _RECYCLED:
            refused.append(f"{slots.rank_dir(self.root, rank)}/slot{info.slot}: snapshot of step {info.record.step} "
                           f"refused: {problem}")
        return None

    def restored(self, source: str, rank: int, slot: int, step: int, refused: list[str]) -> dict:
        """The restore reply: where ``rank``'s snapshot of ``step`` now is; what was refused on the way is logged."""
        for line in refused:
            log.warning("%s", line)
        path = slots.slot_path(slots.rank_dir(self.root, rank), slot)
        log.info("restore rank %d step %d from %s", rank, step, source)
        return {"source": source, "rank": rank, "step": step, "slot": slot, "path": str(path),
                "root": str(self.root), "refused": refused}

    def materialize(self, source: str, rank: int, snapshots, refused: list[str]) -> dict:
        """Write rebuilt or persisted snapshots of this node into its shm slots, as committed snapshots."""
        found = None
        for record, buffer in snapshots:
            with self._lock:
                known = self.ranks.get(record.rank)
            writer = slots.SnapshotWriter(self.root, record.rank, record.layout,
                                          known.slots if known else slots.SLOTS)
            try:
                target = writer.begin(record.step)
                target.numpy()[:record.layout.nbytes] = np.frombuffer(buffer, dtype=np.uint8, count=record.layout.nbytes)
                slot = writer.slot
                writer.commit(record, slot)
                del target
            finally:
                writer.close()
            with self._lock:
                state = self.ranks.setdefault(record.rank, RankState(record.rank, record.layout.nbytes,
                                                                    Identity.of(record)))
                state.results[(slot, record.step)] = None
            if record.rank == rank:
                found = (slot, record.step)
        if found is None:
            raise BaftError(f"restore rank {rank}: the {source} snapshot holds no rank {rank}")
        return self.restored(source, rank, found[0], found[1], refused)

    # ---- verification ------------------------------------------------------------------------

    def _check_in_place(self, rank: int, info: slots.SlotInfo):
        """None if the slot verifies, the first bad chunk if not, _RECYCLED if a trainer reused it meanwhile."""
        try:
            with slots.open_slot(self.root, rank, info.slot) as m:
                problem = info.record.verify(m)
        except (OSError, ValueError) as err:
            problem = f"cannot map the slot file ({err})"
        if problem is None:
            return None
        now = slots.read_slots(slots.rank_dir(self.root, rank))[info.slot].record
        if now is None or now.step != info.record.step:
            return _RECYCLED
        return problem

    def verify_all(self) -> None:
        """Verify every rank's committed slots not verified yet."""
        for rank in self.ids():
            self._verify_rank(rank)

    def _verify_rank(self, rank: int) -> None:
        with self._verify_lock:
            infos = slots.committed(self.root, rank)
            current = {(i.slot, i.record.step) for i in infos}
            with self._lock:
                state = self.ranks[rank]
                state.results = {key: v for key, v in state.results.items() if key in current}
                todo = [i for i in infos if (i.slot, i.record.step) not in state.results]
            for info in todo:
                problem = self._check_in_place(rank, info)
                if problem is _RECYCLED:
                    continue
                with self._lock:
                    state.results[(info.slot, info.record.step)] = problem
                if problem:
                    log.warning("%s/slot%d: snapshot of step %d refused: %s", slots.rank_dir(self.root, rank),
                                info.slot, info.record.step, problem)

    def complete_steps(self) -> set[int]:
        """The steps every known rank holds verified in memory."""
        with self._lock:
            if not self.ranks:
                return set()
            sets = [{s for (_, s), bad in state.results.items() if bad is None} for state in self.ranks.values()]
        return set.intersection(*sets)

    def pack(self, step: int) -> Optional[memoryview]:
        """This node's bundle of ``step``, copied out of shared memory and verified on the copy."""
        maps, snapshots = [], []
        try:
            for rank in self.ids():
                info = next((i for i in slots.committed(self.root, rank) if i.record.step == step), None)
                if info is None:
                    return None
                m = slots.open_slot(self.root, rank, info.slot)
                maps.append(m)
                snapshots.append((info.record, m))
            bundle = erasure.pack_bundle(self.config.node_id, step, snapshots)
        finally:
            snapshots.clear()
            for m in maps:
                m.close()
        try:
            erasure.unpack_bundle(bundle, verify=True)
        except BaftError:
            # a slot was reused during the copy, or corrupted: verifying in place tells which
            with self._lock:
                for state in self.ranks.values():
                    state.results = {key: v for key, v in state.results.items() if key[1] != step}
            return None
        return bundle

    # ---- memory and status -------------------------------------------------------------------

    def slot_bytes(self) -> int:
        """Bytes of the slot files of the node's ranks."""
        total = 0
        with self._lock:
            for rank in self.ranks:
                for path in slots.rank_dir(self.root, rank).glob("slot*.bin"):
                    try:
                        total += path.stat().st_size
                    except OSError:
                        pass
        return total

    def reserved_bytes(self) -> int:
        """Host memory reserved for the ranks said hello (:func:`baft.manager.config.memory_needed`)."""
        with self._lock:
            return memory_needed([r.nbytes for r in self.ranks.values()], self.config.k, self.config.n,
                                 [r.slots for r in self.ranks.values()])

    def status(self) -> dict:
        """Per rank, its size, last commit, run and each committed slot with its verdict."""
        with self._lock:
            out = {}
            for rank, state in sorted(self.ranks.items()):
                held = []
                for info in slots.committed(self.root, rank):
                    key = (info.slot, info.record.step)
                    verdict = state.results.get(key, "pending")
                    held.append({"slot": info.slot, "step": info.record.step,
                                 "verified": "ok" if key in state.results and verdict is None else verdict})
                out[str(rank)] = {"nbytes": state.nbytes, "last_commit": state.last_commit, "slots": held,
                                  "run_id": state.identity.run_id}
            return out

    def unlink(self) -> None:
        """Remove every rank's directory: its slot files, and the heartbeat of a rank that never said hello."""
        for rank in slots.rank_ids(self.root):
            shutil.rmtree(slots.rank_dir(self.root, rank), ignore_errors=True)
