"""Compare snapshot policies on one engine, interleaved: A B C … A B C …, so drift hits all alike.

Run on every rank (``baft compare`` launches it): the example GPT is built once, every
policy's hook is constructed up front, and each round runs a block of iterations under
each policy in turn. Rank 0 writes every iteration's wall time and stall (max over ranks)
to ``--out`` (JSON); :func:`summarize` turns that into medians and overhead ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from baft.config import BaftConfig
from baft.examples import worker
from baft.snapshot.baselines import DiskCheckpoint
from baft.snapshot.build import PlannedExecutor
from baft.snapshot.policies import SyncCopy, ThreadCopy

POLICIES = ("none", "sync-copy", "thread-copy", "baft", "torch-save", "deepspeed")


def make_hook(name: str, engine, data, scratch: Path, bubble_map: str | None):
    """The hook of one policy, snapshotting every iteration (baft: at the period its planner picks)."""
    root = str(scratch / name)
    if name == "none":
        return None
    if name == "sync-copy":
        return SyncCopy(root, period=1, data_iterator=data)
    if name == "thread-copy":
        return ThreadCopy(root, period=1, data_iterator=data)
    if name == "baft":
        return PlannedExecutor(BaftConfig(bubble_map=bubble_map), root, period=1, data_iterator=data)
    return DiskCheckpoint(name, str(scratch / f"{name}-disk"), 1, data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="baft-compare")
    p.add_argument("--policies", default="none,sync-copy,baft")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block", type=int, default=3, help="iterations per policy per round; the first is dropped")
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", required=True, help="directory for the policies' slots and checkpoints")
    ours, model_argv = p.parse_known_args(argv)
    args = worker.parse_args(model_argv)
    engine, data = worker.build(args)
    names = ours.policies.split(",")
    scratch = Path(ours.scratch)
    engine.train_batch(data_iter=data)  # the first step creates the optimizer state every policy snapshots
    hooks = {n: make_hook(n, engine, data, scratch, args.bubble_map) for n in names}
    rows = []
    for round_ in range(ours.rounds):
        for name in names:
            engine.baft_hooks = [hooks[name]] if hooks[name] is not None else []
            for i in range(ours.block):
                start = time.perf_counter()
                engine.train_batch(data_iter=data)
                wall = torch.tensor([time.perf_counter() - start, getattr(hooks[name], "stall", 0.0)])
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                rows.append({"policy": name, "round": round_, "warmup": i == 0, "wall": float(wall[0]),
                             "stall": float(wall[1]), "period": getattr(hooks[name], "period", 0)})
            if name in ("deepspeed", "torch-save"):
                shutil.rmtree(scratch / f"{name}-disk", ignore_errors=True)  # keep the disk from filling
    if engine.global_rank == 0:
        Path(ours.out).write_text(json.dumps(rows))
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """Per policy: median iteration and stall (warm-up iterations dropped), overhead versus ``none``."""
    by_policy: dict[str, list[dict]] = {}
    for row in rows:
        if not row["warmup"]:
            by_policy.setdefault(row["policy"], []).append(row)
    base = statistics.median(r["wall"] for r in by_policy["none"]) if "none" in by_policy else None
    out = []
    for name, its in by_policy.items():
        wall = statistics.median(r["wall"] for r in its)
        out.append({"policy": name, "iterations": len(its), "median_s": wall,
                    "stall_s": statistics.median(r["stall"] for r in its), "period": its[-1]["period"],
                    "overhead": wall / base - 1 if base else None})
    return out


def render(summary: list[dict]) -> str:
    lines = [f"{'policy':<12} {'period':>6} {'iters':>5} {'median iter':>12} {'stall':>9} {'overhead':>9}"]
    for s in summary:
        overhead = "" if s["overhead"] is None else f"{s['overhead']:+.1%}"
        lines.append(f"{s['policy']:<12} {s['period'] or '-':>6} {s['iterations']:>5} "
                     f"{s['median_s'] * 1e3:>9.1f} ms {s['stall_s'] * 1e3:>6.1f} ms {overhead:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
