"""Agreement on the step: the newest step whose snapshots every pipeline stage can reach.

In the manner of ``torch.distributed.checkpoint``'s planners: each rank makes a :class:`LocalPlan`
of what it can reach (:func:`local_plan`) — the steps of its stage in this node's shared memory,
or through the node's manager from the parity group or from disk, and which data-parallel shards
each covers; after an all-gather every rank computes the same :class:`GlobalPlan` from everyone's
(:func:`global_plan`). Both are plain data: the collectives are the caller's
(:mod:`baft.recovery.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from baft.snapshot import slots
from baft.snapshot.layout import signature_difference

SOURCES = ("memory", "parity", "disk")  # fastest first


def slower(a: str, b: str) -> str:
    """Of two restore sources, the slower one: it is where the job's restore time went."""
    return max(a, b, key=SOURCES.index)


@dataclass(frozen=True)
class Offer:
    """What one rank can reach of one step of its stage."""

    stage: int
    shards: frozenset[int] = frozenset()  # in this node's shared memory
    num_shards: Optional[int] = None  # None: only a manager holds the step
    pending: tuple[tuple[int, str], ...] = ()  # (old rank, "parity" or "disk") the manager can materialize


@dataclass(frozen=True)
class Note:
    """Why snapshots were passed over: ``"stages"`` (another pipeline depth: the job cannot resume as
    launched) or ``"model"`` (another model's: ignored)."""

    kind: str
    text: str


@dataclass(frozen=True)
class LocalPlan:
    """What one rank offers: its steps, its notes, and whether it saw any snapshot of the run at all."""

    offers: dict[int, Offer] = field(default_factory=dict)
    notes: tuple[Note, ...] = ()
    saw_snapshot: bool = False
    # of each snapshot of its stage this rank saw, its step where it is the run's first, else None
    firsts: frozenset = frozenset()


@dataclass(frozen=True)
class GlobalPlan:
    """What every rank agrees on: the step to load (None: none is whole), whether any rank saw a
    snapshot of this run, and the reason the job cannot resume as launched, if there is one."""

    step: Optional[int]
    saw_snapshot: bool
    fatal: Optional[str] = None
    # where no step is whole and every snapshot any rank saw is the run's first, of this step: a fault as it was
    # being committed, which some stages committed and others did not
    only_first: Optional[int] = None


def local_plan(root: str, stage: int, stages: int, fingerprint: str, held: dict, tried=frozenset(),
               refused=(), tensors=()) -> LocalPlan:
    """This rank's plan: the steps of ``stage`` it can reach under ``root`` or through its manager
    (``held``: the manager's answer, old rank -> source -> steps), less the steps ``tried`` before. ``tensors``: this
    stage's (:func:`~baft.snapshot.layout.model_signature`'s), to say how another model's snapshots differ."""
    found: dict[int, dict] = {}
    notes = set()
    firsts = set()  # the steps of the run's first snapshot seen, and None for any other
    for old_rank in slots.rank_ids(root):
        for info in slots.committed(root, old_rank):
            rec = info.record
            if rec.topology.get("pipe", stages) != stages:
                notes.add(Note("stages", f"{slots.rank_dir(root, old_rank)}: snapshots were taken with "
                                         f"{rec.topology['pipe']} pipeline stages, this run has {stages}; restart "
                                         f"with {rec.topology['pipe']} stages (any number of data-parallel replicas "
                                         f"works), or start fresh in a new run directory"))
            elif rec.stage == stage and rec.model != fingerprint:
                differ = signature_difference(rec.layout.tensors, tensors) if tensors else ""
                notes.add(Note("model", f"{slots.rank_dir(root, old_rank)}: ignoring snapshots of another model "
                                        f"(stage {stage} signature {rec.model}, this model's is {fingerprint}"
                                        f"{': ' + differ if differ else ''})"))
            elif rec.stage == stage:
                entry = found.setdefault(rec.step, {"shards": set(), "num_shards": rec.layout.num_shards})
                entry["shards"].add(rec.layout.shard)
                firsts.add(rec.step if rec.items.get("first") else None)
    for old_rank, sources in held.items():
        for source in SOURCES[1:]:
            for step in sources.get(source, []):
                found.setdefault(step, {"shards": set(), "num_shards": None}).setdefault("pending", []).append(
                    (int(old_rank), source))
    saw = bool(found or notes or refused or any(steps for sources in held.values() for steps in sources.values()))
    offers = {step: Offer(stage, frozenset(o["shards"]), o["num_shards"], tuple(o.get("pending", ())))
              for step, o in found.items() if step not in tried}
    if notes or refused or any(o.get("pending") for o in found.values()):
        firsts.add(None)
    return LocalPlan(offers, tuple(sorted(notes, key=lambda n: (n.kind, n.text))), saw, frozenset(firsts))


def global_plan(plans: list[LocalPlan], stages: int) -> GlobalPlan:
    """The same answer on every rank from everyone's plans: the newest step at which, for every stage, the
    ranks of that stage together reach every shard (a step a manager can materialize counts as whole)."""
    saw = any(plan.saw_snapshot for plan in plans)
    fatal = next((note.text for plan in plans for note in plan.notes if note.kind == "stages"), None)
    if fatal is not None:
        return GlobalPlan(None, saw, fatal)
    steps = set.intersection(*(set(plan.offers) for plan in plans)) if plans else set()
    for step in sorted(steps, reverse=True):
        if all(_whole([plan.offers[step] for plan in plans if plan.offers[step].stage == s]) for s in range(stages)):
            return GlobalPlan(step, saw)
    firsts = frozenset().union(*(plan.firsts for plan in plans))
    return GlobalPlan(None, saw, only_first=next(iter(firsts)) if len(firsts) == 1 else None)


def _whole(offers: list[Offer]) -> bool:
    if any(offer.pending for offer in offers):
        return True  # a manager will materialize it from parity or disk
    counts = {offer.num_shards for offer in offers}
    covered = frozenset().union(*(offer.shards for offer in offers))
    return len(counts) == 1 and bool(covered) and covered == set(range(counts.pop() or 0))
