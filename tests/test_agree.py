"""The agreement on the step to restore, from every rank's plan: the same answer on every rank."""

from baft.recovery.agree import GlobalPlan, LocalPlan, Note, Offer, global_plan, slower
from baft.snapshot.layout import TensorEntry, signature_difference


def plan(stage, steps, shards=(0,), num_shards=1, pending=()):
    return LocalPlan({step: Offer(stage, frozenset(shards), num_shards, tuple(pending)) for step in steps},
                     saw_snapshot=bool(steps))


def test_the_newest_step_every_stage_holds_whole():
    plans = [plan(0, [3, 4, 5]), plan(1, [3, 4])]
    assert global_plan(plans, stages=2) == GlobalPlan(4, True)


def test_a_stage_whose_replicas_miss_a_shard_is_not_whole():
    # stage 0 at dp=2: step 5 has shard 0 only (shard 1 was on a lost node); step 4 has both
    plans = [plan(0, [4], shards=(0,), num_shards=2), plan(0, [4], shards=(1,), num_shards=2),
             plan(0, [5], shards=(0,), num_shards=2), plan(0, [5], shards=(), num_shards=2)]
    everyone = [LocalPlan({**a.offers, **b.offers}, saw_snapshot=True) for a, b in zip(plans[:2], plans[2:])]
    assert global_plan(everyone, stages=1).step == 4


def test_a_step_a_manager_can_rebuild_counts_as_whole():
    plans = [plan(0, [6], shards=(), num_shards=None, pending=[(0, "parity")]), plan(1, [6])]
    assert global_plan(plans, stages=2).step == 6


def test_nothing_in_common_is_no_step_and_a_fresh_start_knows_snapshots_were_seen():
    assert global_plan([plan(0, [3]), plan(1, [4])], stages=2) == GlobalPlan(None, True)
    assert global_plan([plan(0, []), plan(1, [])], stages=2) == GlobalPlan(None, False)


def test_only_the_runs_first_snapshot_held_by_some_stages_is_a_start_over():
    first = LocalPlan({1: Offer(0, frozenset({0}), 1)}, saw_snapshot=True, firsts=frozenset({1}))
    assert global_plan([first, LocalPlan(saw_snapshot=True)], stages=2) == GlobalPlan(None, True, only_first=1)
    later = LocalPlan({2: Offer(0, frozenset({0}), 1)}, saw_snapshot=True, firsts=frozenset({1, None}))
    assert global_plan([later, LocalPlan(saw_snapshot=True)], stages=2).only_first is None


def test_snapshots_of_another_pipeline_depth_stop_every_rank_alike():
    deeper = LocalPlan({}, (Note("stages", "taken with 4 pipeline stages, this run has 2"),), True)
    assert global_plan([plan(0, [3]), deeper], stages=2).fatal == "taken with 4 pipeline stages, this run has 2"


def test_the_slower_source_is_where_the_time_went():
    assert slower("memory", "disk") == "disk" and slower("parity", "memory") == "parity"


def test_another_models_snapshot_is_said_by_the_tensors_only_one_side_has():
    """Probe 15: a layer that registers a cache buffer as it first runs forward made every restart refuse its
    snapshots as "another model", two signatures and nothing else: the note names the buffer and what to do."""
    weight = TensorEntry("param/1.lin.weight", "float32", (4, 4), 64, "parameters")
    cache = TensorEntry("buffer/1.cache", "float32", (6, 1), 24, "other")
    moment = TensorEntry("optimizer/exp_avg", "float32", (4, 4), 64, "optimizer")
    said = signature_difference([weight, cache, moment], [weight])
    assert said.startswith("only the snapshot has buffer/1.cache (float32, [6, 1]); a buffer a layer registers")
    assert "register it in the layer's __init__" in said
    assert signature_difference([weight], [weight, cache]) == "only this model has buffer/1.cache (float32, [6, 1])"
    assert signature_difference([weight, moment], [weight]) == ""
