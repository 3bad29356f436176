"""The restart hook: agree on the newest step every rank can restore, load it, and time the restart.

On every (re)start ``baft.initialize`` calls :func:`restore`. Each rank lists the steps whose
snapshots of its pipeline stage it can reach — in this node's shared memory (fastest), or
through the node's manager from the parity group or from disk — and which data-parallel
shards of the stage each covers. An all-gather lets every rank compute the same answer:
the newest step for which every stage's shards are all reachable. Each rank then loads its
stage's shards (verifying checksums), replicas of a stage exchange shards they lack, and
the small items (RNG, counters, LR scheduler, data position) are put back. If any rank
fails to load the chosen step, all ranks drop it and agree on the next one: the job never
resumes from a mix of steps.

Restart timings (T1 process restart, T2 process-group init, T3 state load, T4 warm-up,
T0 rollback) are recorded in :data:`clock` and written to ``RUN_DIR/recovery.jsonl`` by
rank 0 once the first resumed iteration completes.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from baft.errors import BaftError
from baft.pipeline.hooks import InstructionHook
from baft.snapshot import slots, state
from baft.snapshot.layout import CommitRecord, model_signature, plan_layout

clock: dict[str, float] = {"process_start": psutil.Process().create_time()}
SOURCES = ("memory", "parity", "disk")


def mark(name: str) -> None:
    """Record the wall time of a restart phase boundary (first call wins)."""
    clock.setdefault(name, time.time())


@dataclass
class Restored:
    step: int
    source: str
    shards: int
    refused: list[str] = field(default_factory=list)


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _slower(a: str, b: str) -> str:
    """Of two restore sources, the slower one: it is where the job's restore time went."""
    return max(a, b, key=SOURCES.index)


def _rank_ids(root) -> list[int]:
    return sorted(int(p.name[4:]) for p in Path(root).glob("rank*") if p.name[4:].isdigit())


def _local_offers(root: str, stage: int, stages: int, fingerprint: str, held: dict) -> tuple[dict[int, dict], list]:
    """What this node can reach: step -> {"shards", "num_shards", "pending"}, and why others were passed over.

    ``pending`` lists (old rank, source) the node's manager can rebuild from parity or read
    from disk on request. The notes are (kind, text): "stages" for snapshots of another
    pipeline depth (fatal: the job cannot be resumed as launched), "model" for snapshots of
    another model (ignored).
    """
    offers: dict[int, dict] = {}
    notes = set()
    for old_rank in _rank_ids(root):
        for info in slots.committed(root, old_rank):
            rec = info.record
            if rec.topology.get("pipe", stages) != stages:
                notes.add(("stages", f"{slots.rank_dir(root, old_rank)}: snapshots were taken with "
                                     f"{rec.topology['pipe']} pipeline stages, this run has {stages}; restart with "
                                     f"{rec.topology['pipe']} stages (any number of data-parallel replicas works), "
                                     f"or start fresh in a new run directory"))
            elif rec.stage == stage and rec.model != fingerprint:
                notes.add(("model", f"{slots.rank_dir(root, old_rank)}: ignoring snapshots of another model "
                                    f"(stage {stage} signature {rec.model}, this model's is {fingerprint})"))
            elif rec.stage == stage:
                entry = offers.setdefault(rec.step, {"shards": set(), "num_shards": rec.layout.num_shards})
                entry["shards"].add(rec.layout.shard)
    for old_rank, sources in held.items():
        for source in ("parity", "disk"):
            for step in sources.get(source, []):
                if step not in offers:
                    offers.setdefault(step, {"shards": set(), "num_shards": None})
                offers[step].setdefault("pending", []).append((int(old_rank), source))
    return offers, sorted(notes)


def restore(engine, root: str, client=None, data_iterator=None, fresh_start=True,
            log=print) -> Optional[Restored]:
    """Load the newest snapshot every rank can restore into ``engine``; None for a fresh start.

    A fresh start needs that no rank saw any snapshot of this run, or ``fresh_start="always"``:
    snapshots that exist but cannot be restored stop the job with the reason for each.
    """
    mark("restore_start")
    stage, rank = engine.stage_id, engine.global_rank
    fingerprint = model_signature(state.tensor_entries(engine))
    held = {}
    if client is not None:
        try:
            held = client.held()
        except BaftError as err:
            log(f"manager did not say what it holds ({err})")
    refused: list[str] = []
    tried: set[int] = set()
    found_any = False  # did any rank see a snapshot of this run (memory, parity, disk), restorable or not?
    while True:
        offers, notes = _local_offers(root, stage, engine.num_stages, fingerprint, held)
        mine = {step: {"stage": stage, "shards": sorted(o["shards"]), "num_shards": o["num_shards"],
                       "pending": bool(o.get("pending"))}
                for step, o in offers.items() if step not in tried}
        everyone = [None] * dist.get_world_size()
        saw_snapshot = bool(offers or notes or refused
                            or any(steps for sources in held.values() for steps in sources.values()))
        dist.all_gather_object(everyone, (mine, notes, saw_snapshot))
        found_any = found_any or any(saw for _, _, saw in everyone)
        fatal = next((text for _, rank_notes, _ in everyone for kind, text in rank_notes if kind == "stages"), None)
        if fatal:
            raise BaftError(fatal)  # on every rank alike: they all saw it in the gather
        if not tried:
            for kind, text in notes:
                log(text)
        step = _newest_common([offer for offer, _, _ in everyone], engine.num_stages)
        if step is None:
            break
        ok, source, shards = _try_load(engine, root, client, step, offers.get(step, {}), fingerprint, refused)
        flags = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flags)
        if flags.item() == 0:
            for line in refused:
                log(line)
            _apply(engine, shards)
            state.restore_items(engine, shards_items(shards, rank), data_iterator)
            count = len(shards)
            _close(shards)
            sources = [None] * dist.get_world_size()
            dist.all_gather_object(sources, source)
            mark("restore_end")
            return Restored(step, functools.reduce(_slower, sources), count, refused)
        _close(shards)
        tried.add(step)
        held = {}  # what the manager could not materialize, it will not on a second ask
    for line in refused:
        log(line)
    mark("restore_end")
    if found_any and fresh_start != "always":
        reasons = "; ".join(refused) or "no step was complete for every pipeline stage"
        raise BaftError(f"rank {rank}: this run has snapshots but none can be restored ({reasons}); refusing to "
                        f"start again from step 0. Set baft.fresh_start to \"always\" to drop them and start fresh")
    if found_any:
        log("fresh_start is \"always\": snapshots of this run exist but none can be restored; starting from step 0")
    elif not fresh_start:
        raise BaftError("no snapshot of this run anywhere, and fresh_start is false")
    return None


def _newest_common(everyone: list[dict], stages: int) -> Optional[int]:
    """The newest step at which, for every stage, the ranks of that stage together reach every shard."""
    steps = set.intersection(*(set(offers) for offers in everyone)) if everyone else set()
    for step in sorted(steps, reverse=True):
        complete = True
        for s in range(stages):
            entries = [o[step] for o in everyone if o[step]["stage"] == s]
            if any(e["pending"] for e in entries):
                continue  # a manager will materialize it from parity or disk; assume whole
            counts = {e["num_shards"] for e in entries}
            covered = set().union(*(set(e["shards"]) for e in entries))
            if len(counts) != 1 or covered != set(range(counts.pop() or 0)) or not covered:
                complete = False
                break
        if complete:
            return step
    return None


def _try_load(engine, root, client, step, offer, fingerprint, refused) -> tuple[bool, str, dict]:
    """Load and check every reachable shard of this stage at ``step``, changing nothing in the engine.

    Only when every rank succeeds are the shards applied (:func:`_apply`), so a failed attempt
    leaves no rank with a half-restored state.
    """
    source = "memory"
    for old_rank, pending_source in offer.get("pending", []):
        try:
            source = _slower(source, client.restore(old_rank, step)["source"])
        except BaftError as err:
            refused.append(f"manager could not restore rank {old_rank} step {step}: {err}")
    shards: dict[int, tuple[CommitRecord, mmap.mmap]] = {}  # verified in place, copied once by _apply
    mine = lambda record: record.stage == engine.stage_id and record.model == fingerprint  # noqa: E731
    for old_rank in _rank_ids(root):
        found = slots.map_verified(root, old_rank, step=step, log=refused.append, accept=mine)
        if found is not None and found[0].layout.shard not in shards:
            shards[found[0].layout.shard] = found
        elif found is not None:
            found[1].close()
    problem = _coverage_problem(engine, shards)
    if problem is None and shards:
        state.create_optimizer_state(engine, next(iter(shards.values()))[0].layout.tensors)
        problem = _fit_problem(engine, shards)
    if problem is not None:
        refused.append(problem)
    return problem is None, source, shards


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


def _views(engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().reshape(-1).view(torch.uint8) for name, t in state.state_tensors(engine).items()}


def _fit_problem(engine, shards: dict) -> Optional[str]:
    """Why the shards do not fit this rank's tensors, or None.

    Partitioned optimizer state (fp32 masters and moments under ZeRO-1 or bf16) is owned by one
    replica: it can only be restored with the same number of replicas, each from its own shard.
    """
    views = _views(engine)
    dp, me = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    for record, _ in shards.values():
        owners = {t.name: t.owner for t in record.layout.tensors}
        if any(o is not None for o in owners.values()):
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


def _coverage_problem(engine, shards: dict) -> Optional[str]:
    """None when this stage's replicas together hold every shard (a collective over the replicas)."""
    num_shards = next(iter(shards.values()))[0].layout.num_shards if shards else 0
    have = [sorted(shards)]
    if engine.grid.get_data_parallel_world_size() > 1:
        have = [None] * engine.grid.get_data_parallel_world_size()
        dist.all_gather_object(have, (sorted(shards), num_shards), group=engine.grid.get_data_parallel_group())
        num_shards = max(n for _, n in have)
        have = [h for h, _ in have]
    covered = set().union(*map(set, have))
    if not covered or covered != set(range(num_shards)):
        return (f"stage {engine.stage_id}: shards {sorted(covered)} of {num_shards} are reachable; the rest were "
                f"on other nodes and no replica of this stage holds them")
    return None


def _apply(engine, shards: dict) -> None:
    """Copy the shards into the engine's tensors; replicas broadcast the shards others lack."""
    views = _views(engine)
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
    entries = state.tensor_entries(engine)
    owned = {e.name for e in entries if e.owner is not None}  # each replica restored its own partitions
    for shard in range(num_shards):
        holders = [i for i, h in enumerate(have) if shard in h]
        if len(holders) == dp:
            continue
        for chunk in plan_layout(entries, shard=shard, num_shards=num_shards).chunks:
            if chunk.tensor in owned:
                continue
            dist.broadcast(views[chunk.tensor][chunk.start:chunk.start + chunk.nbytes], src=ranks[holders[0]],
                           group=group)


class RecoveryReport(InstructionHook):
    """After the first resumed iteration: T0..T4 of this restart, printed and appended to recovery.jsonl."""

    def __init__(self, restored: Optional[Restored], run_dir: Optional[str]):
        self.restored, self.run_dir, self.done = restored, run_dir, False

    def iteration_end(self, engine):
        if self.done:
            return
        self.done = True
        mark("first_iteration_end")
        if engine.global_rank != 0 or restart_count() == 0 or self.run_dir is None:
            return
        record = recovery_record(self.restored, Path(self.run_dir))
        with open(Path(self.run_dir) / "recovery.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print("baft: recovered " + "  ".join(f"{k} {record[k]:.2f}s" for k in ("T0", "T1", "T2", "T3", "T4", "total"))
              + f"  from step {record['restored_step']} ({record['source']})", flush=True)


def _last_progress(run_dir: Path) -> dict[int, float]:
    """step -> wall time it completed, from losses.jsonl (every attempt so far)."""
    done = {}
    path = run_dir / "losses.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["step"]] = rec["time"]
            except (ValueError, KeyError):
                continue
    return done


def _fault(run_dir: Path) -> dict:
    """The newest injected fault (chaos.jsonl), if the run has one for this restart."""
    path = run_dir / "chaos.jsonl"
    faults = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    faults = [f for f in faults if f.get("restart") == restart_count() - 1]
    return faults[-1] if faults else {}


def recovery_record(restored: Optional[Restored], run_dir: Path) -> dict:
    progress = _last_progress(run_dir)
    fault = _fault(run_dir)
    failed_at = fault.get("time") or (max(progress.values()) if progress else clock["process_start"])
    step = restored.step if restored else 0
    since = progress.get(step, failed_at)
    t = {
        "T0": max(0.0, failed_at - since),
        "T1": clock.get("init_start", clock["process_start"]) - failed_at,  # restart, interpreter, imports
        "T2": clock.get("init_end", 0) - clock.get("init_start", 0),
        "T3": clock["restore_end"] - clock["restore_start"],
        "T4": clock["first_iteration_end"] - clock["restore_end"],
    }
    return {"restart": restart_count(), "fault": fault.get("what", "process exit"), "killed_at": fault.get("time"),
            "restored_step": step, "source": restored.source if restored else "fresh",
            "lost_steps": max(progress, default=step) - step, **t, "total": sum(t.values())}
