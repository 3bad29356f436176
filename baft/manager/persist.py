"""Committed snapshots on disk: safetensors files plus a JSON manifest, written atomically.

Layout of a snapshot directory ``DIR`` (one per node)::

    DIR/step-00000120/manifest.json        schema "baft.snapshot", version 1
    DIR/step-00000120/rank0.safetensors    the tensors of local rank 0 at step 120
    DIR/step-00000120/rank1.safetensors    ...

A step directory is written under a temporary name (``DIR/.tmp-step-...``), every file and
the directory are fsync'ed, and only then is it renamed into place: a crash leaves either
the complete directory or none, and readers never look at the temporary names. Older step
directories beyond the retention count are removed after a successful write.

Each safetensors file holds the rank's tensors under their own names with their dtype and
shape. With data-parallel sharding a rank may hold only a byte range of a tensor; that
range is stored as a flat ``uint8`` tensor keyed ``"<name>#bytes=<start>:<end>"``.

``manifest.json`` holds the step, run id, model fingerprint (its first rank's), topology and node id, and per
rank the file name and size, where each tensor is in the file, and the rank's full commit
record (layout, per-chunk checksums, and the small state in ``items``: RNG states, LR
scheduler, loss scaler, data-loader position, step counters).

Loading without baft (see also docs/persisted-format.rst)::

    import json, safetensors.torch
    manifest = json.load(open("DIR/step-00000120/manifest.json"))
    for entry in manifest["ranks"]:
        tensors = safetensors.torch.load_file(f"DIR/step-00000120/{entry['file']}")
        items = entry["record"]["items"]      # RNG, scheduler, data position ...

:func:`read_snapshot` returns each rank as ``(CommitRecord, bytes)``, the same form
:func:`baft.snapshot.slots.load_verified` gives for shared memory, after checking every chunk.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import jsonschema
import safetensors

from baft.errors import BaftError, ConfigError
from baft.jsonfile import read_json, write_json_atomic
from baft.snapshot.layout import CommitRecord, Layout

SCHEMA = "baft.snapshot"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"

_MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["schema", "version", "step", "run_id", "model", "topology", "node_id", "ranks"],
    "properties": {
        "step": {"type": "integer", "minimum": 0},
        "run_id": {"type": "string"},
        "model": {"type": "string"},
        "topology": {"type": "object"},
        "node_id": {"type": "integer"},
        "ranks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rank", "file", "file_bytes", "tensors", "record"],
                "properties": {
                    "rank": {"type": "integer"},
                    "file": {"type": "string", "pattern": r"^rank[0-9]+\.safetensors$"},
                    "file_bytes": {"type": "integer"},
                    "tensors": {"type": "array"},
                    "record": {"type": "object", "required": ["step", "rank", "layout", "checksums"]},
                },
            },
        },
    },
}


def _torch():
    """torch and safetensors.torch, imported on first use: the manager starts without them."""
    import safetensors.torch
    import torch

    return torch, safetensors.torch


def preload() -> None:
    """Import what writing and reading snapshots needs (about 2 s), e.g. in a background thread."""
    _torch()

Log = Optional[Callable[[str], None]]


@dataclass(frozen=True)
class Identity:
    """What a snapshot must match to be restored into a run; empty fields are not checked."""

    run_id: str = ""
    model: str = ""
    topology: dict = field(default_factory=dict)

    @classmethod
    def of(cls, record: CommitRecord) -> "Identity":
        return cls(record.run_id, record.model, dict(record.topology))

    def mismatch(self, manifest: dict) -> Optional[str]:
        """Why a manifest belongs to another run, model or pipeline depth, or None."""
        if self.run_id and manifest["run_id"] != self.run_id:
            return f"from run {manifest['run_id']!r}, this run is {self.run_id!r}"
        # a node holds ranks of several stages, each its own model fingerprint
        models = [manifest["model"], *(e["record"].get("model") for e in manifest["ranks"])]
        if self.model and self.model not in models:
            return f"from model {manifest['model']!r}, this model is {self.model!r}"
        # only the pipeline depth must match: a restart may have more or fewer data-parallel replicas
        stages = self.topology.get("pipe")
        if stages and manifest["topology"].get("pipe") != stages:
            return (f"taken with {manifest['topology'].get('pipe')} pipeline stages, this run has {stages}; "
                    f"restart with that many stages")
        return None


@dataclass(frozen=True)
class PersistedStep:
    """A step directory whose manifest is readable (its tensors are checked only when read)."""

    step: int
    path: Path
    manifest: dict

    @property
    def ranks(self) -> list[int]:
        return [r["rank"] for r in self.manifest["ranks"]]


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"{_STEP_PREFIX}{step:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_pieces(layout: Layout) -> list[dict]:
    """Where each tensor of the shard sits: its contiguous byte range in the tensor and in the buffer."""
    pieces: dict[str, dict] = {}
    for c in layout.chunks:
        p = pieces.get(c.tensor)
        if p is None:
            pieces[c.tensor] = {"name": c.tensor, "start": c.start, "end": c.start + c.nbytes, "offset": c.offset}
        else:
            p["end"] = c.start + c.nbytes
    out = []
    for t in layout.tensors:
        p = pieces.get(t.name)
        if p is None:
            if t.nbytes == 0 and layout.shard == 0:
                p = {"name": t.name, "start": 0, "end": 0, "offset": 0}
            else:
                continue
        whole = p["start"] == 0 and p["end"] == t.nbytes
        p["key"] = t.name if whole else f"{t.name}#bytes={p['start']}:{p['end']}"
        p["dtype"] = t.dtype if whole else "uint8"
        p["shape"] = list(t.shape) if whole else [p["end"] - p["start"]]
        out.append(p)
    return out


def _tensors_of(record: CommitRecord, buffer) -> tuple[dict, list[dict]]:
    torch, _ = _torch()
    flat = torch.frombuffer(memoryview(buffer), dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    pieces = _tensor_pieces(record.layout)
    tensors = {}
    for p in pieces:
        raw = flat[p["offset"]:p["offset"] + p["end"] - p["start"]]
        dtype = getattr(torch, p["dtype"])
        if p["offset"] % dtype.itemsize:  # the layout packs tensors unaligned; a view needs alignment
            raw = raw.clone()
        tensors[p["key"]] = raw.view(dtype).reshape(p["shape"])
    return tensors, pieces


def _write_rank(path: Path, record: CommitRecord, buffer) -> dict:
    with warnings.catch_warnings():  # bytes are read-only; safetensors only reads them
        warnings.simplefilter("ignore", UserWarning)
        tensors, pieces = _tensors_of(record, buffer)
    metadata = {"baft.step": str(record.step), "baft.rank": str(record.rank), "baft.run_id": record.run_id}
    _torch()[1].save_file(tensors, str(path), metadata=metadata)
    _fsync_path(path)
    return {
        "rank": record.rank,
        "stage": record.stage,
        "dp_rank": record.dp_rank,
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "tensors": [{k: p[k] for k in ("key", "name", "dtype", "shape", "start", "end")} for p in pieces],
        "record": record.to_json(),
    }


def write_snapshot(directory, snapshots: list[tuple[CommitRecord, bytes]], node_id: int = 0,
                   keep: Optional[int] = None) -> Path:
    """Persist one step of a node's ranks atomically; keep only the ``keep`` newest steps if given.

    A failure (full disk, unwritable directory) raises a one-line BaftError and leaves
    ``directory`` as it was: the previous step directories are untouched.
    """
    if not snapshots:
        raise ValueError("write_snapshot: no snapshots")
    first = snapshots[0][0]
    if any(r.step != first.step for r, _ in snapshots):
        raise ValueError("write_snapshot: snapshots of different steps")
    directory = Path(directory)
    final = step_dir(directory, first.step)
    tmp = directory / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        ranks = [_write_rank(tmp / f"rank{r.rank}.safetensors", r, b) for r, b in sorted(snapshots, key=lambda s: s[0].rank)]
        manifest = {"schema": SCHEMA, "version": VERSION, "step": first.step, "run_id": first.run_id,
                    "model": first.model, "topology": first.topology, "node_id": node_id, "ranks": ranks}
        write_json_atomic(tmp / MANIFEST, manifest)
        _fsync_path(tmp)
        if final.exists():  # the same step again: swap, so one complete copy always exists
            old = directory / f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(directory)
    except (OSError, safetensors.SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BaftError(f"{directory}: cannot persist step {first.step} ({_reason(err)}); "
                        f"earlier snapshots are kept") from None
    if keep is not None:
        retain(directory, keep)
    return final


def _reason(err: Exception) -> str:
    """An OS error's own words, also when safetensors wraps it ("... (os error 28)")."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    found = re.search(r"os error (\d+)", text)
    return os.strerror(int(found.group(1))) if found else text


def retain(directory, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest step directories, and leftovers of interrupted writes."""
    if keep < 1:
        raise BaftError(f"retention: keep={keep}, must keep at least 1 snapshot")
    directory = Path(directory)
    removed = []
    steps = sorted(_step_dirs(directory), reverse=True)
    for _, path in steps[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in directory.glob(f"{_TMP_PREFIX}*"):
        if not path.name.endswith(f"-{os.getpid()}"):  # another writer's leftover: it was killed
            shutil.rmtree(path, ignore_errors=True)
    return removed


def _step_dirs(directory: Path) -> Iterable[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    out = []
    for path in directory.iterdir():
        suffix = path.name[len(_STEP_PREFIX):]
        if path.name.startswith(_STEP_PREFIX) and suffix.isdigit() and path.is_dir():
            out.append((int(suffix), path))
    return out


def read_manifest(path) -> dict:
    """The validated manifest of a step directory; a one-line ConfigError if unreadable."""
    file = Path(path) / MANIFEST
    doc = read_json(file)
    if doc.get("schema") != SCHEMA:
        raise ConfigError(f"{file}: not a {SCHEMA} manifest (its 'schema' is {doc.get('schema')!r})")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{file}: {SCHEMA} version {doc.get('version')!r}, this baft reads version {VERSION}")
    try:
        jsonschema.validate(doc, _MANIFEST_SCHEMA)
    except jsonschema.ValidationError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "top level"
        raise ConfigError(f"{file}: {where}: {err.message}") from None
    return doc


def list_steps(directory, log: Log = None) -> list[PersistedStep]:
    """Step directories of ``directory`` with a readable manifest, newest first."""
    out = []
    for step, path in sorted(_step_dirs(Path(directory)), reverse=True):
        try:
            manifest = read_manifest(path)
        except BaftError as err:
            if log:
                log(f"{err}; snapshot of step {step} skipped")
            continue
        out.append(PersistedStep(step, path, manifest))
    return out


def damaged_newest(directory) -> Optional[str]:
    """Why the newest step directory of ``directory`` cannot be read (its manifest missing or damaged), or None.

    A step directory is renamed into place whole, so one whose manifest is unreadable was changed since: skipped
    as :func:`list_steps` skips it, a restart would go back to an older step, or start from step 0, without a word.
    """
    steps = sorted(_step_dirs(Path(directory)), reverse=True)
    if not steps:
        return None
    try:
        read_manifest(steps[0][1])
    except BaftError as err:
        return str(err)
    return None


def _read_rank(step_path: Path, entry: dict) -> tuple[CommitRecord, bytes]:
    file = step_path / entry["file"]
    try:
        size = file.stat().st_size
    except OSError as err:
        raise BaftError(f"{file}: cannot read ({err.strerror})") from None
    if size != entry["file_bytes"]:
        raise BaftError(f"{file}: holds {size} bytes, the manifest says {entry['file_bytes']} (truncated or replaced)")
    torch, _ = _torch()
    record = CommitRecord.from_json(entry["record"])
    buffer = bytearray(record.layout.nbytes)
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for p in _tensor_pieces(record.layout):
                if p["key"] not in keys:
                    raise BaftError(f"{file}: tensor {p['key']!r} of the manifest is missing")
                raw = f.get_tensor(p["key"]).reshape(-1).view(torch.uint8)
                if raw.numel() != p["end"] - p["start"]:
                    raise BaftError(f"{file}: tensor {p['key']!r} holds {raw.numel()} bytes, "
                                    f"the layout needs {p['end'] - p['start']}")
                flat[p["offset"]:p["offset"] + raw.numel()] = raw
    except safetensors.SafetensorError as err:
        raise BaftError(f"{file}: not a readable safetensors file ({str(err).splitlines()[0]})") from None
    problem = record.verify(buffer)
    if problem:
        raise BaftError(f"{file}: snapshot of step {record.step} refused: {problem}")
    return record, bytes(buffer)


def read_snapshot(step_path, ranks: Optional[Iterable[int]] = None) -> list[tuple[CommitRecord, bytes]]:
    """Read (and verify, chunk by chunk) the ranks of one step directory, all of them by default."""
    step_path = Path(step_path)
    manifest = read_manifest(step_path)
    wanted = None if ranks is None else set(ranks)
    entries = [e for e in manifest["ranks"] if wanted is None or e["rank"] in wanted]
    if wanted is not None and len(entries) != len(wanted):
        missing = sorted(wanted - {e["rank"] for e in entries})
        raise BaftError(f"{step_path / MANIFEST}: holds no snapshot of rank {missing[0]}")
    return [_read_rank(step_path, e) for e in entries]


def check_identity(step: PersistedStep, expect: Optional[Identity]) -> None:
    """Refuse, in one line, a snapshot of another run, model or topology."""
    problem = expect.mismatch(step.manifest) if expect else None
    if problem:
        raise BaftError(f"{step.path}: snapshot {problem}; point --dir elsewhere or remove it")

