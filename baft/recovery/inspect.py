"""``baft inspect PATH``: describe a persisted or in-memory snapshot and verify its checksums.

PATH may be a persisted step directory (``DIR/step-00000120``), a persisted snapshot
directory (``DIR``: every step in it), a shared-memory rank directory (``<shm root>/rank0``)
or a shared-memory root (every rank in it).
"""

from __future__ import annotations

from pathlib import Path
from baft.errors import BaftError
from baft.manager import persist
from baft.snapshot import slots
from baft.snapshot.layout import CommitRecord


class SnapshotCorrupt(BaftError):
    """A snapshot failed verification; ``str()`` names the first bad file and chunk, ``report`` has it all."""

    def __init__(self, message: str, report: str):
        super().__init__(message)
        self.report = report


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _describe_record(record: CommitRecord, lines: list[str], indent: str = "  ") -> None:
    layout = record.layout
    kinds = ", ".join(f"{k} {_size(v)}" for k, v in layout.bytes_by_kind().items() if v)
    lines.append(f"{indent}rank {record.rank} (stage {record.stage}, dp {record.dp_rank}, shard "
                 f"{layout.shard + 1}/{layout.num_shards}): {_size(layout.nbytes)} in {len(layout.chunks)} chunks"
                 f"{' (' + kinds + ')' if kinds else ''}")
    covered: dict[str, list[int]] = {}
    for c in layout.chunks:
        lo_hi = covered.setdefault(c.tensor, [c.start, c.start + c.nbytes])
        lo_hi[1] = c.start + c.nbytes
    for t in layout.tensors:
        if t.name not in covered:
            continue
        lo, hi = covered[t.name]
        part = "" if (lo, hi) == (0, t.nbytes) else f"  bytes {lo}..{hi} of {t.nbytes}"
        lines.append(f"{indent}  {t.name:<40} {t.dtype:<9} {str(list(t.shape)):<18} {_size(t.nbytes):>10} {t.kind}{part}")
    if record.items:
        lines.append(f"{indent}  items: {', '.join(sorted(record.items))}")


def _persisted_step(path: Path, verify: bool, lines: list[str], failures: list[str]) -> None:
    manifest = persist.read_manifest(path)
    lines.append(f"step {manifest['step']} (persisted) {path}")
    lines.append(f"  run {manifest['run_id']!r}, model {manifest['model']!r}, node {manifest['node_id']}, "
                 f"topology {manifest['topology']}")
    for entry in manifest["ranks"]:
        record = CommitRecord.from_json(entry["record"])
        _describe_record(record, lines)
        lines.append(f"    file {entry['file']} ({_size(entry['file_bytes'])})")
        if verify:
            try:
                persist.read_snapshot(path, ranks=[record.rank])
                lines.append(f"    checksums: ok ({len(record.checksums)} chunks)")
            except BaftError as err:
                lines.append(f"    checksums: FAILED: {err}")
                failures.append(str(err))


def _shm_rank(path: Path, verify: bool, lines: list[str], failures: list[str]) -> None:
    rank = slots.rank_of(path)
    infos = slots.read_slots(path)
    lines.append(f"rank {rank} (shared memory) {path}")
    for info in sorted(infos, key=lambda s: -(s.record.step if s.record else -1)):
        if info.record is None:
            lines.append(f"  slot {info.slot}: no commit record (empty, or being filled)")
            continue
        record = info.record
        lines.append(f"  slot {info.slot}: step {record.step}, run {record.run_id!r}, model {record.model!r}, "
                     f"topology {record.topology}")
        _describe_record(record, lines, indent="    ")
        if verify:
            with slots.open_slot(path.parent, rank, info.slot) as m:
                problem = record.verify(m)
            if problem is None:
                lines.append(f"      checksums: ok ({len(record.checksums)} chunks)")
            else:
                message = f"{slots.slot_path(path, info.slot)}: snapshot of step {record.step} refused: {problem}"
                lines.append(f"      checksums: FAILED: {problem}")
                failures.append(message)


def inspect(path, verify: bool = True) -> str:
    """A text description of the snapshot(s) at ``path``, with each rank's checksums verified.

    Raises :class:`SnapshotCorrupt` (a BaftError naming the first failing file and chunk,
    with the whole description in ``.report``) when any check fails.
    """
    path = Path(path)
    if not path.exists():
        raise BaftError(f"{path}: no such file or directory")
    lines: list[str] = []
    failures: list[str] = []
    if (path / persist.MANIFEST).is_file():
        _persisted_step(path, verify, lines, failures)
    elif slots.rank_of(path) is not None:
        _shm_rank(path, verify, lines, failures)
    elif path.is_dir() and (steps := persist.list_steps(path, log=failures.append)):
        for found in steps:
            _persisted_step(found.path, verify, lines, failures)
    elif path.is_dir() and (ranks := slots.rank_ids(path)):
        for rank in ranks:
            _shm_rank(slots.rank_dir(path, rank), verify, lines, failures)
    else:
        raise BaftError(f"{path}: not a baft snapshot (no manifest.json, step-*/ directories, slot files or rank*/ "
                        f"directories)")
    report = "\n".join(lines)
    if failures:
        raise SnapshotCorrupt(failures[0], report + "\n" + "\n".join(f"FAILED: {f}" for f in failures))
    return report

