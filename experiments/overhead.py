"""Experiment 1 (overhead): what each snapshot policy costs per training iteration, measured interleaved.

    python experiments/overhead.py [--rounds R] [--iters K] [--model-size small|medium]
                                   [--schedule 1f1b|gpipe] [--all] [--policies a,b,...] [--tag T]
                                   [--wait-quiet S] [--out experiments/results] [--render RESULT.json ...]

For each configuration of the 2-stage example GPT (8 micro-batches of 2 x 128 tokens),
``baft profile`` measures the bubbles, then ``baft compare --none-between`` runs every policy
on one engine, taking turns with none between every two (none A none B ...), K iterations per
block, R rounds, so drift of the machine hits them all alike. Policies: none; DeepSpeed
``save_checkpoint`` every iteration and every 10; ``torch.save`` every iteration; a synchronous
host copy every iteration (CheckFreq's snapshot phase); a background thread copy that ignores
bubbles; ``torch.distributed.checkpoint.async_save``; and baft, planned from the bubble map just
measured (the product workflow). ``overhead_report.py`` analyses the run.

Writes, under ``--out``: ``overhead-<size>-<schedule>[-<tag>].md`` (tables, targets, findings,
machine, command, date), ``.json`` (the analysis and every iteration's raw figures), ``.png``
(overhead per policy) and ``-bubblemap.json`` / ``-bubblemap.plan.json`` (the profile baft
planned from). ``--all`` runs the 2 x 2 grid (small/medium model x 1F1B/GPipe) and adds
``overhead-grid.md|json|png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baft.cli.launch import flags
from common import RESULTS, provenance
from overhead_report import AA, analyse, config_name, render, target_lines, write_grid, write_outputs

# 8 micro-batches of 2 x 128 = 256 tokens: one iteration of the small model takes ~3 s on this 2-core machine
# (4 x 128 took 5-8 s), and the last stage's bubble (~130 ms profiled) still holds its state copy (~30-60 ms)
COMMON = {"stages": 2, "micro_batches": 8, "micro_batch_size": 2, "seq": 128, "vocab": 4096}
SIZES = {
    "small": {"d_model": 384, "layers": 8, "heads": 6},
    "medium": {"d_model": 512, "layers": 8, "heads": 8},
}
POLICIES = "none,deepspeed,deepspeed/10,torch-save,sync-copy,thread-copy,dcp-async,baft"


def baft(*args: str) -> float:
    """``baft ARGS`` in a subprocess, its output shown; the seconds it took. Stops the experiment if it fails."""
    start = time.time()
    code = subprocess.run([sys.executable, "-m", "baft.cli", *args]).returncode
    if code != 0:
        raise SystemExit(f"baft {args[0]} failed (exit code {code}); its output is above")
    return time.time() - start


def run_config(size: str, schedule: str, args, out: Path) -> dict:
    """Profile, then run every policy interleaved; the run's document, as ``baft compare --out`` writes it."""
    name = f"overhead-{size}-{schedule}" + (f"-{args.tag}" if args.tag else "")
    opts = {**COMMON, **SIZES[size], "schedule": schedule}
    bmap = out / f"{name}-bubblemap.json"
    print(f"== {name}: profiling the bubbles ({args.profile_iters} iterations) -> {bmap}", flush=True)
    profiled = baft("profile", "--example", "gpt", *flags(opts), "--iters", str(args.profile_iters), "--out", str(bmap))
    print(f"== {name}: {args.policies} x {args.rounds} rounds x {args.iters} iterations, none between", flush=True)
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="baft-overhead-") as tmp:
        raw = Path(tmp) / "compare.json"
        ran = baft("compare", *flags(opts), "--policies", args.policies, "--rounds", str(args.rounds),
                   "--block", str(args.iters), "--none-between", "--bubble-map", str(bmap), "--out", str(raw))
        doc = json.loads(raw.read_text())
    doc.update(config={"size": size, "schedule": schedule, "tag": args.tag, **opts}, bubble_map=str(bmap),
               profile_seconds=profiled, run_seconds=ran,
               load_average={"before": before, "after": os.getloadavg()[0]})
    return doc


def wait_quiet(limit: float, threshold: float = 1.0) -> None:
    """Other jobs on a 2-core machine swamp a 1% effect: give them a chance to finish first."""
    start = time.time()
    while limit > 0 and os.getloadavg()[0] >= threshold and time.time() - start < limit:
        print(f"waiting for a quieter machine: load average {os.getloadavg()[0]:.2f} "
              f"({time.time() - start:.0f}/{limit:.0f} s)", flush=True)
        time.sleep(30)


def rerender(paths: list[Path]) -> None:
    """Re-analyse saved runs and rewrite their outputs beside them (and the grid's, given several)."""
    runs = []
    for path in paths:
        saved = json.loads(path.read_text())
        prov = {k: saved[k] for k in ("machine", "command", "date", "revision")}
        doc, result = saved["raw"], analyse(saved["raw"])
        stem = write_outputs(doc, result, path.parent, prov)
        print(render(doc, result, prov))
        print(f"wrote {stem}.md, .json, .png")
        runs.append((doc, result))
    if len(runs) > 1:
        write_grid(runs, paths[-1].parent, prov)
        print(f"wrote {paths[-1].parent / 'overhead-grid.md'}, .json, .png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds of none A none B ... (default 4; 2 with --all)")
    p.add_argument("--iters", type=int, default=2,
                   help="iterations per policy per round (the first of each is discarded)")
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--all", action="store_true", help="run the 2 x 2 grid of model size x schedule")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--profile-iters", type=int, default=6, help="iterations `baft profile` measures")
    p.add_argument("--policies", default=POLICIES, help="comma-separated, in the order they take turns "
                                                        "(as `baft compare --policies`; none runs between every two)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="before each configuration, wait up to SECONDS for the 1-minute load average to drop below 1")
    p.add_argument("--tag", default="", help="suffix for the output names (overhead-<size>-<schedule>-<tag>.*)")
    p.add_argument("--render", metavar="RESULT.json", nargs="+", type=Path,
                   help="re-analyse saved runs and rewrite their .md/.png (no training); given the runs of an --all "
                        "grid, rewrite overhead-grid.* too")
    args = p.parse_args(argv)
    if args.render:
        rerender(args.render)
        return 0
    if args.iters < 2:
        p.error("--iters must be at least 2 (to tell whether the first iteration of a block runs slower)")
    args.rounds = args.rounds or (2 if args.all else 4)
    if AA not in args.policies.split(","):
        args.policies = f"{args.policies},{AA}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    grid = [(s, sch) for s in SIZES for sch in ("1f1b", "gpipe")] if args.all else [(args.model_size, args.schedule)]
    runs = []
    for size, schedule in grid:
        wait_quiet(args.wait_quiet)
        doc = run_config(size, schedule, args, out)
        result = analyse(doc)
        stem = write_outputs(doc, result, out, prov)
        runs.append((doc, result))
        print("\n" + render(doc, result, prov) + f"\nwrote {stem}.md, .json, .png", flush=True)
    if args.all:
        write_grid(runs, out, prov)
        print(f"wrote {out / 'overhead-grid.md'}, .json, .png")
    print()
    for doc, result in runs:
        for line in target_lines(result):
            print(f"{config_name(doc)}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
