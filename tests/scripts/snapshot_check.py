"""Train under --policy with an independent synchronous reference copy after every optimizer step.

After each iteration, the snapshot committed for the previous step is read back from shared
memory (checksums verified) and compared byte for byte with the reference taken right after
that step. Writes ``--out/rank<R>.json``: the steps checked and any mismatch.
With ``--kill-step S --kill-chunk N`` the rank ``--kill-rank`` SIGKILLs itself while copying
chunk N of step S's snapshot.
"""

import argparse
import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch

from baft.examples.worker import build, parse_args
from baft.pipeline.hook import InstructionHook
from baft.snapshot import copy, slots, state
from baft.snapshot.build import rank_node_root
from baft.snapshot.layout import CommitRecord

extra = argparse.ArgumentParser()
extra.add_argument("--out", required=True)
extra.add_argument("--kill-step", type=int, default=-1)
extra.add_argument("--kill-chunk", type=int, default=-1)
extra.add_argument("--kill-rank", type=int, default=0)
mine, rest = extra.parse_known_args()
args = parse_args(rest)
engine, data = build(args)
rank = engine.global_rank
root = rank_node_root(engine.baft.config, rank)

if rank == mine.kill_rank and mine.kill_step >= 0:
    original_copy = copy.Snapshot.copy

    def copy_then_die(self, *args, **kwargs):
        if self.step == mine.kill_step and len(self.source.layout.chunks) - len(self.pending) == mine.kill_chunk:
            os.kill(os.getpid(), signal.SIGKILL)
        return original_copy(self, *args, **kwargs)

    copy.Snapshot.copy = copy_then_die


class Reference(InstructionHook):
    """A synchronous copy of the state right after each optimizer step, and the check of the snapshots."""

    def __init__(self):
        self.reference = {}
        self.checked, self.mismatches = [], []

    def iteration_end(self, engine):
        step = engine.global_steps
        engine.baft.hooks.policy.drain()  # the snapshot of step - 1 is sealed off the trainer's path
        self.check(step - 1)
        self.reference[step] = ({k: v.detach().clone().reshape(-1).view(torch.uint8)
                                 for k, v in state.state_tensors(engine).items()},
                                {**state.capture_items(engine, data), **state.capture_rng()})

    def check(self, step):
        if step not in self.reference:
            return
        tensors, items = self.reference.pop(step)
        found = slots.load_verified(root, rank, step=step)
        if found is None:
            return
        record, buf = found
        view = memoryview(buf)
        for chunk in record.layout.chunks:
            got = view[chunk.offset:chunk.offset + chunk.nbytes]
            want = tensors[chunk.tensor][chunk.start:chunk.start + chunk.nbytes].numpy().tobytes()
            if bytes(got) != want:
                self.mismatches.append(f"step {step} chunk {chunk.index} ({chunk.tensor})")
        for key in ("rng", "counters", "data", "param_groups"):
            if record.items.get(key) != items.get(key):
                self.mismatches.append(f"step {step} item {key}")
        self.checked.append(step)


ref = Reference()
engine.baft.hooks.others.append(ref)
for _ in range(args.iters):
    engine.train_batch(data_iter=data)
policy = engine.baft.hooks.policy
plan = getattr(policy, "plan", None)
Path(mine.out, f"rank{rank}.json").write_text(json.dumps({
    "placement": {i: [c.nbytes for c in policy.source.layout.chunks[r.start:r.stop]]
                  for i, r in plan.placement().items()} if plan else None,
    "leftover_bytes": plan.leftover_bytes if plan else None,
    "bubble_bytes": dict(getattr(policy, "bubble_bytes", {})), "flushed_bytes": getattr(policy, "flushed_bytes", None),
    "checked": ref.checked, "mismatches": ref.mismatches, "root": root,
    "commits": policy.committed_steps, "stage": engine.stage_id,
    # a long run must not hold a commit record per step: at most those of the slots and the one in flight
    "live_records": sum(isinstance(o, CommitRecord) for o in gc.get_objects()),
    "chunks": [c.index for c in policy.source.layout.chunks],
    "total_chunks": policy.source.layout.total_chunks}))
sys.exit(0)
