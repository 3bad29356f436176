"""Runs on every rank of the overhead experiment (launched by ``experiments/overhead.py``).

Builds the example GPT pipeline ONCE, constructs every policy hook up front, then cycles
the policies A B C ... A B C ... in blocks of ``--iters`` iterations per round by setting
``engine.baft_hooks``, so machine drift hits every policy alike. After every iteration
the ranks exchange their per-iteration figures (outside the timed region); rank 0 writes
them all to ``--raw-out`` (JSON) for the driver to analyse.

Arguments it does not know are handed to ``baft.examples.worker.parse_args`` (the model options).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import RecvActivation, RecvGrad

from baft.config import BaftConfig
from baft.examples import worker
from baft.pipeline.hooks import InstructionHook
from baft.snapshot import state
from baft.snapshot.baselines import DiskCheckpoint
from baft.snapshot.build import PlannedExecutor
from baft.snapshot.copy import Snapshot
from baft.snapshot.layout import checksum
from baft.snapshot.policies import SnapshotPolicy, SyncCopy, ThreadCopy
from baft.snapshot.slots import read_slots

# name, kind, period ("auto": the planner's)
POLICIES = [
    ("none", "none", 1),
    ("deepspeed", "deepspeed", 1),
    ("deepspeed/10", "deepspeed", 10),
    ("torch-save", "torch-save", 1),
    ("sync-copy", "sync-copy", 1),
    ("thread-copy", "thread-copy", 1),
    ("dcp-async", "dcp-async", 1),
    ("baft", "baft", "auto"),
]

# per-iteration figures every rank contributes (one float64 each)
FIELDS = ("wall", "stall", "fired", "bubble_bytes", "flushed_bytes", "recv_wait", "t_start", "t_instr", "t_end",
          "run_delay", "cpu", "cpu_hook")
NEVER = 1 << 40  # a period no step reaches: the hook stays idle this iteration


class Meter(InstructionHook):
    """Wraps the policy's hook: times the receives (the bubbles, plus any copy run inside them) and
    the policy's own callbacks on the trainer's thread (iteration start, around instructions, end),
    in wall-clock seconds and in the thread's CPU seconds (which a busy machine does not inflate).

    The same wrapper (around no hook) runs under ``none``, so its own cost is in the baseline too.
    """

    def __init__(self, inner=None):
        self.inner = inner
        self.recv_wait = self.t_start = self.t_instr = self.t_end = self.cpu_hook = 0.0
        self._recv_start = 0.0

    def _call(self, fn, *args) -> float:
        wall, cpu = time.perf_counter(), time.thread_time()
        fn(*args)
        self.cpu_hook += time.thread_time() - cpu
        return time.perf_counter() - wall

    def iteration_start(self, engine):
        self.recv_wait = self.t_start = self.t_instr = self.t_end = self.cpu_hook = 0.0
        if self.inner is not None:
            self.t_start = self._call(self.inner.iteration_start, engine)

    def before(self, engine, index, cmd):
        if self.inner is not None:
            self.t_instr += self._call(self.inner.before, engine, index, cmd)
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            self._recv_start = time.perf_counter()

    def bubble(self, engine, index, cmd):
        return self.inner.bubble(engine, index, cmd) if self.inner is not None else None

    def after(self, engine, index, cmd):
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            self.recv_wait += time.perf_counter() - self._recv_start
        if self.inner is not None:
            self.t_instr += self._call(self.inner.after, engine, index, cmd)

    def iteration_end(self, engine):
        if self.inner is not None:
            self.t_end = self._call(self.inner.iteration_end, engine)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="overhead_worker")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=4, help="iterations per policy per round (the first is warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="iterations without any policy before setting up the policies")
    p.add_argument("--bubble-map", required=True)
    p.add_argument("--raw-out", required=True)
    p.add_argument("--tmp-dir", required=True, help="disk directory for the disk-checkpoint baselines")
    p.add_argument("--shm-dir", required=True, help="shared-memory directory for the in-memory policies")
    p.add_argument("--policies", default=",".join(name for name, _, _ in POLICIES))
    ours, model_argv = p.parse_known_args(argv)
    return ours, worker.parse_args(model_argv)


def make_hooks(names, engine, data, ours, model_args):
    """Every policy's hook, constructed before the first timed iteration."""
    hooks, periods = {}, {}
    for name, kind, period in POLICIES:
        if name not in names:
            continue
        safe = name.replace("/", "-")
        shm = str(Path(ours.shm_dir) / safe)
        disk = str(Path(ours.tmp_dir) / safe)
        if kind == "none":
            hook = None
        elif kind == "baft":
            cfg = BaftConfig(policy="baft", schedule=model_args.schedule, bubble_map=ours.bubble_map,
                             shm_root=ours.shm_dir, run_id=safe)
            hook = PlannedExecutor(cfg, shm, period=1, data_iterator=data)
        elif kind == "sync-copy":
            hook = SyncCopy(shm, period=1, data_iterator=data)
        elif kind == "thread-copy":
            hook = ThreadCopy(shm, period=1, data_iterator=data)
        else:
            hook = DiskCheckpoint(kind, disk, period if isinstance(period, int) else 1, data)
        hooks[name], periods[name] = hook, period
    return hooks, periods


def prefault(hook, engine) -> None:
    """Lay out the state and touch every page of the shared-memory slots now, not in a timed iteration."""
    if isinstance(hook, SnapshotPolicy) and not isinstance(hook, PlannedExecutor):
        hook.prepare(engine)
    if isinstance(hook, SnapshotPolicy) and hook.writer is not None:
        for buf in hook.writer.buffers:
            buf.zero_()


_STEP = re.compile(r"(?:global_step|step)(\d+)")


def rotate(directory: Path, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` saved steps in a disk baseline's directory (untimed)."""
    if not directory.is_dir():
        return
    by_step = {}
    for entry in directory.iterdir():
        m = _STEP.match(entry.name)
        if m:
            by_step.setdefault(int(m.group(1)), []).append(entry)
    for step in sorted(by_step)[:-keep]:
        for entry in by_step[step]:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def newest_bytes(directory: Path) -> int:
    """Bytes of the newest saved step in a disk baseline's directory (every rank's files)."""
    if not directory.is_dir():
        return 0
    by_step = {}
    for entry in directory.iterdir():
        m = _STEP.match(entry.name)
        if m:
            by_step.setdefault(int(m.group(1)), []).append(entry)
    if not by_step:
        return 0
    total = 0
    for entry in by_step[max(by_step)]:
        if entry.is_dir():
            total += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        else:
            total += entry.stat().st_size
    return total


def fired_count(hook) -> int:
    if hook is None:
        return 0
    if isinstance(hook, DiskCheckpoint):
        return len(hook.saved)
    return len(hook.commits)


def drain(hook) -> float:
    """After a disk baseline's block, untimed: wait for a dcp-async save still running in the background
    and write the dirty page cache back (``sync``), so neither slows the next policy's block."""
    if not isinstance(hook, DiskCheckpoint):
        return 0.0
    start = time.perf_counter()
    if hook.pending is not None:
        hook.pending.result()
        hook.pending = None
    os.sync()
    return time.perf_counter() - start


def schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread, from the kernel."""
    try:
        cpu, delay, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(cpu) / 1e9, int(delay) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _median_time(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def microbench(engine, data, hook) -> dict:
    """Untimed costs behind a snapshot, on this rank: what the trainer's thread pays per snapshot
    outside the bubbles, and the raw copy and checksum rates."""
    out = {}
    out["capture_items_s"] = _median_time(lambda: state.capture_items(engine, data))
    if isinstance(hook, SnapshotPolicy) and hook.writer is not None:
        writer = hook.writer
        out["read_slots_s"] = _median_time(lambda: read_slots(writer.directory))
        if hook.commits:
            # the store's own begin (picks a slot: reads every commit record) and commit (writes one), as
            # every snapshot pays them; the slots' contents no longer matter once the run is over
            record = hook.commits[-1]
            begins, commits = [], []
            for _ in range(7):
                t0 = time.perf_counter()
                writer.begin(record.step)
                t1 = time.perf_counter()
                path = writer.commit(record)
                commits.append(time.perf_counter() - t1)
                begins.append(t1 - t0)
            out["begin_s"], out["commit_s"] = statistics.median(begins), statistics.median(commits)
            out["commit_file_bytes"] = path.stat().st_size
            out["commit_to_json_s"] = _median_time(record.to_json)
            out["items_json_bytes"] = len(json.dumps(record.items))
        out["snapshot_cycle"] = snapshot_cycle(engine, data, hook)
        source, buf = hook.source, hook.writer.buffers[0]
        chunks = source.layout.chunks

        def copy_all():
            for c in chunks:
                buf[c.offset:c.offset + c.nbytes].copy_(source.view(c))

        def checksum_all():
            for c in chunks:
                checksum(buf[c.offset:c.offset + c.nbytes].numpy())

        nbytes = source.layout.nbytes
        out["state_bytes"] = nbytes
        out["copy_s"] = _median_time(copy_all, 3)
        out["checksum_s"] = _median_time(checksum_all, 3)
        out["copy_GBps"] = nbytes / out["copy_s"] / 1e9
        out["checksum_GBps"] = nbytes / out["checksum_s"] / 1e9
    return out


def snapshot_cycle(engine, data, hook, repeats: int = 7) -> dict:
    """Thread CPU seconds of each piece of one snapshot that runs on the trainer's thread outside the bubbles,
    replaying the executor's own calls: due(), capture_items, Snapshot() (SnapshotWriter.begin), and finish()
    (CommitRecord + SnapshotWriter.commit) once every chunk is in; the bubble copy itself is left out."""
    parts = {"due": [], "capture_items": [], "Snapshot() incl. begin": [], "finish (commit)": []}
    for _ in range(repeats):
        c0 = time.thread_time()
        hook.due(engine)
        c1 = time.thread_time()
        items = state.capture_items(engine, data)
        c2 = time.thread_time()
        snap = Snapshot(hook.source, hook.writer, engine.global_steps, items, None)
        c3 = time.thread_time()
        snap.copy_while(lambda: True)
        hook.snapshot = snap
        c4 = time.thread_time()
        hook.finish()
        c5 = time.thread_time()
        for key, dt in zip(parts, (c1 - c0, c2 - c1, c3 - c2, c5 - c4)):
            parts[key].append(dt)
    return {k: statistics.median(v) for k, v in parts.items()}


def interference(engine, hook, d: int, rounds: int = 9) -> dict:
    """Does a copy on one rank slow the other rank's compute (shared memory bandwidth, caches)?

    Rank ``who`` times a fixed matmul workload shaped like the example's MLP (512 tokens) while
    the other rank either idles in a barrier or copies its state chunk by chunk into a host buffer,
    for longer than the workload runs; then the roles swap, ``rounds`` times. Returns this rank's
    median seconds per workload alone and beside the other rank's copy, the median of the paired
    ratios, and how much the workload alone spreads from one timing to the next (the machine's own
    noise: 10th to 90th percentile over the median).
    """
    rank = engine.global_rank
    x, w1, w2 = torch.randn(512, d), torch.randn(d, 4 * d), torch.randn(4 * d, d)

    def work():
        for _ in range(20):
            torch.relu(x @ w1) @ w2

    work()
    samples, budget = {"alone": [], "beside_copy": []}, torch.zeros(1)
    for _ in range(rounds):  # alternate, so drift of the machine hits both alike
        for mode in ("alone", "beside_copy"):
            for who in range(dist.get_world_size()):
                dist.barrier()
                if rank == who:
                    samples[mode].append(_median_time(work, 3))
                    budget[0] = samples[mode][-1] * 3 * 1.5 + 0.2
                elif mode == "beside_copy" and isinstance(hook, SnapshotPolicy) and hook.source is not None:
                    source, buf, chunks = hook.source, hook.writer.buffers[1], hook.source.layout.chunks
                    end, i = time.perf_counter() + float(budget_of[who]), 0
                    while time.perf_counter() < end:
                        c = chunks[i % len(chunks)]
                        buf[c.offset:c.offset + c.nbytes].copy_(source.view(c))
                        i += 1
                if mode == "alone":
                    dist.broadcast(budget, src=who)
                    budget_of[who] = float(budget.item())
                dist.barrier()
    alone = sorted(samples["alone"])
    return {**{mode: statistics.median(v) for mode, v in samples.items()},
            "paired": statistics.median(b / a - 1 for a, b in zip(samples["alone"], samples["beside_copy"])),
            "alone_spread": (alone[int(0.9 * (len(alone) - 1))] - alone[int(0.1 * (len(alone) - 1))])
            / statistics.median(alone), "rounds": rounds}


budget_of: dict = {}


def main(argv=None) -> int:
    ours, model_args = parse_args(argv)
    engine, data = worker.build(model_args)
    rank, world = engine.global_rank, dist.get_world_size()
    lead = rank == 0
    names = [n for n in ours.policies.split(",") if n]
    idle = Meter()

    def say(msg):
        if lead:
            print(f"[overhead] {msg}", flush=True)

    engine.baft_hooks = [idle]
    for i in range(ours.warmup):
        start = time.perf_counter()
        engine.train_batch(data_iter=data)
        say(f"warm-up iteration {i + 1}/{ours.warmup}: {time.perf_counter() - start:.2f} s")

    hooks, periods = make_hooks(names, engine, data, ours, model_args)
    meters = {name: Meter(hook) for name, hook in hooks.items()}
    for hook in hooks.values():
        prefault(hook, engine)
    params = torch.tensor([float(sum(p.numel() for p in engine.module.parameters()))])
    dist.all_reduce(params)
    dist.barrier()

    errors, drains = {}, {}
    sched = {"cpu": 0.0, "run_delay": 0.0}  # the trainer thread's, over the last iteration

    def run_one(name) -> float | None:
        """One iteration under policy ``name``; its wall time, or None if it failed (then it is dropped)."""
        failed = torch.zeros(1)
        cpu0, delay0 = schedstat()
        start = time.perf_counter()
        try:
            engine.train_batch(data_iter=data)
        except Exception as err:  # noqa: BLE001 (a baseline that does not run on this setup: report, drop it)
            failed[0] = 1
            errors[name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            traceback.print_exc()
        wall = time.perf_counter() - start
        cpu1, delay1 = schedstat()
        sched["cpu"], sched["run_delay"] = cpu1 - cpu0, delay1 - delay0
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            errors.setdefault(name, "failed on another rank")
            say(f"{name}: failed ({errors[name]}); dropped from the comparison")
            engine.baft_hooks = [idle]
            return None
        return wall

    # Setup, untimed: every policy runs once (first saves create directories and files); baft runs
    # until it has planned (it times one iteration for its analytic fallback, then loads the bubble map).
    chosen = {}  # policy -> the period it ran at
    for name in names:
        meter = meters[name]
        engine.baft_hooks = [meter]
        for _ in range(4):
            if run_one(name) is None:
                break
            if not isinstance(meter.inner, PlannedExecutor) or meter.inner.planned:
                break
        if isinstance(meter.inner, PlannedExecutor) and meter.inner.planned:
            chosen[name] = meter.inner.period
            say(f"baft planned from {meter.inner.plan_source}: period {meter.inner.period}")
        drain(meter.inner)
        say(f"set up {name}" + (f" FAILED: {errors[name]}" if name in errors else ""))
    dist.barrier()

    records = []  # one per iteration: policy, round, index in block, step, and FIELDS for every rank
    total = ours.rounds * (2 * len(names) - 2 if "none" in names else len(names)) * ours.block
    done = 0
    t_start = time.time()
    # none runs between every two policies (none A none B ...): each block gets a baseline measured
    # just before and just after it, so drift within a round cancels too
    order = [n for name in names if name != "none" for n in ("none", name)] if "none" in names else names
    block_index = 0
    for rnd in range(ours.rounds):
        say(f"round {rnd + 1}/{ours.rounds}  load average {os.getloadavg()[0]:.2f}")
        for name in order:
            if name in errors:
                continue
            block_index += 1
            hook = hooks[name]
            meter = meters[name]
            engine.baft_hooks = [meter]
            for j in range(ours.block):
                period = chosen.get(name, periods[name])
                if isinstance(period, int) and period > 1 and hook is not None:
                    # a periodic policy snapshots in the last iteration of each of its blocks: enough snapshot and
                    # plain iterations to measure both; the analysis amortizes them over its real period
                    hook.period = 1 if j == ours.block - 1 else NEVER
                before = fired_count(hook)
                wall = run_one(name)
                if wall is None:
                    break
                stall = float(getattr(hook, "stall", 0.0)) if hook is not None else 0.0
                mine = torch.tensor([wall, stall, float(fired_count(hook) > before),
                                     float(sum(getattr(hook, "bubble_bytes", {}).values())) if hook else 0.0,
                                     float(getattr(hook, "flushed_bytes", 0)) if hook else 0.0,
                                     meter.recv_wait, meter.t_start, meter.t_instr, meter.t_end,
                                     sched["run_delay"], sched["cpu"], meter.cpu_hook], dtype=torch.float64)
                gathered = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
                if isinstance(hook, DiskCheckpoint) and lead:
                    rotate(hook.save_dir)
                done += 1
                if lead:
                    rec = {"policy": name, "round": rnd, "block": block_index, "j": j, "step": int(engine.global_steps),
                           "ranks": [dict(zip(FIELDS, g.tolist())) for g in gathered]}
                    records.append(rec)
                    r0 = rec["ranks"][0]
                    stall_max = max(r["stall"] for r in rec["ranks"])
                    eta = (time.time() - t_start) / done * (total - done)
                    print(f"[overhead] r{rnd + 1} {name:13s} it{j} step {rec['step']:4d}  "
                          f"{r0['wall'] * 1e3:8.1f} ms  stall {stall_max * 1e3:7.1f} ms"
                          f"{'  snapshot' if r0['fired'] else ''}  (eta {eta / 60:.1f} min)", flush=True)
            drains.setdefault(name, []).append(drain(hook))
            dist.barrier()

    # sizes: bytes of one snapshot, per rank (in-memory policies) or all ranks' files (disk)
    sizes = {}
    for name, hook in hooks.items():
        if isinstance(hook, SnapshotPolicy) and hook.source is not None:
            items = hook.commits[-1].items if hook.commits else {}
            sizes[name] = {"state": hook.source.layout.nbytes, "items": len(json.dumps(items))}
    all_sizes = [None] * world
    dist.all_gather_object(all_sizes, sizes)
    plans = {}
    hook = hooks.get("baft")
    if hook is not None and getattr(hook, "plan", None) is not None:
        p = hook.plan
        plans = {"rank": rank, "stage": engine.stage_id, "bandwidth": p.bandwidth, "bubble_time": p.bubble_time,
                 "nbytes": p.nbytes, "leftover_bytes": p.leftover_bytes, "predicted_stall": p.stall,
                 "iteration_time": p.iteration_time, "slots": [s.slot for s in p.slots],
                 "planned_bubble_bytes": sum(s.nbytes for s in p.slots), "source": hook.plan_source,
                 "period": chosen.get("baft", hook.period)}
    all_plans = [None] * world
    dist.all_gather_object(all_plans, plans)
    bench = microbench(engine, data, hooks.get("baft"))
    bench["interference"] = interference(engine, hooks.get("baft") or hooks.get("sync-copy"), model_args.d_model)
    all_bench = [None] * world
    dist.all_gather_object(all_bench, bench)
    all_errors = [None] * world
    dist.all_gather_object(all_errors, errors)
    dist.barrier()
    if lead:
        disk = {name: newest_bytes(h.save_dir) for name, h in hooks.items() if isinstance(h, DiskCheckpoint)}
        doc = {
            "policies": [{"name": n, "kind": k, "period": chosen.get(n, p)} for n, k, p in POLICIES if n in names],
            "records": records, "fields": list(FIELDS), "rounds": ours.rounds, "block": ours.block,
            "warmup": ours.warmup, "world": world,
            "snapshot_sizes": all_sizes, "microbench": all_bench, "disk_bytes": disk, "baft_plans": all_plans,
            "errors": {k: v for e in all_errors for k, v in (e or {}).items()},
            "drain_seconds": drains, "model": vars(model_args),
            "parameters": int(params.item()), "elapsed_s": time.time() - t_start,
            "python": platform.python_version(),
        }
        Path(ours.raw_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ours.raw_out).write_text(json.dumps(doc))
        say(f"wrote {ours.raw_out}")
    for hook in hooks.values():
        if isinstance(hook, SnapshotPolicy) and hook.writer is not None:
            hook.writer.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
