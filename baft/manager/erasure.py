"""Erasure coding of node snapshots across a group of snapshot managers.

The scheme
----------
Managers form groups of ``n`` members (one per node), listed in the same order on every
member; member ``j`` is the ``j``-th entry of ``--group``. The group tolerates the loss of
``m = n - k`` whole nodes.

1. When every local rank of a node has committed step ``s``, its manager packs the node's
   snapshot into one *bundle* (:func:`pack_bundle`): a small header (magic, version, the
   commit records of all its local ranks) followed by their buffers.
2. It encodes the bundle with a systematic erasure code into ``n`` shares of
   ``ceil(size / k)`` bytes each (:func:`encode`): shares ``0 .. k-1`` are the bundle cut in
   ``k`` pieces, shares ``k .. n-1`` are parity — a copy of the bundle when ``k = 1``, the XOR
   of the pieces when ``m = 1`` (numpy, memory speed), Reed–Solomon over GF(2^8) (zfec,
   C-backed) when ``m >= 2``. Every member of a group uses the same ``k, n``, so the same code.
3. Share ``j`` goes to member ``j``; the node keeps the share with its own index. So every
   member holds one share of every member's bundle: ``n / k`` times the bundle size in all.
4. When a node is lost, any ``k`` survivors' shares of its bundle rebuild it bit for bit
   (:func:`decode`), and the commit records' chunk checksums prove it (:func:`unpack_bundle`).
   With ``m`` nodes lost (the lost node among them) ``n - m = k`` shares survive.

With ``n = 2, k = 1`` each share is the whole bundle: plain replication on the partner node.
With ``k = n - 1`` it is single (XOR) parity, at ``1 / k`` extra memory per node.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Union

import numpy as np
import zfec

from baft.errors import BaftError
from baft.snapshot.layout import CommitRecord, checksum

MAX_SHARES = 256  # GF(2^8): zfec's limit on n
BUNDLE_MAGIC = b"BAFTBUN1"
_HEADER_LEN = struct.Struct("<Q")

Buffer = Union[bytes, bytearray, memoryview]  # any contiguous bytes-like object


def validate(k: int, n: int) -> None:
    """Refuse a code that cannot work: ``1 <= k < n <= 256``."""
    if not isinstance(k, int) or not isinstance(n, int):
        raise BaftError(f"erasure code: k and n must be integers, got k={k!r}, n={n!r}")
    if n < 2 or n > MAX_SHARES:
        raise BaftError(f"erasure code: group size n={n} must be between 2 and {MAX_SHARES}")
    if not 1 <= k < n:
        raise BaftError(f"erasure code: k={k} data shares must be at least 1 and below the group size n={n}")


def share_size(size: int, k: int) -> int:
    """Bytes of each share of a ``size``-byte input cut into ``k`` pieces."""
    return max(1, -(-size // k))


def _buffer(nbytes: int) -> np.ndarray:
    # numpy asks the kernel for huge pages on large arrays: filling one is several times faster
    # here than filling a fresh bytes object, whose first touch of every page faults
    return np.empty(nbytes, dtype=np.uint8)


def _u8(data) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _xor(blocks: list) -> memoryview:
    acc = np.bitwise_xor(_u8(blocks[0]), _u8(blocks[1]))
    for block in blocks[2:]:
        np.bitwise_xor(acc, _u8(block), out=acc)
    return memoryview(acc)


def encode(data: Buffer, k: int, n: int) -> list[Buffer]:
    """Encode ``data`` into ``n`` equal bytes-like shares, any ``k`` of which rebuild it (see :func:`decode`).

    Shares ``0 .. k-1`` are the input cut in ``k`` pieces (views into ``data``, the last one
    zero-padded); copy the ones to keep beyond ``data``'s life. The parity is the input itself
    when ``k = 1``, the XOR of the pieces when ``n = k + 1``, Reed–Solomon (zfec) otherwise.
    """
    validate(k, n)
    view = memoryview(data).cast("B")
    size = view.nbytes
    if k == 1:
        return [view if size else memoryview(b"\0")] * n
    block = share_size(size, k)
    pieces = [view[i * block:(i + 1) * block] for i in range(k)]
    for i, piece in enumerate(pieces):
        if piece.nbytes < block:  # the input's tail (with tiny inputs, more than one piece)
            padded = np.zeros(block, dtype=np.uint8)
            padded[:piece.nbytes] = _u8(piece)
            pieces[i] = memoryview(padded)
    if n == k + 1:
        return pieces + [_xor(pieces)]
    return list(zfec.Encoder(k, n).encode(tuple(pieces)))


def decode(shares: dict[int, Buffer], k: int, n: int, size: int) -> memoryview:
    """Rebuild the ``size``-byte input of :func:`encode` from any ``k`` of its shares, keyed by index."""
    validate(k, n)
    bad = [i for i in shares if not 0 <= i < n]
    if bad:
        raise BaftError(f"erasure decode: share index {bad[0]} is outside 0..{n - 1}")
    if len(shares) < k:
        raise BaftError(f"erasure decode: {len(shares)} shares of {n} left, at least k={k} are needed")
    block = share_size(size, k)
    chosen = sorted(shares)[:k]  # data shares (index < k) first: they need no arithmetic
    for i in chosen:
        if memoryview(shares[i]).nbytes != block:
            raise BaftError(f"erasure decode: share {i} holds {memoryview(shares[i]).nbytes} bytes, expected {block} "
                            f"for a {size}-byte input with k={k}")
    if k == 1:
        return memoryview(shares[chosen[0]]).cast("B")[:size]
    if chosen == list(range(k)):
        pieces = [shares[i] for i in chosen]
    elif n == k + 1:
        missing = next(i for i in range(k) if i not in shares)
        pieces = [shares[i] if i != missing else _xor([shares[j] for j in chosen]) for i in range(k)]
    else:
        pieces = zfec.Decoder(k, n).decode(tuple(shares[i] for i in chosen), tuple(chosen))
    out = _buffer(size)
    for i, piece in enumerate(pieces):
        lo = i * block
        hi = min(size, lo + block)
        if hi > lo:
            out[lo:hi] = _u8(piece)[:hi - lo]
    return memoryview(out)


@dataclass
class Bundle:
    """The committed snapshot of all local ranks of one node at one step."""

    node_id: int
    step: int
    snapshots: list[tuple[CommitRecord, memoryview]]


def pack_bundle(node_id: int, step: int, snapshots: list[tuple[CommitRecord, Buffer]]) -> memoryview:
    """Serialize a node's snapshot (one copy): magic, header length, JSON header, each rank's buffer."""
    entries, offset = [], 0
    for record, buffer in snapshots:
        nbytes = record.layout.nbytes
        entries.append({"record": record.to_json(), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"node_id": node_id, "step": step, "ranks": entries}).encode()
    parts = [BUNDLE_MAGIC, _HEADER_LEN.pack(len(header)), header]
    parts += [memoryview(buffer).cast("B")[:record.layout.nbytes] for record, buffer in snapshots]
    out = _buffer(sum(memoryview(p).nbytes for p in parts))
    pos = 0
    for part in parts:
        nbytes = memoryview(part).nbytes
        out[pos:pos + nbytes] = _u8(part)
        pos += nbytes
    return memoryview(out)


def unpack_bundle(data: Buffer, verify: bool = True) -> Bundle:
    """Read a bundle back, its buffers as views into ``data``; with ``verify``, every chunk must pass its checksum."""
    view = memoryview(data)
    start = len(BUNDLE_MAGIC) + _HEADER_LEN.size
    if view.nbytes < start or bytes(view[:len(BUNDLE_MAGIC)]) != BUNDLE_MAGIC:
        raise BaftError("snapshot bundle: not a baft bundle (bad magic)")
    (hlen,) = _HEADER_LEN.unpack(view[len(BUNDLE_MAGIC):start])
    try:
        header = json.loads(bytes(view[start:start + hlen]))
        body = start + hlen
        snapshots = []
        for entry in header["ranks"]:
            record = CommitRecord.from_json(entry["record"])
            lo = body + entry["offset"]
            snapshots.append((record, view[lo:lo + entry["nbytes"]]))
    except (ValueError, KeyError, TypeError) as err:
        raise BaftError(f"snapshot bundle: unreadable header ({err})") from None
    if verify:
        for record, buffer in snapshots:
            problem = record.verify(buffer)
            if problem:
                raise BaftError(f"snapshot bundle of node {header['node_id']} step {header['step']}, "
                                f"rank {record.rank}: {problem}")
    return Bundle(header["node_id"], header["step"], snapshots)


def bundle_checksum(data: Buffer) -> str:
    """Checksum of a whole bundle, carried with every share so a rebuild can be checked end to end."""
    return checksum(data)
