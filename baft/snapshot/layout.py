"""What a snapshot holds: the layout of one rank's state in a host buffer, and its commit record.

A rank's state is a list of tensors (parameters, optimizer state) plus small JSON items
(RNG states, LR scheduler, loss scaler, data position, step counters). The tensors are
cut into chunks, the unit the executor copies in one go inside a bubble. With ``dp``
data-parallel replicas of a stage, each replica holds only its shard: a contiguous share
of the stage's chunks. A commit record, written last, makes a filled buffer a snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

import xxhash

from baft.config import DEFAULT_CHUNK_BYTES
from baft.snapshot.checksum import digest

FORMAT_VERSION = 2  # 2: chunk checksums are baft.snapshot.checksum's weighted sums; 1: xxh3-64

_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def checksum(data, version: int = FORMAT_VERSION) -> str:
    """The checksum of a bytes-like object as a commit record of format ``version`` holds it: the weighted
    sum of :mod:`baft.snapshot.checksum` (what a GPU computes from the source tensors), or for records
    written before it, xxh3-64."""
    return digest(data) if version >= 2 else xxhash.xxh3_64(data).hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the state. ``kind`` is "parameters", "optimizer" or "other".

    ``owner`` is the data-parallel rank that alone holds the tensor (a partition of fp32 master
    weights or optimizer state under ZeRO or DeepSpeed's bf16 optimizer); None when every
    replica of the stage holds it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    owner: Optional[int] = None


@dataclass(frozen=True)
class Chunk:
    """A byte range ``[start, start + nbytes)`` of one tensor, stored at ``offset`` in the shard buffer."""

    index: int
    tensor: str
    start: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Layout:
    """The tensors of a stage and the chunks of this replica's shard, packed in a buffer."""

    tensors: tuple[TensorEntry, ...]
    chunks: tuple[Chunk, ...]
    shard: int = 0
    num_shards: int = 1
    total_chunks: int = 0  # chunks of the whole stage, over all shards

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def fingerprint(self) -> str:
        """Identifies the stage's tensors (names, dtypes, shapes), independent of sharding."""
        return _digest(self.tensors)

    def tensor(self, name: str) -> TensorEntry:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def bytes_by_kind(self) -> dict[str, int]:
        kinds = {t.name: t.kind for t in self.tensors}
        out = {"parameters": 0, "optimizer": 0, "other": 0}
        for c in self.chunks:
            out[kinds[c.tensor]] += c.nbytes
        return out

    def to_json(self) -> dict:
        return self._json

    @functools.cached_property
    def _json(self) -> dict:
        # every snapshot of a run shares one layout: build its JSON once, not at every commit
        return dataclasses.asdict(self)

    @functools.cached_property
    def json_text(self) -> str:
        """:meth:`to_json` as JSON text, made once (a stage's layout is ~80 KB of it)."""
        return json.dumps(self._json)

    @classmethod
    def from_json(cls, doc: dict) -> "Layout":
        tensors = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in doc["tensors"])
        chunks = tuple(Chunk(**c) for c in doc["chunks"])
        return cls(tensors, chunks, doc.get("shard", 0), doc.get("num_shards", 1), doc.get("total_chunks", len(chunks)))


def model_signature(tensors: Iterable[TensorEntry]) -> str:
    """Identifies the model a stage's state belongs to: its parameters and buffers, not optimizer state."""
    return _digest(t for t in tensors if t.kind != "optimizer")


def _digest(tensors: Iterable[TensorEntry]) -> str:
    """Of the tensors' names, dtypes and shapes (:func:`_described`)."""
    desc = json.dumps([[name, dtype, list(shape)] for name, dtype, shape in _described(tensors)])
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _described(tensors: Iterable[TensorEntry]) -> dict:
    """(name, dtype, shape) of each tensor, in order; the replicas' own copies of a module buffer
    (``buffer/dp<d>/<name>``) as one, so that it does not depend on the number of replicas."""
    return {(re.sub(r"^buffer/dp\d+/", "buffer/", t.name), t.dtype, tuple(t.shape)): None for t in tensors}


def signature_difference(theirs: Iterable[TensorEntry], ours: Iterable[TensorEntry]) -> str:
    """Why two stages' :func:`model_signature` differ, for a person: a few of the tensors only one of them has; a
    buffer only ``theirs`` has is one a layer registers in its forward, perhaps, which a restore comes before."""
    theirs, ours = (set(_described(t for t in side if t.kind != "optimizer")) for side in (theirs, ours))
    said = []
    for who, only in (("the snapshot", theirs - ours), ("this model", ours - theirs)):
        if only:
            shown = ", ".join(f"{name} ({dtype}, {list(shape)})" for name, dtype, shape in sorted(only)[:3])
            said.append(f"only {who} has {shown}{' ...' if len(only) > 3 else ''}")
    if any(name.startswith("buffer/") for name, _, _ in theirs - ours):
        said.append("a buffer a layer registers as it runs forward is not there yet when baft.initialize restores: "
                    "register it in the layer's __init__")
    return "; ".join(said)


def plan_layout(tensors: Iterable[TensorEntry], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                shard: int = 0, num_shards: int = 1) -> Layout:
    """Cut tensors into chunks of at most ``chunk_bytes`` and keep shard ``shard`` of ``num_shards``.

    A tensor with an ``owner`` goes whole to that shard (only that replica holds it). The
    replicated tensors are split into contiguous runs of chunks with about equal bytes, so
    replicas share their copy work evenly.
    """
    tensors = tuple(tensors)
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {t.name}: unsupported dtype {t.dtype}")
        if t.owner is not None and not 0 <= t.owner < num_shards:
            raise ValueError(f"tensor {t.name}: owned by replica {t.owner}, but there are {num_shards} shards")
    pieces = []
    for t in tensors:
        for start in range(0, max(t.nbytes, 1), chunk_bytes):
            if t.nbytes:
                pieces.append((t.name, start, min(chunk_bytes, t.nbytes - start), t.owner))
    total = sum(p[2] for p in pieces if p[3] is None)
    chunks, offset, before = [], 0, 0
    for index, (name, start, nbytes, owned_by) in enumerate(pieces):
        if owned_by is None:
            # a replicated chunk belongs to the shard its first byte falls in, by cumulative bytes
            owner = min(num_shards - 1, before * num_shards // total) if total else 0
            before += nbytes
        else:
            owner = owned_by
        if owner == shard:
            chunks.append(Chunk(index, name, start, nbytes, offset))
            offset += nbytes
    return Layout(tensors, tuple(chunks), shard, num_shards, len(pieces))


@dataclass
class CommitRecord:
    """Written last: the buffer it names holds a complete, checksummed snapshot of ``step``.

    ``items`` holds the small state as JSON (RNG states, LR scheduler, loss scaler, data
    position, step counters); ``checksums[i]`` is the checksum of ``layout.chunks[i]``.
    """

    step: int
    rank: int
    stage: int
    layout: Layout
    checksums: list[str]
    items: dict = field(default_factory=dict)
    dp_rank: int = 0
    topology: dict = field(default_factory=dict)  # pipe, data, world size
    run_id: str = ""
    model: str = ""  # layout fingerprint of the whole model, for refusing foreign snapshots
    wall_time: float = 0.0
    version: int = FORMAT_VERSION

    def _without_layout(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}

    def to_json(self) -> dict:
        return {**self._without_layout(), "layout": self.layout.to_json()}

    def to_text(self) -> str:
        """:meth:`to_json` as one line of JSON text, the layout's text made once per run: a commit per
        step serializes only what changes."""
        return f'{json.dumps(self._without_layout())[:-1]}, "layout": {self.layout.json_text}}}'

    @classmethod
    def from_json(cls, doc: dict) -> "CommitRecord":
        doc = dict(doc)
        doc["layout"] = Layout.from_json(doc["layout"])
        return cls(**doc)

    def verify(self, buffer) -> Optional[str]:
        """Check every chunk of ``buffer`` against its checksum; return the first bad chunk's description."""
        view = memoryview(buffer)
        if len(self.checksums) != len(self.layout.chunks):
            return f"commit record lists {len(self.checksums)} checksums for {len(self.layout.chunks)} chunks"
        if view.nbytes < self.layout.nbytes:
            return f"buffer holds {view.nbytes} bytes, the layout needs {self.layout.nbytes}"
        for chunk, expected in zip(self.layout.chunks, self.checksums):
            if checksum(view[chunk.offset:chunk.offset + chunk.nbytes], self.version) != expected:
                return f"chunk {chunk.index} ({chunk.tensor} bytes {chunk.start}..{chunk.start + chunk.nbytes}) fails its checksum"
        return None
