"""A manager whose --memory-limit holds three slots per rank, not four: training goes on, each snapshot waiting
for the previous one's seal, and every rank says so once."""

import pytest

from baft.manager.config import ManagerConfig
from baft.manager.control import start, stop
from baft.manager.protocol import ManagerClient
from baft.snapshot import slots
from conftest import TINY, run_worker


@pytest.mark.slow
def test_three_slots_where_the_memory_limit_allows_no_more(shm_root):
    node_root = shm_root / "default" / "node0"
    args = [*TINY, "--policy", "baft", "--period", "1", "--shm-root", str(shm_root)]
    start(ManagerConfig(node_id=0, shm_root=node_root).validate())
    try:
        roomy = run_worker(2, [*args, "--iters", "2"])
        with ManagerClient.connect(node_root, timeout=30) as client:
            sizes = [r["nbytes"] for r in client.status()["ranks"].values()]
    finally:
        stop(node_root)
    assert "snapshot slots" not in roomy.stderr
    assert len(sizes) == 2

    # three slots for both fit, four for both do not: whichever rank says hello first leaves the other room
    start(ManagerConfig(node_id=0, shm_root=node_root, memory_limit=int(3.5 * sum(sizes))).validate())
    try:
        tight = run_worker(2, [*args, "--iters", "6"])
        lines = [line for line in tight.stderr.splitlines() if "snapshot slots" in line]
        assert sorted(lines) == [f"baft: rank {r}: memory_limit allows 3 snapshot slots, not 4: each snapshot waits "
                                 f"for the previous one's seal" for r in (0, 1)]
        for rank in (0, 1):
            assert sorted(p.name for p in slots.rank_dir(node_root, rank).glob("slot*.bin")) == \
                ["slot0.bin", "slot1.bin", "slot2.bin"]
            assert [s.record.step for s in slots.committed(node_root, rank)] == [6, 5, 4]
            record, data = slots.load_verified(node_root, rank)
            assert record.step == 6 and record.verify(data) is None
    finally:
        stop(node_root)
