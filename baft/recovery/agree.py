"""Agreement on the step: the newest step whose snapshots every pipeline stage can reach.

Each rank lists the steps of its stage it can reach — in this node's shared memory, or
through the node's manager from the parity group or from disk — and which data-parallel
shards each covers (:func:`local_offers`); after an all-gather every rank computes the same
answer from everyone's offers (:func:`newest_common`).
"""

from __future__ import annotations

from typing import Optional

from baft.snapshot import slots

SOURCES = ("memory", "parity", "disk")


def slower(a: str, b: str) -> str:
    """Of two restore sources, the slower one: it is where the job's restore time went."""
    return max(a, b, key=SOURCES.index)


def local_offers(root: str, stage: int, stages: int, fingerprint: str, held: dict) -> tuple[dict[int, dict], list]:
    """What this node can reach: step -> {"shards", "num_shards", "pending"}, and why others were passed over.

    ``pending`` lists (old rank, source) the node's manager can rebuild from parity or read
    from disk on request. The notes are (kind, text): "stages" for snapshots of another
    pipeline depth (fatal: the job cannot be resumed as launched), "model" for snapshots of
    another model (ignored).
    """
    offers: dict[int, dict] = {}
    notes = set()
    for old_rank in slots.rank_ids(root):
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


def newest_common(everyone: list[dict], stages: int) -> Optional[int]:
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
