"""Compare snapshot policies on one engine, interleaved, so drift of the machine hits them all alike.

Run on every rank (``baft compare`` launches it). The example GPT is built once, every
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
:data:`FIELDS`; ``policies`` with the period each ran at; ``snapshot_bytes``, one snapshot of
all ranks (the shared-memory state, or the files a disk baseline wrote); ``plans``, baft's
plan per rank. :func:`summarize` turns it into medians and overhead ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import RecvActivation, RecvGrad

from baft.accelerator import collective_device
from baft.config import POLICIES, BaftConfig
from baft.errors import BaftError
from baft.examples import worker
from baft.pipeline.hook import Hooks, InstructionHook
from baft.pipeline.profiler import sync_device
from baft.snapshot.baselines import DiskCheckpoint
from baft.snapshot.build import make_policy

# What every rank measures per iteration, in seconds or bytes: wall time of train_batch; the
# policy's stall; 1 if it took a snapshot; wall and CPU time in its callbacks on the trainer's
# thread (outside the bubbles); bytes copied inside the receive waits and flushed before the
# optimizer step (baft); time in receives (the bubbles, with any copy run inside them); and time
# the trainer's thread was runnable but waited for a CPU (other load on the machine); on a GPU, the
# device's wait at the fence for copies still running (the host's stall does not see it); how long
# the latest finished seal took (copies awaited, checksums, commit record), off the trainer's path, and
# the CPU time it took there.
FIELDS = ("wall", "stall", "fired", "hook_wall", "hook_cpu", "bubble_bytes", "flushed_bytes", "recv_wait",
          "run_delay", "fence_wait", "seal", "seal_cpu")
NEVER = 1 << 40  # a period no step reaches: the hook stays idle this iteration


def parse_policies(text: str) -> list[tuple[str, str, int | None]]:
    """``none,deepspeed/10,baft`` as (name, kind, period); period None: baft's planner chooses."""
    out = []
    for name in text.split(","):
        kind, _, period = name.partition("/")
        if kind not in POLICIES:
            raise BaftError(f"--policies: unknown policy {kind!r} (known: {', '.join(POLICIES)})")
        if period and not (period.isdigit() and int(period) >= 1):
            raise BaftError(f"--policies: {name!r}: the period after '/' must be a whole number of steps")
        out.append((name, kind, int(period) if period else (None if kind == "baft" else 1)))
    if len({n for n, _, _ in out}) < len(out):
        raise BaftError(f"--policies: {text!r} names a policy twice")
    return out


class Meter(InstructionHook):
    """Wraps a policy's hook (or none): times its callbacks on the trainer's thread, in wall and
    CPU seconds (which a busy machine does not inflate), and the waits for other stages (receives,
    the optimizer step's collectives). The same wrapper runs under ``none``, so its own cost is in
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

    def waited(self, engine, index, seconds):
        self.recv_wait += seconds
        if self.inner is not None:
            self.inner.waited(engine, index, seconds)

    def after(self, engine, index, cmd):
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            self.recv_wait += time.perf_counter() - self._recv_start
        if self.inner is not None:
            self._call(self.inner.after, engine, index, cmd)

    def iteration_end(self, engine):
        if self.inner is not None:
            self._call(self.inner.iteration_end, engine)
            wall, cpu = getattr(self.inner, "fence_at_update", (0.0, 0.0))  # inside the optimizer step, no callback
            self.wall, self.cpu = self.wall + wall, self.cpu + cpu


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


def snapshots_taken(hook) -> int:
    """Snapshots the policy has taken: copied in memory (still being sealed, maybe), or saved to disk."""
    return getattr(hook, "taken", len(getattr(hook, "saved", ())))


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


def measure(engine, data, meter: Meter) -> list[dict]:
    """One iteration under ``meter``'s policy: every rank's :data:`FIELDS`, gathered after the timed part."""
    hook, before, delay = meter.inner, snapshots_taken(meter.inner), schedstat()
    sync_device()  # on a GPU train_batch returns with work still queued: time the device's iteration
    start = time.perf_counter()
    engine.train_batch(data_iter=data)
    sync_device()
    wall = time.perf_counter() - start
    fired = snapshots_taken(hook) > before
    copied = float(sum(getattr(hook, "bubble_bytes", {}).values())) if fired else 0.0
    flushed = float(getattr(hook, "flushed_bytes", 0)) if fired else 0.0
    fence_wait = hook.fence_wait() if fired and hasattr(hook, "fence_wait") else 0.0
    sealer = getattr(hook, "sealer", None)
    seal, seal_cpu = (sealer.seconds, sealer.cpu_seconds) if sealer is not None else (0.0, 0.0)
    mine = torch.tensor([wall, getattr(hook, "stall", 0.0), float(fired), meter.wall, meter.cpu, copied, flushed,
                         meter.recv_wait, schedstat() - delay, fence_wait, seal, seal_cpu], dtype=torch.float64,
                        device=collective_device())
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(FIELDS, g.tolist())) for g in gathered]


def clear_disk(hook, saves: int) -> float | None:
    """After a disk baseline's block, untimed: let its last save land, then delete its files, so that
    neither slows the next block nor fills the disk. Rank 0 returns the bytes of one save (all ranks)."""
    if not isinstance(hook, DiskCheckpoint):
        return None
    hook.wait()  # for a DCP save still being written
    dist.barrier()
    nbytes = None
    if dist.get_rank() == 0 and hook.save_dir.exists():
        nbytes = sum(f.stat().st_size for f in hook.save_dir.rglob("*") if f.is_file()) / max(saves, 1)
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
            meter, saves = meters[name], snapshots_taken(meters[name].inner)
            engine.baft.hooks = Hooks(policy=meter)
            for j in range(ours.block):
                if periods[name] > 1:
                    meter.inner.period = 1 if j == ours.block - 1 else NEVER
                records.append({"policy": name, "round": round_, "block": block, "j": j,
                                "step": int(engine.global_steps), "ranks": measure(engine, data, meter)})
            nbytes = clear_disk(meter.inner, snapshots_taken(meter.inner) - saves)
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


def overhead(ratios: list[float], fired: list[bool], period: int, centre=statistics.median) -> float:
    """Overhead per iteration from iteration times over the baseline's: at period 1 their ``centre`` - 1;
    at period P, one snapshot iteration and P - 1 plain ones: ((snapshot - 1) + (P - 1)(plain - 1)) / P.
    The median suits a few rounds; the experiments, with hundreds, pass a tighter centre."""
    if period == 1 or not any(fired):
        return centre(ratios) - 1
    snap = [x for x, f in zip(ratios, fired) if f]
    plain = [x for x, f in zip(ratios, fired) if not f] or [1.0]
    return ((centre(snap) - 1) + (period - 1) * (centre(plain) - 1)) / period


def worst(rec: dict, field: str) -> float:
    """The largest of the ranks' ``field`` in one iteration's record (0 where a run before the field had none)."""
    return max(r.get(field, 0.0) for r in rec["ranks"])


def measured(rec: dict, block: int) -> bool:
    """Whether an iteration's record counts: in blocks of several, a block's first does not, as it still
    runs the previous block's work (a snapshot's seal outlives its iteration) and misses its own policy's."""
    return rec["j"] > 0 or block == 1


def summarize(doc: dict) -> list[dict]:
    """Per policy: median iteration (rank 0), and per snapshot the median stall and CPU time in the policy's
    callbacks (max over ranks); overhead versus ``none``'s median iteration. Blocks of several iterations
    drop their first."""
    by_policy: dict[str, list[dict]] = {}
    for rec in doc["records"]:
        if measured(rec, doc["block"]):
            by_policy.setdefault(rec["policy"], []).append(rec)
    none = by_policy.get("none")
    base = statistics.median(r["ranks"][0]["wall"] for r in none) if none else None
    out = []
    for policy in doc["policies"]:
        recs = by_policy[policy["name"]]
        fired = [bool(r["ranks"][0]["fired"]) for r in recs]
        snaps = [r for r, f in zip(recs, fired) if f] or recs
        wall = [r["ranks"][0]["wall"] for r in recs]
        out.append({"policy": policy["name"], "period": policy["period"], "iterations": len(recs),
                    "median_s": statistics.median(wall),
                    "stall_s": statistics.median(worst(r, "stall") for r in snaps),
                    "hook_cpu_s": statistics.median(worst(r, "hook_cpu") for r in snaps),
                    "fence_wait_s": statistics.median(worst(r, "fence_wait") for r in snaps),
                    "seal_s": statistics.median(worst(r, "seal") for r in snaps),
                    "seal_cpu_s": statistics.median(worst(r, "seal_cpu") for r in snaps),
                    "overhead": overhead([w / base for w in wall], fired, policy["period"]) if base else None})
    return out


def render(summary: list[dict]) -> str:
    """The summary as a plain-text table; on a GPU, with the device's wait at the fence."""
    device = any(s.get("fence_wait_s", 0.0) > 0 for s in summary)
    lines = [f"{'policy':<14} {'period':>6} {'iters':>5} {'median iter':>12} {'stall':>9} "
             + (f"{'device wait':>11} " if device else "") + f"{'CPU in hook':>11} {'overhead':>9}"]
    for s in summary:
        over = "" if s["overhead"] is None else f"{s['overhead']:+.1%}"
        period = s["period"] if s["policy"] != "none" else "-"
        wait = f"{s.get('fence_wait_s', 0.0) * 1e3:>8.1f} ms " if device else ""
        lines.append(f"{s['policy']:<14} {period:>6} {s['iterations']:>5} {s['median_s'] * 1e3:>9.1f} ms "
                     f"{s['stall_s'] * 1e3:>6.1f} ms {wait}{s['hook_cpu_s'] * 1e3:>8.1f} ms {over:>9}")
    return "\n".join(lines)


def launch_compare(model: dict, dp: int, policies: str, rounds: int, block: int, bubble_map, out,
                   none_between: bool = False, shuffle: bool = False) -> list[dict]:
    """``baft compare``: run this module on every rank of the example through torchrun; its :func:`summarize`."""
    from baft.cli.launch import flags, launch_env
    from baft.cli.runlog import run_example_logged

    parse_policies(policies)  # a bad name stops here, in one line, rather than on every rank
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="baft-compare-", dir=shm) as fast, \
            tempfile.TemporaryDirectory(prefix="baft-compare-") as disk:  # the disk baselines write to a disk
        result = Path(out) if out else Path(disk) / "compare.json"
        outcome = run_example_logged(model["stages"] * dp, [
            "baft.cli.compare", "--policies", policies, "--rounds", str(rounds), "--block", str(block),
            *(["--none-between"] if none_between else []), *(["--shuffle"] if shuffle else []),
            "--out", str(result), "--shm-dir", fast, "--disk-dir", disk, *flags({**model, "bubble_map": bubble_map})],
            launch_env(), result.with_suffix(".log"),
            announce=bool(out))  # a temporary log is gone when the command ends
        if outcome.code != 0 or not result.exists():
            raise BaftError(f"the comparison run failed ({outcome.reason()})")
        return summarize(json.loads(result.read_text()))


if __name__ == "__main__":
    sys.exit(main())
