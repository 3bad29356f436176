"""A restart never drops a run's progress silently: a corrupt snapshot is skipped for the one before it, and
snapshots that exist but none of which can be restored stop the restart."""

import json

import pytest

from baft.snapshot import slots
from conftest import TINY, run_worker


def flip_byte(rank_dir, info, chunk_index: int) -> None:
    chunk = info.record.layout.chunks[chunk_index]
    path = rank_dir / f"slot{info.slot}.bin"
    data = bytearray(path.read_bytes())
    data[chunk.offset + 7] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_corrupt_snapshot_falls_back_and_unrestorable_ones_stop_the_restart_unless_fresh_start_is_always(
        tmp_path, shm_root):
    run_dir = tmp_path / "run"
    common = [*TINY, "--policy", "baft", "--period", "1", "--shm-root", str(shm_root), "--run-dir", str(run_dir)]
    run_worker(2, [*common, "--iters", "4"])
    rank1 = slots.rank_dir(shm_root / "default" / "node0", 1)
    newest = slots.committed(rank1.parent, 1)[0]
    assert newest.record.step == 4  # the final state, snapshotted as the ranks exit
    flip_byte(rank1, newest, 2)
    chunk = newest.record.layout.chunks[2]
    resumed = run_worker(2, [*common, "--iters", "5"])
    assert f"chunk {chunk.index} ({chunk.tensor}" in resumed.stderr and "fails its checksum" in resumed.stderr
    assert "resumed from step 3" in resumed.stdout

    corrupted = []
    for info in slots.committed(rank1.parent, 1):  # flip one byte of every committed snapshot of rank 1
        flip_byte(rank1, info, 0)
        corrupted.append(info.record.step)
    # one per slot (four): the first run's step 3, the resumed run's 4 and 5 (the last at exit), and the corrupt
    # step 4 it skipped
    assert sorted(corrupted) == [3, 4, 4, 5]

    refused = run_worker(2, [*common, "--iters", "6"], check=False)
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("baft: error:")]
    assert errors and "this run has snapshots but none can be restored" in errors[0]
    assert "refusing to start again from step 0" in errors[0] and "fresh_start" in errors[0]
    assert "fails its checksum" in refused.stderr
    assert "BaftError" not in refused.stderr, "a rank printed a traceback (the launcher's own report is expected)"
    steps = [json.loads(line)["step"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4, 5], "the refused restart trained nothing"

    fresh = run_worker(2, [*common, "--iters", "2", "--fresh-start", "always"])
    assert "snapshots of this run exist but none can be restored; starting from step 0" in fresh.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4, 5, 1, 2]
