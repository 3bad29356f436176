"""Erasure coding of node snapshots across a group of snapshot managers.

The scheme
----------
Managers form groups of ``n`` members (one per node), listed in the same order on every
member; member ``j`` is the ``j``-th entry of ``--group``. The group tolerates the loss of
``m = n - k`` whole nodes.

1. When every local rank of a node has committed step ``s``, its manager packs the node's
   snapshot into one *bundle* (:func:`pack_bundle`): a small header (magic, version, the
   commit records of all its local ranks) followed by their buffers.
2. It encodes the bundle with a systematic Reed–Solomon code (zfec, C-backed) into ``n``
   shares of ``ceil(size / k)`` bytes each (:func:`encode`): shares ``0 .. k-1`` are the
   bundle cut in ``k`` pieces, shares ``k .. n-1`` are parity.
3. Share ``j`` goes to member ``j``; the node keeps the share with its own index. So every
   member holds one share of every member's bundle: ``n / k`` times the bundle size in all.
4. When a node is lost, any ``k`` survivors' shares of its bundle rebuild it bit for bit
   (:func:`decode`), and the commit records' chunk checksums prove it (:func:`unpack_bundle`).
   With ``m`` nodes lost (the lost node among them) ``n - m = k`` shares survive.

With ``n = 2, k = 1`` each share is the whole bundle: plain replication on the partner node.
With ``k = n - 1`` it is single parity, like XOR, at ``1 / k`` extra memory per node.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import zfec

from baft.errors import BaftError
from baft.snapshot import CommitRecord, checksum

MAX_SHARES = 256  # GF(2^8): zfec's limit on n
BUNDLE_MAGIC = b"BAFTBUN1"
_HEADER_LEN = struct.Struct("<Q")


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


def encode(data, k: int, n: int) -> list[bytes]:
    """Encode ``data`` into ``n`` equal shares, any ``k`` of which rebuild it (see :func:`decode`)."""
    validate(k, n)
    view = memoryview(data).cast("B")
    size = view.nbytes
    if k == 1:  # every share is the input itself: replication, at copy speed
        share = bytes(view) if size else b"\0"
        return [share] * n
    block = share_size(size, k)
    blocks = []
    for i in range(k):
        piece = view[i * block:(i + 1) * block]
        if piece.nbytes < block:  # the last piece, padded with zeros
            piece = bytes(piece) + bytes(block - piece.nbytes)
        blocks.append(piece)
    shares = zfec.Encoder(k, n).encode(tuple(blocks))
    return [bytes(s) for s in shares]


def decode(shares: dict[int, bytes], k: int, n: int, size: int) -> bytes:
    """Rebuild the ``size``-byte input of :func:`encode` from any ``k`` of its shares, keyed by index."""
    validate(k, n)
    bad = [i for i in shares if not 0 <= i < n]
    if bad:
        raise BaftError(f"erasure decode: share index {bad[0]} is outside 0..{n - 1}")
    if len(shares) < k:
        raise BaftError(f"erasure decode: {len(shares)} shares of {n} left, at least k={k} are needed")
    block = share_size(size, k)
    if k == 1:
        share = shares[min(shares)]
        if len(share) != block:
            raise BaftError(f"erasure decode: share {min(shares)} holds {len(share)} bytes, expected {block} "
                            f"for a {size}-byte input with k=1")
        return bytes(share[:size])
    # primary shares (index < k) decode for free, so prefer them
    chosen = sorted(shares)[:k]
    for i in chosen:
        if len(shares[i]) != block:
            raise BaftError(f"erasure decode: share {i} holds {len(shares[i])} bytes, expected {block} "
                            f"for a {size}-byte input with k={k}")
    pieces = zfec.Decoder(k, n).decode(tuple(shares[i] for i in chosen), tuple(chosen))
    data = b"".join(pieces)
    return data[:size] if len(data) != size else data


@dataclass
class Bundle:
    """The committed snapshot of all local ranks of one node at one step."""

    node_id: int
    step: int
    snapshots: list[tuple[CommitRecord, memoryview]]


def pack_bundle(node_id: int, step: int, snapshots: list[tuple[CommitRecord, bytes]]) -> bytes:
    """Serialize a node's snapshot: magic, header length, JSON header, then each rank's buffer."""
    entries, offset = [], 0
    for record, buffer in snapshots:
        nbytes = record.layout.nbytes
        entries.append({"record": record.to_json(), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"node_id": node_id, "step": step, "ranks": entries}).encode()
    parts = [BUNDLE_MAGIC, _HEADER_LEN.pack(len(header)), header]
    parts += [memoryview(buffer)[:record.layout.nbytes] for record, buffer in snapshots]
    return b"".join(parts)


def unpack_bundle(data, verify: bool = True) -> Bundle:
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


def bundle_checksum(data) -> str:
    """Checksum of a whole bundle, carried with every share so a rebuild can be checked end to end."""
    return checksum(data)
