"""SIGKILL a DeepSpeed trainer at chosen moments: its node's manager still holds the newest committed snapshot."""

import pytest

from baft.manager.config import ManagerConfig
from baft.manager.control import start, stop
from baft.manager.protocol import ManagerClient
from baft.snapshot import slots
from conftest import TINY, run_worker


@pytest.mark.slow
@pytest.mark.parametrize("phase,newest", [("copy", 4), ("seal", 4), ("commit", 5), ("optimizer", 5)])
def test_manager_keeps_newest_committed_snapshot_when_a_trainer_is_killed(shm_root, phase, newest, monkeypatch):
    node_root = shm_root / "default" / "node0"
    start(ManagerConfig(node_id=0, shm_root=node_root).validate())
    try:
        monkeypatch.setenv("BAFT_CHAOS", f"rank=1,step=6,phase={phase}")
        proc = run_worker(2, [*TINY, "--iters", "8", "--policy", "baft", "--period", "1",
                              "--shm-root", str(shm_root)], check=False)
        assert proc.returncode != 0, "the fault did not fire"
        with ManagerClient.connect(node_root, timeout=30) as client:
            held = client.held()
        # during iteration 6 the snapshot of step 5 is copied: killed mid-copy, or after the copy's fence
        # while its checksums and commit record are being written, step 4 is the newest; killed after
        # its commit (or in the optimizer step that follows), step 5 is
        assert held["1"]["memory"][0] == newest
        record, data = slots.load_verified(node_root, 1, step=newest)
        assert record.verify(data) is None
        assert newest - 1 in held["1"]["memory"], "the previous committed snapshot is kept too"
    finally:
        stop(node_root)


@pytest.mark.slow
def test_trainers_outlive_a_killed_manager_and_keep_their_snapshots(shm_root, monkeypatch):
    node_root = shm_root / "default" / "node0"
    start(ManagerConfig(node_id=0, shm_root=node_root).validate())
    monkeypatch.setenv("BAFT_CHAOS", "manager=0,step=4")
    proc = run_worker(2, [*TINY, "--iters", "8", "--policy", "baft", "--period", "1", "--shm-root", str(shm_root)])
    assert "step     8" in proc.stdout, "training did not go on without its manager"
    # once per rank, not once per commit (two ranks' lines may interleave on the shared stderr: count phrases)
    assert proc.stderr.count("snapshots stay in shared memory only") == 2, proc.stderr
    for rank in (0, 1):
        record, data = slots.load_verified(node_root, rank)
        assert record.step == 8 and record.verify(data) is None  # the final state, snapshotted at exit
