"""torchrun's restart rendezvous, as torch ships it and as ``baft train`` runs it (:mod:`baft.cli.torchrun`).

    python experiments/rendezvous.py [--rounds 10] [--out experiments/results]

After a rank fails, torchrun's agent stops the others and joins the next round of its rendezvous before it starts
any rank again: part of every relaunch's T1. Each launch here runs two ranks of a script that fails on rank 1 in
the first attempt and ends at once in the second (``--max-restarts 1 --monitor-interval 0.1 --standalone``, as
``baft train``), with torchrun's INFO log; the restart's rendezvous is the time between its "Rendezvous'ing worker
group" and "Rendezvous complete" lines after "Worker group FAILED". Arms: ``torch`` (``python -m
torch.distributed.run``), ``baft`` (``python -m baft.cli.torchrun``), and ``torch again`` (the first arm run again:
the A/A check of the method); each in a launcher that imported torch and DeepSpeed first (``warm``, as one forked
from the warm server) and one that did not (``new``). Every round runs every arm once, in a drawn order. Ratios
are geometric means over the rounds' pairs with 95% bootstrap intervals. Writes ``rendezvous.md`` and
``rendezvous.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from baft.cli.launch import launch_env
from common import RESULTS, geometric_mean_ratio, header, md_table, provenance

FAILS_ONCE = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(1)
"""
MODULES = {"torch": "torch.distributed.run", "baft": "baft.cli.torchrun", "torch again": "torch.distributed.run"}
PRELOADS = {"new": "", "warm": "import torch, deepspeed; "}
ARMS = [(launcher, preload) for preload in PRELOADS for launcher in MODULES]
RATIOS = (("baft", "torch"), ("torch again", "torch"))


def restart_rendezvous(module: str, preload: str, script: Path) -> float:
    """Seconds the agent's rendezvous took on its restart (one launch)."""
    code = (f"{PRELOADS[preload]}import runpy, sys; sys.argv = ['torchrun', *sys.argv[1:]]; "
            f"runpy.run_module({module!r}, run_name='__main__')")
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", "--", str(script)]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=launch_env({"LOGLEVEL": "INFO"}))
    if done.returncode != 0:
        raise SystemExit(f"{module} ({preload}) failed: {done.stderr[-2000:]}")
    lines = done.stderr.splitlines()
    failed = next(i for i, line in enumerate(lines) if "Worker group FAILED" in line)
    began = next(line for line in lines[failed:] if "Rendezvous'ing worker group" in line)
    ended = next(line for line in lines[failed:] if "Rendezvous complete" in line)
    return _clock(ended) - _clock(began)


def _clock(line: str) -> float:
    """The time of day of a torch log line (``I1126 22:30:09.049000 ...``), in seconds."""
    stamp = datetime.strptime(line.split()[1], "%H:%M:%S.%f")
    return stamp.hour * 3600 + stamp.minute * 60 + stamp.second + stamp.microsecond / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    prov, start = provenance(), time.time()
    times: dict[str, list[float]] = {f"{launcher}, {preload}": [] for launcher, preload in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fails_once.py"
        script.write_text(FAILS_ONCE)
        order = random.Random(0)
        for done in range(args.rounds):
            for launcher, preload in order.sample(ARMS, len(ARMS)):
                times[f"{launcher}, {preload}"].append(restart_rendezvous(MODULES[launcher], preload, script))
            print(f"round {done + 1}/{args.rounds}", file=sys.stderr, flush=True)
    rows = [[arm, len(t), f"{statistics.median(t) * 1000:.1f}", f"{min(t) * 1000:.1f}–{max(t) * 1000:.1f}"]
            for arm, t in times.items()]
    ratios = []
    for preload in PRELOADS:
        for arm, base in RATIOS:
            logs = [math.log(max(a, 1e-4) / max(b, 1e-4))
                    for a, b in zip(times[f"{arm}, {preload}"], times[f"{base}, {preload}"])]
            mean, (low, high) = geometric_mean_ratio(logs)
            ratios.append(f"- {preload} launcher, {arm} / {base}: {mean:.3f}x (95% interval {low:.3f}–{high:.3f})")
    wall = time.time() - start
    lines = ["# torchrun's restart rendezvous: as torch ships it, and as baft train runs it", "",
             *header(prov, wall), f"- {args.rounds} rounds, every arm once a round in a drawn order; a launch: 2 "
             f"ranks, rank 1 fails in the first attempt (`--max-restarts 1 --monitor-interval 0.1 --standalone`)",
             "- warm: the launcher imported torch and DeepSpeed first (as one forked from baft's warm server); new: "
             "it did not", "", *md_table(["arm", "launches", "restart rendezvous ms (median)", "range ms"], rows), "",
             "## Ratios (geometric mean over the rounds' pairs)", "", *ratios, ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rendezvous.md").write_text("\n".join(lines))
    (args.out / "rendezvous.json").write_text(json.dumps({"provenance": prov, "wall_s": wall, "seconds": times},
                                                         indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
