"""Fault injection: kill random ranks (and simulated nodes) and check that training resumes bit-identically.

    python experiments/fault_injection.py [--runs N] [--seed S] [--model tiny|small] [--iters K]
                                          [--node-every J] [--out experiments/results] [--keep DIR]
                                          [--render faults.json]

Run ``i`` of ``N`` draws its fault from ``(seed, i)`` alone, so a seed reproduces the same
faults: a rank (0 or 1), a step (2..K) and a phase (forward, backward, copy, commit,
optimizer) through :func:`baft.recovery.chaos.random_fault`; every ``J``-th run instead kills a whole
simulated node (``--nodes 2 --fault node=N,step=S``: its manager, its shared memory and its
rank), which forces a rebuild from the other node's parity. Each run is

    baft train --example gpt <model> --iters K --policy baft --period 1 --fault ... --max-restarts 1

and one uninterrupted reference run (``--policy none``, same model, seed and iterations) gives
the losses to compare with. A run *resumed* when its losses.jsonl has ``restart: 1`` records
that continue from the restored step and reach step K; it *matched* when every resumed loss
(and every loss before the fault) equals the reference loss at that step bit for bit
(``repr(float)``). The restored step, its source and T0..T4 come from RUN_DIR/recovery.jsonl.

Prints the table and "M of N runs resumed bit-identical", and writes ``faults.md`` and
``faults.json`` (with machine, command and date) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from baft.recovery import chaos
from common import RESULTS, clean_shm, first_recovery, header, md_table, provenance, read_jsonl, train

MODELS = {
    # ~0.1 M parameters: ~60 ms iterations, a faulted run with its restart takes ~30 s here
    "tiny": ["--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--vocab", "256",
             "--micro-batches", "4"],
    # ~0.9 M parameters
    "small": ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq", "64", "--vocab", "1024",
              "--micro-batches", "4"],
}
RANKS = 2  # the example: 2 pipeline stages, 1 replica each
TIMES = ("T0", "T1", "T2", "T3", "T4", "total")  # seconds, from recovery.jsonl


def reference_losses(run_dir: Path) -> dict[int, str]:
    return {r["step"]: repr(float(r["loss"])) for r in read_jsonl(run_dir / "losses.jsonl")}


# ----------------------------------------------------------------------------- faults

def draw_fault(seed: int, index: int, iters: int, node_every: int) -> tuple[str, list[str]]:
    """The fault of run ``index`` (text for --fault) and any extra train options, from (seed, index) alone."""
    run_seed = seed * 1_000_003 + index
    if node_every and index % node_every == node_every - 1:
        rng = random.Random(run_seed)
        return f"node={rng.randrange(RANKS)},step={rng.randint(2, iters)}", ["--nodes", str(RANKS)]
    f = chaos.random_fault(run_seed, RANKS, 2, iters)
    return f"rank={f.rank},step={f.step},phase={f.phase}", []


def check_run(run_dir: Path, ref: dict[int, str], iters: int) -> dict:
    """What a faulted run did: fired, resumed, restored step and source, T0..T4, matched."""
    losses = read_jsonl(run_dir / "losses.jsonl")
    fired = read_jsonl(run_dir / "chaos.jsonl")
    before = [r for r in losses if r.get("restart", 0) == 0]
    after = [r for r in losses if r.get("restart") == 1]
    rec = first_recovery(run_dir)
    restored = rec.get("restored_step")
    resumed_steps = [r["step"] for r in after]
    resumed = bool(after) and max(resumed_steps) == iters
    continuous = bool(after) and restored is not None and resumed_steps == list(range(restored + 1, iters + 1))
    mismatches = [{"step": r["step"], "restart": r.get("restart", 0), "loss": repr(float(r["loss"])),
                   "reference": ref.get(r["step"])}
                  for r in before + after if ref.get(r["step"]) != repr(float(r["loss"]))]
    return {
        "fired": bool(fired),
        "killed": fired[0]["what"] if fired else None,
        "resumed": resumed,
        "continuous": continuous,
        "restored_step": restored,
        "source": rec.get("source"),
        "lost_steps": rec.get("lost_steps"),
        **{k: rec.get(k) for k in TIMES},
        "resumed_losses": len(after),
        "matched": resumed and continuous and not mismatches,
        "mismatches": mismatches[:5],
    }


def fmt_s(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    head = ["#", "fault", "fired", "restored step", "source", "lost steps", *(f"{k} s" for k in TIMES), "resumed",
            "matched"]
    return "\n".join(md_table(head, [
        [r["index"], f"`{r['fault']}`", "yes" if r["fired"] else "NO", _or_dash(r["restored_step"]),
         r["source"] or "-", _or_dash(r["lost_steps"]), *(fmt_s(r[k]) for k in TIMES),
         "yes" if r["resumed"] else "NO", "yes" if r["matched"] else "NO"] for r in rows]))


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def write_outputs(data: dict, out: Path) -> int:
    """Print the table and summary; write faults.md and faults.json under ``out``. The number matched."""
    rows = data["runs"]
    matched = sum(r["matched"] for r in rows)
    resumed = sum(r["resumed"] for r in rows)
    summary = f"{matched} of {len(rows)} runs resumed bit-identical"
    data.update(summary=summary, resumed=resumed, matched=matched)
    text = table(rows)
    print("\n" + text + "\n\n" + summary + f" ({resumed} of {len(rows)} resumed)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(data, indent=2) + "\n")
    sources = sorted({r["source"] for r in rows if r["source"]})
    node = [r for r in rows if "node=" in r["fault"]]
    older = [r for r in node if r["lost_steps"] is not None and r["lost_steps"] > 1]
    md = [
        "# Fault injection: resume from the newest snapshot, bit for bit",
        "",
        *header(data, data["wall_s"]),
        (f"- model: `{data['model']}` (`{' '.join(data['model_args'])}`), 2 pipeline stages, {data['iters']} steps, "
         f"`--policy baft --period 1 --max-restarts 1`; faults drawn from seed {data['seed']}"),
        ("- reference: one uninterrupted run with `--policy none`; *matched* = every loss of the faulted run "
         "(before the fault and after the restart) equals the reference's at that step, compared as `repr(float)`, "
         "and the restarted job logs every step from restored step + 1 to the last"),
        ("- restored step, source and T0..T4 from `RUN_DIR/recovery.jsonl` (T0 rollback, T1 process restart, "
         "T2 process-group init, T3 state load, T4 first resumed iteration); lost steps = completed steps "
         "after the restored one"),
        ("- a rank fault at step S kills the rank while it computes step S; the snapshot of step S-1 is copied "
         "during that iteration and committed just before its optimizer step, so faults before the commit "
         "restore S-2 and faults at or after it restore S-1. A node fault kills the node's manager, shared memory "
         "and rank at the start of iteration S (restoring S-2); the replaced node rebuilds its snapshot from the "
         "parity the managers encode in the background after each commit, so a node that dies before the "
         "newest snapshot's parity is out restores one step older"
         + (f" ({', '.join('run ' + str(r['index']) for r in older)} here)." if older else ".")),
        "",
        text,
        "",
        f"**{summary}** ({resumed} of {len(rows)} resumed to the last step; sources: {', '.join(sources) or '-'}).",
        "",
    ]
    (out / "faults.md").write_text("\n".join(md))
    print(f"wrote {out / 'faults.md'} and {out / 'faults.json'}")
    return matched


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="faulted runs")
    p.add_argument("--seed", type=int, default=0, help="draws the faults; the same seed gives the same faults")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--iters", type=int, default=10, help="train until this step")
    p.add_argument("--node-every", type=int, default=4, help="every J-th run kills a simulated node (0: never)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--keep", help="keep the run directories here (default: a temporary directory, removed)")
    p.add_argument("--render", metavar="JSON", help="only rewrite faults.md (and the JSON) from a faults.json")
    args = p.parse_args(argv)
    if args.render:
        write_outputs(json.loads(Path(args.render).read_text()), Path(args.out))
        return 0
    if args.iters < 3:
        p.error("--iters must be at least 3")

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="baft-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    model = MODELS[args.model] + ["--iters", str(args.iters)]
    started, prov = time.time(), provenance()
    print(f"machine: {prov['machine']}\ncommand: {prov['command']}\nrun directories: {work}", flush=True)

    ref_dir = work / "reference"
    shutil.rmtree(ref_dir, ignore_errors=True)
    code, secs = train(ref_dir, model + ["--policy", "none", "--max-restarts", "0"])
    ref = reference_losses(ref_dir)
    if len(ref) != args.iters:
        print(f"the reference run failed (exit code {code}); see {ref_dir / 'train.log'}", file=sys.stderr)
        return 1
    print(f"reference run (--policy none): {args.iters} steps in {secs:.0f} s, final loss {ref[args.iters]}",
          flush=True)

    rows = []
    for i in range(args.runs):
        fault, extra = draw_fault(args.seed, i, args.iters, args.node_every)
        run_dir = work / f"run{i:02d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        code, secs = train(run_dir, model + ["--policy", "baft", "--period", "1", "--fault", fault,
                                             "--max-restarts", "1", *extra])
        clean_shm(run_dir)
        row = {"index": i, "fault": fault + (" (--nodes 2)" if extra else ""), "exit_code": code,
               "wall_s": secs, **check_run(run_dir, ref, args.iters)}
        rows.append(row)
        print(f"run {i:2d}  {row['fault']:<40} restored {row['restored_step']} ({row['source']})  "
              f"lost {row['lost_steps']}  total {fmt_s(row['total'])} s  "
              f"{'matched' if row['matched'] else 'NOT matched'}  [{secs:.0f} s]", flush=True)
    clean_shm(ref_dir)

    data = {**prov, "model": args.model, "model_args": MODELS[args.model], "iters": args.iters, "seed": args.seed,
            "wall_s": round(time.time() - started, 1), "reference_losses": ref, "runs": rows}
    matched = write_outputs(data, Path(args.out))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if matched == len(rows) else 3


if __name__ == "__main__":
    sys.exit(main())
