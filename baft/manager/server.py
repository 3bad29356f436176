"""The per-node snapshot manager: keeps committed snapshots alive past trainers, nodes and jobs.

One manager runs per node, started before the trainers and outliving them::

    python -m baft.manager --node-id 0 --shm-root /dev/shm/baft/run/node0 --dir /ckpt/node0 \\
        --group 10.0.0.1:7100,10.0.0.2:7100,10.0.0.3:7100 --parity-k 2 --persist-every 100 --keep 3

* It owns the shared-memory slot files of the node's ranks (``<shm root>/rank<R>/slot<i>.bin``,
  see :mod:`baft.snapshot.slots`; kept by :mod:`baft.manager.ranks`): it creates and sizes them
  when a rank says ``hello``, and unlinks them only on ``stop``, so a trainer killed with SIGKILL
  loses nothing it committed.
* It learns of commits over its Unix socket (:mod:`baft.manager.protocol`), verifies their
  checksums in a background thread, and reports the newest committed snapshot of each rank
  and the one before it (the store never overwrites those two).
* With ``--group``, it packs a step all its ranks have committed into a bundle, encodes
  it (:mod:`baft.manager.erasure`) off the trainers' path and sends one share to each group member;
  it keeps the shares it receives. Any ``k`` members rebuild a lost node's bundle bit for bit
  (:mod:`baft.manager.parity`).
* With ``--dir``, it persists every N-th step (``--persist-every``) or every T seconds
  (``--persist-seconds``) in a background thread (:mod:`baft.manager.persister`), atomically
  (:mod:`baft.manager.persist`), keeping the ``--keep`` newest, and once more when it stops
  (with ``--dir`` alone, only then: the newest step, for the next launch to go on from).
* ``restore`` answers where a rank's snapshot is in shared memory, after re-verifying it,
  rebuilding it there from the group's shares or from disk when memory does not hold it.
* It watches its ranks' heartbeats and kills a rank that hangs (:mod:`baft.manager.watchdog`), so
  that torchrun relaunches the job as after a death.

This module is the process: its sockets, the dispatch of requests to those parts, the
background loop that verifies commits and hands bundles to parity and disk, and ``main``.
Its configuration is :mod:`baft.manager.config`; starting, stopping and asking it,
:mod:`baft.manager.control`.
"""

from __future__ import annotations

import logging
import os
import signal
import socketserver
import sys
import threading
import time
from typing import Optional

from baft.errors import BaftError
from baft.jsonfile import write_json_atomic
from baft.manager import erasure, persist
from baft.manager.config import ManagerConfig, parse_args
from baft.manager.control import INFO_NAME
from baft.manager.parity import ParityGroup
from baft.manager.persister import Persister
from baft.manager.protocol import (ManagerClient, ManagerUnavailable, check_version, read_message, socket_path,
                                   write_message)
from baft.manager.ranks import NodeRanks
from baft.manager.watchdog import Watchdog

__all__ = ["Manager", "main"]

log = logging.getLogger("baft.manager")

POLL_SECONDS = 0.5


class Manager:
    """The manager of one node. ``open()`` binds its sockets, ``serve()`` runs until stopped.

    Its parts share one lock: ``ranks`` (the node's ranks and their slots), ``parity`` (the
    parity group) and ``persister`` (persistence to ``--dir``); ``watchdog`` (the ranks' heartbeats)
    needs none.
    """

    def __init__(self, config: ManagerConfig):
        self.config = config.validate()
        self.root = self.config.shm_root
        self.started = time.time()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._unlink = False
        self.ranks = NodeRanks(self.config, self._lock)
        self.parity = ParityGroup(self.config, self._lock, self.ranks)
        self.persister = Persister(self.config, self._lock, self.started, self._stopping)
        self.watchdog = Watchdog(self.root, self.config.node_id)
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
            self.persister.open()
        self.ranks.adopt()
        if cfg.group:
            self.parity.check_group()
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

    def serve(self) -> None:
        """Run the servers and background threads until ``shutdown`` or :meth:`request_stop`."""
        if self.config.dir is not None or self.config.group:
            # restores from disk or parity write slots through torch: load it before one is asked for
            self._spawn(persist.preload, "preload")
        for server in self._servers:  # polled every 50 ms for a stop (the default, 0.5 s, is a stop's whole wait)
            self._spawn(lambda server=server: server.serve_forever(poll_interval=0.05), f"serve-{type(server).__name__}")
        self._spawn(self._work_loop, "verify-encode")
        self._spawn(self.persister.run, "persist")
        self._spawn(lambda: self.watchdog.run(self._stopping), "watchdog")
        self._stopping.wait()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._wake.set()
        self.persister.wake()
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
            self.ranks.unlink()
            try:  # empty unless it also holds this manager's log (a manager started without another log file)
                self.root.rmdir()
            except OSError:
                pass
            log.info("stopped; shared-memory snapshots unlinked")
        else:
            log.info("stopped; shared-memory snapshots left in %s for the next manager", self.root)

    # ---- requests that span the parts --------------------------------------------------------

    def hello(self, rank: int, nbytes: int, run_id: str = "", model: str = "", topology: Optional[dict] = None,
              node_ranks: int = 1) -> dict:
        """Register ``rank`` and create its slots; the reply says where they are and how parity and disk stand."""
        reply = self.ranks.hello(rank, nbytes, run_id, model, topology, node_ranks)
        return {**reply, "parity": self.parity.line(), "persist": self.persister.line()}

    def held(self) -> dict:
        """Per rank, the steps this manager can serve from memory (verified), parity and disk."""
        self.ranks.verify_all()
        parity, disk = self._parity_and_disk()
        memory = self.ranks.memory_steps()
        # a replaced node's ranks have not said hello yet: what parity or disk holds of them counts too
        known = (set(memory) | {r for _, ranks in parity.values() for r in ranks}
                 | {r for p in disk.values() for r in p.ranks})
        per_rank = {}
        for rank in sorted(known):
            in_parity, on_disk = _steps_of(rank, parity, disk)
            per_rank[str(rank)] = {"memory": memory.get(rank, []), "parity": in_parity, "disk": on_disk}
        return {"ranks": per_rank}

    def _parity_and_disk(self) -> tuple[dict, dict]:
        """What this node's parity holds (step -> (bundle, ranks)) and its disk (step -> PersistedStep, newest
        first), where a snapshot is looked for after memory."""
        parity = self.parity.steps(self.config.node_id)
        disk = {p.step: p for p in persist.list_steps(self.config.dir)} if self.config.dir is not None else {}
        return parity, disk

    def restore(self, rank: int, step: Optional[int] = None) -> dict:
        """Make ``rank``'s snapshot of ``step`` (newest available by default) readable in shared memory."""
        refused: list[str] = []
        parity, disk = self._parity_and_disk()
        memory = self.ranks.in_memory(rank)
        in_parity, on_disk = _steps_of(rank, parity, disk)
        candidates = set(memory) | set(in_parity) | set(on_disk)
        if step is not None:
            candidates &= {step}
        for s in sorted(candidates, reverse=True):
            if s in memory:
                reply = self.ranks.restore_in_place(rank, memory[s], refused)
                if reply is not None:
                    return reply
            if s in parity and rank in parity[s][1]:
                try:
                    _, bundle = self.parity.rebuild(self.config.node_id, s)
                    return self.ranks.materialize("parity", rank, erasure.unpack_bundle(bundle).snapshots, refused)
                except BaftError as err:
                    refused.append(f"parity of step {s}: {err}")
            if s in disk and rank in disk[s].ranks:
                try:
                    persist.check_identity(disk[s], self.ranks.identity(rank))
                    # its own file alone: another rank's damaged one is that rank's to refuse
                    return self.ranks.materialize("disk", rank, persist.read_snapshot(disk[s].path, [rank]), refused)
                except BaftError as err:
                    refused.append(str(err))
        for line in refused:
            log.warning("%s", line)
        wanted = f"step {step}" if step is not None else "any step"
        why = f"; {refused[-1]}" if refused else ""
        raise BaftError(f"restore rank {rank}: {wanted} is held nowhere valid (memory, parity, disk){why}")

    def status(self) -> dict:
        """Everything ``baft manager status`` shows: ranks and their slots, memory, parity, persistence."""
        with self._lock:
            ranks = self.ranks.status()
            slot_bytes, share_bytes = self.ranks.slot_bytes(), self.parity.share_bytes()
            return {
                "node_id": self.config.node_id, "pid": os.getpid(), "root": str(self.root),
                "uptime": time.time() - self.started,
                "address": str(self.config.me) if self.config.me else None,
                "ranks": ranks,
                "memory": {"slots": slot_bytes, "shares": share_bytes, "total": slot_bytes + share_bytes,
                           "reserved": self.ranks.reserved_bytes(), "limit": self.config.memory_limit},
                "parity": self.parity.status(),
                "persist": self.persister.status(),
            }

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
        """Verify new commits; encode and distribute a step all ranks hold, queue one due on disk."""
        self.ranks.verify_all()
        common = self.ranks.complete_steps()
        if not common:
            return
        encode = self.parity.step_to_encode(common)
        save = self.persister.due_step(common)
        bundles = {s: self.ranks.pack(s) for s in {encode, save} - {None}}
        if save is not None and bundles[save] is not None:
            self.persister.queue(save, bundles[save])
        if encode is not None and bundles[encode] is not None:
            self.parity.distribute(encode, bundles[encode])

    def _final_persist(self) -> None:
        """On a clean stop, persist the newest complete step if the schedule has not yet (with ``--dir`` and no
        schedule, the only write: the state a stopped run goes on from)."""
        if self.config.dir is None:
            return
        self.ranks.verify_all()
        common = self.ranks.complete_steps()
        if not common:
            return
        step = max(common)
        last = self.persister.state.last_step
        if last is not None and step <= last:
            return
        bundle = self.ranks.pack(step)
        if bundle is None:
            return
        self.persister.write(step, bundle)
        if self.persister.state.last_step != step:  # the write failed: memory holds the only copy
            self._unlink = False
            log.error("step %d is not on disk: its shared-memory snapshots stay in %s "
                      "(`baft manager clean` frees them)", step, self.root)

    # ---- dispatch ----------------------------------------------------------------------------

    def handle(self, msg: dict, payload: Optional[memoryview], local: bool) -> tuple[dict, Optional[erasure.Buffer]]:
        """Answer one request; a BaftError becomes a one-line refusal."""
        problem = check_version(msg)
        if problem:
            raise BaftError(problem)
        op = msg.get("op")
        if op in _PEER_OPS:
            self.parity.check_peer(msg)
        elif op not in (_LOCAL_OPS if local else _REMOTE_OPS):
            raise BaftError(f"unknown or not allowed request {op!r}")
        if op == "hello":
            return self.hello(msg.get("rank"), msg.get("nbytes"), msg.get("run_id", ""), msg.get("model", ""),
                              msg.get("topology"), msg.get("node_ranks", 1)), None
        if op == "commit":
            self.ranks.commit(msg.get("rank"), msg.get("step"))
            self._wake.set()
            return {}, None
        if op == "status":
            return self.status(), None
        if op == "held":
            return self.held(), None
        if op == "restore":
            return self.restore(msg.get("rank"), msg.get("step")), None
        if op == "rebuild":
            step, bundle = self.parity.rebuild(msg.get("node"), msg.get("step"))
            return {"node": msg.get("node"), "step": step, "size": len(bundle),
                    "checksum": erasure.bundle_checksum(bundle)}, bundle
        if op == "shutdown":
            return {}, None
        if op == "group":
            return {"node_id": self.config.node_id, "group": self.config.signature()}, None
        if op == "share_put":
            self.parity.receive(msg, payload)
            return {}, None
        if op == "share_list":
            node = self.parity.member(msg["node"]).node_id
            return {"steps": {str(s): r for s, r in self.parity.held_shares(node).items()}}, None
        if op == "share_get":
            share = self.parity.get_share(self.config.me, self.parity.member(msg["node"]).node_id, msg["step"])
            return {"index": share.index, "size": share.size, "checksum": share.checksum, "ranks": share.ranks}, share.data
        raise BaftError(f"unknown request {op!r}")


_PEER_OPS = {"group", "share_put", "share_list", "share_get"}
_LOCAL_OPS = {"hello", "commit", "status", "held", "restore", "rebuild", "shutdown"}
_REMOTE_OPS = {"status", "held", "rebuild"}


def _steps_of(rank: int, parity: dict, disk: dict) -> tuple[list[int], list[int]]:
    """The steps of ``rank``'s snapshot that ``parity`` and ``disk`` (:meth:`Manager._parity_and_disk`) hold, newest
    first."""
    return (sorted((s for s, (_, ranks) in parity.items() if rank in ranks), reverse=True),
            [s for s, p in disk.items() if rank in p.ranks])


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
