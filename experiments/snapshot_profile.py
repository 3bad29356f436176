"""Where a snapshot's cost goes, arm by arm: the device's checksums, the copy, the trainer's thread.

    torchrun --nproc-per-node 1 experiments/snapshot_profile.py --out DIR [--rounds 6] [--block 3] \
        --stages 1 --precision bf16 --d-model 2048 ...   # the example's model arguments (baft compare's)

One engine, two arms interleaved in blocks (none, baft/1, none), round after round, as ``baft compare``
interleaves policies: ``baft/1`` is baft's executor at period 1, every chunk's checksum computed as it is copied
(on a GPU by kernels on the copy stream; without them the seal's host threads read all 11.5 GB of the
0.82B-parameter model every iteration: 2.1 s iterations against 1.0 s on an H200, gpu.md section 7).

Then one iteration of ``baft/1`` under ``torch.profiler`` (host, and on a GPU the device) gives the device's busy
time per stream, the copies' and the checksum kernels' share, and the host's operators by their own CPU time;
one under cProfile gives baft's functions on the trainer's thread (one iteration each: a profiler's trace of
11,000 chunks takes minutes to read). Writes ``DIR/profile.json`` and ``DIR/profile.md`` after the rounds and
again after the profiles; an arm's overhead is the median of its block against the ``none`` blocks around it
(per round, then the median of rounds).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from baft.benchmark import Meter, make_hook, set_up, timed_batch
from baft.examples import worker
from baft.pipeline.hook import Hooks
from baft.snapshot import copy as snapshot_copy

ARMS = ("none", "baft/1")
BAFT_DIR = Path(snapshot_copy.__file__).parent.parent
THE_TRAINING = (str(BAFT_DIR / "pipeline" / "engine.py"), str(BAFT_DIR / "examples"))  # the engine and model, not baft's cost


def arm(engine, meters: dict, name: str) -> None:
    """Make ``name`` (``meters``: by policy name) the arm that runs."""
    engine.baft.hooks = Hooks(policy=meters[name])


def device_summary(prof) -> dict:
    """The profiled block's device time: per stream, the copies, and the checksum's kernels."""
    by_stream, copies, kernels = defaultdict(float), 0.0, defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        by_stream[str(getattr(event, "device_resource_id", "?"))] += us / 1e3
        if "Memcpy" in event.name:
            copies += us / 1e3
        else:
            kernels[event.name[:80]] += us / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"ms_by_stream": dict(by_stream), "memcpy_ms": copies, "top_kernels_ms": top}


def host_summary(prof, limit: int = 25) -> list:
    """Host operators by their own CPU time in the profiled block."""
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:limit]


def baft_functions(stats: pstats.Stats, limit: int = 15) -> list:
    """baft's own functions on the trainer's thread, by cumulative time: (name, ms, calls)."""
    rows = [(f"{Path(file).name}:{line} {fn}", cum * 1e3, calls)
            for (file, line, fn), (_, calls, _, cum, _) in stats.stats.items()
            if file.startswith(str(BAFT_DIR)) and not file.startswith(THE_TRAINING)]
    return sorted(rows, key=lambda r: -r[1])[:limit]


def profiled(engine, data) -> dict:
    """One iteration under ``torch.profiler`` (operators, and a GPU's kernels by stream), then one under cProfile
    (baft's Python on the trainer's thread; the seal's thread is not in it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        walls = [timed_batch(engine, data)]
    python = cProfile.Profile()
    python.runcall(timed_batch, engine, data)
    out = {"walls_s": walls, "host_ms": host_summary(prof), "baft_ms": baft_functions(pstats.Stats(python))}
    if torch.cuda.is_available():
        out["device"] = device_summary(prof)
    return out


def report(doc: dict) -> str:
    lines = ["| arm | median iteration | overhead (median of rounds) | per round |", "|---|---|---|---|"]
    for name in ARMS:
        med = statistics.median(doc["walls"][name]) * 1e3
        rounds = doc["overheads"].get(name, [])
        over = f"{statistics.median(rounds) * 100:+.1f}%" if rounds else ""
        lines.append(f"| {name} | {med:.1f} ms | {over} | {', '.join(f'{r * 100:+.1f}' for r in rounds)} |")
    for name, prof in doc.get("profiles", {}).items():
        lines += ["", f"### {name}, profiled (one iteration: {prof['walls_s'][0] * 1e3:.0f} ms)", ""]
        if "device" in prof:
            dev = prof["device"]
            lines.append(f"device ms by stream: {json.dumps({k: round(v, 1) for k, v in dev['ms_by_stream'].items()})}; "
                         f"copies {dev['memcpy_ms']:.1f} ms")
            lines += [f"- {ms:.1f} ms {name_}" for name_, ms in dev["top_kernels_ms"]]
        lines += ["", "host operators, own CPU time:"] + [f"- {ms:.1f} ms x{n} {key}" for key, ms, n in prof["host_ms"]]
        lines += ["", "baft on the trainer's thread, cumulative (cProfile, its own overhead included):"]
        lines += [f"- {ms:.1f} ms x{n} {key}" for key, ms, n in prof["baft_ms"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="snapshot_profile")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=3)
    ours, model_argv = p.parse_known_args(argv)
    args = worker.parse_args([*model_argv, "--executor", "stream", "--leftovers", "start"])
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    engine, data = worker.build(args)
    engine.train_batch(data_iter=data)  # the optimizer state every snapshot copies
    shm = argparse.Namespace(shm_dir=f"/dev/shm/baft-profile-{dist.get_rank()}", disk_dir=str(out / "disk"))
    baft = Meter(make_hook(("baft/1", "baft", 1), engine, data, shm, args))
    set_up(engine, data, baft)
    meters = {"none": Meter(None), "baft/1": baft}  # none under the same wrapper, as compare runs it
    walls: dict[str, list[float]] = {name: [] for name in ARMS}
    overheads: dict[str, list[float]] = defaultdict(list)
    for round_ in range(ours.rounds):
        blocks = []
        for name in ("none", "baft/1", "none"):
            arm(engine, meters, name)
            times = [timed_batch(engine, data) for _ in range(ours.block)][1:]  # the first of a block: a change of arm
            walls[name] += times
            blocks.append(statistics.median(times))
        overheads["baft/1"].append(blocks[1] / ((blocks[0] + blocks[2]) / 2) - 1)
        print(f"round {round_ + 1}/{ours.rounds}: " + ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in
                                                               zip(("none", "baft/1", "none"), blocks)), flush=True)
    doc = {"argv": sys.argv[1:], "walls": walls, "overheads": dict(overheads), "profiles": {},
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    write(out, doc)  # the rounds, should the profiles not finish in the time a lent GPU has left
    arm(engine, meters, "baft/1")
    timed_batch(engine, data)
    doc["profiles"]["baft/1"] = profiled(engine, data)
    arm(engine, meters, "none")
    baft.inner.close()
    shutil.rmtree(shm.shm_dir, ignore_errors=True)
    write(out, doc)
    print(report(doc))
    return 0


def write(out: Path, doc: dict) -> None:
    (out / "profile.json").write_text(json.dumps(doc))
    (out / "profile.md").write_text(report(doc))


if __name__ == "__main__":
    sys.exit(main())
