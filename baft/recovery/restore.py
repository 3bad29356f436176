"""Restore: load the newest step every rank can restore into the engine, or refuse to start.

On every (re)start ``baft.initialize`` calls :func:`restore`. Each rank lists the steps whose
snapshots of its pipeline stage it can reach — in this node's shared memory (fastest), or
through the node's manager from the parity group or from disk — and which data-parallel
shards of the stage each covers. An all-gather lets every rank compute the same answer:
the newest step for which every stage's shards are all reachable. Each rank then loads its
stage's shards (verifying checksums), replicas of a stage exchange shards they lack, and
the small items (RNG, counters, LR scheduler, data position) are put back. If any rank
fails to load the chosen step, all ranks drop it and agree on the next one: the job never
resumes from a mix of steps.

The time it takes is T3 of the recovery record (:mod:`baft.recovery.record`).
"""

from __future__ import annotations

import functools
import mmap
from typing import Optional

import torch
import torch.distributed as dist

from baft.accelerator import collective_device
from baft.errors import BaftError
from baft.recovery.agree import GlobalPlan, LocalPlan, global_plan, local_plan, slower
from baft.recovery.record import Restored, mark
from baft.recovery.restored_weights import RestoredWeights
from baft.snapshot import slots, state
from baft.snapshot.layout import CommitRecord, model_signature, plan_layout, signature_difference

Shards = dict[int, tuple[CommitRecord, mmap.mmap]]  # data-parallel shard -> its verified record and mapping


def restore(engine, root: str, client=None, data_iterator=None, fresh_start=True,
            log=print, run_id: str = "") -> Optional[Restored]:
    """Load the newest snapshot every rank can restore into ``engine``; None for a fresh start.

    A fresh start needs that no rank saw any snapshot of this run, or ``fresh_start="always"``:
    snapshots that exist but cannot be restored stop the job with the reason for each, one of another
    run (``run_id``: this one's) among them.
    """
    mark("restore_start")
    later = state.register_later_buffers(engine, (info.record.layout for old_rank in slots.rank_ids(root)
                                                  for info in slots.committed(root, old_rank)
                                                  if info.record.stage == engine.stage_id))
    if later:
        log(f"registered the buffers {', '.join(later)} the snapshots hold and this model registers as it runs "
            f"(a cache made at its first forward), for the restore to fill")
    tensors = state.tensor_entries(engine)
    fingerprint = model_signature(tensors)
    held = _held(client, log)
    refused: list[str] = []
    tried: set[int] = set()
    saw_snapshot = False  # did any rank see a snapshot of this run (memory, parity, disk), restorable or not?
    only_first = None  # the step of the run's first snapshot, where it is all there is and no step is whole
    while True:
        mine = local_plan(root, engine.stage_id, engine.num_stages, fingerprint, held, tried, refused, tensors)
        plan = _agree(mine, engine.num_stages)
        saw_snapshot = saw_snapshot or plan.saw_snapshot
        only_first = plan.only_first if not tried else None
        if plan.fatal:
            raise BaftError(plan.fatal)  # on every rank alike: they all saw it in the gather
        if not tried:
            for note in mine.notes:
                log(note.text)
        if plan.step is None:
            break
        source, shards = _load_shards(engine, root, client, plan.step, mine.offers[plan.step], tensors, refused,
                                      run_id)
        if _everyone(shards is not None):
            for line in refused:
                log(line)
            _apply(engine, shards)
            items = shards_items(shards, engine.global_rank)
            configured = engine.train_batch_size()
            rng = state.restore_items(engine, items, data_iterator)
            if engine.global_rank == 0:
                _say_another_batch_size(engine, items, configured, log)
            restored = Restored(plan.step, _slowest(source), len(shards), refused, rng, items)
            if not items.get("at_exit"):  # taken as an iteration started: after the loop's code before its call
                rng.weights = RestoredWeights(engine, shards)  # keeps the shards' maps open until then
            else:
                _close(shards)
            mark("restore_end")
            return restored
        if shards is not None:
            _close(shards)
        tried.add(plan.step)
        held = {}  # what the manager could not materialize, it will not on a second ask
    mark("restore_end")
    _fresh_start(engine.global_rank, saw_snapshot, fresh_start, refused, log, only_first)
    return None


def _say_another_batch_size(engine, items: dict, configured: int, log) -> None:
    """Say where this launch's config asks another batch size than the one the restored run's config asked: the run
    goes on at the snapshot's (as the script last set it), which the config's change does not reach (before, it was
    dropped without a word)."""
    was = items.get("configured_batch_size")
    if was is None or was == configured:
        return
    micro = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
    log(f"the config's train_batch_size is {configured} ({configured // micro} micro-batches), the run's snapshots were "
        f"taken under a config of {was}: it goes on at the restored step's {engine.train_batch_size()} "
        f"({engine.gradient_accumulation_steps()} micro-batches), as it trained; to train at {configured}, start "
        "afresh in another run directory (or call set_train_batch_size in the script)")


def _held(client, log) -> dict:
    """What the node's manager can serve: old rank -> source -> steps ({} without a manager)."""
    if client is None:
        return {}
    try:
        return client.held()
    except BaftError as err:
        log(f"manager did not say what it holds ({err})")
        return {}


def _agree(mine: LocalPlan, stages: int) -> GlobalPlan:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return global_plan(everyone, stages)


def _everyone(ok: bool) -> bool:
    """Whether every rank is ``ok``: one failed load drops the step on all of them."""
    failed = torch.tensor([0 if ok else 1], dtype=torch.int64, device=collective_device())
    dist.all_reduce(failed)
    return failed.item() == 0


def _slowest(source: str) -> str:
    """The slowest of every rank's restore source: where the job's restore time went."""
    sources = [None] * dist.get_world_size()
    dist.all_gather_object(sources, source)
    return functools.reduce(slower, sources)


def _fresh_start(rank: int, saw_snapshot: bool, fresh_start, refused: list[str], log,
                 only_first: Optional[int] = None) -> None:
    """The rule for starting from step 0: allowed only where no rank saw a snapshot of this run, or only the run's
    first (``only_first``, its step), which some stages committed and others did not (a fault as it was committed:
    the run had no step to go back to but its start, as after a fault before any snapshot), or where
    ``fresh_start`` is ``"always"``; else a one-line error with every reason a snapshot was refused (said there
    alone, not also line by line before it)."""
    if saw_snapshot and only_first is not None and fresh_start is True and not refused:
        if rank == 0:
            log(f"the run's first snapshot, of step {only_first}, was committed by some stages and not others (a "
                f"fault as it was committed): starting again from step 0")
        return
    if saw_snapshot and fresh_start != "always":
        reasons = "; ".join(_everyones(refused)) or "no step was complete for every pipeline stage"
        raise BaftError(f"rank {rank}: this run has snapshots but none can be restored ({reasons}); refusing to "
                        f"start again from step 0. Set baft.fresh_start to \"always\" to drop them and start fresh, or "
                        f"train under another baft.run_id (baft train: another --run-dir)")
    for line in refused:
        log(line)
    if saw_snapshot:
        log("fresh_start is \"always\": snapshots of this run exist but none can be restored; starting from step 0")
    elif not fresh_start:
        raise BaftError("no snapshot of this run anywhere, and fresh_start is false")


def _everyones(lines: list[str]) -> list[str]:
    """Every rank's ``lines``, each once, in rank order (a collective): whichever rank's error stops the launch says
    why each rank refused (probe 21: on two nodes, rank 0's said no step was complete, and the damaged file rank 1
    read on the other node was named in no line on the screen)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lines)
    return list(dict.fromkeys(line for mine in everyone for line in mine))


def _load_shards(engine, root, client, step, offer, tensors, refused, run_id="") -> tuple[str, Optional[Shards]]:
    """Map and verify every reachable shard of this stage at ``step`` (``tensors``: this stage's): the slowest source
    it came from, and the shards, or None (the reasons appended to ``refused``). Nothing the engine trains with changes: the
    shards are only applied (:func:`_apply`) once every rank has loaded its own, so a failed attempt leaves
    no rank half-restored; the optimizer's empty state tensors are made where it has none yet (a first
    step not taken), for the shards to be checked against."""
    source, unserved = "memory", False
    for old_rank, _ in offer.pending:
        try:
            source = slower(source, client.restore(old_rank, step)["source"])
        except BaftError as err:
            refused.append(f"manager could not restore rank {old_rank} step {step}: {err}")
            unserved = True
    shards: Shards = {}  # verified in place, copied once by _apply
    fingerprint = model_signature(tensors)

    def mine(record: CommitRecord) -> bool:
        why = None
        if record.stage == engine.stage_id and record.model != fingerprint:
            differ = signature_difference(record.layout.tensors, tensors)
            why = (f"the snapshot of step {record.step} of stage {record.stage} is of another model (signature "
                   f"{record.model}, this model's is {fingerprint}{': ' + differ if differ else ''})")
        elif record.stage == engine.stage_id and run_id and record.run_id and record.run_id != run_id:
            # persisted by another run: under baft train a run's id is its directory's path, so a run directory
            # moved or copied elsewhere is another run (before, it resumed and its first snapshot was refused)
            why = (f"the snapshot of step {record.step} of stage {record.stage} is of run {record.run_id!r}, this "
                   f"run is {run_id!r} (baft train names a run by its directory's path: one moved or copied "
                   f"resumes only where it was)")
        if why is not None and why not in refused:
            refused.append(why)
        return record.stage == engine.stage_id and why is None
    for old_rank in slots.rank_ids(root):
        found = slots.map_verified(root, old_rank, step=step, log=refused.append, accept=mine)
        if found is not None and found[0].layout.shard not in shards:
            shards[found[0].layout.shard] = found
        elif found is not None:
            found[1].close()
    problem = _coverage_problem(engine, step, shards)
    if problem is None and shards:
        state.create_optimizer_state(engine, next(iter(shards.values()))[0].layout.tensors)
        problem = _fit_problem(engine, shards)
    if problem is not None:
        if shards or not unserved:  # none at all, where the manager's refusal above says why, needs no second line
            refused.append(problem)
        _close(shards)
        return source, None
    return source, shards


def shards_items(shards: dict, rank: int) -> dict:
    """The small items to restore: this rank's own record if it is here, else any shard's."""
    for record, _ in shards.values():
        if record.rank == rank:
            return record.items
    return next(iter(shards.values()))[0].items


def _close(shards: dict) -> None:
    for _, m in shards.values():
        m.close()
    shards.clear()


def _fit_problem(engine, shards: dict) -> Optional[str]:
    """Why the shards do not fit this rank's tensors, or None.

    Partitioned optimizer state (fp32 masters and moments under ZeRO-1 or bf16) is owned by one
    replica: it can only be restored with the same number of replicas, each from its own shard.
    """
    views = _views(engine, shards)
    dp, me = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    for record, _ in shards.values():
        owners = {t.name: t.owner for t in record.layout.tensors}
        if any(t.owner is not None and t.kind == "optimizer" for t in record.layout.tensors):
            if record.layout.num_shards != dp:
                return (f"snapshot of step {record.step} holds optimizer state partitioned over "
                        f"{record.layout.num_shards} data-parallel replicas (ZeRO-1 or bf16 master weights); "
                        f"this run has {dp}: restart with {record.layout.num_shards} replicas per stage")
            if me not in shards:
                return (f"snapshot of step {record.step}: shard {me}, this replica's optimizer partition, "
                        f"is not reachable from this node")
        for chunk in record.layout.chunks:
            target = views.get(chunk.tensor)
            if target is None and owners.get(chunk.tensor) not in (None, me):
                continue  # another replica's partition
            if target is None or chunk.start + chunk.nbytes > target.numel():
                return (f"snapshot of step {record.step} (rank {record.rank}) has tensor {chunk.tensor}, "
                        f"which this model does not have in that size")
    return None


def _coverage_problem(engine, step: int, shards: dict) -> Optional[str]:
    """None when this stage's replicas together hold every shard of ``step`` (a collective over the replicas)."""
    num_shards = next(iter(shards.values()))[0].layout.num_shards if shards else 0
    have = [sorted(shards)]
    if engine.grid.get_data_parallel_world_size() > 1:
        have = [None] * engine.grid.get_data_parallel_world_size()
        dist.all_gather_object(have, (sorted(shards), num_shards), group=engine.grid.get_data_parallel_group())
        num_shards = max(n for _, n in have)
        have = [h for h, _ in have]
    covered = set().union(*map(set, have))
    if not covered:  # what is there belongs to another model or stage, or failed its checksums (said above)
        return f"stage {engine.stage_id}: no snapshot of step {step} that fits this model"
    if covered != set(range(num_shards)):
        return (f"stage {engine.stage_id}: shards {sorted(covered)} of {num_shards} are reachable; the rest were "
                f"on other nodes and no replica of this stage holds them")
    return None


def _views(engine, shards: dict) -> dict:
    """This rank's tensors as a restore fills them, by the names the snapshot's chunks have: its module buffers
    as replica 0 named them too, where the snapshot had another number of replicas."""
    views = state.byte_views(engine)
    num_shards = next(iter(shards.values()))[0].layout.num_shards if shards else 1
    if num_shards != engine.grid.get_data_parallel_world_size():
        views.update(state.buffer_views(engine, 0, num_shards))
    return views


def _apply(engine, shards: dict) -> None:
    """Copy the shards into the engine's tensors; replicas broadcast the shards others lack (and, where the
    snapshot had another number of replicas, replica 0's module buffers)."""
    views = _views(engine, shards)
    for record, data in shards.values():
        source = torch.frombuffer(data, dtype=torch.uint8, count=record.layout.nbytes)
        for chunk in record.layout.chunks:
            if chunk.tensor in views:  # else another replica's partition (checked by _fit_problem)
                views[chunk.tensor][chunk.start:chunk.start + chunk.nbytes].copy_(
                    source[chunk.offset:chunk.offset + chunk.nbytes])
        del source  # the map can only close once no tensor views it
    dp = engine.grid.get_data_parallel_world_size()
    if dp == 1:
        return
    group = engine.grid.get_data_parallel_group()
    have = [None] * dp
    dist.all_gather_object(have, sorted(shards), group=group)
    ranks = dist.get_process_group_ranks(group)
    num_shards = max(max(h) + 1 for h in have if h)
    replicated = [e for e in state.tensor_entries(engine) if e.owner is None]  # each replica restored its own
    for shard in range(num_shards):
        holders = [i for i, h in enumerate(have) if shard in h]
        if len(holders) == dp:
            continue
        for chunk in plan_layout(replicated, shard=shard, num_shards=num_shards).chunks:
            dist.broadcast(views[chunk.tensor][chunk.start:chunk.start + chunk.nbytes], src=ranks[holders[0]],
                           group=group)
    if num_shards != dp:  # replica 0's buffers, from a holder of its shard, for every replica
        holder = ranks[next(i for i, h in enumerate(have) if 0 in h)]
        for view in state.buffer_views(engine, 0, num_shards).values():
            dist.broadcast(view, src=holder, group=group)
