"""Recovery time, T0..T4, for baft (restore from the manager's memory) against DeepSpeed's disk checkpoint.

    python experiments/recovery.py [--sizes 17M,92M] [--iters 12] [--period 6] [--fault-step S]
                                   [--no-cold] [--repeats 3] [--out experiments/results] [--keep DIR] [--render JSON]

For every model size, the same fault — rank 1 SIGKILLed in the backward pass of step
``--fault-step`` — is injected into three runs of the example GPT (2 pipeline stages, 1F1B):

* ``baft``: ``--policy baft --period 1`` (a snapshot per iteration, copied in the bubbles and
  kept by the node's snapshot manager); the restart restores from the manager's shared memory;
* ``deepspeed``: ``--policy deepspeed --period P``: ``engine.save_checkpoint`` to
  RUN_DIR/checkpoints every P steps, and the restart goes through ``engine.load_checkpoint``
  (the usual practice); the fault step sits mid-period (P + P/2 + 1: P/2 finished steps lost);
* ``deepspeed, cold cache``: the same, but once the fault fires this script fsyncs the
  checkpoint files and drops them from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``),
  so the load reads the disk instead of memory, as it would after a reboot or on another node.

Per run it reports the snapshot/checkpoint stall per save (``stall_s`` of the save iterations
in losses.jsonl), the median iteration, and T0..T4 with T3's source from recovery.jsonl, then
checks the issue's targets: (a) T3 from memory at least 10x faster than DeepSpeed's load of
the same state from disk; (b) T0 at most one snapshot period of baft (at most one finished step
redone) against half the checkpoint period for the disk baseline (expected T0 over a uniform
fault time: P/2 iterations). Writes ``recovery.md``, ``recovery.json`` and ``recovery.png``
(the phases per model and policy) under ``--out``, with machine, command and date.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from baft.cli.launch import flags
from baft.cli.report import PHASE_COLOURS
from baft.examples.gpt import GPTConfig
from baft.recovery.record import PHASE_NAMES, PHASES
from common import RESULTS, clean_shm, first_recovery, header, md_table, provenance, read_jsonl, train

SIZES = {
    # the default example: ~17 M parameters, ~0.2 GB of state per stage
    "17M": {"d_model": 384, "layers": 8, "heads": 6},
    # ~92 M parameters, ~0.55 GB of state per stage
    "92M": {"d_model": 768, "layers": 12, "heads": 12},
}
COMMON = {"seq": 128, "vocab": 4096, "micro_batches": 8, "micro_batch_size": 2}
# The public resumable-training reference (DESIGN.md, "Reference figures"): GPT-3 on one 8-accelerator server.
REFERENCE = [
    {"model": "GPT 3B", "flush_s": 30, "restart_s": 70, "load_s": 3, "T0": "~30 min (hourly checkpoint)"},
    {"model": "GPT 15B", "flush_s": 120, "restart_s": 210, "load_s": 90, "T0": "~30 min (hourly checkpoint)"},
]


def parameters(size: str) -> int:
    """Parameters of the example GPT at ``size``."""
    s = SIZES[size]
    return GPTConfig(vocab=COMMON["vocab"], seq=COMMON["seq"], d_model=s["d_model"], layers=s["layers"],
                     heads=s["heads"]).parameters()


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of these files in the page cache (util-linux ``fincore``), or None if it cannot tell."""
    if not paths or not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                             check=False, capture_output=True, text=True, timeout=60).stdout
        return sum(int(line) for line in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def drop_from_cache(directory: Path) -> dict:
    """fsync every file under ``directory`` and ask the kernel to drop its pages; residency before/after."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    before = resident_bytes(files)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "resident_before": before, "resident_after": resident_bytes(files)}


class CacheDropper(threading.Thread):
    """Waits for the fault to fire (RUN_DIR/chaos.jsonl), then drops the checkpoints from the page cache."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.result, self.stop = run_dir, None, threading.Event()

    def run(self):
        while not self.stop.is_set():
            if (self.run_dir / "chaos.jsonl").exists():
                start = time.time()
                self.result = drop_from_cache(self.run_dir / "checkpoints")
                self.result["seconds"] = time.time() - start
                self.result["after_fault_s"] = start - read_jsonl(self.run_dir / "chaos.jsonl")[0]["time"]
                return
            time.sleep(0.02)


def best(fn, repeats: int = 5) -> float:
    """The shortest of ``repeats`` timings of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def load_floor(checkpoints: Path) -> dict:
    """The same bytes loaded three ways in this process, one thread: the lower bounds of T3.

    ``torch.load`` of every file of DeepSpeed's checkpoint from the page cache and after dropping
    it, against reading as many bytes from shared memory (/dev/shm), checksumming them (as
    baft's commit records do) and copying them into a tensor.
    """
    import torch

    latest = checkpoints / "latest"  # the tag load_checkpoint reads
    if latest.exists():
        checkpoints = checkpoints / latest.read_text().strip()
    files = sorted(p for p in checkpoints.rglob("*.pt"))
    total = sum(p.stat().st_size for p in files)
    if not files:
        return {}

    def load_all():
        for f in files:
            torch.load(f, map_location="cpu", weights_only=False)

    load_all()  # warm the cache
    warm = best(load_all, 3)
    drop_from_cache(checkpoints)
    cold = best(load_all, 1)
    return {"bytes": total, "files": len(files), "torch_load_warm_s": warm, "torch_load_cold_s": cold,
            "shm_verify_copy_s": shm_verify_copy(total)}


def shm_verify_copy(nbytes: int) -> float:
    """Seconds to checksum (as baft's commit records) and copy ``nbytes`` out of shared memory."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="baft-floor-")
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            return _verify_copy(m)
    finally:
        os.close(fd)
        os.unlink(path)


def _verify_copy(m) -> float:
    import torch

    from baft.snapshot.layout import checksum

    src = torch.frombuffer(m, dtype=torch.uint8)  # gone when this returns, before the map closes
    src.fill_(7)
    dst = torch.empty_like(src)
    return best(lambda: (checksum(m), dst.copy_(src)))


def memory_restore(stage_bytes: int, ranks_on_node: int = 2) -> dict:
    """T3 from memory, piece by piece, on baft's own store (one process, no training running).

    Commits one snapshot of ``stage_bytes`` per rank into shared-memory slots with
    :class:`baft.snapshot.slots.SnapshotWriter`, then times what a rank's restore
    (``baft.recovery.restore``) does: :func:`baft.snapshot.slots.map_verified` of every rank
    directory of the node, verifying in place the slot of its own stage only; the chunk-by-chunk
    copy into the engine's tensors; and the floor: checksumming the slot in place and copying it
    into a tensor in one go.
    """
    import torch

    from baft.snapshot import slots
    from baft.snapshot.layout import CommitRecord, TensorEntry, checksum, plan_layout

    n = stage_bytes // 4 * 4
    layout = plan_layout([TensorEntry("state", "float32", (n // 4,), n, "parameters")])
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="baft-restore-"))
    try:
        for rank in range(ranks_on_node):
            writer = slots.SnapshotWriter(root, rank, layout)
            buf = writer.begin(1)
            buf[:n].fill_(rank + 1)  # the checksum and memcpy run at the same speed whatever the bytes
            view = memoryview(buf.numpy())
            sums = [checksum(view[c.offset:c.offset + c.nbytes]) for c in layout.chunks]
            del view
            writer.commit(CommitRecord(1, rank, rank, layout, sums), writer.slot)
            writer.close()
            del buf
        target = torch.zeros(n, dtype=torch.uint8)

        def read():
            found = [slots.map_verified(root, r, step=1, accept=lambda rec: rec.stage == 0)
                     for r in range(ranks_on_node)]
            for f in found[1:]:
                if f is not None:
                    f[1].close()
            return found[0]

        read_s = best(lambda: read()[1].close())
        record, data = read()

        def copy_in():
            source = torch.frombuffer(data, dtype=torch.uint8, count=record.layout.nbytes)
            for c in record.layout.chunks:
                target[c.start:c.start + c.nbytes].copy_(source[c.offset:c.offset + c.nbytes])

        copy_s = best(copy_in)
        data.close()
        slot = slots.committed(root, 0)[0].slot

        def floor():
            with slots.open_slot(root, 0, slot) as m:
                view = memoryview(m)
                for c in layout.chunks:
                    checksum(view[c.offset:c.offset + c.nbytes])
                src = torch.frombuffer(m, dtype=torch.uint8)
                target.copy_(src[:n])
                del src
                view.release()

        floor_s = best(floor)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"stage_bytes": n, "ranks_on_node": ranks_on_node, "path": "map_verified", "slots_read": 1,
            "read_s": read_s, "copy_s": copy_s, "as_restored_s": read_s + copy_s, "floor_s": floor_s}


def measure(run_dir: Path, policy: str, period: int, size: str, iters: int) -> dict:
    """The numbers of one faulted run, from its losses.jsonl and recovery.jsonl."""
    losses = read_jsonl(run_dir / "losses.jsonl")
    first = [r for r in losses if r.get("restart", 0) == 0]
    resumed = [r for r in losses if r.get("restart") == 1]
    saves = [r for r in first if r["step"] % period == 0 and r["step"] > 1]  # step 1: no optimizer state yet
    plain = [r for r in first if r["step"] % period != 0 and r["step"] > 1] or [r for r in first if r["step"] > 1]
    rec = first_recovery(run_dir)
    iter_s = statistics.median(r["iter_s"] - r["stall_s"] for r in first if r["step"] > 1) if len(first) > 1 else None
    out = {
        "size": size, "policy": policy, "period": period, "params": parameters(size),
        "iter_s": iter_s,
        "stall_per_save_s": statistics.median(r["stall_s"] for r in saves) if saves else None,
        "saves": len(saves),
        "iter_without_save_s": statistics.median(r["iter_s"] for r in plain) if plain else None,
        "fault": rec.get("fault"), "restored_step": rec.get("restored_step"), "source": rec.get("source"),
        "lost_steps": rec.get("lost_steps"),
        **{k: rec.get(k) for k in (*PHASES, "total")},
        "resumed_to_end": bool(resumed) and max(r["step"] for r in resumed) == iters,
        "checkpoint_bytes": du(run_dir / "checkpoints") if policy != "baft" else None,
    }
    if out["T1"] is not None:
        out["restart_s"] = sum(out[k] for k in ("T1", "T2", "T3", "T4"))
        out["T0_iters"] = out["T0"] / iter_s if iter_s else None
    return out


def fmt(v, digits=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.4f}"
    return str(v)


def gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def label(r: dict) -> str:
    return r["policy"] + (" (cold cache)" if r.get("cold") else "")


NUMERIC = ("iter_s", "stall_per_save_s", "T0", "T1", "T2", "T3", "T4", "total", "restart_s", "T0_iters",
           "load_avg_5min")


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (size, policy, cache): the median of every time over the repeats, T3's range, and
    the restored step and lost steps as a range when the repeats differ (the worst case is kept for checks)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["policy"], bool(r.get("cold"))), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r.get("T3") is not None] or group
        row = {**ok[0], "n": len(group), "recovered": sum(r.get("T3") is not None for r in group)}
        for key in NUMERIC:
            values = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        t3 = [r["T3"] for r in ok if r.get("T3") is not None]
        row["T3_range"] = (min(t3), max(t3)) if t3 else None
        for key in ("restored_step", "lost_steps"):
            values = sorted({r[key] for r in ok if r.get(key) is not None})
            row[f"{key}_text"] = "-" if not values else (str(values[0]) if len(values) == 1
                                                        else f"{values[0]}-{values[-1]}")
        lost = [r["lost_steps"] for r in ok if r.get("lost_steps") is not None]
        row["lost_steps"] = max(lost) if lost else None
        out.append(row)
    return out


def render_table(rows: list[dict]) -> str:
    head = ["model", "policy", "period", "runs", "iteration s", "stall per save s", "restored step (source)",
            "lost steps", "T0 s (iters)", "T1 s", "T2 s", "T3 s (range)", "T4 s", "restart T1..T4 s", "total s"]
    return "\n".join(md_table(head, [
        [f"{r['size']} ({r['params'] / 1e6:.0f} M params)", label(r), r["period"], f"{r['recovered']}/{r['n']}",
         fmt(r["iter_s"]), fmt(r["stall_per_save_s"], 3), f"{r['restored_step_text']} ({r['source'] or '-'})",
         r["lost_steps_text"], f"{fmt(r['T0'])} ({fmt(r['T0_iters'], 1)})", fmt(r["T1"]), fmt(r["T2"]), t3_text(r),
         fmt(r["T4"]), fmt(r.get("restart_s")), fmt(r["total"])] for r in rows]))


def t3_text(row: dict) -> str:
    text = fmt(row["T3"], 3)
    if row["n"] > 1 and row["T3_range"]:
        text += f" ({row['T3_range'][0]:.3f}-{row['T3_range'][1]:.3f})"
    return text


def reference_table() -> str:
    return "\n".join(md_table(["model", "checkpoint flush", "restart", "of which load", "T0"], [
        [r["model"], f"~{r['flush_s']} s", f"~{r['restart_s']} s", f"~{r['load_s']} s", r["T0"]] for r in REFERENCE]))


def targets(rows: list[dict], period: int, floors: dict) -> list[dict]:
    """PASS/FAIL of the issue's two targets per model size."""
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        by = {label(r): r for r in rows if r["size"] == size}
        b, warm, cold = by.get("baft"), by.get("deepspeed"), by.get("deepspeed (cold cache)")
        if not b or b["T3"] is None:
            out.append({"size": size, "target": "all", "pass": False, "line": f"{size}: the baft run did not recover"})
            continue
        floor = floors.get(size) or {}
        for disk in (warm, cold):
            if not disk or disk["T3"] is None:
                continue
            ratio = disk["T3"] / b["T3"] if b["T3"] > 0 else float("inf")
            ok = ratio >= 10 and b["source"] == "memory"
            bound = ""
            if floor:
                limit = floor["torch_load_cold_s" if disk.get("cold") else "torch_load_warm_s"] / floor["shm_verify_copy_s"]
                bound = (f"; best possible on this machine (torch.load of the same bytes against a checksummed copy "
                         f"out of shared memory): {limit:.1f}x")
            out.append({"size": size, "target": "a", "against": label(disk), "ratio": ratio, "pass": ok,
                        "line": f"(a) {size}: T3 baft from {b['source']} {b['T3']:.3f} s vs DeepSpeed load_checkpoint "
                                f"({'page cache dropped' if disk.get('cold') else 'page cache warm'}) "
                                f"{disk['T3']:.3f} s: {ratio:.2f}x, target >= 10x: {'PASS' if ok else 'FAIL'}{bound}"})
        if warm and warm["T0"] is not None and b["T0"] is not None:
            # the machine's load varied between runs: convert iterations to seconds with one iteration time
            it = min(b["iter_s"], warm["iter_s"])
            ok = b["lost_steps"] is not None and b["lost_steps"] <= 1 and b["T0"] <= 2 * b["iter_s"]
            out.append({"size": size, "target": "b", "pass": ok, "iteration_s": it,
                        "T0_iters_baft": b["T0"] / b["iter_s"], "T0_iters_disk": warm["T0"] / warm["iter_s"],
                        "expected_T0_baft_s": 1.5 * it, "expected_T0_disk_s": period / 2 * it,
                        "line": f"(b) {size}: T0 baft {b['T0']:.2f} s = {b['T0'] / b['iter_s']:.2f} iterations "
                                f"({b['lost_steps']} finished step redone; snapshot period 1) vs DeepSpeed every "
                                f"{period} steps {warm['T0']:.2f} s = {warm['T0'] / warm['iter_s']:.2f} iterations "
                                f"({warm['lost_steps']} steps redone). Expected over a uniform fault time, at "
                                f"{it:.2f} s per iteration: baft <= 1.5 iterations = {1.5 * it:.2f} s, disk "
                                f"P/2 = {period / 2:g} iterations = {period / 2 * it:.2f} s. Target T0 <= one "
                                f"snapshot period (<= 1 finished step redone): {'PASS' if ok else 'FAIL'}"})
    return out


def draw(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['size']} {label(r)}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.7 * len(rows) + 2.6),
                                      gridspec_kw={"width_ratios": [3, 2]})
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        x = 0.0
        for k in PHASES:
            v = r.get(k) or 0.0
            left.barh(y, v, left=x, color=PHASE_COLOURS[k], edgecolor="white", label=PHASE_NAMES[k] if y == ys[0] else None)
            x += v
        left.text(x, y, f" {x:.1f} s", va="center", fontsize=8)
    left.set_yticks(ys, names, fontsize=8)
    left.set_xlabel("seconds from the fault to the first resumed iteration (T0..T4)")
    left.set_xlim(0, max(sum(r.get(k) or 0.0 for k in PHASES) for r in rows) * 1.15)
    left.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    left.set_title("recovery time per phase", fontsize=9)
    t3 = [max(r.get("T3") or 0.0, 1e-4) for r in rows]
    right.barh(ys, t3, color=[PHASE_COLOURS["T3"] if r["policy"] == "baft" else "#8c564b" for r in rows])
    for y, v, r in zip(ys, t3, rows):
        right.text(v, y, f" {v:.3f} s ({r['source']})", va="center", fontsize=8)
    right.set_xscale("log")
    right.set_yticks(ys, [""] * len(ys))
    right.set_xlabel("T3 state load, seconds (log scale)")
    right.set_title("T3: manager memory vs DeepSpeed load_checkpoint", fontsize=9)
    right.set_xlim(min(t3) / 2, max(t3) * 20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _second_reason(rows: list[dict], mem_rows: list) -> str:
    """The part of the T3 gap that is baft's own: its restore against the floor."""
    if not mem_rows:
        return ""
    ratios = ", ".join(f"{m['as_restored_s'] / m['floor_s']:.1f}x at {s}" for s, m in mem_rows)
    floor_of = dict(mem_rows)
    measured = ", ".join(f"{r['T3'] / floor_of[r['size']]['floor_s']:.1f}x at {r['size']}" for r in rows
                         if r["policy"] == "baft" and r.get("T3") and r["size"] in floor_of)
    return (f"Second, baft's own read path (verify in place, one copy per chunk) takes {ratios} that floor in "
            f"the last table; the T3 measured in the restarted job is {measured} the floor of one stage: the rest is "
            "the agreement between ranks (all-gathers over gloo), creating the optimizer state, and both ranks "
            "restoring at once on 2 cores shared with other work.")


def setup_lines(data: dict, rows: list[dict]) -> list[str]:
    """What ran: model, fault, policies, columns, load."""
    period = data["period"]
    loads = ", ".join(f"{r['size']} {label(r)} {r['load_avg_5min']:.1f}" for r in rows if r.get("load_avg_5min"))
    repeats = max(r["n"] for r in rows)
    return [
        (f"- model: the example GPT, 2 pipeline stages, 1F1B, {COMMON['micro_batches']} micro-batches of "
         f"{COMMON['micro_batch_size']} x {COMMON['seq']} tokens, vocab {COMMON['vocab']}; sizes: "
         + "; ".join(f"{s} = d_model {v['d_model']}, {v['layers']} layers ({v['params'] / 1e6:.1f} M parameters, "
                     f"{12 * v['params'] / 1e9:.2f} GB of fp32 weights and Adam moments)"
                     for s, v in data["sizes"].items())),
        (f"- fault, the same for every run: `--fault {data['fault']}` (rank 1 SIGKILLed in the backward pass of step "
         f"{data['fault_step']}), `--max-restarts 1`, {data['iters']} steps"
         + (f"; every run repeated {repeats} times, interleaved (baft, DeepSpeed, DeepSpeed cold, baft, ...), "
            "and the table shows the median of each time over the repeats (runs = repeats that recovered)"
            if repeats > 1 else "")),
        (f"- baft: `--policy baft --period 1` (snapshot every step, in the bubbles; restore from the node manager's "
         f"shared memory). DeepSpeed: `--policy deepspeed --period {period}` (`engine.save_checkpoint` every "
         f"{period} steps; the restart calls `engine.load_checkpoint`), the fault mid-period. Cold cache: the same "
         f"DeepSpeed run, with the checkpoint files fsynced and dropped from the page cache "
         f"(`posix_fadvise(POSIX_FADV_DONTNEED)`) as soon as the fault fires, so that `load_checkpoint` reads the disk."),
        ("- columns: iteration = median iteration time without the save stall; stall per save = median `stall_s` of "
         "the save iterations (baft: every iteration; DeepSpeed: every period-th); T0..T4 from `RUN_DIR/recovery.jsonl` "
         "(T0 rollback = wall time from the end of the restored step to the kill, T1 process restart by torchrun, "
         "T2 process-group init, T3 state load with its source, T4 the first resumed iteration); "
         "restart = T1+T2+T3+T4."),
        ("- the machine was shared with other work while this ran"
         + (f" (5-minute load average at the end of the runs, median: {loads}, on {os.cpu_count()} cores)"
            if loads else "")
         + ", so iteration times, T0 and T4 carry a lot of noise; compare T3 and ratios, not absolute seconds."),
    ]


def notes(data: dict, rows: list[dict], checks: list[dict]) -> list[str]:
    """Why the figures come out as they do."""
    floors = data.get("load_floor", {})
    mem_rows = [(s, f["memory"]) for s, f in floors.items() if f and f.get("memory")]
    pages = {r["size"]: r["page_cache"] for r in data["runs"] if r.get("page_cache")}
    cold = [f"  - {size}: {pc['files']} files, {gb(pc['bytes'])}; resident in the page cache before "
            f"{gb(pc['resident_before'])}, after {gb(pc['resident_after'])} (dropped {pc['after_fault_s']:.2f} s "
            f"after the kill, in {pc['seconds']:.2f} s)" for size, pc in pages.items()]
    why_a = [("- Why (a) fails here, in two parts. First, the bound on this machine: loading DeepSpeed's checkpoint "
              "with torch.load takes "
              + "; ".join(f"{f['torch_load_warm_s'] / f['shm_verify_copy_s']:.1f}x (page cache warm) and "
                          f"{f['torch_load_cold_s'] / f['shm_verify_copy_s']:.1f}x (from the disk, "
                          f"{f['bytes'] / f['torch_load_cold_s'] / 1e9:.1f} GB/s) as long as checksumming and copying "
                          f"the same bytes out of shared memory ({f['bytes'] / f['shm_verify_copy_s'] / 1e9:.1f} GB/s) "
                          f"at {s}" for s, f in floors.items() if f)
              + " (table below), so no restore from memory reaches 10x here; the reference's slow load is shared "
              "storage (NFS, 4.8 GB/s read for 8 accelerators; ~90 s for 15B) against host memory in every process. "
              + _second_reason(rows, mem_rows))]
    return [
        ("- T0: baft copies the snapshot of step k during iteration k+1 and commits it just before that iteration's "
         "optimizer step, so a fault before the commit redoes one finished step plus the interrupted part of the "
         "iteration: T0 is between 1 and 2 iterations before the commit and under 1 iteration after it (about 1.5 "
         "iterations expected over a uniform fault time). A disk checkpoint every P steps loses P/2 iterations on "
         "average; the fault here sits mid-period for it."),
        ("- T3 (DeepSpeed, warm): the checkpoint was written a few iterations before the fault and is still in the "
         "page cache, so `load_checkpoint` reads memory, not disk; its time is torch.load's unpickling and the copies "
         "into the engine. The cold-cache row reads the disk (here a VM's virtual disk, itself fast)."
         + ("" if not cold else "\n- page cache in the cold runs:\n" + "\n".join(cold))),
        *(why_a if any(c["target"] == "a" and not c["pass"] for c in checks) else []),
        ("- T1 and T2 (torchrun restarting the processes; Python, torch and DeepSpeed imports; gloo init) are the "
         "same work for both policies and dominate the restart on this machine; baft changes T0 and T3."),
    ]


def floor_tables(floors: dict) -> list[str]:
    """The lower bounds of T3, and where baft's own restore from memory spends its time."""
    loads = [(s, f) for s, f in floors.items() if f]
    lines = [
        "## Lower bounds of T3 on this machine (one process, one thread, no training running)", "",
        ("The newest DeepSpeed checkpoint of each size, loaded file by file with `torch.load` (page cache warm, and "
         "after dropping it), against the same number of bytes checksummed (as baft's commit records) and "
         "copied out of shared memory: what a restore from memory costs at least."), "",
        *md_table(["model", "checkpoint", "torch.load, warm", "torch.load, cold", "shm checksum + copy", "warm / shm",
                   "cold / shm"],
                  [[s, f"{gb(f['bytes'])} in {f['files']} files", f"{f['torch_load_warm_s']:.3f} s",
                    f"{f['torch_load_cold_s']:.3f} s", f"{f['shm_verify_copy_s']:.3f} s",
                    f"{f['torch_load_warm_s'] / f['shm_verify_copy_s']:.1f}x",
                    f"{f['torch_load_cold_s'] / f['shm_verify_copy_s']:.1f}x"] for s, f in loads]), ""]
    mem_rows = [(s, f["memory"]) for s, f in loads if f.get("memory")]
    if mem_rows:
        lines += [
            "## Where baft's T3 from memory goes (one stage, baft's own store, one process)", "",
            ("One snapshot of one stage's bytes per rank committed with `baft.snapshot.slots.SnapshotWriter`, then "
             "what one rank's restore (`baft.recovery.restore`) does with them: read and verify the slots "
             "(`slots.map_verified`: its own stage's slot only, checksummed in place), then copy the state into the "
             "engine's tensors chunk by chunk. The floor checksums the slot in place and copies it into a tensor once."),
            "",
            *md_table(["model", "stage state", "read path", "slots read", "read + verify", "copy into tensors",
                       "as restored", "floor", "as restored / floor"],
                      [[s, gb(m["stage_bytes"]), f"`{m['path']}`", m["slots_read"], f"{m['read_s']:.3f} s",
                        f"{m['copy_s']:.3f} s", f"{m['as_restored_s']:.3f} s", f"{m['floor_s']:.3f} s",
                        f"{m['as_restored_s'] / m['floor_s']:.1f}x"] for s, m in mem_rows]), ""]
    return lines


def write_outputs(data: dict, out: Path) -> None:
    """Print the table and targets; write recovery.md, .json and .png under ``out``."""
    rows = aggregate(data["runs"])
    checks = targets(rows, data["period"], data.get("load_floor", {}))
    data["targets"] = checks
    text = render_table(rows)
    print("\n" + text + "\n")
    for c in checks:
        print(c["line"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(data, indent=2) + "\n")
    draw(rows, out / "recovery.png", f"baft vs DeepSpeed checkpoint: rank 1 killed in the backward pass of step "
                                     f"{data['fault_step']}; {data['date']}; {data['machine'].split(',')[0]}, "
                                     f"{os.cpu_count()} cores")
    md = [
        "# Recovery time: baft's in-memory snapshot against DeepSpeed's disk checkpoint", "",
        *header({"revision": data.get("baft_commit"), **data}, data["wall_s"]),  # older results: baft_commit
        *setup_lines(data, rows), "", text, "",
        "## Targets", "", *[f"- {c['line']}" for c in checks], "",
        "## Notes", "", *notes(data, rows, checks), "",
        *floor_tables(data.get("load_floor", {})),
        "## The public reference, for shape (DESIGN.md, \"Reference figures\")", "",
        "GPT-3 on one 8-accelerator server, NFS at 2.7 GB/s write and 4.8 GB/s read, checkpoint once an hour:", "",
        reference_table(), "",
        ("Scaled to this machine: 'checkpoint flush' is the stall per save column, 'restart' is T1..T4, "
         "'of which load' is T3, and T0 is the rollback column."), "",
        "![recovery phases](recovery.png)", "",
    ]
    (out / "recovery.md").write_text("\n".join(md))
    print(f"wrote {out / 'recovery.md'}, {out / 'recovery.json'} and {out / 'recovery.png'}")


def run_one(run_dir: Path, size: str, rep: int, variant: tuple, args, fault: str) -> dict:
    """One faulted ``baft train`` run and its figures."""
    policy, period, cold = variant
    shutil.rmtree(run_dir, ignore_errors=True)
    dropper = CacheDropper(run_dir) if cold else None
    if dropper:
        dropper.start()
    code, secs = train(run_dir, flags({**COMMON, **SIZES[size]}) + [
        "--iters", str(args.iters), "--policy", policy, "--period", str(period), "--fault", fault,
        "--max-restarts", "1"])
    if dropper:
        dropper.stop.set()
        dropper.join()
    clean_shm(run_dir)
    row = {**measure(run_dir, policy, period, size, args.iters), "cold": cold, "repeat": rep, "exit_code": code,
           "wall_s": secs, "load_avg_5min": os.getloadavg()[1], "page_cache": dropper.result if dropper else None}
    print(f"{size:>4} #{rep} {label(row):<24} restored {row['restored_step']} ({row['source']})  "
          f"lost {row['lost_steps']}  " + "  ".join(f"{k} {fmt(row[k], 3)}" for k in PHASES)
          + f"  total {fmt(row['total'])} s  stall/save {fmt(row['stall_per_save_s'], 3)} s  [{secs:.0f} s]",
          flush=True)
    if dropper and dropper.result:
        print(f"     page cache: {dropper.result}", flush=True)
    return row


def floors_of(checkpoints: Path) -> dict:
    """The lower bounds of T3 for one size, from its DeepSpeed checkpoint."""
    floor = load_floor(checkpoints)
    if floor:
        floor["memory"] = memory_restore(floor["bytes"] // 2)
        print(f"     load floor, {gb(floor['bytes'])}: torch.load warm {floor['torch_load_warm_s']:.3f} s, cold "
              f"{floor['torch_load_cold_s']:.3f} s; shm checksum+copy {floor['shm_verify_copy_s']:.3f} s; "
              f"baft memory restore of one stage {floor['memory']}", flush=True)
    return floor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="17M,92M", help=f"model sizes, of {', '.join(SIZES)}")
    p.add_argument("--iters", type=int, default=12, help="train until this step")
    p.add_argument("--period", type=int, default=6, help="DeepSpeed checkpoint period (steps)")
    p.add_argument("--fault-step", type=int, help="step whose backward pass rank 1 dies in "
                                                  "(default: period + period/2 + 1, mid-period for the disk baseline)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-page-cache DeepSpeed run")
    p.add_argument("--repeats", type=int, default=3, help="runs of every (size, policy), interleaved; medians reported")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--keep", help="keep the run directories here (default: a temporary directory, removed)")
    p.add_argument("--render", metavar="JSON", help="only rewrite the table, md and PNG from a recovery.json")
    args = p.parse_args(argv)
    if args.render:
        write_outputs(json.loads(Path(args.render).read_text()), Path(args.out))
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        p.error(f"unknown size {unknown[0]!r}; known: {', '.join(SIZES)}")
    fault_step = args.fault_step or args.period + args.period // 2 + 1
    if not args.period < fault_step <= args.iters:
        p.error(f"the fault step ({fault_step}) must come after the first checkpoint (step {args.period}) "
                f"and by --iters ({args.iters})")
    fault = f"rank=1,step={fault_step},phase=backward"

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="baft-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    started, prov = time.time(), provenance()
    print(f"machine: {prov['machine']}\ncommand: {prov['command']}\nrun directories: {work}", flush=True)
    variants = [("baft", 1, False), ("deepspeed", args.period, False)] + \
        ([] if args.no_cold else [("deepspeed", args.period, True)])
    rows, floors = [], {}
    for size, rep, variant in ((s, r, v) for s in sizes for r in range(args.repeats) for v in variants):
        run_dir = work / f"{size}-{variant[0]}{'-cold' if variant[2] else ''}-{rep}"
        rows.append(run_one(run_dir, size, rep, variant, args, fault))
        if variant == ("deepspeed", args.period, False) and size not in floors:
            floors[size] = floors_of(run_dir / "checkpoints")
        if not args.keep and variant[0] != "baft":
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)

    data = {**prov, "wall_s": round(time.time() - started, 1), "iters": args.iters, "period": args.period,
            "fault": fault, "fault_step": fault_step,
            "sizes": {s: {**SIZES[s], **COMMON, "params": parameters(s)} for s in sizes},
            "runs": rows, "load_floor": floors, "reference": REFERENCE}
    write_outputs(data, Path(args.out))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
