"""The committed snapshot of step k equals, bit for bit, a synchronous copy taken right after step k."""

import json

import pytest

from baft.snapshot import slots
from conftest import TINY, run_ranks


@pytest.mark.parametrize("schedule,policy", [("1f1b", "baft"), ("gpipe", "baft"), ("1f1b", "thread-copy")])
def test_committed_snapshot_equals_synchronous_copy(tmp_path, shm_root, schedule, policy):
    run_ranks(2, "snapshot_check.py", [*TINY, "--schedule", schedule, "--policy", policy, "--period", "1",
                                       "--iters", "6", "--shm-root", str(shm_root), "--out", str(tmp_path)])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["mismatches"] == []
        # the snapshot of step k is committed during iteration k+1, before its optimizer step
        assert result["checked"] == [1, 2, 3, 4, 5]
        assert result["commits"] == [1, 2, 3, 4, 5]


def test_snapshot_torn_by_a_kill_is_never_committed(tmp_path, shm_root):
    proc = run_ranks(2, "snapshot_check.py", [*TINY, "--policy", "baft", "--period", "1", "--iters", "8",
                                              "--shm-root", str(shm_root), "--out", str(tmp_path),
                                              "--kill-step", "4", "--kill-chunk", "3", "--kill-rank", "1"],
                     check=False)
    assert proc.returncode != 0
    root = shm_root / "default" / "node0"
    held = [s.record.step for s in slots.committed(root, 1)]
    assert 4 not in held
    assert held[0] == 3
    record, data = slots.load_verified(root, 1)
    assert record.step == 3 and record.verify(data) is None
    # the other rank was not killed mid-copy and may hold step 4: the restorable step is the common one
    assert 3 in [s.record.step for s in slots.committed(root, 0)]
