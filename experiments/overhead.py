"""Experiment 1 (overhead): what each snapshot policy costs per training iteration, measured interleaved.

    python experiments/overhead.py [--rounds R] [--iters K] [--model-size small|medium]
                                   [--schedule 1f1b|gpipe] [--all] [--out experiments/results]

Trains the 2-stage example GPT (8 micro-batches of 2 x 128 tokens) on this machine under every
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
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baft.cli.launch import launch_env, torchrun
from baft.cli.machine import cpu_model, now
from overhead_analysis import analyse, target_lines
from overhead_report import config_name, render, write_grid, write_outputs

HERE = Path(__file__).resolve().parent
WORKER = HERE / "overhead_worker.py"

# 8 micro-batches of 2 x 128 = 256 tokens: one iteration of the small model takes ~3 s on this 2-core machine
# (4 x 128 took 5-8 s), and the last stage's bubble (~130 ms profiled) still holds its state copy (~30-60 ms)
COMMON = {"stages": 2, "micro_batches": 8, "micro_batch_size": 2, "seq": 128, "vocab": 4096}
SIZES = {
    "small": {"d_model": 384, "layers": 8, "heads": 6},
    "medium": {"d_model": 512, "layers": 8, "heads": 8},
}


# ---------------------------------------------------------------------------------------------
# machine


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
    name = f"overhead-{size}-{schedule}" + (f"-{args.tag}" if args.tag else "")
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
            keep = out / f"{name}-profile-failed.log"
            shutil.copy(work / "profile.log", keep)
            raise SystemExit(f"baft profile failed (exit {code}); its whole log is in {keep}:\n{tail(work / 'profile.log')}")
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
            keep = out / f"{name}-failed.log"
            shutil.copy(work / "run.log", keep)
            raise SystemExit(f"the overhead run failed (exit {code}); its whole log is in {keep}:\n{tail(work / 'run.log')}")
        doc = json.loads(raw.read_text())
        doc.update(config={"size": size, "schedule": schedule, "tag": args.tag, **opts}, bubble_map=str(bmap),
                   profile_seconds=profile_s, run_seconds=time.time() - t1,
                   load_average={"before": load_before, "after": os.getloadavg()})
        return doc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def wait_quiet(limit: float, threshold: float = 1.0) -> None:
    """Other jobs on a 2-core machine swamp a 1% effect: give them a chance to finish first."""
    start = time.time()
    while limit > 0 and os.getloadavg()[0] >= threshold and time.time() - start < limit:
        print(f"waiting for a quieter machine: load average {os.getloadavg()[0]:.2f} "
              f"({time.time() - start:.0f}/{limit:.0f} s)", flush=True)
        time.sleep(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds of none A none B ... (default 4; 2 with --all)")
    p.add_argument("--iters", type=int, default=2,
                   help="iterations per policy per round (the first of each is discarded if it runs slower)")
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--all", action="store_true", help="run the 2 x 2 grid of model size x schedule")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--profile-iters", type=int, default=6, help="iterations `baft profile` measures")
    p.add_argument("--policies", default="none,deepspeed,deepspeed/10,torch-save,sync-copy,thread-copy,dcp-async,baft",
                   help="comma-separated subset, in the order they take turns")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="before each configuration, wait up to SECONDS for the 1-minute load average to drop below 1")
    p.add_argument("--tag", default="", help="suffix for the output names (overhead-<size>-<schedule>-<tag>.*)")
    p.add_argument("--rerender", metavar="RESULT.json", nargs="+",
                   help="re-analyse runs' overhead-<size>-<schedule>.json and rewrite their .md/.png (no training); "
                        "given the runs of an --all grid, rewrite overhead-grid.* too")
    args = p.parse_args(argv)
    if args.rerender:
        runs = []
        for path in map(Path, args.rerender):
            saved = json.loads(path.read_text())
            doc, result = saved["raw"], analyse(saved["raw"])
            stem = write_outputs(doc, result, path.parent, saved["date"], saved["command"], saved["machine"])
            print(render(doc, result, saved["date"], saved["command"], saved["machine"]))
            print(f"wrote {stem}.md, .json, .png")
            runs.append((doc, result))
        if len(runs) > 1:
            write_grid(runs, path.parent, saved["date"], saved["command"], saved["machine"])
            print(f"wrote {path.parent / 'overhead-grid.md'}, .json, .png")
        return 0
    if args.iters < 2:
        p.error("--iters must be at least 2 (to tell whether the first iteration of a block runs slower)")
    if args.rounds is None:
        args.rounds = 2 if args.all else 4
    if "none" not in args.policies.split(","):
        p.error("--policies must include none (the baseline)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python experiments/overhead.py" + (" " + shlex.join(given) if given else "")
    mach = machine()
    when = now()
    grid = [(s, sch) for s in ("small", "medium") for sch in ("1f1b", "gpipe")] if args.all \
        else [(args.model_size, args.schedule)]
    runs = []
    for size, schedule in grid:
        wait_quiet(args.wait_quiet)
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
        for line in target_lines(r):
            print(f"{config_name(d)}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
