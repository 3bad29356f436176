"""Spare ranks: processes the warm server forks ahead of a fault, which import what the job's script imports and
wait to take a killed rank's place (``baft train --in-place --spares N``).

A spare is forked with the request of one of the job's ranks: it takes that rank's working directory and
environment (less the variables that name a rank), seeds its generators as a new interpreter does, then imports
the modules the script imports at its top level (read from its source, never run), each where it can: one that
fails is left for the rank to import and raise. Its objects are then frozen (``gc.freeze``) and it waits on its
channel. When a rank of the job is killed, the server sends the spare that rank's request and standard streams,
and the spare becomes the rank (:func:`baft.warm.child.become_rank`); the server forks a new spare behind it.
"""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.util
import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from baft.warm.child import as_started, become_rank, enter_argv

MAX_REQUEST = 1 << 20  # bytes of a request (its environment, mostly) sent to a spare


@dataclass
class Spare:
    """A spare process of the server's, the server's end of its channel, and the request it was forked for."""

    pid: int
    channel: socket.socket
    request: dict


def job_of(env: dict) -> str:
    """Which job a rank's environment belongs to: torchrun's run and rendezvous (the ranks of all its attempts)."""
    return f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """The server's end and the spare's of a spare's channel: one message, one request."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def assign(spare: Spare, request: dict, fds: list[int]) -> None:
    """Make ``spare`` the process of ``request`` with the standard streams ``fds``."""
    socket.send_fds(spare.channel, [json.dumps(request).encode()], fds)
    spare.channel.close()


def wait_as_spare(channel: socket.socket, request: dict) -> None:
    """In the forked spare: prepare as a rank of ``request``'s job would start, then wait for the request of the
    rank to become (never returns; exits where the server closes the channel unused)."""

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({key: value for key, value in request["env"].items() if not key.endswith("RANK")})
    as_started()
    enter_argv(request["argv"])  # as the rank's (a module may read sys.argv as it imports)
    script = _source(request["argv"])
    for name in script_imports(script) if script else ():
        _import(name)
    gc.collect()
    gc.freeze()
    message, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 3)
    if not message:
        os._exit(0)
    become_rank(channel, fds, json.loads(message), started=True)


def _source(argv: list[str]) -> Path | None:
    """The source file ``python ARGV`` runs (``sys.path`` as it has it), where there is one."""
    if argv[0] != "-m":
        return Path(argv[0]).resolve()
    try:
        spec = importlib.util.find_spec(argv[1])
    except Exception:  # its package failed to import: the rank will say so
        return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def script_imports(script: Path) -> list[str]:
    """The absolute imports at the top level of ``script`` (and in its top-level ``try`` and ``if`` blocks):
    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module). [] where the
    file cannot be read or parsed."""
    try:
        tree = ast.parse(script.read_text(), str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")]
        elif isinstance(node, (ast.Try, ast.If)):
            statements += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
    return list(dict.fromkeys(names))


def _import(name: str) -> None:
    try:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    except KeyboardInterrupt:
        raise
    except BaseException:  # not a module, or its import fails here: the rank imports it as the script runs
        pass


def kill_spare(spare: Spare) -> None:
    spare.channel.close()
    try:
        os.kill(spare.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
