"""``baft compare``: policies interleaved on one engine, summarized against no snapshots."""

import json
import subprocess
import sys

import pytest

from baft.cli.compare import render, summarize
from conftest import TINY


def compare(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "baft.cli", "compare", *TINY, *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_compare_interleaves_policies_in_each_rounds_drawn_order_and_reports_overhead(tmp_path):
    from baft.benchmark import block_order

    out = tmp_path / "compare.json"
    proc = compare("--policies", "sync-copy,thread-copy,baft,torch-save/2", "--none-between", "--shuffle",
                   "--rounds", "2", "--block", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["shuffle"] is True
    # none A none B ..., A B ... in the order each round's seed draws (every rank the same), a block of 2 each
    names = ["none", "sync-copy", "thread-copy", "baft", "torch-save/2"]
    orders = [block_order(names, True, shuffle_seed=k) for k in range(2)]
    assert orders[0] != orders[1], "the two rounds' seeds must draw different orders for this test to mean anything"
    assert [r["policy"] for r in doc["records"]] == [name for order in orders for name in order for _ in range(2)]
    assert all(len(r["ranks"]) == 2 for r in doc["records"])
    # a policy with a period snapshots in the last iteration of each of its blocks only
    assert [r["j"] for r in doc["records"] if r["policy"] == "torch-save/2" and r["ranks"][0]["fired"]] == [1, 1]
    assert all(r["ranks"][0]["fired"] for r in doc["records"] if r["policy"] == "sync-copy")
    assert {name: b > 0 for name, b in doc["snapshot_bytes"].items()} == {"sync-copy": True, "thread-copy": True,
                                                                         "baft": True, "torch-save/2": True}
    assert [p["stage"] for p in doc["plans"]["baft"]] == [0, 1]
    assert {p["source"] for p in doc["plans"]["baft"]} == {"receive waits timed in this run's iteration 2"}

    summary = {s["policy"]: s for s in summarize(doc)}
    assert summary["none"]["overhead"] == 0 and summary["none"]["stall_s"] == 0
    assert summary["sync-copy"]["stall_s"] > 0, "a synchronous copy every iteration must stall"
    assert summary["sync-copy"]["hook_cpu_s"] > 0, "the copy runs in the policy's callback, on the trainer's thread"
    assert summary["sync-copy"]["seal_s"] > 0 and summary["none"]["seal_s"] == 0, "seals are timed where they run"
    # the sealing thread's CPU, on its own thread: the commit record at least
    assert summary["baft"]["seal_cpu_s"] > 0 and summary["sync-copy"]["seal_cpu_s"] > 0
    assert summary["none"]["seal_cpu_s"] == 0
    assert all(s["fence_wait_s"] == 0 for s in summary.values()), "on CPU the host waits at the fence, not a device"
    assert summary["baft"]["period"] >= 1 and summary["torch-save/2"]["period"] == 2
    assert summary["none"]["iterations"] == 8  # 2 rounds x 4 blocks x (2 - 1 dropped)
    assert summary["sync-copy"]["iterations"] == 2
    for name in names:
        assert name in proc.stdout
    assert render(list(summary.values())).count("\n") == 5


def test_compare_refuses_an_unknown_policy_in_one_line():
    proc = compare("--policies", "none,sync-copy/0", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "baft: error: --policies: 'sync-copy/0': the period after '/' must be a whole " \
                                  "number of steps"


def test_the_demo_says_what_the_comparison_means():
    from baft.cli.demo import what_it_means

    summary = [{"policy": "none", "period": 1, "stall_s": 0.0, "overhead": 0.0},
               {"policy": "sync-copy", "period": 1, "stall_s": 0.044, "overhead": 0.126},
               {"policy": "baft", "period": 1, "stall_s": 0.0011, "overhead": 0.004}]
    line = what_it_means(summary)
    assert "44 ms" in line and "+12.6%" in line and "1.1 ms per snapshot, 40x less" in line and "\n" not in line
    assert "inside the bubbles" in line and "every" not in line.split("baft")[1]
    summary[2]["period"] = 3  # the bubbles hold less than the state: the sentence must not hide the period
    assert "snapshots every 3 iterations" in what_it_means(summary)
    assert "1.1 ms per snapshot (0.4 ms per iteration), 120x less" in what_it_means(summary)


def test_the_table_has_a_device_wait_column_only_where_a_device_waited():
    def row(policy, wait):
        return {"policy": policy, "period": 1, "iterations": 4, "median_s": 1.0, "stall_s": 0.0, "hook_cpu_s": 0.0,
                "fence_wait_s": wait, "overhead": 0.0}

    assert "device wait" not in render([row("none", 0.0), row("baft", 0.0)])
    on_gpu = render([row("none", 0.0), row("baft", 0.0123)])
    assert "device wait" in on_gpu.splitlines()[0] and "12.3 ms" in on_gpu.splitlines()[2]


def test_shuffled_rounds_keep_none_between_and_draw_the_same_order_on_every_rank():
    from baft.benchmark import block_order

    names = ["none", "none/1", "sync-copy", "thread-copy", "baft"]
    fixed = block_order(names, none_between=True)
    assert fixed == ["none", "none/1", "none", "sync-copy", "none", "thread-copy", "none", "baft"]
    orders = [block_order(names, True, shuffle_seed=r) for r in range(12)]
    assert orders == [block_order(names, True, shuffle_seed=r) for r in range(12)], "a round's order is its seed's"
    for order in orders:
        assert order[0::2] == ["none"] * 4 and sorted(order[1::2]) == sorted(names[1:])
    assert len({tuple(o) for o in orders}) > 6, "12 rounds drew only a few of the 24 orders"
    assert {o[1] for o in orders} == set(names[1:]), "every arm comes first in some round"
