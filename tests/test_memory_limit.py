"""A manager whose --memory-limit holds three slots per rank, not four, for some rank: training goes on, that
rank's snapshots each waiting for the previous one's seal, and it says so once."""

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
            sizes = {int(rank): r["nbytes"] for rank, r in client.status()["ranks"].items()}
    finally:
        stop(node_root)
    assert "snapshot slots" not in roomy.stderr
    assert len(sizes) == 2

    # three slots for both fit, four for both do not: the first rank to say hello gets three, and the other
    # gets four only where that still fits (when its state is no larger), so which one says it is a race
    limit = int(3.5 * sum(sizes.values()))
    start(ManagerConfig(node_id=0, shm_root=node_root, memory_limit=limit).validate())
    try:
        tight = run_worker(2, [*args, "--iters", "6"])
        lines = [line for line in tight.stderr.splitlines() if "snapshot slots" in line]
        said = sorted(int(line.split(":")[1].split()[-1]) for line in lines)
        assert said and len(said) == len(set(said)), lines
        assert sorted(lines) == [f"baft: rank {r}: memory_limit allows 3 snapshot slots, not 4: each snapshot "
                                 f"waits for the previous one's seal" for r in said], lines
        counts = {rank: 3 if rank in said else 4 for rank in (0, 1)}
        assert sum(counts[rank] * size for rank, size in sizes.items()) <= limit, (counts, sizes, limit)
        for rank, count in counts.items():
            assert sorted(p.name for p in slots.rank_dir(node_root, rank).glob("slot*.bin")) == \
                [f"slot{i}.bin" for i in range(count)]
            assert [s.record.step for s in slots.committed(node_root, rank)] == list(range(6, 6 - count, -1))
            record, data = slots.load_verified(node_root, rank)
            assert record.step == 6 and record.verify(data) is None
    finally:
        stop(node_root)


def test_the_keys_that_ask_a_running_manager_for_what_it_does_not_do_are_named():
    """A rank that finds its node's manager running (`baft train` started it with its options) names the keys of its
    "baft" section that manager does not apply, with the manager's value, rather than drop them without a word."""
    from baft.config import parse_config
    from baft.manager_link import settings_not_applied

    train = {"memory": {"limit": None}, "persist": {"dir": "/run/persisted/node0", "every": 4, "seconds": None,
                                                    "keep": 3}}
    asked = parse_config({"baft": {"persist": {"dir": "/run/persisted", "every": 4}}})
    assert settings_not_applied(asked, train, 0) == []
    asked = parse_config({"baft": {"memory_limit": 1024, "persist": {"dir": "/elsewhere", "every": 1, "keep": 5}}})
    assert settings_not_applied(asked, train, 0) == [
        "persist.dir /elsewhere/node0 (the manager's: /run/persisted/node0)", "persist.every 1 (the manager's: 4)",
        "persist.keep 5 (the manager's: 3)", "memory_limit 1024 (the manager's: none)"]
    assert settings_not_applied(asked, {"memory": {"limit": 1024}, "persist": None}, 0)[0] == \
        "persist.dir /elsewhere/node0 (the manager's: none)"
