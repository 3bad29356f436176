"""The planner counts a snapshot's wait for a slot still held by the previous one's seal."""

import pytest

from baft.pipeline.bubblemap import Bubble
from baft.snapshot.planner import choose_period, plan_rank


def rank(seal: float, slots: int, stall_bytes: int = 0):
    """A rank with a 1 s iteration whose state (10 MB at 1 GB/s) fits its bubble, or not by ``stall_bytes``."""
    bubble = Bubble(stage=0, start=0.1, end=0.12, instruction=3, after="ForwardPass", before="BackwardPass", kind="recv")
    mine = plan_rank([bubble], [1 << 20] * 10 + ([stall_bytes] if stall_bytes else []), 1e9, 1.0)
    mine.seal, mine.slots = seal, slots
    return mine


@pytest.mark.parametrize("slots, seal, period, wait", [
    (4, 0.8, 1, 0.0),   # the seal overlaps the next snapshot's copy: no wait while it takes under a period
    (4, 1.5, 1, 0.5),   # a seal longer than the period: the next-but-one snapshot waits for it
    (4, 1.5, 2, 0.0),
    (3, 0.8, 1, 0.8),   # three slots: the next snapshot begins only once this one is committed
    (3, 0.8, 2, 0.0),
    (3, 2.5, 2, 1.5),
])
def test_the_wait_for_a_slot(slots, seal, period, wait):
    assert rank(seal, slots).seal_wait(period) == pytest.approx(wait)


def test_the_period_stretches_until_the_seal_fits_it_with_three_slots_and_not_with_four():
    assert rank(0.0, 3).stall == 0.0
    assert choose_period([rank(0.3, 4)], budget=0.01) == 1
    # period 1 waits 0.3 s (30%); from period 2 the seal ends before the next snapshot begins
    assert choose_period([rank(0.3, 3)], budget=0.01) == 2
    assert rank(0.3, 3).cost(1) == pytest.approx(0.3)


def test_a_plan_made_for_another_chunk_size_is_refused_in_one_line():
    """A plan's bubbles name chunks by index: one made from a profile cut into other chunks would place the wrong
    ones (every chunk is still copied by the fence, but the plan no longer says where)."""
    from baft.config import ConfigError
    from baft.snapshot.planner import Plan, check_plan

    bubble = Bubble(stage=0, start=0.1, end=0.12, instruction=3, after="ForwardPass", before="BackwardPass", kind="recv")
    mine = plan_rank([bubble], [1 << 20] * 8, 1e9, 1.0, layout="abc")
    plan = Plan(schedule="1f1b", stages=1, micro_batches=4, period=1, budget=0.01, ranks=[mine])
    assert check_plan(plan, 0, 1, "abc", 8 << 20, 8) is mine
    with pytest.raises(ConfigError) as refused:
        check_plan(plan, 0, 1, "abc", 8 << 20, 2)
    assert str(refused.value) == ("plan for rank 0 cuts its state into 8 chunks, this run into 2: baft.chunk_bytes "
                                  "differs from the profile's; profile and plan again")
