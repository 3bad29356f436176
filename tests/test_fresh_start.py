"""A restart never drops a run's progress silently: snapshots that exist but cannot be restored stop it."""

import json

from baft.snapshot import slots
from conftest import TINY, run_worker


def test_unrestorable_snapshots_stop_the_restart_unless_fresh_start_is_always(tmp_path, shm_root):
    run_dir = tmp_path / "run"
    common = [*TINY, "--policy", "baft", "--period", "1", "--shm-root", str(shm_root), "--run-dir", str(run_dir)]
    run_worker(2, [*common, "--iters", "4"])
    rank1 = slots.rank_dir(shm_root / "default" / "node0", 1)
    corrupted = []
    for info in slots.committed(rank1.parent, 1):  # flip one byte of every committed snapshot of rank 1
        path = rank1 / f"slot{info.slot}.bin"
        data = bytearray(path.read_bytes())
        data[info.record.layout.chunks[0].offset] ^= 0xFF
        path.write_bytes(bytes(data))
        corrupted.append(info.record.step)
    assert sorted(corrupted) == [2, 3, 4], "the snapshots of steps 2..4 (the last at exit) were committed, one per slot"

    refused = run_worker(2, [*common, "--iters", "6"], check=False)
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("baft: error:")]
    assert errors and "this run has snapshots but none can be restored" in errors[0]
    assert "refusing to start again from step 0" in errors[0] and "fresh_start" in errors[0]
    assert "fails its checksum" in refused.stderr
    assert "BaftError" not in refused.stderr, "a rank printed a traceback (the launcher's own report is expected)"
    assert len([json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]) == 4, \
        "the refused restart trained nothing"

    fresh = run_worker(2, [*common, "--iters", "2", "--fresh-start", "always"])
    assert "snapshots of this run exist but none can be restored; starting from step 0" in fresh.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 1, 2]
