"""The warm fork server (``python -m baft.warm.server SOCKET PARENT_PID [LATER]``): imports once, forks every
rank.

It listens first, then imports (:mod:`baft.warm.preload`; a client that connects meanwhile waits in the listen
queue), then answers each client by forking a child that becomes the rank (:mod:`baft.warm.child`). The server
writes the child's pid, then its exit status (negative: the signal) on the client's connection, and kills the child
when the client goes away (torchrun killed it), so rank and client live and die together. A job that recovers in
place (:mod:`baft.recovery.world`) has its killed ranks replaced, each by one of the spares the server keeps for it
(:mod:`baft.warm.spares`), or by a new fork; not one that its client stopped (:func:`_hear`). A client stopped
(SIGSTOP, SIGTSTP: to ``ps`` it is the rank) has its rank stopped with it, and continued with it (:meth:`_mirror_stops`).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

from baft.config import LAUNCHER_ENV, REPLACE_ENV, REPLACEMENT_ENV, SPARES_ENV, STORE_ENV
from baft.warm.child import become_rank, die_with_parent
from baft.warm.preload import freeze, import_if_there, preload, unforkable
from baft.warm.spares import Spare, assign, channel_pair, job_of, kill_spare, wait_as_spare

IDLE = 1.0  # seconds without a request after which the server imports what preload() left for later
STOP_POLL = 0.25  # seconds between looks at whether a rank's client is stopped
ORPHAN_GRACE = 60.0  # seconds the ranks of a dead launcher have to be stopped by its torchrun (30 s, then SIGKILL)


def serve(path: str, parent: int, later: str = "idle") -> None:
    """Answer fork requests on the Unix socket ``path`` until SIGTERM, or until ``parent`` (the launcher) is dead
    and no rank is left. A dead launcher's torchrun stops the ranks through their clients, as it stops
    ranks it started itself: killing them here as well would race torchrun's own shutdown (a torchrun
    that saw its workers fail as its SIGTERM came stayed alive, tailing their logs, after the launcher
    was SIGKILLed). Ranks still there :data:`ORPHAN_GRACE` seconds after the launcher's death are killed."""
    die_with_parent(parent, signal.SIGHUP)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".new")
    listener.listen(256)
    os.rename(path + ".new", path)  # the launcher starts torchrun once the path exists
    ForkServer(path, listener, later=preload(later)).run()


class ForkServer:
    """The server's state once it has imported: its listener, its children (ranks and spares) and what it keeps
    for the jobs that recover in place."""

    def __init__(self, path: str, listener: socket.socket, later: list[str]):
        self.path, self.listener, self.later = path, listener, later
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGTERM, self.stop)
        self.launcher_died: list[float] = []
        signal.signal(signal.SIGHUP, lambda *_: self.launcher_died.append(time.monotonic()))
        self.children: dict[int, Rank] = {}  # pid -> the rank's request and its client's connection
        self.orphans: set[int] = set()  # children whose client is gone, killed and not yet reaped
        self.store: list[str] = []  # the address of the store where ranks that recover in place meet, once kept
        self.spares: dict[str, list[Spare]] = {}  # job -> its spares, forked ahead of a fault
        self.reaping = False  # whether a signal handler reaps

    def run(self) -> None:
        while True:
            died = self.launcher_died
            if died and (not self.children or time.monotonic() - died[0] > ORPHAN_GRACE):
                self.stop()
            watched = [r.conn for pid, r in self.children.items() if pid not in self.orphans]
            timeout = IDLE if self.later or self.launcher_died else None
            if self.children:
                timeout = min(timeout or STOP_POLL, STOP_POLL)
            listening = [self.listener] if self.listener else []
            ready = select.select([*listening, self.wake_r, *watched], [], [], timeout)[0]
            if not ready and self.later:
                self._do_later()
                continue
            for conn in ready:
                if conn is self.listener:
                    rank = _accept(self.listener, self.store)
                    if rank is not None:
                        self.children[_fork(rank, *self._inherited())] = rank
                        self._keep_spares(rank.request)
                elif conn is self.wake_r:
                    os.read(self.wake_r, 512)
                else:
                    pid = next(p for p, r in self.children.items() if r.conn is conn)
                    if not _hear(self.children[pid]):  # the client is gone (torchrun killed it): so is its rank
                        os.kill(pid, signal.SIGKILL)
                        self.orphans.add(pid)
            self._reap()
            self.orphans &= self.children.keys()
            self._mirror_stops()

    def stop(self, *_) -> None:
        """The ranks and spares die with the server (and by their death signal, should it be SIGKILLed)."""
        for pid in [*self.children, *(s.pid for kept in self.spares.values() for s in kept)]:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)  # the launcher's, made for this server alone
        os._exit(0)

    def _do_later(self) -> None:
        # a rank that dies meanwhile is reaped as it dies (its relaunch waited for the import, 1.8 s), where no rank is
        # replaced in place: a replacement is a fork, and a fork must not copy a half-done import
        signal.signal(signal.SIGCHLD, self._reap_unless_replaced)
        try:
            import_if_there(self.later.pop(0))
        finally:
            signal.signal(signal.SIGCHLD, lambda *_: None)
        freeze()
        refusal = unforkable()
        if refusal:  # the ranks already forked go on; new ones start cold
            print(refusal, file=sys.stderr, flush=True)
            self.listener.close()
            os.unlink(self.path)
            self.listener = None

    def _inherited(self) -> tuple[list[socket.socket], list[int]]:
        """What a child closes: the server's sockets, and its files (the wake-up pipe, ranks' standard streams)."""
        sockets = [*(r.conn for r in self.children.values()),
                   *(spare.channel for kept in self.spares.values() for spare in kept)]
        return ([self.listener, *sockets] if self.listener else sockets,
                [self.wake_r, self.wake_w, *(fd for r in self.children.values() for fd in r.fds)])

    def _keep_spares(self, request: dict) -> None:
        kept = self.spares.setdefault(job_of(request["env"]), [])
        while len(kept) < spares_wanted(request["env"]):
            kept.append(_fork_spare(request, *self._inherited()))

    def _replace(self, rank: Rank) -> int:
        """The process that takes a killed rank's place: a spare of its job's, or a new fork; its pid."""
        kept = self.spares.get(job_of(rank.request["env"]), [])
        while kept:
            spare = kept.pop(0)
            try:
                assign(spare, rank.request, rank.fds)
            except OSError:  # it died a moment ago, not yet reaped
                kill_spare(spare)
                continue
            _tell(rank.conn, {"pid": spare.pid})
            self._keep_spares(rank.request)
            return spare.pid
        return _fork(rank, *self._inherited())

    def _mirror_stops(self) -> None:
        """Stop each rank whose client is stopped, and continue it once its client is: a SIGSTOP sent to the process
        ``ps`` shows as the rank reaches no rank otherwise (no process can pass it on), and the rank trained on while
        the stopped client held up torchrun at the job's end, forever. Stopped, the rank is a hang its manager
        kills (:meth:`_reap` continues its client then)."""
        for pid, rank in self.children.items():
            stopped = _is_stopped(rank.request.get("client"))
            if stopped != rank.client_stopped and pid not in self.orphans:
                rank.client_stopped = stopped
                _signal(pid, signal.SIGSTOP if stopped else signal.SIGCONT)  # (one just ended is reaped next)

    def _reap_unless_replaced(self, *_) -> None:
        """:meth:`_reap` from a signal handler, where no end of a child forks another (no rank may be replaced, no
        spare kept), and not inside itself."""
        if self.reaping or any(rank.replacements for rank in self.children.values()) or any(self.spares.values()):
            return
        self.reaping = True
        try:
            self._reap()
        finally:
            self.reaping = False

    def _reap(self) -> None:
        """Collect the children that ended: a rank killed by a signal whose client is still there and did not stop
        it (:func:`_hear`) is replaced in place where it may be (:func:`replaceable`), one generation on; any other
        end of a rank goes to its client, and the last rank of a job takes its spares with it; a spare killed has
        another forked behind it (one that failed on its own, not)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            rank = self.children.pop(pid, None)
            if rank is None:
                self._spare_ended(pid, code)
                continue
            if rank.client_stopped:  # it ended stopped with its client (a hang its manager killed): the client
                rank.client_stopped = False  # goes on, to follow its replacement or to end as it ended
                _signal(rank.request["client"], signal.SIGCONT)
            if code < 0:
                _kill_session(pid)
                _hear(rank)  # the signal it died of may be one its client passed on just before
                if not rank.stopped:
                    _log_death(rank, code)
            if code < 0 and rank.replacements:
                rank.request["env"][REPLACEMENT_ENV] = "1"
                rank.replacements -= 1
                self.children[self._replace(rank)] = rank
                continue
            for fd in rank.fds:
                os.close(fd)
            _tell(rank.conn, {"exit": code})
            rank.conn.close()
            job = job_of(rank.request["env"])
            if not any(job_of(r.request["env"]) == job for r in self.children.values()):
                for spare in self.spares.pop(job, []):
                    kill_spare(spare)

    def _spare_ended(self, pid: int, code: int) -> None:
        dead = next((s for kept in self.spares.values() for s in kept if s.pid == pid), None)
        if dead is None:  # a job's spare killed as the job ended, or the store keeper
            return
        self.spares[job_of(dead.request["env"])].remove(dead)
        dead.channel.close()
        if code in (-signal.SIGKILL, -signal.SIGTERM):
            self._keep_spares(dead.request)


@dataclass
class Rank:
    """A forked rank: its client's connection and request; while it may be replaced in place, the client's
    standard streams (the replacement's) and how many replacements are left."""

    conn: socket.socket
    request: dict
    fds: list[int]
    replacements: int = 0
    stopped: bool = False  # its client passed on a signal to it, or is gone: it was stopped from outside
    client_stopped: bool = False  # its client is stopped (SIGSTOP), and so is it (ForkServer._mirror_stops)


def _accept(listener: socket.socket, store: list[str]) -> Optional[Rank]:
    """The next client's request, or None where it sent none (it died, or only asked whether a server listens)."""
    conn, _ = listener.accept()
    try:
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        request = json.loads(conn.makefile("rb").readline())
    except (OSError, ValueError):
        conn.close()
        return None
    request["server"] = os.getpid()
    env = request["env"]
    rank = Rank(conn, request, fds, replaceable(env))
    if rank.replacements:
        if not store:
            store.append(_keep_store())
        env[STORE_ENV] = store[0]
    return rank


def replaceable(env: dict) -> int:
    """How many times a rank started with ``env`` is replaced in place when killed: its launcher's budget
    (``BAFT_REPLACE_RANKS``) where it is a worker of torchrun's and the whole job runs on this node (its survivors
    meet the replacement at this server's store); 0 elsewhere (torchrun itself among them)."""
    budget = env.get(REPLACE_ENV, "0")
    one_node = env.get("WORLD_SIZE") is not None and env.get("WORLD_SIZE") == env.get("LOCAL_WORLD_SIZE")
    worker = "TORCHELASTIC_RESTART_COUNT" in env  # torchrun's agent gives it its workers, not itself
    return int(budget) if budget.isdigit() and one_node and worker else 0


def spares_wanted(env: dict) -> int:
    """How many spares a job whose rank started with ``env`` keeps (``BAFT_SPARES``): none where its ranks are not
    replaced in place."""
    wanted = env.get(SPARES_ENV, "0")
    return int(wanted) if wanted.isdigit() and replaceable(env) else 0


def _keep_store() -> str:
    """Fork the process that keeps the c10d store (``torch.distributed.TCPStore``) where the ranks of a job
    that recovers in place meet again; its address. It outlives any rank, and dies with the server."""
    import torch.distributed as dist

    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        die_with_parent(os.getppid(), signal.SIGKILL)
        keeper = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)
        os.write(w, str(keeper.port).encode())
        os.close(w)
        while True:
            signal.pause()
    os.close(w)
    with os.fdopen(r) as port:
        return f"127.0.0.1:{port.read()}"


def _fork(rank: Rank, sockets: list[socket.socket], fds: list[int]) -> int:
    """Fork ``rank``'s process. The client hears the pid."""
    pid = os.fork()
    if pid == 0:
        _as_child(rank.conn, sockets, fds)
        become_rank(rank.conn, list(rank.fds), rank.request)
    if not rank.replacements:
        for fd in rank.fds:
            os.close(fd)
        rank.fds = []
    _tell(rank.conn, {"pid": pid})
    return pid


def _fork_spare(request: dict, sockets: list[socket.socket], fds: list[int]) -> Spare:
    """Fork a spare for ``request``'s job (:mod:`baft.warm.spares`)."""
    mine, theirs = channel_pair()
    pid = os.fork()
    if pid == 0:
        _as_child(theirs, [*sockets, mine], fds)
        die_with_parent(request["server"], signal.SIGKILL)
        wait_as_spare(theirs, request)
    theirs.close()
    return Spare(pid, mine, request)


def _as_child(kept: socket.socket, sockets: list[socket.socket], fds: list[int]) -> None:
    """In a forked child: the default signal handling; the server's ``sockets`` but ``kept`` closed (through their
    objects: a socket object closed by number would close, when collected as the child exits, whatever the rank has
    opened under that number since), and its files ``fds`` (the wake-up pipe, the standard streams it keeps for
    other ranks' replacements)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for other in sockets:
        if other is not kept:
            other.close()
    for fd in fds:
        os.close(fd)


def _hear(rank: Rank) -> bool:
    """Read, without waiting, what ``rank``'s client sent: a byte before each signal it passes on to the rank, which
    is then stopped from outside (torchrun stops its workers with SIGTERM) and is replaced no more; a replacement
    would wait for its peers, stopped too, and torchrun for it, until its SIGKILL 30 s on. The same where the client
    is gone; False then."""
    try:
        heard = rank.conn.recv(64, socket.MSG_DONTWAIT)
    except BlockingIOError:  # nothing sent
        return True
    except ConnectionResetError:  # it died with a line of the server's unread
        heard = b""
    rank.replacements, rank.stopped = 0, True
    return bool(heard)


def _is_stopped(pid: Optional[int]) -> bool:
    """Whether the process ``pid`` is stopped by a signal (state ``T`` in ``/proc/PID/stat``; not ``t``, a debugger's
    stop); False where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError, TypeError):
        return False


def _signal(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``, where it has not ended meanwhile."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _log_death(rank: Rank, code: int) -> None:
    """A rank killed by a signal nothing passed on to it (the kernel's OOM killer, a user's ``kill``): the fault of its
    attempt in its run's fault log, when it died, where nothing logged one (an injected fault, a hang its manager
    killed), so that the restart's record counts its phases from then (:mod:`baft.recovery.record`)."""
    from baft import faults
    from baft.recovery.record import attempt_of

    env = rank.request["env"]
    run_dir = env.get(LAUNCHER_ENV["run_dir"])
    attempt = attempt_of(env)
    try:
        if run_dir:
            faults.append_first(run_dir, f"rank {env.get('RANK', '?')} killed by {signal.Signals(-code).name}", attempt)
    except (OSError, ValueError):  # its run directory gone, or a signal without a name: the record says less
        pass


def _tell(conn: socket.socket, message: dict) -> None:
    """One line to a rank's client (gone already: nobody to tell)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _kill_session(pid: int) -> None:
    """Kill what a rank killed by a signal leaves in its session (it leads one: :func:`become_rank`): a DataLoader's
    workers, forked after its process groups connected, hold its sockets open and its peers wait on them (for up
    to 5 s, until the workers see their parent gone)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing was left
        pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
