"""Experiment 1 (overhead): what each snapshot policy costs per training iteration, measured interleaved.

    python experiments/overhead.py [--rounds R] [--iters K] [--model-size small|medium]
                                   [--schedule 1f1b|gpipe] [--all] [--out experiments/results]

Trains the 2-stage example GPT (8 micro-batches of 4 x 128 tokens) on this machine under every
policy *in one run*: the engine is built once per launch, every policy's hook is constructed up
front, and the policies take turns, A B C ... A B C ..., K iterations each per round (the first
iteration of each block is discarded as warm-up), so drift of the machine hits them all alike.

Policies: none; DeepSpeed ``save_checkpoint`` every iteration and every 10; ``torch.save`` every
iteration; a synchronous host copy every iteration (CheckFreq's snapshot phase); a background
thread copy that ignores bubbles; ``torch.distributed.checkpoint.async_save``; and baft, planned
from a bubble map measured by ``baft profile`` just before (the product workflow).

Writes, under ``--out``: ``overhead-<size>-<schedule>.md`` (tables, targets, findings, machine,
command, date), ``.json`` (the analysis and every iteration's raw figures), ``.png`` (overhead per
policy) and ``-bubblemap.json`` / ``-bubblemap.plan.json`` (the profile baft planned from).
``--all`` runs the 2 x 2 grid (small/medium model x 1F1B/GPipe) and adds ``overhead-grid.md|json|png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from baft.launch import launch_env, torchrun

HERE = Path(__file__).resolve().parent
WORKER = HERE / "overhead_worker.py"

COMMON = {"stages": 2, "micro_batches": 8, "micro_batch_size": 4, "seq": 128, "vocab": 4096}
SIZES = {
    "small": {"d_model": 384, "layers": 8, "heads": 6},
    "medium": {"d_model": 512, "layers": 8, "heads": 8},
}
BUDGET = 0.01  # the 1% target
LABELS = {
    "none": "none",
    "deepspeed": "DeepSpeed save_checkpoint",
    "deepspeed/10": "DeepSpeed save_checkpoint",
    "torch-save": "torch.save",
    "sync-copy": "sync host copy (CheckFreq snapshot)",
    "thread-copy": "background-thread copy",
    "dcp-async": "DCP async_save",
    "baft": "baft (measured bubble map)",
}


# ---------------------------------------------------------------------------------------------
# machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def revision() -> str:
    """The commit the run used, and whether baft/ had uncommitted changes (others edit it concurrently)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "baft"], cwd=HERE.parent, capture_output=True, check=False,
                               text=True).stdout.strip()
        return head + (" (baft/ with uncommitted changes: " + ", ".join(
            line[3:] for line in dirty.splitlines()) + ")" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import deepspeed
    import torch

    return {"cores": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "kernel": platform.release(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
            "revision": revision()}


# ---------------------------------------------------------------------------------------------
# running


def model_opts(size: str, schedule: str) -> dict:
    return {**COMMON, **SIZES[size], "schedule": schedule}


def flags(opts: dict) -> list[str]:
    out = []
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def run_logged(cmd: list[str], log_path: Path, env: dict, show=lambda line: line.startswith("[overhead]")) -> int:
    """Run ``cmd``; keep its whole output in ``log_path``, echo the progress lines."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if show(line):
                print(line.rstrip(), flush=True)
        return proc.wait()


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def run_config(size: str, schedule: str, args, out: Path) -> dict:
    """Profile, then run every policy interleaved; return the raw document of the run."""
    name = f"overhead-{size}-{schedule}"
    opts = model_opts(size, schedule)
    env = launch_env()
    bmap = out / f"{name}-bubblemap.json"
    work = Path(tempfile.mkdtemp(prefix="baft-overhead-"))  # on disk: the disk baselines write here
    shm = Path("/dev/shm") / f"baft-overhead-{os.getpid()}-{size}-{schedule}"
    try:
        print(f"== {name}: profiling the bubbles ({args.profile_iters} iterations) -> {bmap}", flush=True)
        t0 = time.time()
        cmd = [sys.executable, "-m", "baft.cli", "profile", "--example", "gpt", *flags(opts),
               "--iters", str(args.profile_iters), "--out", str(bmap)]
        code = run_logged(cmd, work / "profile.log", env, show=lambda line: "│" in line or "stage" in line[:8])
        if code != 0:
            raise SystemExit(f"baft profile failed (exit {code}):\n{tail(work / 'profile.log')}")
        profile_s = time.time() - t0
        print(f"== {name}: {len(args.policies.split(','))} policies x {args.rounds} rounds x {args.iters} iterations",
              flush=True)
        raw = work / "raw.json"
        cmd = torchrun(2, [str(WORKER), "--rounds", str(args.rounds), "--block", str(args.iters),
                           "--bubble-map", str(bmap), "--raw-out", str(raw), "--tmp-dir", str(work / "disk"),
                           "--shm-dir", str(shm), "--policies", args.policies, *flags(opts)], module=False)
        load_before = os.getloadavg()
        t1 = time.time()
        code = run_logged(cmd, work / "run.log", env)
        if code != 0 or not raw.exists():
            raise SystemExit(f"the overhead run failed (exit {code}):\n{tail(work / 'run.log')}")
        doc = json.loads(raw.read_text())
        doc.update(config={"size": size, "schedule": schedule, **opts}, bubble_map=str(bmap),
                   profile_seconds=profile_s, run_seconds=time.time() - t1,
                   load_average={"before": load_before, "after": os.getloadavg()})
        return doc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# analysis


def med(values):
    return statistics.median(values) if values else float("nan")


def amortized(times, fired, base, period):
    """Overhead per iteration vs ``base`` (the median of none), from medians.

    Period 1: median / base - 1. Period P > 1: one snapshot iteration and P - 1 plain ones,
    ((median(snapshot) - base) + (P - 1)(median(plain) - base)) / P / base.
    """
    if period == 1 or not any(fired):
        return med(times) / base - 1
    snap = [t for t, f in zip(times, fired) if f]
    plain = [t for t, f in zip(times, fired) if not f] or [base]
    return ((med(snap) - base) + (period - 1) * (med(plain) - base)) / period / base


def bootstrap_ci(times, fired, none_times, period, reps=2000, seed=0):
    """95% interval of the overhead estimate, resampling iterations (snapshot and plain ones apart)."""
    rng = np.random.default_rng(seed)
    times, fired, none_times = np.asarray(times), np.asarray(fired, bool), np.asarray(none_times)
    snap, plain = times[fired], times[~fired]
    ests = []
    for _ in range(reps):
        base = float(np.median(rng.choice(none_times, len(none_times))))
        if period == 1 or not len(snap):
            ests.append(float(np.median(rng.choice(times, len(times)))) / base - 1)
            continue
        s = float(np.median(rng.choice(snap, len(snap))))
        p = float(np.median(rng.choice(plain, len(plain)))) if len(plain) else base
        ests.append(((s - base) + (period - 1) * (p - base)) / period / base)
    return float(np.percentile(ests, 2.5)), float(np.percentile(ests, 97.5))


def analyse(doc: dict) -> dict:
    recs = doc["records"]
    world = doc["world"]
    measured = [r for r in recs if r["j"] > 0]
    by = {}
    for r in measured:
        by.setdefault(r["policy"], []).append(r)
    none_times = [r["ranks"][0]["wall"] for r in by.get("none", [])]
    base = med(none_times)
    sizes = doc["snapshot_sizes"]
    rows = []
    for pol in doc["policies"]:
        name, period = pol["name"], pol["period"]
        rs = by.get(name, [])
        if name in doc["errors"] or not rs:
            rows.append({"policy": name, "kind": pol["kind"], "period": period, "error": doc["errors"].get(name, "no data")})
            continue
        if not isinstance(period, int):
            period = 1
        times = [r["ranks"][0]["wall"] for r in rs]
        fired = [bool(r["ranks"][0]["fired"]) for r in rs]
        snaps = [r for r in rs if r["ranks"][0]["fired"]] or rs
        stall = med([max(x["stall"] for x in r["ranks"]) for r in snaps])
        in_hook = med([max(x["t_start"] + x["t_instr"] + x["t_end"] for x in r["ranks"]) for r in snaps])
        if pol["kind"] in ("deepspeed", "torch-save", "dcp-async"):
            nbytes = doc["disk_bytes"].get(name, 0)
        elif pol["kind"] == "none":
            nbytes = 0
        else:
            nbytes = sum(s[name]["state"] + s[name]["items"] for s in sizes if name in s)
        oh = amortized(times, fired, base, period) if name != "none" else 0.0
        lo, hi = bootstrap_ci(times, fired, none_times, period) if name != "none" else (0.0, 0.0)
        first = [r["ranks"][0]["wall"] for r in recs if r["policy"] == name and r["j"] == 0]
        rows.append({
            "policy": name, "kind": pol["kind"], "period": period, "iterations": len(times),
            "snapshots": sum(fired), "median_s": med(times), "overhead": oh, "ci95": [lo, hi],
            "raw_median_ratio": med(times) / base - 1, "stall_s": stall if name != "none" else 0.0,
            "in_hook_s": in_hook if name != "none" else 0.0, "snapshot_bytes": nbytes,
            "bytes_per_iteration": nbytes / period,
            "bytes_per_hour": nbytes * 3600 / (med(times) * period) if nbytes else 0.0,
            "first_of_block_ratio": med(first) / med(times) - 1 if first else None,
        })
    result = {"rows": rows, "base_s": base, "stages": stage_rows(doc, by), "world": world}
    result["targets"] = targets(result, doc)
    return result


def stage_rows(doc: dict, by: dict) -> list[dict]:
    """How much of each stage's bubble time baft used, and the stall it left."""
    plans = [p for p in doc["baft_plans"] if p]
    baft = [r for r in by.get("baft", []) if r["ranks"][0]["fired"]]
    none = by.get("none", [])
    out = []
    for p in sorted(plans, key=lambda p: p["rank"]):
        k = p["rank"]
        copied = med([r["ranks"][k]["bubble_bytes"] for r in baft])
        flushed = med([r["ranks"][k]["flushed_bytes"] for r in baft])
        wait_none = med([r["ranks"][k]["recv_wait"] for r in none])
        wait_baft = med([r["ranks"][k]["recv_wait"] for r in baft])
        copy_s = copied / p["bandwidth"] if p["bandwidth"] else float("nan")
        out.append({
            "rank": k, "stage": p["stage"], "state_bytes": p["nbytes"], "bandwidth": p["bandwidth"],
            "bubble_profiled_s": p["bubble_time"], "bubble_this_run_s": wait_none,
            "planned_leftover_bytes": p["leftover_bytes"], "copied_in_bubbles_bytes": copied,
            "copy_time_in_bubbles_s": copy_s,
            "bubble_used": copy_s / p["bubble_time"] if p["bubble_time"] else float("nan"),
            "bubble_used_this_run": copy_s / wait_none if wait_none else float("nan"),
            "flushed_bytes": flushed,
            "stall_s": med([r["ranks"][k]["stall"] for r in baft]),
            "in_hook_s": med([r["ranks"][k]["t_start"] + r["ranks"][k]["t_instr"] + r["ranks"][k]["t_end"]
                              for r in baft]),
            "start_s": med([r["ranks"][k]["t_start"] for r in baft]),
            "recv_wait_baft_s": wait_baft, "recv_wait_none_s": wait_none,
        })
    return out


def targets(result: dict, doc: dict) -> dict:
    rows = {r["policy"]: r for r in result["rows"]}
    baft, sync = rows.get("baft"), rows.get("sync-copy")
    out = {}
    if not baft or "error" in baft or not sync or "error" in sync:
        out["error"] = "baft or sync-copy did not run"
        return out
    p = baft["period"]
    oh, (lo, hi) = baft["overhead"], baft["ci95"]
    out["t1"] = {"pass": oh <= BUDGET, "overhead": oh, "ci95": [lo, hi], "period": p,
                 "line": f"{'PASS' if oh <= BUDGET else 'FAIL'} target 1: baft overhead {oh:+.2%} "
                         f"(95% CI {lo:+.2%} .. {hi:+.2%}) at its planner's period {p}, target <= 1%"}
    plans = [q for q in doc["baft_plans"] if q]
    hold = bool(plans) and all(q["leftover_bytes"] == 0 for q in plans)
    c = sync["overhead"]  # per snapshot: sync-copy ran every iteration
    needed = max(1, math.ceil(c / BUDGET - 1e-9))
    ok_a = p == 1 if hold else True
    ok_b = 3 * p <= needed
    out["t2"] = {"pass": ok_a and ok_b, "bubbles_hold_state": hold, "period": p, "sync_cost_per_snapshot": c,
                 "sync_period_needed": needed,
                 "line": f"{'PASS' if ok_a and ok_b else 'FAIL'} target 2: every stage's measured bubbles "
                         f"{'hold' if hold else 'do NOT hold'} its state -> baft period {p}"
                         f"{' (must be 1: ' + ('ok' if ok_a else 'no') + ')' if hold else ''}; sync copy costs "
                         f"{c:+.2%} per snapshot, so needs period {needed} for 1%; baft period {p} "
                         f"{'<=' if ok_b else '>'} {needed}/3 = {needed / 3:.2f}"}
    sync_at_p = c / p
    ratio = sync_at_p / oh if oh > 0 else math.inf
    out["t3"] = {"pass": ratio >= 5, "sync_at_period": sync_at_p, "baft": oh, "ratio": ratio,
                 "line": f"{'PASS' if ratio >= 5 else 'FAIL'} target 3: at period {p} sync copy costs "
                         f"{sync_at_p:+.2%}, baft {oh:+.2%}: "
                         + (f"{ratio:.1f}x lower" if math.isfinite(ratio) else "baft's overhead is <= 0 (noise)")
                         + ", target >= 5x"}
    return out


# ---------------------------------------------------------------------------------------------
# output


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def policy_table(result: dict, config: str = "") -> list[str]:
    head = ("| " + ("config | " if config else "") + "policy | period | median iteration | overhead vs none "
            "(95% CI) | median stall | in-hook time | snapshot | bytes / iteration | bytes saved / hour |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        label = f"{r['policy']}: {LABELS.get(r['policy'], r['policy'])}"
        pre = f"| {config} " if config else ""
        if "error" in r:
            lines.append(f"{pre}| {label} | {r['period']} | did not run: {r['error']} | | | | | | |")
            continue
        oh = "—" if r["policy"] == "none" else f"{r['overhead']:+.2%} ({r['ci95'][0]:+.1%} .. {r['ci95'][1]:+.1%})"
        lines.append(
            f"{pre}| {label} | {r['period']} | {r['median_s'] * 1e3:.0f} ms | {oh} | {r['stall_s'] * 1e3:.1f} ms | "
            f"{r['in_hook_s'] * 1e3:.1f} ms | {fmt_bytes(r['snapshot_bytes'])} | {fmt_bytes(r['bytes_per_iteration'])} | "
            f"{fmt_bytes(r['bytes_per_hour'])} |")
    return lines


def stage_table(result: dict) -> list[str]:
    lines = [("| stage | state | copy bandwidth | bubble (profiled) | bubble (this run, none) | copied in bubbles | "
             "bubble time used (profiled / this run) | flushed before step | stall | in-hook time (of it at start) | "
             "receive wait none → baft |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["stages"]:
        lines.append(
            f"| {s['stage']} (rank {s['rank']}) | {fmt_bytes(s['state_bytes'])} | {s['bandwidth'] / 1e9:.2f} GB/s | "
            f"{s['bubble_profiled_s'] * 1e3:.0f} ms | {s['bubble_this_run_s'] * 1e3:.0f} ms | "
            f"{fmt_bytes(s['copied_in_bubbles_bytes'])} ({s['copied_in_bubbles_bytes'] / s['state_bytes']:.0%}) | "
            f"{s['bubble_used']:.0%} / {s['bubble_used_this_run']:.0%} | {fmt_bytes(s['flushed_bytes'])} | "
            f"{s['stall_s'] * 1e3:.1f} ms | {s['in_hook_s'] * 1e3:.1f} ms ({s['start_s'] * 1e3:.1f} ms) | "
            f"{s['recv_wait_none_s'] * 1e3:.0f} → {s['recv_wait_baft_s'] * 1e3:.0f} ms |")
    return lines


def findings(doc: dict, result: dict) -> list[str]:
    """Where baft's time goes: measured costs behind a snapshot (per rank, untimed, after the run)."""
    bench = doc.get("microbench") or []
    lines = [("| rank | capture_items | SnapshotWriter.begin (of it read_slots) | SnapshotWriter.commit | "
              "commit record | copy | xxh3 checksum | matmul alone → beside the other rank's copy |"),
             "|---|---|---|---|---|---|---|---|"]
    for k, b in enumerate(bench):
        if not b:
            continue
        inter = b.get("interference", {})
        slow = inter.get("beside_copy", 0) / inter["alone"] - 1 if inter.get("alone") else float("nan")
        lines.append(
            f"| {k} | {b.get('capture_items_s', 0) * 1e3:.2f} ms | {b.get('begin_s', 0) * 1e3:.2f} ms "
            f"({b.get('read_slots_s', 0) * 1e3:.2f} ms) | {b.get('commit_s', 0) * 1e3:.2f} ms | "
            f"{fmt_bytes(b.get('commit_file_bytes', 0))} (items {fmt_bytes(b.get('items_json_bytes', 0))}) | "
            f"{b.get('copy_GBps', 0):.2f} GB/s | {b.get('checksum_GBps', 0):.2f} GB/s | "
            f"{inter.get('alone', 0) * 1e3:.0f} → {inter.get('beside_copy', 0) * 1e3:.0f} ms ({slow:+.1%}) |")
    return lines


def config_name(doc: dict) -> str:
    c = doc["config"]
    return f"{c['size']}/{c['schedule']}"


def describe(doc: dict) -> str:
    c = doc["config"]
    return (f"example GPT, {doc['parameters'] / 1e6:.1f}M parameters (d_model {c['d_model']}, {c['layers']} layers, "
            f"{c['heads']} heads, vocab {c['vocab']}), {c['stages']} pipeline stages, {c['micro_batches']} "
            f"micro-batches of {c['micro_batch_size']} x {c['seq']} = {c['micro_batch_size'] * c['seq']} tokens, "
            f"schedule {c['schedule']}")


def method(doc: dict) -> list[str]:
    return [
        (f"Method: one launch of 2 ranks (gloo, 1 intra-op thread each); the engine is built once and every policy's "
        f"hook constructed up front (shared-memory slots pre-faulted); each policy then runs once, untimed (baft: "
        f"until its planner has run); then {doc['rounds']} rounds in which the policies take turns "
        f"({', '.join(p['name'] for p in doc['policies'])}), {doc['block']} iterations each. The first iteration "
        f"of every block is discarded as warm-up; {doc['block'] - 1} x {doc['rounds']} iterations per policy remain. "
        "Iteration time is rank 0's wall clock around `train_batch`; stall is the hook's own `.stall` (max over "
        "ranks), in-hook time is all time spent in the policy's callbacks on the trainer's thread (max over ranks: "
        "for baft it includes `capture_items`, `SnapshotWriter.begin` and the commit, which `.stall` does not). "
        "Overhead is median iteration time / median of none - 1; for a period P > 1 it is amortized from the "
        "medians of snapshot and plain iterations, ((snap - none) + (P - 1)(plain - none)) / P / none, and a "
        "periodic policy fires on every P-th of its own measured iterations. The 95% interval bootstraps over "
        "iterations. Disk baselines write to a temporary directory on the local disk (the two newest saves kept); "
        "bytes are one whole snapshot of both ranks (disk: the files written; memory: state + JSON items)."),
    ]


def render(doc: dict, result: dict, when: str, command: str, mach: dict) -> str:
    c = doc["config"]
    lines = [f"# Overhead of snapshot policies: {c['size']} model, {c['schedule']}", ""]
    lines += [(f"- Machine: {mach['cores']} cores, {mach['cpu']}, {mach['memory_gb']} GB; python {mach['python']}, "
              f"torch {mach['torch']}, DeepSpeed {mach['deepspeed']}, Linux {mach['kernel']}"),
              f"- Command: `{command}`", f"- Date: {when}; baft revision {mach['revision']}",
              f"- Model: {describe(doc)}",
              (f"- Load average before / after the run: {doc['load_average']['before'][0]:.2f} / "
              f"{doc['load_average']['after'][0]:.2f} (other jobs share this machine; interleaving spreads them over "
              "all policies)"),
              (f"- Duration: profile {doc['profile_seconds']:.0f} s, interleaved run {doc['run_seconds']:.0f} s; "
              f"baft planned from `{Path(doc['bubble_map']).name}`"), ""]
    lines += method(doc) + [""]
    lines += policy_table(result) + [""]
    firsts = [r["first_of_block_ratio"] for r in result["rows"] if r.get("first_of_block_ratio") is not None]
    if firsts:
        lines += [(f"First iteration of each block versus the rest (median, per policy): "
                  f"{min(firsts):+.1%} .. {max(firsts):+.1%}; discarded."), ""]
    if doc["errors"]:
        lines += [f"- {k}: did not run here: {v}" for k, v in doc["errors"].items()] + [""]
    lines += ["`dcp-async` is `DiskCheckpoint(\"dcp-async\")`'s code path with one change: `async_save` gets a "
              "process group of its own (`DcpAsyncOwnGroup` in overhead_worker.py). As shipped, its background "
              "thread runs DCP's plan collectives on the default gloo group, concurrently with the pipeline's p2p and "
              "the main thread's collectives, and gloo aborts the process (\"Received data size doesn't match "
              "expected size\"). Drain of the last pending save at the end of each block (untimed): "
              + ", ".join(f"{statistics.median(v):.2f} s" for k, v in doc["drain_seconds"].items() if k == "dcp-async")
              + ".", ""]
    lines += ["## baft per stage", ""] + stage_table(result) + [""]
    lines += [("Bubble time used = bytes copied inside receive waits / the profiled copy bandwidth, over the stage's "
              "profiled bubble time (and over its receive wait measured under `none` in this run). The receive wait "
              "under baft includes the copy; a wait longer than under none means a copy overran its bubble."), ""]
    lines += ["## Targets", ""] + ["    " + result["targets"][k]["line"] for k in ("t1", "t2", "t3")
                                     if k in result["targets"]] + [""]
    lines += ["## Where the time goes (measured after the run, per rank)", ""] + findings(doc, result) + [""]
    return "\n".join(lines)


def draw(results: list[tuple[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results[0][1]["rows"] if r["policy"] != "none"]
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(names) * max(1, len(results)) + 1.8))
    height = 0.8 / len(results)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for i, (label, res) in enumerate(results):
        rows = {r["policy"]: r for r in res["rows"]}
        ys, xs, errs = [], [], []
        for j, n in enumerate(names):
            r = rows.get(n)
            if not r or "error" in r:
                continue
            ys.append(j + i * height)
            xs.append(r["overhead"] * 100)
            errs.append([[max(0.0, (r["overhead"] - r["ci95"][0]) * 100)], [max(0.0, (r["ci95"][1] - r["overhead"]) * 100)]])
        err = np.hstack(errs) if errs else None
        bars = ax.barh(ys, xs, height=height, xerr=err, color=colours[i % 4], label=label, capsize=2)
        for b, x in zip(bars, xs):
            ax.text(max(x, 0) + 0.3, b.get_y() + b.get_height() / 2, f"{x:+.1f}%", va="center", fontsize=7)
    ax.set_yticks([j + height * (len(results) - 1) / 2 for j in range(len(names))])
    periods = {r["policy"]: r["period"] for r in results[0][1]["rows"]}
    ax.set_yticklabels([f"{n} (every {periods.get(n)})" for n in names])
    ax.invert_yaxis()
    ax.axvline(BUDGET * 100, color="k", ls="--", lw=1)
    ax.text(BUDGET * 100, -0.6, " 1% budget", fontsize=8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("iteration-time overhead vs no checkpointing (%), 95% bootstrap interval")
    ax.set_title(title, fontsize=10)
    if len(results) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(doc, result, out: Path, when, command, mach) -> Path:
    c = doc["config"]
    stem = out / f"overhead-{c['size']}-{c['schedule']}"
    text = render(doc, result, when, command, mach)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"machine": mach, "command": command, "date": when, "config": c, "result": result, "raw": doc}, indent=1))
    draw([(config_name(doc), result)], stem.with_suffix(".png"),
         f"{c['size']} ({doc['parameters'] / 1e6:.0f}M params), {c['schedule']}, 2 stages x 8 micro-batches — {when}")
    return stem


def write_grid(runs, out: Path, when, command, mach) -> None:
    lines = ["# Overhead of snapshot policies: model size x schedule", "",
             (f"- Machine: {mach['cores']} cores, {mach['cpu']}, {mach['memory_gb']} GB; python {mach['python']}, "
             f"torch {mach['torch']}, DeepSpeed {mach['deepspeed']}"), f"- Command: `{command}`", f"- Date: {when}"]
    lines += [f"- {config_name(d)}: {describe(d)}; load average {d['load_average']['before'][0]:.2f} / "
              f"{d['load_average']['after'][0]:.2f}" for d, _ in runs]
    lines += [""] + method(runs[0][0]) + [""]
    head = None
    for d, r in runs:
        t = policy_table(r, config_name(d))
        if head is None:
            head = t[:2]
            lines += head
        lines += t[2:]
    lines += ["", "## baft per stage", ""]
    for d, r in runs:
        lines += [f"### {config_name(d)}", ""] + stage_table(r) + [""]
    lines += ["## Targets", ""]
    for d, r in runs:
        lines += [f"{config_name(d)}:", ""] + ["    " + r["targets"][k]["line"] for k in ("t1", "t2", "t3")
                                                if k in r["targets"]] + [""]
    (out / "overhead-grid.md").write_text("\n".join(lines))
    (out / "overhead-grid.json").write_text(json.dumps(
        {"machine": mach, "command": command, "date": when,
         "runs": [{"config": d["config"], "result": r} for d, r in runs]}, indent=1))
    draw([(config_name(d), r) for d, r in runs], out / "overhead-grid.png", f"overhead per policy — {when}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds of A B C ... (default 5; 3 with --all)")
    p.add_argument("--iters", type=int, default=4, help="iterations per policy per round; the first is warm-up")
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--all", action="store_true", help="run the 2 x 2 grid of model size x schedule")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--profile-iters", type=int, default=8, help="iterations `baft profile` measures")
    p.add_argument("--policies", default="none,deepspeed,deepspeed/10,torch-save,sync-copy,thread-copy,dcp-async,baft",
                   help="comma-separated subset, in the order they take turns")
    args = p.parse_args(argv)
    if args.iters < 2:
        p.error("--iters must be at least 2 (the first iteration of each block is discarded)")
    if args.rounds is None:
        args.rounds = 3 if args.all else 5
    if "none" not in args.policies.split(","):
        p.error("--policies must include none (the baseline)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python experiments/overhead.py" + (" " + shlex.join(given) if given else "")
    mach = machine()
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    grid = [(s, sch) for s in ("small", "medium") for sch in ("1f1b", "gpipe")] if args.all \
        else [(args.model_size, args.schedule)]
    runs = []
    for size, schedule in grid:
        doc = run_config(size, schedule, args, out)
        result = analyse(doc)
        stem = write_outputs(doc, result, out, when, command, mach)
        runs.append((doc, result))
        print()
        print(render(doc, result, when, command, mach))
        print(f"wrote {stem}.md, .json, .png", flush=True)
    if args.all:
        write_grid(runs, out, when, command, mach)
        print(f"wrote {out / 'overhead-grid.md'}, .json, .png")
    print()
    for d, r in runs:
        for k in ("t1", "t2", "t3"):
            if k in r["targets"]:
                print(f"{config_name(d)}: {r['targets'][k]['line']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
