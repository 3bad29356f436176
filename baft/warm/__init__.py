"""Warm rank processes: torch and DeepSpeed imported once per node, every rank a fork of that process.

A rank started as ``python train.py`` spends seconds of CPU importing torch, DeepSpeed and
``torch._dynamo`` before it runs a line of the script; after a fault torchrun starts every rank
again and each pays it again (issue 33's T1). Under ``baft train`` the node runs one
:mod:`~baft.warm.server` that has imported them, and torchrun starts each rank as
:mod:`~baft.warm.client` (a few milliseconds of plain Python), which hands the rank's command,
environment and standard streams to the server and mirrors the forked rank: signals go to it,
its exit status comes back as the client's own. To torchrun, to ``ps`` and to anything that kills a
rank from outside, the client *is* the rank (its command line and environment are the rank's; the
rank dies with it). Where no server answers, the client becomes the rank by ``exec``, as plain
torchrun would have started it. ``baft train`` starts torchrun itself through a client as well: it
imports torch too.

The client is a file of the standard library only (run by path, it imports nothing of baft).

- ``__init__`` :class:`WarmServer`: the launcher's side, starting (or finding) the node's server
- ``server``   the fork server: imports once, forks every rank, supervises and replaces them
- ``preload``  what the server imports and does once for all its forks, before it forks any
- ``child``    in a forked child: become the rank, as ``python ARGV`` would have started it
- ``client``   a rank as torchrun starts it: asks the server to fork it, mirrors the forked rank
- ``spares``   spare ranks, forked ahead of a fault, that import what the script imports and wait
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

SOCKET_ENV = "BAFT_WARM_SOCKET"  # the server's Unix socket, for the clients
CLIENT = str(Path(__file__).with_name("client.py"))
# The server's own environment over the ranks': one OpenMP thread (a pool's threads are not forked), and
# torch asks NVML, not the CUDA driver, whether a GPU is there (DeepSpeed's import asks): a driver
# initialised before a fork is unusable in the child. Each rank's own values come back with its environment.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


class WarmServer:
    """The node's warm fork server, started by :meth:`start` and stopped by :meth:`close` (or ``with``);
    or, from :meth:`running`, one that runs already, which both leave alone."""

    def __init__(self, socket_path: Optional[str] = None):
        self.shared = socket_path is not None
        self.directory = None if self.shared else \
            os.path.join(tempfile.gettempdir(), f"baft-warm-{os.getpid()}-{os.urandom(4).hex()}")
        self.socket = socket_path or os.path.join(self.directory, "warm.sock")
        self.process: subprocess.Popen | None = None

    @classmethod
    def running(cls, env: dict) -> Optional["WarmServer"]:
        """The server ``env`` names in ``BAFT_WARM_SOCKET``, where one answers there: a node that launches
        many short runs (a sweep, a test suite) keeps one server for all of them, and each launch's ranks
        fork from it at once instead of waiting for a new server's imports."""
        path = env.get(SOCKET_ENV)
        if not path:
            return None
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
            except OSError:
                return None
        return cls(path)

    def start(self, env: dict, later: str = "idle") -> "WarmServer":
        """Start the server in ``env`` (the ranks' launch environment: what a process reads as it starts,
        ``MALLOC_*`` or ``PYTHONHASHSEED``, is the server's; a rank's ``OMP_NUM_THREADS`` is its own). Returns once it
        listens; its imports go on in the background, and a rank that asks before they are done waits for them.
        ``later``: when it imports what only some jobs' ranks import (:data:`baft.warm.preload.PRELOAD_LATER`): "now",
        before it forks any, "idle", or "never" (:data:`baft.warm.preload.LATER_CHOICES`)."""
        if self.shared:
            return self
        os.mkdir(self.directory, 0o700)
        self.process = subprocess.Popen([sys.executable, "-m", "baft.warm.server", self.socket, str(os.getpid()),
                                         later],
                                        env={**env, **SERVER_ENV}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        start_new_session=True)
        while not os.path.exists(self.socket):
            if self.process.poll() is not None:
                raise RuntimeError(f"baft's warm fork server exited with {self.process.returncode} before it listened")
            time.sleep(0.01)
        return self

    def env(self) -> dict:
        """What the clients need to find the server."""
        return {SOCKET_ENV: self.socket}

    @staticmethod
    def program(argv: list[str]) -> list[str]:
        """The program torchrun runs for a rank whose own is ``python ARGV`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``)."""
        return [CLIENT, *argv]

    @classmethod
    def command(cls, cmd: list[str]) -> list[str]:
        """The command line ``cmd`` (``PYTHON ARGV``: torchrun's own, say) run as a fork of the server."""
        return [cmd[0], *cls.program(cmd[1:])]

    def close(self) -> None:
        """Stop the server (a rank still running is killed with it) and remove its socket; a shared server
        (:meth:`running`) runs on."""
        if self.shared:
            return
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "WarmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warmable(argv: list[str]) -> bool:
    """Whether ``python ARGV`` can be forked from the server: a script, or ``-m MODULE``; torchrun's other
    options (``--no-python``) start something else."""
    return bool(argv) and (argv[0] == "-m" and len(argv) > 1 or not argv[0].startswith("-"))
