"""The snapshot manager's message format, and the client trainers and peers use to speak it.

Protocol version 1, the same on the manager's Unix socket (``<shm root>/manager.sock``, for
the node's trainers and the CLI) and on its TCP port (for the other managers of its group):

* A message is one JSON object on one line (UTF-8, ending in ``\\n``). When it has an
  integer ``"payload": N``, exactly ``N`` raw bytes follow the line (shares, bundles).
* A request is ``{"v": 1, "op": NAME, ...}``; its reply ``{"v": 1, "ok": true, ...}`` or
  ``{"v": 1, "ok": false, "error": ONE_LINE}``. A connection carries any number of
  request/reply pairs, in order. A request with another ``v`` is refused, naming both.

Requests on the Unix socket:

=============  ==========================================  =======================================
op             fields                                      reply
=============  ==========================================  =======================================
``hello``      rank, nbytes, [run_id, model, topology]     node_id, root, slots (paths), memory
``commit``     rank, step, [slot]                          (verified later, in the background)
``status``                                                 the manager's state (see ``status``)
``held``                                                   ranks: {rank: {memory, parity, disk}}
``restore``    rank, [step]                                source, step, rank, slot, path, root
``rebuild``    node, [step]                                node, step, size, checksum + payload
``shutdown``                                               (then the manager stops and unlinks)
=============  ==========================================  =======================================

Requests between managers (TCP; each carries the sender's ``group`` and ``from`` node id,
and is refused when the groups differ): ``group`` (reply: node_id, group), ``share_put``
(node, step, index, size, checksum + payload), ``share_list`` (node → steps),
``share_get`` (node, step → index, size, checksum + payload). ``status``, ``held`` and
``rebuild`` are served on TCP too.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path
from typing import Optional, Union

import numpy as np

from baft.errors import BaftError

PROTOCOL_VERSION = 1
SOCKET_NAME = "manager.sock"
MAX_LINE = 64 << 20  # a header line; payloads are not bounded by it
_UNIX_PATH_MAX = 107

Address = Union[str, Path, tuple[str, int]]


class ManagerUnavailable(BaftError):
    """No manager answers at the address (not started, stopped, or dead)."""


def socket_path(shm_root) -> Path:
    return Path(shm_root) / SOCKET_NAME


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise BaftError(f"{path}: socket path is {len(os.fsencode(path))} bytes, Unix sockets allow "
                        f"{_UNIX_PATH_MAX}; use a shorter --shm-root")


def read_message(rfile) -> Optional[tuple[dict, Optional[memoryview]]]:
    """The next message and its payload from a binary file-like object, or None at end of stream."""
    line = rfile.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise BaftError("manager protocol: message line too long or cut short")
    try:
        msg = json.loads(line)
    except json.JSONDecodeError as err:
        raise BaftError(f"manager protocol: not a JSON message ({err.msg})") from None
    if not isinstance(msg, dict):
        raise BaftError("manager protocol: a message must be a JSON object")
    payload = None
    size = msg.get("payload")
    if size is not None:
        if not isinstance(size, int) or size < 0:
            raise BaftError(f"manager protocol: bad payload size {size!r}")
        payload = memoryview(np.empty(size, dtype=np.uint8))  # huge pages: filled faster than fresh bytes
        got = 0
        while got < size:
            n = rfile.readinto(payload[got:])
            if not n:
                raise BaftError(f"manager protocol: payload cut short ({got} of {size} bytes)")
            got += n
    return msg, payload


def write_message(sock: socket.socket, msg: dict, payload=None) -> None:
    """Send one message (and its payload)."""
    msg = {"v": PROTOCOL_VERSION, **msg}
    if payload is not None:
        msg["payload"] = memoryview(payload).nbytes
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
    if payload is not None:
        sock.sendall(payload)


def check_version(msg: dict) -> Optional[str]:
    found = msg.get("v")
    if found != PROTOCOL_VERSION:
        return f"manager protocol version {found!r} requested, this manager speaks version {PROTOCOL_VERSION}"
    return None


def describe(address: Address) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


class ManagerClient:
    """A connection to one snapshot manager: its Unix socket path, or ``(host, port)`` of a peer.

    Every method raises :class:`ManagerUnavailable` when the manager cannot be reached and
    :class:`BaftError` (one line, from the manager) when it refuses the request.
    """

    _warned: set = set()

    def __init__(self, address: Address, timeout: float = 5.0):
        self.address = address
        self.timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._rfile = None

    @classmethod
    def connect(cls, shm_root, timeout: float = 5.0) -> "ManagerClient":
        """Connect to the manager of the node whose shared-memory root is ``shm_root``."""
        client = cls(socket_path(shm_root), timeout)
        client._open()
        return client

    @classmethod
    def try_connect(cls, shm_root, timeout: float = 2.0, warn=None) -> Optional["ManagerClient"]:
        """Connect, or warn once (per root, per process) and return None, so training can go on."""
        try:
            return cls.connect(shm_root, timeout)
        except BaftError as err:
            key = str(Path(shm_root))
            if key not in cls._warned:
                cls._warned.add(key)
                message = (f"baft: no snapshot manager reachable ({err}); training continues, but its snapshots "
                           f"get no parity across nodes, no persistence and no manager to serve a restore")
                (warn or (lambda m: warnings.warn(m, RuntimeWarning, stacklevel=3)))(message)
            return None

    def _open(self) -> None:
        try:
            if isinstance(self.address, tuple):
                sock = socket.create_connection(self.address, timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(str(self.address))
                except OSError:
                    sock.close()
                    raise
        except OSError as err:
            raise ManagerUnavailable(f"{describe(self.address)}: no manager answers "
                                     f"({err.strerror or type(err).__name__})") from None
        self._sock, self._rfile = sock, sock.makefile("rb")

    def close(self) -> None:
        if self._sock is not None:
            self._rfile.close()
            self._sock.close()
            self._sock = self._rfile = None

    def __enter__(self) -> "ManagerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, op: str, payload=None, **fields) -> tuple[dict, Optional[memoryview]]:
        """Send one request; return the reply and its payload, raising on a refusal."""
        if self._sock is None:
            self._open()
        try:
            write_message(self._sock, {"op": op, **fields}, payload)
            got = read_message(self._rfile)
        except (OSError, BaftError) as err:
            self.close()
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
            raise ManagerUnavailable(f"{describe(self.address)}: manager connection lost during {op} ({reason})") from None
        if got is None:
            self.close()
            raise ManagerUnavailable(f"{describe(self.address)}: manager closed the connection during {op}")
        reply, data = got
        if not reply.get("ok"):
            raise BaftError(reply.get("error") or f"{op}: refused")
        return reply, data

    def hello(self, rank: int, nbytes: int, run_id: str = "", model: str = "",
              topology: Optional[dict] = None, node_ranks: int = 1) -> dict:
        """Announce a rank and its snapshot size (and how many ranks the node runs): the manager sizes its slot
        files or refuses."""
        reply, _ = self.request("hello", rank=rank, nbytes=nbytes, run_id=run_id, model=model,
                                topology=topology or {}, node_ranks=node_ranks)
        return reply

    def commit(self, rank: int, step: int, slot: Optional[int] = None) -> None:
        """Tell the manager that ``rank`` committed ``step`` (in ``slot``); it verifies in the background."""
        self.request("commit", rank=rank, step=step, slot=slot)

    def status(self) -> dict:
        return self.request("status")[0]

    def held(self) -> dict:
        """Which steps the manager can serve for each rank, from memory, parity and disk."""
        return self.request("held")[0]["ranks"]

    def restore(self, rank: int, step: Optional[int] = None) -> dict:
        """Where ``rank``'s snapshot of ``step`` (the newest by default) is, rebuilt into shared memory if needed.

        Read it with ``baft.snapshot.slots.load_verified(reply["root"], rank, reply["step"])``.
        """
        return self.request("restore", rank=rank, step=step)[0]

    def rebuild(self, node: int, step: Optional[int] = None) -> tuple[dict, memoryview]:
        """The bundle of ``node`` at ``step`` (the newest available by default), rebuilt from its group's shares."""
        return self.request("rebuild", node=node, step=step)

    def shutdown(self) -> None:
        self.request("shutdown")
