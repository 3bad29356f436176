"""Warm rank processes for the suite: one process imports torch and DeepSpeed once and forks every rank.

A rank started as ``python -m baft.examples.worker ...`` spends about 6 s of CPU importing torch,
DeepSpeed and ``torch._dynamo`` (which every torch optimizer's ``__init__`` imports) before it
does anything; the suite starts a few hundred ranks on 2 cores. :class:`Forks` starts this file as
a server (``python tests/warm.py SOCKET``) that imports them once, single-threaded, and answers each
request on a Unix socket by forking a child that takes the request's environment, working
directory, ``argv`` and output files and runs the script or module as ``python`` would, exiting
through the interpreter's own shutdown (non-daemon threads joined, ``atexit`` run). The server
reports the child's pid, then its exit status (negative: the signal), on the request's connection.

Only launches that torchrun would start once (``spawn_ranks``) fork here; the product itself
launches through ``torchrun``. Environment read when a process starts (``MALLOC_*``,
``OMP_NUM_THREADS``, ``PYTHONUNBUFFERED``) is the server's: it starts with baft's launch environment.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

PRELOAD = """
import torch, torch._dynamo, torch.optim, torch.distributed
import deepspeed
from deepspeed.pipe import PipelineModule
"""


class WarmProcess:
    """A forked rank, used as the suite uses a :class:`subprocess.Popen`."""

    def __init__(self, conn: socket.socket):
        self._conn, self._file = conn, conn.makefile("r")
        self.pid: int = json.loads(self._file.readline())["pid"]
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def _read_exit(self) -> None:
        line = self._file.readline()
        self.returncode = json.loads(line)["exit"] if line else -signal.SIGKILL  # the server itself died
        self._file.close()
        self._conn.close()

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            self._read_exit()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forks:
    """The fork server's client: :meth:`start` runs a command in a child forked from the warm server."""

    def __init__(self, env: dict):
        self.directory = tempfile.mkdtemp(prefix="baft-warm-")
        self.socket = os.path.join(self.directory, "warm.sock")
        self.server = subprocess.Popen([sys.executable, __file__, self.socket], env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL)
        while not os.path.exists(self.socket):  # bound once the imports are done
            if self.server.poll() is not None:
                raise RuntimeError(f"the warm fork server exited with {self.server.returncode} before it listened")
            time.sleep(0.05)

    def start(self, cmd: list[str], env: dict, stdout: str, stderr: str) -> WarmProcess:
        """Like ``Popen(cmd, env=env, stdout=open(stdout, "w"), stderr=open(stderr, "w"))``, for
        ``cmd`` of the form ``[python, script, *args]`` or ``[python, "-m", module, *args]``."""
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(self.socket)
        request = {"argv": cmd[1:], "env": env, "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return WarmProcess(conn)

    def close(self) -> None:
        self.server.terminate()
        self.server.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _run_child(request: dict) -> None:
    """In the forked child: become the requested process and run it to the end (raises SystemExit)."""
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


def serve(path: str) -> None:
    """Answer fork requests on the Unix socket ``path`` until SIGTERM; single-threaded, so fork is safe."""
    exec(PRELOAD, {})
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the client connects once the path exists
    children: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener], [], [], 0.02)[0]
        if readable:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in children.values():
                    other.close()
                _run_child(request)
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
