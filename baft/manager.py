"""The per-node snapshot manager: keeps committed snapshots alive past trainers, nodes and jobs.

One manager runs per node, started before the trainers and outliving them::

    python -m baft.manager --node-id 0 --shm-root /dev/shm/baft/run/node0 --dir /ckpt/node0 \\
        --group 10.0.0.1:7100,10.0.0.2:7100,10.0.0.3:7100 --parity-k 2 --persist-every 100 --keep 3

* It owns the shared-memory slot files of the node's ranks (``<shm root>/rank<R>/slot<i>.bin``,
  see :mod:`baft.store`): it creates and sizes them when a rank says ``hello``, and unlinks
  them only on ``stop``, so a trainer killed with SIGKILL loses nothing it committed.
* It learns of commits over its Unix socket (:mod:`baft.manager_protocol`), verifies their
  checksums in a background thread, and reports the newest committed snapshot of each rank
  and the one before it (the store never overwrites those two).
* With ``--group``, it packs each step all its ranks have committed into a bundle, encodes
  it (:mod:`baft.erasure`) off the trainers' path and sends one share to each group member;
  it keeps the shares it receives. Any ``k`` members rebuild a lost node's bundle bit for bit.
* With ``--dir``, it persists every N-th step (``--persist-every``) or every T seconds
  (``--persist-seconds``) in a background thread (:mod:`baft.persist`), atomically, keeping
  the ``--keep`` newest, and once more when it stops.
* ``restore`` answers where a rank's snapshot is in shared memory, after re-verifying it,
  rebuilding it there from the group's shares or from disk when memory does not hold it.

``start``, ``stop`` and ``status`` are the API behind ``baft manager start|stop|status``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from baft import erasure, persist, store
from baft.errors import BaftError
from baft.jsonfile import read_json, write_json_atomic
from baft.manager_protocol import (ManagerClient, ManagerUnavailable, check_socket_path, check_version,
                                   read_message, socket_path, write_message)
from baft.persist import Identity

__all__ = ["ManagerConfig", "Member", "Manager", "ManagerClient", "ManagerUnavailable", "memory_needed",
           "parse_args", "main", "spawn", "start", "stop", "status", "format_status", "wait_ready"]

log = logging.getLogger("baft.manager")

INFO_NAME = "manager.json"
LOG_NAME = "manager.log"
SHARE_STEPS_KEPT = 2  # an origin may die mid-distribution: the step before stays rebuildable
POLL_SECONDS = 0.5
PEER_TIMEOUT = 30.0
MEMORY_HELD = 2  # newest committed snapshot of each rank and the one before


@dataclass(frozen=True)
class Member:
    """One manager of a parity group, reachable at ``host:port``."""

    node_id: int
    host: str
    port: int

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def __str__(self) -> str:
        return f"{self.node_id}@{self.host}:{self.port}"


def parse_group(text: str) -> tuple[Member, ...]:
    """``host:port,...`` (node ids 0, 1, ... in order) or ``ID@host:port,...``."""
    members = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        node, _, address = item.rpartition("@")
        host, _, port = address.rpartition(":")
        try:
            node_id = int(node) if node else i
            port_no = int(port)
        except ValueError:
            raise BaftError(f"--group: {item!r} is not host:port or ID@host:port") from None
        if not host or not 0 < port_no < 65536:
            raise BaftError(f"--group: {item!r} is not host:port or ID@host:port")
        members.append(Member(node_id, host, port_no))
    ids = [m.node_id for m in members]
    if len(set(ids)) != len(ids):
        raise BaftError(f"--group: node id {next(i for i in ids if ids.count(i) > 1)} is listed twice")
    return tuple(members)


def parse_bytes(text: str) -> int:
    """``123``, ``512M``, ``8G``, ``1.5T`` (powers of 1024) as bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise BaftError(f"--memory-limit: {text!r} is not a byte count (like 512M or 8G)") from None


def human(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TB"


@dataclass
class ManagerConfig:
    """Everything ``python -m baft.manager`` takes on its command line."""

    node_id: int
    shm_root: Path
    dir: Optional[Path] = None
    group: tuple[Member, ...] = ()
    parity_k: Optional[int] = None
    persist_every: Optional[int] = None
    persist_seconds: Optional[float] = None
    keep: int = 3
    memory_limit: Optional[int] = None

    @property
    def n(self) -> int:
        return len(self.group)

    @property
    def k(self) -> Optional[int]:
        return self.parity_k if self.group else None

    @property
    def me(self) -> Optional[Member]:
        return next((m for m in self.group if m.node_id == self.node_id), None)

    @property
    def persists(self) -> bool:
        return self.dir is not None and (self.persist_every is not None or self.persist_seconds is not None)

    def validate(self) -> "ManagerConfig":
        """Check the configuration; a one-line BaftError naming the flag otherwise."""
        self.shm_root = Path(self.shm_root)
        self.dir = Path(self.dir) if self.dir is not None else None
        if not isinstance(self.node_id, int) or self.node_id < 0:
            raise BaftError(f"--node-id {self.node_id!r}: must be a non-negative integer")
        if self.group:
            ids = [m.node_id for m in self.group]
            if self.node_id not in ids:
                raise BaftError(f"--node-id {self.node_id}: not a member of --group (members {', '.join(map(str, ids))})")
            if len(self.group) < 2:
                raise BaftError(f"--group: {len(self.group)} member; a parity group needs at least 2")
            if self.parity_k is None:
                self.parity_k = self.n - 1
            if not 1 <= self.parity_k < self.n or self.n > erasure.MAX_SHARES:
                raise BaftError(f"--parity-k {self.parity_k}: must be at least 1 and below the group size {self.n} "
                                f"(and the group at most {erasure.MAX_SHARES})")
        elif self.parity_k is not None:
            raise BaftError(f"--parity-k {self.parity_k}: needs --group (the managers that hold the parity)")
        if self.persist_every is not None and self.persist_every < 1:
            raise BaftError(f"--persist-every {self.persist_every}: must be at least 1")
        if self.persist_seconds is not None and self.persist_seconds <= 0:
            raise BaftError(f"--persist-seconds {self.persist_seconds}: must be positive")
        if (self.persist_every is not None or self.persist_seconds is not None) and self.dir is None:
            raise BaftError("--persist-every/--persist-seconds: need --dir (where to persist)")
        if self.keep < 1:
            raise BaftError(f"--keep {self.keep}: must keep at least 1 persisted snapshot")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise BaftError(f"--memory-limit {self.memory_limit}: must be positive")
        check_socket_path(socket_path(self.shm_root))
        return self

    def argv(self) -> list[str]:
        """The command-line arguments that give this configuration back."""
        out = ["--node-id", str(self.node_id), "--shm-root", str(self.shm_root)]
        if self.dir is not None:
            out += ["--dir", str(self.dir)]
        if self.group:
            out += ["--group", ",".join(str(m) for m in self.group)]
        if self.parity_k is not None:
            out += ["--parity-k", str(self.parity_k)]
        if self.persist_every is not None:
            out += ["--persist-every", str(self.persist_every)]
        if self.persist_seconds is not None:
            out += ["--persist-seconds", str(self.persist_seconds)]
        out += ["--keep", str(self.keep)]
        if self.memory_limit is not None:
            out += ["--memory-limit", str(self.memory_limit)]
        return out

    def signature(self) -> dict:
        """What every member of a group must agree on."""
        return {"k": self.k, "n": self.n, "members": [str(m) for m in self.group]}


def memory_needed(rank_bytes: Iterable[int], k: Optional[int] = None, n: int = 0) -> int:
    """Host memory a manager needs for ranks of these snapshot sizes.

    ``SLOTS`` slot files per rank; with parity, the shares it keeps of every member's bundle
    for ``SHARE_STEPS_KEPT`` steps (members' bundles taken to be as large as its own), plus
    one encode in flight (the bundle and its ``n`` shares).
    """
    local = sum(rank_bytes)
    total = store.SLOTS * local
    if k:
        share = erasure.share_size(local, k)
        total += SHARE_STEPS_KEPT * n * share + local + n * share
    return total


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
            slots = store.committed(self.root, int(suffix))
            if slots:
                record = slots[0].record
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
                shutil.rmtree(store.rank_dir(self.root, rank), ignore_errors=True)
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
                                f"({len(sizes)} ranks x {store.SLOTS} slots{' + parity shares' if self.config.k else ''}), "
                                f"over --memory-limit {human(limit)}")
        if self.config.dir is not None:
            newest = persist.list_steps(self.config.dir)
            if newest:
                persist.check_identity(newest[0], identity)
        directory = store.rank_dir(self.root, rank)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for slot in range(store.SLOTS):
                store.map_file(directory / f"slot{slot}.bin", max(nbytes, 1), create=True).close()
        except OSError as err:
            raise BaftError(f"{directory}: cannot allocate {store.SLOTS} x {human(nbytes)} of shared memory "
                            f"({err.strerror})") from None
        with self._lock:
            state = self.ranks.get(rank)
            if state is None:
                self.ranks[rank] = state = RankState(rank, nbytes, identity)
            state.nbytes, state.identity = nbytes, identity
        log.info("hello from rank %d (%s per snapshot)", rank, human(nbytes))
        return {"node_id": self.config.node_id, "root": str(self.root),
                "slots": [str(directory / f"slot{s}.bin") for s in range(store.SLOTS)],
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
        memory = {info.record.step: info for info in store.committed(self.root, rank)}
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
                    refused.append(f"{store.rank_dir(self.root, rank)}/slot{memory[s].slot}: snapshot of step {s} "
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
        path = store.rank_dir(self.root, rank) / f"slot{slot}.bin"
        log.info("restore rank %d step %d from %s", rank, step, source)
        return {"source": source, "rank": rank, "step": step, "slot": slot, "path": str(path),
                "root": str(self.root), "refused": refused}

    def _materialize(self, source: str, rank: int, snapshots, refused: list[str]) -> dict:
        """Write rebuilt or persisted snapshots of this node into its shm slots, as committed snapshots."""
        found = None
        for record, buffer in snapshots:
            writer = store.SnapshotWriter(self.root, record.rank, record.layout)
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

    def _check_in_place(self, rank: int, info: store.SlotInfo):
        """None if the slot verifies, the first bad chunk if not, _RECYCLED if a trainer reused it meanwhile."""
        try:
            with store.open_slot(self.root, rank, info.slot) as m:
                problem = info.record.verify(m)
        except (OSError, ValueError) as err:
            problem = f"cannot map the slot file ({err})"
        if problem is None:
            return None
        now = store.read_slots(store.rank_dir(self.root, rank))[info.slot].record
        if now is None or now.step != info.record.step:
            return _RECYCLED
        return problem

    def _verify_rank(self, rank: int) -> None:
        with self._verify_lock:
            infos = store.committed(self.root, rank)
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
                    log.warning("%s/slot%d: snapshot of step %d refused: %s", store.rank_dir(self.root, rank),
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
                info = next((i for i in store.committed(self.root, rank) if i.record.step == step), None)
                if info is None:
                    return None
                m = store.open_slot(self.root, rank, info.slot)
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
            for path in store.rank_dir(self.root, rank).glob("slot*.bin"):
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
                slots = []
                for info in store.committed(self.root, rank):
                    key = (info.slot, info.record.step)
                    verdict = state.results.get(key, "pending")
                    slots.append({"slot": info.slot, "step": info.record.step,
                                  "verified": "ok" if key in state.results and verdict is None else verdict})
                ranks[str(rank)] = {"nbytes": state.nbytes, "last_commit": state.last_commit, "slots": slots,
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


# ---- command line and process control ---------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BaftError(f"baft manager: {message}")


def parse_args(argv: Optional[list[str]] = None) -> ManagerConfig:
    """The configuration of ``python -m baft.manager ARGS``, validated (one-line BaftError otherwise)."""
    parser = _Parser(prog="python -m baft.manager", description="baft per-node snapshot manager")
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--shm-root", type=Path, help="shared-memory directory of this node's snapshots")
    parser.add_argument("--dir", type=Path, help="where to persist snapshots")
    parser.add_argument("--group", help="parity group members: host:port,... or ID@host:port,...")
    parser.add_argument("--parity-k", type=int, help="data shares of the group's code (default n-1)")
    parser.add_argument("--persist-every", type=int, metavar="N")
    parser.add_argument("--persist-seconds", type=float, metavar="T")
    parser.add_argument("--keep", type=int, default=3, metavar="R")
    parser.add_argument("--memory-limit", metavar="BYTES")
    args = parser.parse_args(argv)
    config = ManagerConfig(
        node_id=args.node_id,
        shm_root=args.shm_root or Path(store.DEFAULT_ROOT) / f"node{args.node_id}",
        dir=args.dir,
        group=parse_group(args.group) if args.group else (),
        parity_k=args.parity_k,
        persist_every=args.persist_every,
        persist_seconds=args.persist_seconds,
        keep=args.keep,
        memory_limit=parse_bytes(args.memory_limit) if args.memory_limit is not None else None,
    )
    return config.validate()


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


def spawn(config: ManagerConfig) -> subprocess.Popen:
    """Start ``python -m baft.manager`` detached, logging to ``<shm root>/manager.log``."""
    config.validate()
    try:
        config.shm_root.mkdir(parents=True, exist_ok=True)
        logfile = open(config.shm_root / LOG_NAME, "ab")
    except OSError as err:
        raise BaftError(f"--shm-root {config.shm_root}: cannot create ({err.strerror})") from None
    with logfile:
        return subprocess.Popen([sys.executable, "-m", "baft.manager", *config.argv()], stdin=subprocess.DEVNULL,
                                stdout=logfile, stderr=logfile, start_new_session=True)


def wait_ready(shm_root, timeout: float = 60.0, proc: Optional[subprocess.Popen] = None) -> dict:
    """Wait until the manager of ``shm_root`` answers; its status. A manager that exits instead raises its error."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise BaftError(_last_error(Path(shm_root) / LOG_NAME) or f"manager exited with status {proc.returncode}")
        try:
            with ManagerClient.connect(shm_root, timeout=2.0) as client:
                return client.status()
        except ManagerUnavailable:
            if time.monotonic() > deadline:
                raise BaftError(f"{shm_root}: manager did not answer within {timeout:g} s") from None
            time.sleep(0.05)


def _last_error(logfile: Path) -> Optional[str]:
    try:
        lines = [line for line in logfile.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    except OSError:
        return None
    return lines[-1].removeprefix("error: ") if lines else None


def start(config: ManagerConfig, timeout: float = 60.0) -> int:
    """Start a manager for ``config`` in the background, wait until it answers; its pid."""
    proc = spawn(config)
    wait_ready(config.shm_root, timeout, proc)
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop(shm_root, timeout: float = 120.0) -> None:
    """Stop the manager of ``shm_root``: it persists what is due, then unlinks its shared memory."""
    info_path = Path(shm_root) / INFO_NAME
    pid = read_json(info_path)["pid"] if info_path.exists() else None
    try:
        with ManagerClient.connect(shm_root, timeout=5.0) as client:
            client.shutdown()
    except ManagerUnavailable:
        raise BaftError(f"{shm_root}: no manager running (nothing answers at {socket_path(shm_root)})") from None
    deadline = time.monotonic() + timeout
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            raise BaftError(f"{shm_root}: manager (pid {pid}) still running {timeout:g} s after shutdown")
        time.sleep(0.05)


def status(shm_root, timeout: float = 5.0) -> dict:
    """The status of the manager of ``shm_root`` (see :func:`format_status`)."""
    with ManagerClient.connect(shm_root, timeout=timeout) as client:
        return client.status()


def format_status(st: dict) -> str:
    """``baft manager status`` as text: steps held, sizes, checksums, parity, persistence, memory."""
    mem = st["memory"]
    lines = [f"node {st['node_id']} (pid {st['pid']}, up {st['uptime']:.0f} s) shm {st['root']}"
             + (f", listening {st['address']}" if st["address"] else "")]
    for rank, r in st["ranks"].items():
        held = ", ".join(f"step {s['step']} ({s['verified']})" for s in r["slots"]) or "nothing committed"
        lines.append(f"  rank {rank}: {human(r['nbytes'])} per snapshot; {held}")
    if not st["ranks"]:
        lines.append("  no ranks yet")
    lines.append(f"  memory: {human(mem['total'])} held (slots {human(mem['slots'])}, shares {human(mem['shares'])}), "
                 f"{human(mem['reserved'])} reserved, limit {human(mem['limit']) if mem['limit'] else 'none'}")
    lines.append(f"  parity: {st['parity']['line'] if st['parity'] else 'off'}")
    lines.append(f"  persist: {st['persist']['line'] if st['persist'] else 'off'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
