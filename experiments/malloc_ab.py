"""Paired A/B of the launcher's malloc setting: ranks that keep the memory they free (baft's
default) against glibc's own behaviour (``BAFT_KEEP_FREED_MEMORY=0``), checked by an A/A.

    python experiments/malloc_ab.py [--pairs 9] [--iters 15] [--name malloc] [--out experiments/results]
                                    [-- MODEL FLAGS of baft train]

Each pair runs ``baft train --example gpt --policy none --iters N [MODEL FLAGS]`` three times, back
to back: kept, glibc and kept again, the order rotating from pair to pair, so that the machine's
drift hits all alike. Per run: the median iteration after the third (the first ones warm up); per
pair: the ratios kept / glibc and, the A/A check of the method, kept again / kept. Reports the
geometric mean of each with a 95% bootstrap interval over the pairs; the A/A passes when its
interval contains 1. Writes ``NAME.md`` and ``NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, geometric_mean_ratio, header, md_table, provenance, read_jsonl, train  # noqa: E402

from baft.cli.launch import KEEP_FREED_MEMORY_ENV  # noqa: E402

SETTINGS = {"kept": {}, "glibc": {KEEP_FREED_MEMORY_ENV: "0"}, "kept again": {}}
ORDERS = [["kept", "glibc", "kept again"], ["glibc", "kept again", "kept"], ["kept again", "kept", "glibc"]]


def median_iteration(run_dir: Path, warm_up: int = 3) -> float:
    steps = [r["iter_s"] for r in read_jsonl(run_dir / "losses.jsonl") if r["step"] > warm_up]
    if not steps:
        raise SystemExit(f"{run_dir}: no iterations after the warm-up (see {run_dir / 'train.log'})")
    return statistics.median(steps)


def geometric_mean(pairs: list[dict], a: str, b: str) -> tuple[float, tuple[float, float]]:
    """The geometric mean of the pairs' ratios a / b and its 95% bootstrap interval."""
    return geometric_mean_ratio([math.log(p[a] / p[b]) for p in pairs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=9, help="a multiple of 3 gives each setting each place equally")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--name", default="malloc")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("model", nargs="*", help="more flags of baft train (after --)")
    args = p.parse_args(argv)
    flags = ["--policy", "none", "--iters", str(args.iters), *args.model]
    start, pairs = time.time(), []
    with tempfile.TemporaryDirectory(prefix="baft-malloc-") as tmp:
        for i in tqdm(range(args.pairs), desc="pairs"):
            order = ORDERS[i % len(ORDERS)]
            pair = {"order": order}
            for name in order:
                run_dir = Path(tmp) / f"pair{i}-{name.replace(' ', '-')}"
                code, _ = train(run_dir, flags, env=SETTINGS[name])
                if code != 0:
                    raise SystemExit(f"baft train failed (exit code {code}); see {run_dir / 'train.log'}")
                pair[name] = median_iteration(run_dir)
            pairs.append(pair)
    ratio, (low, high) = geometric_mean(pairs, "kept", "glibc")
    aa, (aa_low, aa_high) = geometric_mean(pairs, "kept again", "kept")
    aa_verdict = "PASS" if aa_low <= 1 <= aa_high else "FAIL"
    prov = provenance()
    doc = {**prov, "pairs": pairs, "ratio": ratio, "interval": [low, high],
           "aa": {"ratio": aa, "interval": [aa_low, aa_high], "verdict": aa_verdict}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# Ranks keeping the memory they free, against glibc's behaviour", "", *header(prov, time.time() - start),
             f"- {args.pairs} pairs of `baft train --example gpt {' '.join(flags)}`: kept, glibc and kept again, "
             "the order rotating; median iteration after the third", "",
             *md_table(["pair", "order", "kept", "glibc", "kept again", "kept / glibc", "A/A: kept again / kept"],
                       [[i, ", ".join(p["order"]), *(f"{p[name] * 1e3:.0f} ms" for name in SETTINGS),
                         f"{p['kept'] / p['glibc']:.3f}", f"{p['kept again'] / p['kept']:.3f}"]
                        for i, p in enumerate(pairs)]), "",
             f"Iteration with freed memory kept, over glibc's: **{ratio:.3f}** (95% interval {low:.3f} .. {high:.3f}; "
             f"geometric mean of the pairs' ratios, bootstrap over pairs): {ratio - 1:+.1%} per iteration.", "",
             f"- {aa_verdict} A/A: kept again over kept {aa:.3f} ({aa_low:.3f} .. {aa_high:.3f}); its interval must "
             "contain 1"]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
