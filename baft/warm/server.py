"""The warm fork server (``python -m baft.warm.server SOCKET PARENT_PID [LATER]``): imports once, forks every
rank.

It listens first, then imports :data:`PRELOAD` (where a GPU driver is there, :data:`TORCH` alone) single-threaded,
while a process of its own detects the CPU for DeepSpeed's op builders (a client that connects meanwhile waits in
the listen queue), and :data:`PRELOAD_LATER` as ``LATER`` says (:data:`LATER_CHOICES`), then answers each client by
forking a child that becomes the rank: its own session (as torchrun starts a rank), the client's standard streams
(passed over the socket), environment, working directory and ``argv``, generators seeded afresh as a new
interpreter's are, and ``SIGKILL`` when the server dies. The child runs the script or module as ``python`` would and
exits as the interpreter's shutdown does (non-daemon threads, ``atexit``, open files flushed), without freeing every
module one by one after it. The server writes the child's pid, then its exit status (negative: the signal) on the
client's connection, and kills the child when the client goes away (torchrun killed it), so rank and client live and
die together. A job that recovers in place (:mod:`baft.recovery.world`) has its killed ranks replaced, each by one
of the spares the server keeps for it (:mod:`baft.warm.spares`), or by a new fork; not one that its client stopped
(:func:`_hear`).
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import gc
import importlib
import importlib.util
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from baft.config import REPLACE_ENV, REPLACEMENT_ENV, SPARES_ENV, STORE_ENV, WARM_RANK_ENV
from baft.warm.spares import Spare, assign, channel_pair, job_of, kill_spare, wait_as_spare

TORCH = ("torch", "torch._dynamo", "torch.optim", "torch.distributed")
PRELOAD = (*TORCH, "deepspeed", "deepspeed.pipe",
           # what baft.initialize imports (a replacement's imports would be on its survivors' wait otherwise)
           "baft.plugin", "baft.protection", "baft.recovery.digests", "baft.recovery.script_checkpoint",
           "baft.snapshot.data")
# What DeepSpeed imports as it configures a bf16 or ZeRO optimizer (torch._inductor with it): ~1.8 s of a
# rank's T2 on a 2-core VM; where this DeepSpeed has no such module, nothing is lost but the time.
PRELOAD_LATER = ("deepspeed.runtime.zero.muon.muon_optimizer",)
# When the server imports PRELOAD_LATER. "now": before it forks a rank, for a job known to wrap its optimizer, or
# one that recovers in place (its survivors then hold the modules frozen, :func:`_freeze`, not in every
# gc.collect). "never": for a job known not to. "idle": not knowing, once no request came for IDLE seconds, so that a
# first launch's ranks do not wait for it; a rank that dies meanwhile is reported once the import is done.
LATER_CHOICES = ("now", "idle", "never")
# Where a GPU driver is there, DeepSpeed's import asks NVML how many GPUs there are, and loading NVML starts a
# driver thread (an H200, gpu.md section 7): a rank forked after it could not use the GPU. There the server
# imports torch's modules alone, and each rank imports DeepSpeed itself.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd")
IDLE = 1.0  # seconds without a request after which the server imports what preload() left for later
ORPHAN_GRACE = 60.0  # seconds the ranks of a dead launcher have to be stopped by its torchrun (30 s, then SIGKILL)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int, sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def preload(later: str = "idle") -> list[str]:
    """Import what every rank imports, and :data:`PRELOAD_LATER` where ``later`` is "now", and detect the CPU (a
    SystemExit, with one line, where the server could not fork after it); the modules left to import once the
    server is idle."""
    detecting = _start_detecting_cpu()
    first, optional = (TORCH, ()) if gpu_driver() else (PRELOAD, PRELOAD_LATER)
    for name in first:
        importlib.import_module(name)
    for name in optional if later == "now" else ():
        import_if_there(name)
    if "deepspeed" in first:
        _probe_deepspeed_ops()
    _keep_detected_cpu(detecting)
    refusal = unforkable()
    if refusal:
        raise SystemExit(refusal)
    _freeze()
    return list(optional) if later == "idle" else []


def _probe_deepspeed_ops() -> None:
    """What every rank's ``deepspeed.init_distributed`` does first on a CPU, done once for its forks: probe which of
    DeepSpeed's ops this machine can build (``deepspeed.ops.__compatible_ops__``: compilers run on test programs,
    0.15 s, more on a loaded machine) and load its shared-memory collectives op (a ninja run). DeepSpeed keeps both
    for the process. Where the op does not load, each rank meets that itself, with its own message."""
    build_shm_op = getattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", None)
    if build_shm_op is None:  # another DeepSpeed: its ranks do what it does
        return
    try:
        build_shm_op()
    except Exception:  # noqa: BLE001 - the rank's own call says what it is
        pass


def _start_detecting_cpu() -> Optional[subprocess.Popen]:
    """py-cpuinfo detects the CPU in a new interpreter at every call (1.5 s on a 2-core VM), and DeepSpeed's CPU op
    builders call it twice each time a process loads an op (``FusedAdam`` for a config's ``"Adam"`` on CPU,
    ``DeepSpeedCPUAdam``): 3 s of every rank's ``deepspeed.initialize``, at every relaunch and in every replacement.
    Every fork runs on this CPU: the server detects it once, with py-cpuinfo's own command (``python -m cpuinfo
    --json``, what ``get_cpu_info`` runs) on another core while it imports, and the forks read that.
    None without py-cpuinfo (DeepSpeed's builders fall back to lscpu)."""
    if importlib.util.find_spec("cpuinfo") is None:
        return None
    return subprocess.Popen([sys.executable, "-m", "cpuinfo", "--json"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _keep_detected_cpu(detecting: Optional[subprocess.Popen]) -> None:
    """Once the detection has ended: ``cpuinfo.get_cpu_info`` answers with what it found (a copy: a caller's
    change is its own). Where it failed, each process detects the CPU itself, as it would have."""
    if detecting is None:
        return
    out, _ = detecting.communicate()
    if detecting.returncode != 0:
        return
    import cpuinfo

    detected = json.loads(out)
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(detected)


def gpu_driver() -> bool:
    """Whether a GPU driver's device files are on this machine."""
    return any(os.path.exists(path) for path in GPU_DRIVER_FILES)


def _freeze() -> None:
    """Keep what the imports made out of the collector's sight (``gc.freeze``): a rank's ``gc.collect`` (DeepSpeed's
    bf16 optimizer calls four as it starts) then walks only its own objects, not the 200,000 of torch's and
    DeepSpeed's modules (0.16 s each in a survivor), and leaves their pages shared with the server."""
    gc.collect()
    gc.freeze()


def import_if_there(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


def unforkable() -> Optional[str]:
    """Why a fork of this process would not make a working rank (one line), or None."""
    import torch

    others = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    if others or torch.cuda.is_initialized():  # a fork would copy another thread's locks, or a CUDA context
        started = {t.native_id: t.name for t in threading.enumerate()}  # by Python; others by native code
        names = ", ".join(sorted(started.get(int(t)) or _thread_name(t) for t in others)) or "none"
        return (f"baft: the warm fork server cannot fork after its imports (other threads: {names}; CUDA "
                f"initialised: {torch.cuda.is_initialized()}); ranks start cold")
    return None


def _thread_name(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:  # it ended meanwhile
        return "?"


def become_rank(conn: socket.socket, fds: list[int], request: dict, started: bool = False) -> None:
    """In the forked child: become the requested process, run it to the end and exit (never returns); ``started``:
    a spare, whose generators were seeded as it started (:mod:`baft.warm.spares`)."""
    import runpy

    os.setsid()
    _die_with_parent(request["server"], signal.SIGKILL)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], **{WARM_RANK_ENV: "1"})
    if not started:
        as_started()
    if os.environ.get(REPLACEMENT_ENV):  # it joins the survivors' new world before the script runs
        from baft.recovery.world import join

        join(replacement=True)
    argv = request["argv"]
    enter_argv(argv)
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = _exit_code(end)
    except KeyboardInterrupt:
        raise  # the interpreter's own exit, by the signal
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit_without_finalizing(code)


def _exit_code(end: SystemExit) -> int:
    """The exit status the interpreter gives a ``SystemExit`` (printing a message where it carries one)."""
    if end.code is None:
        return 0
    if isinstance(end.code, int):
        return end.code
    print(end.code, file=sys.stderr)
    return 1


_BUFFERED_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _exit_without_finalizing(code: int) -> None:
    """Leave as the interpreter leaves — non-daemon threads joined, ``atexit`` handlers run (the script's, baft's
    teardown, those of the modules the server imported), every open file flushed — but without its
    finalization, which frees module after module: about a second of CPU a rank once torch and DeepSpeed are
    imported, and the end of every launch waits for its ranks."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    # a file the script left open, and the standard streams: the server made them, and froze them out of
    # gc.get_objects (:func:`_freeze`)
    opened = [o for o in gc.get_objects() if type(o) in _BUFFERED_WRITERS]
    for stream in [*opened, sys.stdout, sys.stderr]:
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, its descriptor gone, or None
            pass
    ctypes.CDLL(None).fflush(None)  # what native code wrote with C's stdio
    os._exit(code)


def enter_argv(argv: list[str]) -> None:
    """``sys.argv`` and ``sys.path[0]`` as ``python ARGV`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) has them."""
    if argv[0] == "-m":
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
    else:
        sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)


def as_started() -> None:
    """What a new interpreter would have: torch's and numpy's global generators seeded from the OS, as each
    process's are (``random`` reseeds itself at every fork), and the rank's ``OMP_NUM_THREADS`` (the server
    imports with one thread: OpenMP would start its pool, and a fork copies no threads)."""
    import numpy
    import torch

    torch.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def serve(path: str, parent: int, later: str = "idle") -> None:
    """Answer fork requests on the Unix socket ``path`` until SIGTERM, or until ``parent`` (the launcher) is dead
    and no rank is left. A dead launcher's torchrun stops the ranks through their clients, as it stops
    ranks it started itself: killing them here as well would race torchrun's own shutdown (a torchrun
    that saw its workers fail as its SIGTERM came stayed alive, tailing their logs, after the launcher
    was SIGKILLed). Ranks still there :data:`ORPHAN_GRACE` seconds after the launcher's death are killed."""
    _die_with_parent(parent, signal.SIGHUP)
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

    def run(self) -> None:
        while True:
            died = self.launcher_died
            if died and (not self.children or time.monotonic() - died[0] > ORPHAN_GRACE):
                self.stop()
            watched = [r.conn for pid, r in self.children.items() if pid not in self.orphans]
            timeout = IDLE if self.later or self.launcher_died else None
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

    def stop(self, *_) -> None:
        """The ranks and spares die with the server (and by their death signal, should it be SIGKILLed)."""
        for pid in [*self.children, *(s.pid for kept in self.spares.values() for s in kept)]:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)  # the launcher's, made for this server alone
        os._exit(0)

    def _do_later(self) -> None:
        import_if_there(self.later.pop(0))
        _freeze()
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
            if code < 0:
                _kill_session(pid)
                _hear(rank)  # the signal it died of may be one its client passed on just before
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
        _die_with_parent(os.getppid(), signal.SIGKILL)
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
        _die_with_parent(request["server"], signal.SIGKILL)
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
    rank.replacements = 0
    return bool(heard)


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
