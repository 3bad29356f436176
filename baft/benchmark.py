"""The per-rank worker of ``baft compare``: snapshot policies on one engine, interleaved, so drift of the
machine hits them all alike.

Run on every rank (``baft compare`` launches ``python -m baft.benchmark``). The example GPT is built once, every
policy's hook is constructed up front and run untimed until it is ready (baft: until it has
planned); then each round runs a block of iterations under each policy in turn: A B C, or,
with ``--none-between``, none A none B none C, so that every block has a baseline measured
just before and just after it; with ``--shuffle`` the policies' order is drawn anew every round,
so that no policy always follows the same one.

A policy is ``KIND`` or ``KIND/PERIOD`` (``deepspeed/10``). Without a period a policy
snapshots every iteration, except ``baft``, whose planner picks its period. A policy whose
period P is over 1 snapshots in the last iteration of each of its blocks only, and
:func:`overhead` amortizes that iteration over P.

Rank 0 writes the run to ``--out`` (JSON): ``records``, one per iteration with every rank's
:class:`RankRecord`; ``policies`` with the period each ran at; ``snapshot_bytes``, one snapshot of
all ranks (the shared-memory state, or the files a disk baseline wrote); ``plans``, baft's
plan per rank. :func:`baft.cli.compare.summarize` turns it into medians and overhead ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import RecvActivation, RecvGrad

from baft.accelerator import collective_device
from baft.config import BaftConfig, parse_policies
from baft.examples import worker
from baft.pipeline.hook import Hooks, InstructionHook
from baft.pipeline.profiler import sync_device
from baft.snapshot.baselines import KEEP, DiskCheckpoint
from baft.snapshot.build import make_policy
from baft.snapshot.metrics import PolicyMetrics


@dataclass(frozen=True)
class RankRecord:
    """What one rank measures in one iteration, in seconds or bytes: wall time of ``train_batch``; the
    policy's stall; 1 if it took a snapshot; wall and CPU time in its callbacks on the trainer's thread
    (outside the bubbles); bytes copied inside the waits and flushed before the optimizer step; time in
    receives and the optimizer step's collectives (the bubbles, with any copy run inside them); time the
    trainer's thread was runnable but waited for a CPU (other load on the machine); on a GPU, the device's
    wait at the fence for copies still running (the host's stall does not see it); the latest finished
    seal's time, and its CPU time, off the trainer's path; the part of the stall spent waiting for a slot a
    seal still held."""

    wall: float
    stall: float
    fired: float
    hook_wall: float
    hook_cpu: float
    bubble_bytes: float
    flushed_bytes: float
    recv_wait: float
    run_delay: float
    fence_wait: float
    seal: float
    seal_cpu: float
    seal_wait: float


class Meter(InstructionHook):
    """Wraps a policy's hook (or none): times its callbacks on the trainer's thread, in wall and
    CPU seconds (which a busy machine does not inflate), and the waits for other stages (receives,
    the optimizer step's wait for them). The same wrapper runs under ``none``, so its own cost is in
    the baseline too."""

    def __init__(self, inner=None):
        self.inner = inner
        self.wall = self.cpu = self.recv_wait = self._recv_start = 0.0

    def _call(self, fn, *args) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        fn(*args)
        self.cpu += time.thread_time() - cpu
        self.wall += time.perf_counter() - wall

    def iteration_start(self, engine):
        self.wall = self.cpu = self.recv_wait = 0.0
        if self.inner is not None:
            self._call(self.inner.iteration_start, engine)

    def before(self, engine, index, cmd):
        if self.inner is not None:
            self._call(self.inner.before, engine, index, cmd)
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            self._recv_start = time.perf_counter()

    def bubble(self, engine, index, cmd):
        return self.inner.bubble(engine, index, cmd) if self.inner is not None else None

    def before_update(self, engine, index, waited):
        self.recv_wait += waited or 0.0
        if self.inner is not None:
            self._call(self.inner.before_update, engine, index, waited)

    def after(self, engine, index, cmd):
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            self.recv_wait += time.perf_counter() - self._recv_start
        if self.inner is not None:
            self._call(self.inner.after, engine, index, cmd)

    def iteration_end(self, engine):
        if self.inner is not None:
            self._call(self.inner.iteration_end, engine)


def make_hook(policy: tuple, engine, data, ours: argparse.Namespace, model: argparse.Namespace):
    """The hook of one :func:`parse_policies` entry, as :func:`~baft.snapshot.build.make_policy` builds it."""
    name, kind, period = policy
    if kind == "none":
        return None
    own = name.replace("/", "-")
    cfg = BaftConfig(policy=kind, period=period or "auto", bubble_map=model.bubble_map, executor=model.executor,
                     leftovers=model.leftovers, shm_root=ours.shm_dir, run_id=own,
                     save_dir=str(Path(ours.disk_dir) / own))
    return make_policy(engine, cfg, data)


def policy_metrics(hook) -> PolicyMetrics:
    """The policy's counters, or none's (no hook)."""
    return hook.metrics() if hook is not None else PolicyMetrics()


def set_up(engine, data, meter: Meter) -> None:
    """Run the policy untimed until it is ready (baft: planned; its slots are mapped pre-faulted)."""
    engine.baft.hooks = Hooks(policy=meter)
    for _ in range(4):
        engine.train_batch(data_iter=data)
        if getattr(meter.inner, "planned", True):
            break


def schedstat() -> float:
    """Seconds the calling thread was runnable but waited for a CPU, from the kernel (0 where unknown)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def timed_batch(engine, data) -> float:
    """Seconds of one ``train_batch``, the device's work included (on a GPU it returns with work still queued)."""
    sync_device()
    start = time.perf_counter()
    engine.train_batch(data_iter=data)
    sync_device()
    return time.perf_counter() - start


def measure(engine, data, meter: Meter) -> list[dict]:
    """One iteration under ``meter``'s policy: every rank's :class:`RankRecord`, gathered after the timed part."""
    delay = schedstat()
    wall = timed_batch(engine, data)
    done = policy_metrics(meter.inner)
    fired = done.snapshotted
    mine = RankRecord(wall=wall, stall=done.stall, fired=float(fired), hook_wall=meter.wall, hook_cpu=meter.cpu,
                      bubble_bytes=float(done.bubble_bytes) if fired else 0.0,
                      flushed_bytes=float(done.flushed_bytes) if fired else 0.0, recv_wait=meter.recv_wait,
                      run_delay=schedstat() - delay, fence_wait=done.fence_wait, seal=done.seal,
                      seal_cpu=done.seal_cpu, seal_wait=done.seal_wait)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, asdict(mine))
    return gathered


def clear_disk(hook, saves: int) -> float | None:
    """After a disk baseline's block, untimed: let its last save land, then delete its files, so that
    neither slows the next block nor fills the disk. Rank 0 returns the bytes of one save (all ranks)."""
    if not isinstance(hook, DiskCheckpoint):
        return None
    hook.wait()  # for a DCP save still being written
    dist.barrier()
    nbytes = None
    if dist.get_rank() == 0 and hook.save_dir.exists():
        kept = max(min(saves, KEEP), 1)  # the hook keeps its newest KEEP saves
        nbytes = sum(f.stat().st_size for f in hook.save_dir.rglob("*") if f.is_file()) / kept
        shutil.rmtree(hook.save_dir)
    dist.barrier()
    return nbytes


def block_order(names: list[str], none_between: bool, shuffle_seed: int | None = None) -> list[str]:
    """The policies' blocks of one round; with ``shuffle_seed``, the policies in an order drawn from
    it (every rank draws the same), so that none keeps one place in every round."""
    arms = [n for n in names if n != "none"] if none_between else list(names)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(arms)
    return [n for name in arms for n in ("none", name)] if none_between else arms


def state_bytes(hooks: dict) -> dict:
    """Bytes of one in-memory snapshot per policy, summed over the ranks."""
    names = [n for n, h in hooks.items() if getattr(h, "source", None) is not None]
    mine = torch.tensor([float(hooks[n].source.layout.nbytes) for n in names], dtype=torch.float64,
                        device=collective_device())
    dist.all_reduce(mine)
    return dict(zip(names, mine.tolist()))


def plans(engine, hooks: dict) -> dict:
    """baft's plan per rank, for every planned policy: what its bubbles hold and what is left to flush."""
    mine = {}
    for name, hook in hooks.items():
        plan = getattr(hook, "plan", None)
        if plan is not None:
            mine[name] = {"rank": engine.global_rank, "stage": engine.stage_id, "bandwidth": plan.bandwidth,
                          "bubble_time": plan.bubble_time, "nbytes": plan.nbytes, "leftover_bytes": plan.leftover_bytes,
                          "source": hook.plan_source}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: [rank[name] for rank in every] for name in mine}


def parameters(engine) -> int:
    """Parameters of the whole model, every stage's."""
    mine = torch.tensor([float(sum(p.numel() for p in engine.module.parameters()))], device=collective_device())
    dist.all_reduce(mine)
    return int(mine.item())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baft-compare")
    p.add_argument("--policies", default="none,sync-copy,baft")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block", type=int, default=3, help="iterations per policy per round")
    p.add_argument("--none-between", action="store_true", help="run none between every two policies' blocks")
    p.add_argument("--shuffle", action="store_true", help="a new order of the policies' blocks every round")
    p.add_argument("--out", required=True)
    p.add_argument("--shm-dir", required=True, help="shared-memory directory for the in-memory policies' slots")
    p.add_argument("--disk-dir", required=True, help="directory on disk for the disk baselines' checkpoints")
    return p


def run_rounds(engine, data, meters: dict, periods: dict, names: list[str], ours) -> tuple[list, dict]:
    """The timed part: ``ours.rounds`` rounds of the policies' blocks (:func:`block_order`); the records and
    the disk baselines' bytes."""
    records, disk_bytes, started = [], {}, time.time()
    for round_ in range(ours.rounds):
        order = block_order(names, ours.none_between, round_ if ours.shuffle else None)
        for block, name in enumerate(order, start=round_ * len(order)):
            meter, saves = meters[name], policy_metrics(meters[name].inner).snapshots
            engine.baft.hooks = Hooks(policy=meter)
            for j in range(ours.block):
                if periods[name] > 1:  # one snapshot a block, in its last iteration
                    meter.inner.snapshot_now = j == ours.block - 1
                records.append({"policy": name, "round": round_, "block": block, "j": j,
                                "step": int(engine.global_steps), "ranks": measure(engine, data, meter)})
            nbytes = clear_disk(meter.inner, policy_metrics(meter.inner).snapshots - saves)
            if nbytes is not None:
                disk_bytes[name] = nbytes
        if engine.global_rank == 0:
            spent = time.time() - started
            print(f"compare: round {round_ + 1}/{ours.rounds} done in {spent / 60:.1f} min, "
                  f"about {spent / (round_ + 1) * (ours.rounds - round_ - 1) / 60:.1f} min left", flush=True)
    return records, disk_bytes


def main(argv=None) -> int:
    ours, model_argv = parser().parse_known_args(argv)
    args = worker.parse_args(model_argv)
    engine, data = worker.build(args)
    policies = parse_policies(ours.policies)
    if ours.none_between and "none" not in [name for name, _, _ in policies]:
        policies.insert(0, ("none", "none", 1))
    engine.train_batch(data_iter=data)  # the first step creates the optimizer state every policy snapshots
    meters = {p[0]: Meter(make_hook(p, engine, data, ours, args)) for p in policies}
    for meter in meters.values():
        set_up(engine, data, meter)
    periods = {name: getattr(m.inner, "period", 1) for name, m in meters.items()}  # baft's: its planner's
    hooks = {name: m.inner for name, m in meters.items() if m.inner is not None}
    started = time.time()
    records, disk_bytes = run_rounds(engine, data, meters, periods, [name for name, _, _ in policies], ours)
    doc = {"policies": [{"name": n, "kind": k, "period": periods[n]} for n, k, _ in policies],
           "rounds": ours.rounds, "block": ours.block, "none_between": ours.none_between, "shuffle": ours.shuffle,
           "world": dist.get_world_size(), "parameters": parameters(engine), "elapsed_s": time.time() - started,
           "snapshot_bytes": {**state_bytes(hooks), **disk_bytes}, "plans": plans(engine, hooks), "records": records}
    for hook in hooks.values():
        hook.close()
    engine.baft.hooks = Hooks()
    if engine.global_rank == 0:
        Path(ours.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
