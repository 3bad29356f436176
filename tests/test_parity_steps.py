"""Which steps a parity group encodes and keeps: a node lost while managers lag is still rebuildable.

Managers busier than their trainers skip steps, each its own; a restore needs one step at
which every node's snapshot can be had. These check the two rules that make one likely to
exist (:meth:`ParityGroup.step_to_encode`, :meth:`ParityGroup.common_steps`) on the group's
bookkeeping alone; ``tests/test_nodes.py`` loses real nodes.
"""

import threading

import numpy as np

from baft.manager.config import SHARE_STEPS_KEPT, ManagerConfig, parse_group
from baft.manager.parity import ParityGroup, Share

GROUP = parse_group("0@10.0.0.1:7100,1@10.0.0.2:7100,2@10.0.0.3:7100")


def group_of(node: int) -> ParityGroup:
    config = ManagerConfig(node_id=node, shm_root=f"/dev/shm/baft-test-parity/node{node}", group=GROUP, parity_k=2)
    return ParityGroup(config.validate(), threading.RLock(), ranks=None)


def share(step: int) -> Share:
    return Share(index=0, size=8, checksum=f"sum{step}", ranks=[0], data=memoryview(np.zeros(4, np.uint8)))


def test_a_step_another_member_encoded_goes_first():
    parity = group_of(0)
    parity.store(1, 6, share(6))
    assert parity.step_to_encode({6, 7}) == 6  # node 1 encoded 6: 7 would leave node 0 without a match


def test_otherwise_the_roundest_step_then_the_newest():
    parity = group_of(0)
    assert parity.step_to_encode({7, 8}) == 8
    assert parity.step_to_encode({5, 6}) == 6
    assert parity.step_to_encode({6, 7}) == 6  # a manager that sees {5, 6} picks 6 as well
    assert parity.step_to_encode({5, 7}) == 7


def test_only_steps_newer_than_the_last_encoded():
    parity = group_of(0)
    parity.state.encoded_step = 8
    assert parity.step_to_encode({7, 8}) is None
    assert parity.step_to_encode({8, 9}) == 9


def test_no_group_encodes_nothing():
    config = ManagerConfig(node_id=0, shm_root="/dev/shm/baft-test-parity/solo").validate()
    assert ParityGroup(config, threading.RLock(), ranks=None).step_to_encode({1, 2}) is None


def test_the_steps_every_member_covers_outlive_newer_ones():  # with SHARE_STEPS_KEPT = 2
    """Node 1 falls behind after step 4 while nodes 0 and 2 go on to 6, 8, 10. Node 0 keeps what it holds
    of steps 2 and 4 from every member (its own newest two would be 8 and 10 only)."""
    parity = group_of(0)
    for step in (2, 4, 6, 8, 10):
        for origin in (0, 1, 2) if step <= 4 else (0, 2):
            parity.store(origin, step, share(step))
    assert parity.common_steps() == {2, 4}
    assert parity.held_shares(1).keys() == {2, 4}
    assert parity.held_shares(0).keys() == {2, 4, 8, 10}
    parity.store(1, 8, share(8))  # node 1 catches up: 4 and 8 are common; 2 goes
    assert parity.common_steps() == {4, 8}
    assert parity.held_shares(0).keys() == {4, 8, 10}
    assert parity.held_shares(1).keys() == {4, 8}


def test_without_lag_only_the_newest_steps_are_kept():
    parity = group_of(0)
    for step in range(1, 7):
        for origin in (0, 1, 2):
            parity.store(origin, step, share(step))
    newest = set(range(7 - SHARE_STEPS_KEPT, 7))
    assert parity.common_steps() == newest
    assert all(parity.held_shares(origin).keys() == newest for origin in (0, 1, 2))
