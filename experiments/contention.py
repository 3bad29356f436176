"""How much a snapshot copy on one core slows the training compute on the other (CPU only).

    python experiments/contention.py [--tokens 32] [--minutes 4] [--out experiments/results]

On a CPU a stage's bubble is time its core waits in a receive while the other stage computes,
so a copy inside one stage's bubble runs beside the other stage's compute and shares the
memory system with it. baft's planner counts the copy as free when it fits the bubble; this
measures what it costs the other core. Two processes, one thread each, as two ranks under
torchrun: one runs forward and backward passes of one stage of the sweep's example (half of
its blocks, d_model 768, one sequence of ``--tokens`` tokens), back to back; the other cycles
through four phases of ``--phase-seconds`` each:

* ``idle`` - sleeps;
* ``copy+checksum`` - copies a stage's state (fp32 weights and Adam's two moments of half the
  example, 1 MiB at a time) into a host buffer and checksums each chunk, as baft's CPU
  executor does inside a bubble;
* ``idle`` again - the A/A check: the compute against itself;
* ``copy`` - the same copy without the checksums.

Each pass is labelled with the phase it ran in (passes that straddle a change are dropped);
per cycle, a phase's mean pass time over the mean of the idle phase before it is one paired
ratio, and the slowdown is their geometric mean, with a 95% interval resampling cycles. The
copier's bandwidth is what a copy inside a bubble gets while the other core computes.
Writes ``contention.md`` and ``contention.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

from baft.examples.gpt import Block, GPTConfig
from baft.snapshot.layout import DEFAULT_CHUNK_BYTES as CHUNK, checksum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, geometric_mean_ratio, header, md_table, provenance  # noqa: E402
from sweep import MODEL  # noqa: E402

PHASES = ("idle", "copy+checksum", "idle again", "copy")


def example(tokens: int) -> GPTConfig:
    """The sweep's state-heavy example (experiments/sweep.py), at ``tokens`` per micro-batch."""
    return GPTConfig(d_model=MODEL["d_model"], layers=MODEL["layers"], heads=MODEL["heads"], vocab=MODEL["vocab"],
                     seq=tokens)


def compute(cfg: GPTConfig, phase, stop, out) -> None:
    """Forward and backward passes of one stage, each with the phase it ran in (or None)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*(Block(cfg) for _ in range(cfg.layers // 2)))
    x = torch.randn(1, cfg.seq, cfg.d_model)
    passes = []
    while not stop.is_set():
        before, start = phase.value, time.perf_counter()
        stage(x).sum().backward()
        seconds, after = time.perf_counter() - start, phase.value
        passes.append((before if before == after else None, seconds))
    out.put(passes)


def copier(state_bytes: int, cycles: int, phase_seconds: float, phase, stop, out) -> None:
    """Cycles through :data:`PHASES`; the bytes per second of each copy phase."""
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (state_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the destination, as a slot written every iteration
    rates: dict[str, list[float]] = {name: [] for name in PHASES if name.startswith("copy")}
    time.sleep(2 * phase_seconds)  # the compute process warms up
    for _ in range(cycles):
        for k, name in enumerate(PHASES):
            phase.value = k
            start = time.perf_counter()
            end, copied = start + phase_seconds, 0
            if name.startswith("idle"):
                time.sleep(phase_seconds)
                continue
            while time.perf_counter() < end:
                for offset in range(0, state_bytes, CHUNK):
                    piece = dst[offset:offset + CHUNK]
                    piece.copy_(src[offset:offset + CHUNK])
                    if name == "copy+checksum":
                        checksum(piece.numpy())
                    copied += piece.numel()
                    if time.perf_counter() >= end:
                        break
            rates[name].append(copied / (time.perf_counter() - start))
    phase.value = -1
    stop.set()
    out.put(rates)


def analyse(passes: list[tuple]) -> dict:
    """Per phase against the idle phase before it: geometric-mean slowdown of a pass, 95% interval."""
    by_cycle: dict[int, dict[int, list[float]]] = {}
    # the copier's phase counter runs 0..3 per cycle; passes arrive in time order, so cycles are counted
    # where the phase goes back to 0
    cycle, last = -1, None
    for k, seconds in passes:
        if k is None or k < 0:
            continue
        if k == 0 and last != 0:
            cycle += 1
        last = k
        if cycle >= 0:
            by_cycle.setdefault(cycle, {}).setdefault(k, []).append(seconds)
    complete = [c for c in by_cycle.values() if len(c) == len(PHASES)]
    rows = {}
    for k, name in enumerate(PHASES[1:], start=1):
        reference = max(j for j in range(k) if PHASES[j].startswith("idle"))
        logs = [math.log(statistics.fmean(c[k]) / statistics.fmean(c[reference])) for c in complete]
        ratio, (low, high) = geometric_mean_ratio(logs)
        rows[name] = {"slowdown": ratio - 1, "ci95": [low - 1, high - 1],
                      "against": PHASES[reference]}
    idle = [s for c in complete for s in c[0]]
    return {"cycles": len(complete), "pass_s": statistics.median(idle), "phases": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--phase-seconds", type=float, default=1.0)
    p.add_argument("--name", default="contention")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    cfg = example(args.tokens)
    state_bytes = 3 * 4 * cfg.parameters() // 2  # fp32 weights and two Adam moments, half the model per stage
    cycles = max(2, round(args.minutes * 60 / (len(PHASES) * args.phase_seconds)))
    ctx = mp.get_context("spawn")
    phase, stop, out = ctx.Value("i", -1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=compute, args=(cfg, phase, stop, out)),
             ctx.Process(target=copier, args=(state_bytes, cycles, args.phase_seconds, phase, stop, out))]
    start = time.time()
    for proc in procs:
        proc.start()
    results = [out.get(), out.get()]
    for proc in procs:
        proc.join()
    passes = next(r for r in results if isinstance(r, list))
    rates = next(r for r in results if isinstance(r, dict))
    result = {**provenance(), "tokens": args.tokens, "state_bytes": state_bytes, **analyse(passes),
              "copy_gb_per_s": {name: statistics.median(r) / 1e9 for name, r in rates.items()}}

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [[name, row["against"], f"{row['slowdown']:+.1%} ({row['ci95'][0]:+.1%} .. {row['ci95'][1]:+.1%})",
             f"{result['copy_gb_per_s'][name]:.2f}" if name in result["copy_gb_per_s"] else "-"]
            for name, row in result["phases"].items()]
    lines = ["# A copy on one core against the compute on the other", "", *header(result, time.time() - start), "",
             f"One stage's forward and backward pass ({cfg.layers // 2} blocks, d_model {cfg.d_model}, "
             f"{args.tokens} tokens): {result['pass_s'] * 1e3:.1f} ms alone; the copier moves "
             f"{state_bytes / 1e6:.0f} MB per state, {result['cycles']} cycles of {len(PHASES)} phases of "
             f"{args.phase_seconds:g} s.", "",
             *md_table(["copier's phase", "against", "slowdown of a pass (95%)", "copy GB/s"], rows), ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
