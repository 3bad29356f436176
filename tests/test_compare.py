"""``baft compare``: policies interleaved on one engine, summarized against no snapshots."""

import json
import subprocess
import sys

from baft.cli.compare import render, summarize
from conftest import TINY


def test_compare_interleaves_policies_and_reports_overhead(tmp_path):
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "compare", *TINY, "--policies", "none,sync-copy,baft",
                           "--rounds", "2", "--block", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    # A B C A B C: every round runs every policy's block, in order
    order = [r["policy"] for r in rows]
    assert order == (["none"] * 3 + ["sync-copy"] * 3 + ["baft"] * 3) * 2
    summary = {s["policy"]: s for s in summarize(rows)}
    assert summary["none"]["overhead"] == 0 and summary["none"]["stall_s"] == 0
    assert summary["sync-copy"]["stall_s"] > 0, "a synchronous copy every iteration must stall"
    assert summary["baft"]["period"] >= 1
    for name in ("none", "sync-copy", "baft"):
        assert summary[name]["iterations"] == 4  # 2 rounds x (3 - 1 warm-up)
        assert name in proc.stdout
    assert render(list(summary.values())).count("\n") == 3
