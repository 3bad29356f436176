"""The per-node snapshot manager: keeps committed snapshots alive past trainers, nodes and jobs.

One manager runs per node, started before the trainers and outliving them::

    python -m baft.manager --node-id 0 --shm-root /dev/shm/baft/run/node0 --dir /ckpt/node0 \\
        --group 10.0.0.1:7100,10.0.0.2:7100,10.0.0.3:7100 --parity-k 2 --persist-every 100 --keep 3

* It owns the shared-memory slot files of the node's ranks (``<shm root>/rank<R>/slot<i>.bin``,
  see :mod:`baft.snapshot.slots`): it creates and sizes them when a rank says ``hello``, and unlinks
  them only on ``stop``, so a trainer killed with SIGKILL loses nothing it committed.
* It learns of commits over its Unix socket (:mod:`baft.manager.protocol`), verifies their
  checksums in a background thread, and reports the newest committed snapshot of each rank
  and the one before it (the store never overwrites those two).
* With ``--group``, it packs each step all its ranks have committed into a bundle, encodes
  it (:mod:`baft.manager.erasure`) off the trainers' path and sends one share to each group member;
  it keeps the shares it receives. Any ``k`` members rebuild a lost node's bundle bit for bit.
* With ``--dir``, it persists every N-th step (``--persist-every``) or every T seconds
  (``--persist-seconds``) in a background thread (:mod:`baft.manager.persist`), atomically, keeping
  the ``--keep`` newest, and once more when it stops.
* ``restore`` answers where a rank's snapshot is in shared memory, after re-verifying it,
  rebuilding it there from the group's shares or from disk when memory does not hold it.

Its configuration is :mod:`baft.manager.config`; starting, stopping and asking it,
:mod:`baft.manager.control`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from baft.errors import BaftError
from baft.jsonfile import write_json_atomic
from baft.manager import erasure, persist
from baft.manager.config import SHARE_STEPS_KEPT, ManagerConfig, Member, human, memory_needed, parse_args
from baft.manager.control import INFO_NAME
from baft.snapshot import slots
from baft.manager.protocol import (ManagerClient, ManagerUnavailable, check_version, read_message, socket_path,
                                   write_message)
from baft.manager.persist import Identity

__all__ = ["Manager", "main"]

log = logging.getLogger("baft.manager")

POLL_SECONDS = 0.5
PEER_TIMEOUT = 30.0
MEMORY_HELD = 2  # newest committed snapshot of each rank and the one before


@dataclass
class Share:
    index: int
    size: int
    checksum: str
    ranks: list[int]
    data: erasure.Buffer


@dataclass
class RankState:
    rank: int
    nbytes: int
    identity: Identity
    results: dict[tuple[int, int], Optional[str]] = field(default_factory=dict)  # (slot, step) → None or why refused
    last_commit: Optional[int] = None


@dataclass
class ParityState:
    acked: dict[int, list[int]] = field(default_factory=dict)  # step → members holding a share of our bundle
    errors: dict[int, str] = field(default_factory=dict)  # member → last failure
    encoded_step: int = -1
    encode_seconds: float = 0.0


@dataclass
class PersistState:
    last_step: Optional[int] = None
    last_time: Optional[float] = None
    queued_step: int = -1
    writing: Optional[int] = None
    error: Optional[str] = None
    write_seconds: float = 0.0


_RECYCLED = object()


class Manager:
    """The manager of one node. ``open()`` binds its sockets, ``serve()`` runs until stopped."""

    def __init__(self, config: ManagerConfig):
        self.config = config.validate()
        self.root = self.config.shm_root
        self.started = time.time()
        self.ranks: dict[int, RankState] = {}
        self.shares: dict[int, dict[int, Share]] = {}
        self.parity = ParityState()
        self.persisted = PersistState(last_time=self.started)
        self._lock = threading.RLock()
        self._verify_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._unlink = False
        self._persist_cv = threading.Condition()
        self._persist_job: Optional[tuple[int, memoryview]] = None
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Create the shm root and check --dir and the group, then bind the sockets."""
        cfg = self.config
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BaftError(f"--shm-root {self.root}: cannot create ({err.strerror})") from None
        sock = socket_path(self.root)
        if sock.exists():
            try:
                with ManagerClient(sock, timeout=2.0) as other:
                    found = other.status()
                raise BaftError(f"{self.root}: manager of node {found['node_id']} (pid {found['pid']}) already serves it")
            except ManagerUnavailable:
                sock.unlink(missing_ok=True)
        if cfg.dir is not None:
            self._check_dir_writable(cfg.dir)
            steps = persist.list_steps(cfg.dir)
            self.persisted.last_step = steps[0].step if steps else None
        self._adopt_ranks()
        if cfg.group:
            self._check_group()
        self._servers.append(_UnixServer(str(sock), self))
        if cfg.group:
            try:
                self._servers.append(_TCPServer(cfg.me.address, self))
            except OSError as err:
                self._servers[0].server_close()
                sock.unlink(missing_ok=True)
                raise BaftError(f"--group: cannot listen on {cfg.me.host}:{cfg.me.port} ({err.strerror})") from None
        write_json_atomic(self.root / INFO_NAME, {"pid": os.getpid(), "node_id": cfg.node_id, "socket": str(sock),
                                                  "address": str(cfg.me) if cfg.me else None, "started": self.started})
        log.info("node %d serving %s%s", cfg.node_id, sock, f" and {cfg.me.host}:{cfg.me.port}" if cfg.me else "")

    @staticmethod
    def _check_dir_writable(directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise BaftError(f"--dir {directory}: not writable ({err.strerror})") from None

    def _adopt_ranks(self) -> None:
        """Take over rank directories a previous manager of this root left (their commits are intact)."""
        for path in sorted(self.root.glob("rank*")):
            suffix = path.name[4:]
            if not (path.is_dir() and suffix.isdigit()):
                continue
            held = slots.committed(self.root, int(suffix))
            if held:
                record = held[0].record
                self.ranks[record.rank] = RankState(record.rank, record.layout.nbytes, Identity.of(record))
                log.info("adopted rank %d (newest committed step %d)", record.rank, record.step)

    def _check_group(self) -> None:
        """Refuse to start when a reachable member describes the group differently."""
        for member in self.config.group:
            if member.node_id == self.config.node_id:
                continue
            try:
                self._peer_request(member, "group", timeout=2.0)
            except ManagerUnavailable:
                log.info("group member %s not reachable yet", member)

    def serve(self) -> None:
        """Run the servers and background threads until ``shutdown`` or :meth:`request_stop`."""
        if self.config.dir is not None or self.config.group:
            # restores from disk or parity write slots through torch: load it before one is asked for
            self._spawn(persist.preload, "preload")
        for server in self._servers:
            self._spawn(server.serve_forever, f"serve-{type(server).__name__}")
        self._spawn(self._work_loop, "verify-encode")
        self._spawn(self._persist_loop, "persist")
        self._stopping.wait()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._wake.set()
        with self._persist_cv:
            self._persist_cv.notify_all()
        for t in self._threads:
            t.join()
        self._final_persist()
        self._close_files()

    def request_stop(self, unlink: bool) -> None:
        self._unlink = self._unlink or unlink
        self._stopping.set()

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _close_files(self) -> None:
        socket_path(self.root).unlink(missing_ok=True)
        (self.root / INFO_NAME).unlink(missing_ok=True)
        if self._unlink:
            for rank in self._rank_ids():
                shutil.rmtree(slots.rank_dir(self.root, rank), ignore_errors=True)
            log.info("stopped; shared-memory snapshots unlinked")
        else:
            log.info("stopped; shared-memory snapshots left in %s for the next manager", self.root)

    # ---- trainers' requests -----------------------------------------------------------------

    def hello(self, rank: int, nbytes: int, run_id: str = "", model: str = "", topology: Optional[dict] = None) -> dict:
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
            sizes = [r.nbytes for r in self.ranks.values() if r.rank != rank] + [nbytes]
            needed = memory_needed(sizes, self.config.k, self.config.n)
            limit = self.config.memory_limit
            if limit is not None and needed > limit:
                raise BaftError(f"rank {rank}: node {self.config.node_id} needs {human(needed)} of host memory "
                                f"({len(sizes)} ranks x {slots.SLOTS} slots{' + parity shares' if self.config.k else ''}), "
                                f"over --memory-limit {human(limit)}")
        if self.config.dir is not None:
            newest = persist.list_steps(self.config.dir)
            if newest:
                persist.check_identity(newest[0], identity)
        directory = slots.rank_dir(self.root, rank)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for slot in range(slots.SLOTS):
                slots.map_file(directory / f"slot{slot}.bin", max(nbytes, 1), create=True).close()
        except OSError as err:
            raise BaftError(f"{directory}: cannot allocate {slots.SLOTS} x {human(nbytes)} of shared memory "
                            f"({err.strerror})") from None
        with self._lock:
            state = self.ranks.get(rank)
            if state is None:
                self.ranks[rank] = state = RankState(rank, nbytes, identity)
            state.nbytes, state.identity = nbytes, identity
        log.info("hello from rank %d (%s per snapshot)", rank, human(nbytes))
        return {"node_id": self.config.node_id, "root": str(self.root),
                "slots": [str(directory / f"slot{s}.bin") for s in range(slots.SLOTS)],
                "memory": {"reserved": needed, "limit": limit},
                "parity": self._parity_line(), "persist": self._persist_line()}

    def commit(self, rank: int, step: int, slot: Optional[int] = None) -> dict:
        with self._lock:
            state = self.ranks.get(rank)
            if state is None:
                raise BaftError(f"commit: rank {rank} has not said hello to the manager of node {self.config.node_id}")
            state.last_commit = step
        self._wake.set()
        return {}

    def held(self) -> dict:
        """Per rank, the steps this manager can serve from memory (verified), parity and disk."""
        for rank in self._rank_ids():
            self._verify_rank(rank)
        parity = self._parity_steps(self.config.node_id) if self.config.group else {}
        disk = persist.list_steps(self.config.dir) if self.config.dir is not None else []
        out = {}
        # a replaced node's ranks have not said hello yet: what parity or disk holds of them counts too
        known = set(self.ranks) | {r for _, ranks in parity.values() for r in ranks} | {r for p in disk for r in p.ranks}
        with self._lock:
            for rank in sorted(known):
                state = self.ranks.get(rank)
                memory = sorted({s for (_, s), bad in state.results.items() if bad is None}, reverse=True) if state else []
                out[str(rank)] = {
                    "memory": memory[:MEMORY_HELD],
                    "parity": sorted((s for s, (_, ranks) in parity.items() if rank in ranks), reverse=True),
                    "disk": [p.step for p in disk if rank in p.ranks],
                }
        return {"ranks": out}

    def restore(self, rank: int, step: Optional[int] = None) -> dict:
        """Make ``rank``'s snapshot of ``step`` (newest available by default) readable in shared memory."""
        refused: list[str] = []
        parity = self._parity_steps(self.config.node_id) if self.config.group else {}
        disk = {p.step: p for p in persist.list_steps(self.config.dir)} if self.config.dir is not None else {}
        memory = {info.record.step: info for info in slots.committed(self.root, rank)}
        candidates = set(memory) | {s for s, (_, ranks) in parity.items() if rank in ranks} | \
            {s for s, p in disk.items() if rank in p.ranks}
        if step is not None:
            candidates &= {step}
        for s in sorted(candidates, reverse=True):
            if s in memory:
                problem = self._check_in_place(rank, memory[s])
                if problem is None:
                    return self._restored("memory", rank, memory[s].slot, s, refused)
                if problem is not _RECYCLED:
                    refused.append(f"{slots.rank_dir(self.root, rank)}/slot{memory[s].slot}: snapshot of step {s} "
                                   f"refused: {problem}")
            if s in parity and rank in parity[s][1]:
                try:
                    _, bundle = self.rebuild(self.config.node_id, s)
                    return self._materialize("parity", rank, erasure.unpack_bundle(bundle).snapshots, refused)
                except BaftError as err:
                    refused.append(f"parity of step {s}: {err}")
            if s in disk and rank in disk[s].ranks:
                try:
                    persist.check_identity(disk[s], self._identity(rank))
                    return self._materialize("disk", rank, persist.read_snapshot(disk[s].path), refused)
                except BaftError as err:
                    refused.append(str(err))
        for line in refused:
            log.warning("%s", line)
        wanted = f"step {step}" if step is not None else "any step"
        why = f"; {refused[-1]}" if refused else ""
        raise BaftError(f"restore rank {rank}: {wanted} is held nowhere valid (memory, parity, disk){why}")

    def _rank_ids(self) -> list[int]:
        with self._lock:
            return sorted(self.ranks)

    def _identity(self, rank: int) -> Optional[Identity]:
        with self._lock:
            state = self.ranks.get(rank)
        return state.identity if state else None

    def _restored(self, source: str, rank: int, slot: int, step: int, refused: list[str]) -> dict:
        for line in refused:
            log.warning("%s", line)
        path = slots.rank_dir(self.root, rank) / f"slot{slot}.bin"
        log.info("restore rank %d step %d from %s", rank, step, source)
        return {"source": source, "rank": rank, "step": step, "slot": slot, "path": str(path),
                "root": str(self.root), "refused": refused}

    def _materialize(self, source: str, rank: int, snapshots, refused: list[str]) -> dict:
        """Write rebuilt or persisted snapshots of this node into its shm slots, as committed snapshots."""
        found = None
        for record, buffer in snapshots:
            writer = slots.SnapshotWriter(self.root, record.rank, record.layout)
            try:
                target = writer.begin(record.step)
                target.numpy()[:record.layout.nbytes] = np.frombuffer(buffer, dtype=np.uint8, count=record.layout.nbytes)
                slot = writer.slot
                writer.commit(record)
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
        return self._restored(source, rank, found[0], found[1], refused)

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

    def _complete_steps(self) -> set[int]:
        """The steps every known rank holds verified in memory."""
        with self._lock:
            if not self.ranks:
                return set()
            sets = [{s for (_, s), bad in state.results.items() if bad is None} for state in self.ranks.values()]
        return set.intersection(*sets)

    # ---- background work ---------------------------------------------------------------------

    def _work_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self._work_once()
            except Exception:  # the manager must outlive any one bad snapshot
                log.exception("background work failed")

    def _work_once(self) -> None:
        for rank in self._rank_ids():
            self._verify_rank(rank)
        common = self._complete_steps()
        if not common:
            return
        newest = max(common)
        encode = newest if self.config.k is not None and newest > self.parity.encoded_step else None
        save = self._persist_step(common)
        bundles = {s: self._pack(s) for s in {encode, save} - {None}}
        if save is not None and bundles[save] is not None:
            with self._persist_cv:
                self._persist_job = (save, bundles[save])
                self.persisted.queued_step = save
                self._persist_cv.notify()
        if encode is not None and bundles[encode] is not None:
            self._distribute(encode, bundles[encode])

    def _pack(self, step: int) -> Optional[memoryview]:
        """This node's bundle of ``step``, copied out of shared memory and verified on the copy."""
        maps, snapshots = [], []
        try:
            for rank in self._rank_ids():
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

    def _distribute(self, step: int, bundle: memoryview) -> None:
        cfg = self.config
        began = time.perf_counter()
        shares = erasure.encode(bundle, cfg.k, cfg.n)
        encoded = time.perf_counter() - began
        meta = {"step": step, "size": len(bundle), "checksum": erasure.bundle_checksum(bundle),
                "ranks": self._rank_ids()}
        acked, errors = [], {}
        for index, member in enumerate(cfg.group):
            data, shares[index] = shares[index], None
            if member.node_id == cfg.node_id:
                kept = memoryview(np.frombuffer(data, dtype=np.uint8).copy())  # data shares are views of the bundle
                self.store_share(cfg.node_id, step, Share(index, meta["size"], meta["checksum"], meta["ranks"], kept))
                acked.append(member.node_id)
                continue
            try:
                self._peer_request(member, "share_put", payload=data, node=cfg.node_id, index=index, **meta)
                acked.append(member.node_id)
            except BaftError as err:
                errors[member.node_id] = str(err)
        with self._lock:
            self.parity.acked[step] = acked
            for old in sorted(self.parity.acked)[:-SHARE_STEPS_KEPT]:
                del self.parity.acked[old]
            self.parity.errors = errors
            self.parity.encoded_step = step
            self.parity.encode_seconds = encoded
        for node, err in errors.items():
            log.warning("parity of step %d: member %d did not take its share: %s", step, node, err)

    def _persist_step(self, common: set[int]) -> Optional[int]:
        """The step to persist now, if one is due.

        With ``--persist-every N`` that is a multiple of N, so all nodes persist the same
        steps; if the multiple was already recycled the newest step is taken instead, so
        persistence never stalls. With ``--persist-seconds T``, the newest step once T
        seconds have passed since the last write.
        """
        cfg = self.config
        if not cfg.persists:
            return None
        newest = max(common)
        with self._lock:
            done = [s for s in (self.persisted.queued_step, self.persisted.last_step) if s is not None and s >= 0]
            last = max(done) if done else None
            since = time.time() - (self.persisted.last_time or self.started)
        if last is not None and newest <= last:
            return None
        every = cfg.persist_every
        if every is not None:
            aligned = [s for s in common if s % every == 0 and (last is None or s > last)]
            if aligned:
                return max(aligned)
            if last is not None and newest // every * every > last:
                return newest
        if cfg.persist_seconds is not None and since >= cfg.persist_seconds:
            return newest
        return None

    def _persist_loop(self) -> None:
        while True:
            with self._persist_cv:
                while self._persist_job is None and not self._stopping.is_set():
                    self._persist_cv.wait()
                if self._persist_job is None:
                    return
                step, bundle = self._persist_job
                self._persist_job = None
            self._write(step, bundle)

    def _write(self, step: int, bundle: memoryview) -> None:
        with self._lock:
            self.persisted.writing = step
        began = time.perf_counter()
        try:
            snapshots = erasure.unpack_bundle(bundle, verify=False).snapshots
            path = persist.write_snapshot(self.config.dir, snapshots, node_id=self.config.node_id, keep=self.config.keep)
        except BaftError as err:
            with self._lock:
                self.persisted.error = str(err)
                self.persisted.writing = None
            log.error("%s", err)
            return
        with self._lock:
            self.persisted.last_step, self.persisted.last_time = step, time.time()
            self.persisted.writing, self.persisted.error = None, None
            self.persisted.write_seconds = time.perf_counter() - began
        log.info("persisted step %d to %s", step, path)

    def _final_persist(self) -> None:
        """On a clean stop, persist the newest complete step if the schedule has not yet."""
        if not self.config.persists:
            return
        for rank in self._rank_ids():
            self._verify_rank(rank)
        common = self._complete_steps()
        if not common:
            return
        step = max(common)
        if self.persisted.last_step is not None and step <= self.persisted.last_step:
            return
        bundle = self._pack(step)
        if bundle is not None:
            self._write(step, bundle)

    # ---- parity between managers -------------------------------------------------------------

    def _peer_request(self, member: Member, op: str, payload=None, timeout: float = PEER_TIMEOUT, **fields):
        with ManagerClient(member.address, timeout=timeout) as client:
            return client.request(op, payload=payload, group=self.config.signature(),
                                  **{"from": self.config.node_id}, **fields)

    def _check_peer(self, msg: dict) -> None:
        mine, theirs = self.config.signature(), msg.get("group")
        sender = msg.get("from")
        if theirs != mine:
            def show(sig):
                return f"n={sig.get('n')}, k={sig.get('k')}, members {','.join(sig.get('members', []))}" \
                    if isinstance(sig, dict) else repr(sig)
            raise BaftError(f"--group mismatch: node {sender} has {show(theirs)}; "
                            f"node {self.config.node_id} has {show(mine)}")
        if sender not in [m.node_id for m in self.config.group]:
            raise BaftError(f"unknown node id {sender!r}: not a member of this group")

    def _member(self, node) -> Member:
        for m in self.config.group:
            if m.node_id == node:
                return m
        ids = ", ".join(str(m.node_id) for m in self.config.group) or "none: no --group"
        raise BaftError(f"unknown node id {node!r}: this manager's group has members {ids}")

    def store_share(self, origin: int, step: int, share: Share) -> None:
        with self._lock:
            kept = {**self.shares.get(origin, {}), step: share}
            kept = {s: kept[s] for s in sorted(kept)[-SHARE_STEPS_KEPT:]}
            limit = self.config.memory_limit
            if limit is not None and origin != self.config.node_id:
                others = sum(len(s.data) for o, h in self.shares.items() if o != origin for s in h.values())
                total = self._slot_bytes() + others + sum(len(s.data) for s in kept.values())
                if total > limit:
                    raise BaftError(f"node {self.config.node_id}: a {human(len(share.data))} share of node {origin} "
                                    f"would bring host memory to {human(total)}, over --memory-limit {human(limit)}")
            self.shares[origin] = kept

    def _parity_steps(self, node: int) -> dict[int, tuple[list[int], list[int]]]:
        """For each step of ``node``'s bundle: which members hold a share, and which ranks it covers.

        Only steps with at least k holders (rebuildable now) are listed.
        """
        holders: dict[int, list[int]] = {}
        ranks: dict[int, list[int]] = {}
        for member in self.config.group:
            try:
                listed = self._share_list(member, node)
            except BaftError:
                continue
            for step, covered in listed.items():
                holders.setdefault(step, []).append(member.node_id)
                ranks[step] = covered
        return {s: (h, ranks[s]) for s, h in holders.items() if len(h) >= self.config.k}

    def _share_list(self, member: Member, node: int) -> dict[int, list[int]]:
        if member.node_id == self.config.node_id:
            with self._lock:
                return {s: sh.ranks for s, sh in self.shares.get(node, {}).items()}
        reply, _ = self._peer_request(member, "share_list", node=node, timeout=5.0)
        return {int(s): r for s, r in reply["steps"].items()}

    def rebuild(self, node: int, step: Optional[int] = None) -> tuple[int, memoryview]:
        """``node``'s bundle of ``step`` (newest rebuildable by default) from k members' shares, checked end to end."""
        cfg = self.config
        if not cfg.group:
            raise BaftError(f"rebuild node {node}: this manager has no --group, so no parity")
        self._member(node)
        available = self._parity_steps(node)
        steps = sorted((s for s in available if step is None or s == step), reverse=True)
        problems = []
        for s in steps:
            shares: dict[int, erasure.Buffer] = {}
            meta = None
            for holder in available[s][0]:
                try:
                    share = self._get_share(self._member(holder), node, s)
                except BaftError as err:
                    problems.append(str(err))
                    continue
                if meta is None:
                    meta = (share.size, share.checksum)
                if (share.size, share.checksum) != meta:
                    problems.append(f"member {holder} holds a share of another bundle of step {s}")
                    continue
                shares[share.index] = share.data
                if len(shares) == cfg.k:
                    break
            if len(shares) < cfg.k:
                continue
            bundle = erasure.decode(shares, cfg.k, cfg.n, meta[0])
            if erasure.bundle_checksum(bundle) != meta[1]:
                problems.append(f"node {node} step {s}: rebuilt bundle fails its checksum")
                continue
            log.info("rebuilt node %d step %d from members %s", node, s, sorted(shares))
            return s, bundle
        wanted = f"step {step}" if step is not None else "any step"
        why = f" ({problems[-1]})" if problems else ""
        raise BaftError(f"rebuild node {node}: {wanted} has fewer than k={cfg.k} reachable shares{why}")

    def _get_share(self, member: Member, node: int, step: int) -> Share:
        if member.node_id == self.config.node_id:
            with self._lock:
                share = self.shares.get(node, {}).get(step)
            if share is None:
                raise BaftError(f"member {member.node_id}: no share of node {node} step {step}")
            return share
        reply, data = self._peer_request(member, "share_get", node=node, step=step)
        return Share(reply["index"], reply["size"], reply["checksum"], reply["ranks"], data)

    # ---- status ------------------------------------------------------------------------------

    def _slot_bytes(self) -> int:
        total = 0
        for rank in self.ranks:
            for path in slots.rank_dir(self.root, rank).glob("slot*.bin"):
                try:
                    total += path.stat().st_size
                except OSError:
                    pass
        return total

    def _share_bytes(self) -> int:
        return sum(len(s.data) for held in self.shares.values() for s in held.values())

    def _parity_line(self) -> str:
        if not self.config.group:
            return "off"
        with self._lock:
            if self.parity.encoded_step < 0:
                return f"k={self.config.k} of n={self.config.n}, nothing encoded yet"
            acked = self.parity.acked.get(self.parity.encoded_step, [])
            others = [a for a in acked if a != self.config.node_id]
            safe = "survives this node's loss" if len(others) >= self.config.k else "NOT protected"
            errors = "; ".join(f"member {m}: {e}" for m, e in self.parity.errors.items())
            return (f"k={self.config.k} of n={self.config.n}, step {self.parity.encoded_step} held by members "
                    f"{','.join(map(str, acked))} ({safe}){'; ' + errors if errors else ''}")

    def _persist_line(self) -> str:
        cfg = self.config
        if cfg.dir is None:
            return "off"
        with self._lock:
            p = self.persisted
            every = ", ".join(x for x in (f"every {cfg.persist_every} steps" if cfg.persist_every else "",
                                          f"every {cfg.persist_seconds:g} s" if cfg.persist_seconds else "") if x)
            line = f"{cfg.dir} ({every or 'on stop only'}, keep {cfg.keep}): last persisted step " \
                   f"{p.last_step if p.last_step is not None else '-'}"
            if p.writing is not None:
                line += f", writing step {p.writing}"
            if p.error:
                line += f"; FAILED: {p.error}"
            return line

    def status(self) -> dict:
        with self._lock:
            ranks = {}
            for rank, state in sorted(self.ranks.items()):
                held = []
                for info in slots.committed(self.root, rank):
                    key = (info.slot, info.record.step)
                    verdict = state.results.get(key, "pending")
                    held.append({"slot": info.slot, "step": info.record.step,
                                  "verified": "ok" if key in state.results and verdict is None else verdict})
                ranks[str(rank)] = {"nbytes": state.nbytes, "last_commit": state.last_commit, "slots": held,
                                    "run_id": state.identity.run_id}
            slot_bytes, share_bytes = self._slot_bytes(), self._share_bytes()
            reserved = memory_needed([r.nbytes for r in self.ranks.values()], self.config.k, self.config.n)
            return {
                "node_id": self.config.node_id, "pid": os.getpid(), "root": str(self.root),
                "uptime": time.time() - self.started,
                "address": str(self.config.me) if self.config.me else None,
                "ranks": ranks,
                "memory": {"slots": slot_bytes, "shares": share_bytes, "total": slot_bytes + share_bytes,
                           "reserved": reserved, "limit": self.config.memory_limit},
                "parity": None if not self.config.group else {
                    "k": self.config.k, "n": self.config.n, "members": [str(m) for m in self.config.group],
                    "encoded_step": self.parity.encoded_step, "encode_seconds": self.parity.encode_seconds,
                    "acked": {str(s): a for s, a in self.parity.acked.items()},
                    "errors": {str(m): e for m, e in self.parity.errors.items()},
                    "shares": {str(o): sorted(h) for o, h in self.shares.items()},
                    "line": self._parity_line()},
                "persist": None if self.config.dir is None else {
                    "dir": str(self.config.dir), "last_step": self.persisted.last_step,
                    "last_time": self.persisted.last_time, "writing": self.persisted.writing,
                    "error": self.persisted.error, "write_seconds": self.persisted.write_seconds,
                    "line": self._persist_line()},
            }

    # ---- dispatch ----------------------------------------------------------------------------

    def handle(self, msg: dict, payload: Optional[memoryview], local: bool) -> tuple[dict, Optional[erasure.Buffer]]:
        """Answer one request; a BaftError becomes a one-line refusal."""
        problem = check_version(msg)
        if problem:
            raise BaftError(problem)
        op = msg.get("op")
        if op in _PEER_OPS:
            self._check_peer(msg)
        elif op not in (_LOCAL_OPS if local else _REMOTE_OPS):
            raise BaftError(f"unknown or not allowed request {op!r}")
        if op == "hello":
            return self.hello(msg.get("rank"), msg.get("nbytes"), msg.get("run_id", ""), msg.get("model", ""),
                              msg.get("topology")), None
        if op == "commit":
            return self.commit(msg.get("rank"), msg.get("step"), msg.get("slot")), None
        if op == "status":
            return self.status(), None
        if op == "held":
            return self.held(), None
        if op == "restore":
            return self.restore(msg.get("rank"), msg.get("step")), None
        if op == "rebuild":
            step, bundle = self.rebuild(msg.get("node"), msg.get("step"))
            return {"node": msg.get("node"), "step": step, "size": len(bundle),
                    "checksum": erasure.bundle_checksum(bundle)}, bundle
        if op == "shutdown":
            return {}, None
        if op == "group":
            return {"node_id": self.config.node_id, "group": self.config.signature()}, None
        if op == "share_put":
            origin = self._member(msg["node"]).node_id
            if payload is None or len(payload) != erasure.share_size(msg["size"], self.config.k):
                raise BaftError(f"share_put from node {origin}: share of {len(payload or b'')} bytes does not fit "
                                f"a {msg['size']}-byte bundle with k={self.config.k}")
            self.store_share(origin, msg["step"], Share(msg["index"], msg["size"], msg["checksum"], msg["ranks"], payload))
            return {}, None
        if op == "share_list":
            node = self._member(msg["node"]).node_id
            with self._lock:
                return {"steps": {str(s): sh.ranks for s, sh in self.shares.get(node, {}).items()}}, None
        if op == "share_get":
            share = self._get_share(self.config.me, self._member(msg["node"]).node_id, msg["step"])
            return {"index": share.index, "size": share.size, "checksum": share.checksum, "ranks": share.ranks}, share.data
        raise BaftError(f"unknown request {op!r}")


_PEER_OPS = {"group", "share_put", "share_list", "share_get"}
_LOCAL_OPS = {"hello", "commit", "status", "held", "restore", "rebuild", "shutdown"}
_REMOTE_OPS = {"status", "held", "rebuild"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        manager: Manager = self.server.manager
        local = isinstance(self.server, _UnixServer)
        while True:
            try:
                got = read_message(self.rfile)
            except (BaftError, OSError):
                return
            if got is None:
                return
            msg, payload = got
            try:
                reply, data = manager.handle(msg, payload, local)
                reply = {"ok": True, **reply}
            except BaftError as err:
                reply, data = {"ok": False, "error": str(err)}, None
            except Exception as err:  # a bug must not take the manager (and its snapshots) down
                log.exception("request %r failed", msg.get("op"))
                reply, data = {"ok": False, "error": f"manager internal error: {type(err).__name__}: {err}"}, None
            try:
                write_message(self.connection, reply, data)
            except OSError:
                return
            if msg.get("op") == "shutdown" and reply["ok"]:
                manager.request_stop(unlink=True)
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, manager: Manager):
        self.manager = manager
        super().__init__(path, _Handler)


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], manager: Manager):
        self.manager = manager
        super().__init__(address, _Handler)


# ---- command line ------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    """Run a manager in this process until it is stopped; 2 and one line on stderr for a bad setup."""
    try:
        config = parse_args(argv)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s baft manager node{config.node_id}: %(levelname)s %(message)s")
        manager = Manager(config)
        manager.open()
    except BaftError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    # SIGTERM keeps the shm files for the next manager; only `stop` unlinks them
    signal.signal(signal.SIGTERM, lambda *_: manager.request_stop(unlink=False))
    signal.signal(signal.SIGINT, lambda *_: manager.request_stop(unlink=False))
    manager.serve()
    return 0
