"""What the simulator predicts when a node's GPUs snapshot at once, and how its one-GPU prediction compares.

    python experiments/node_contention.py [--out experiments/results]

1. The ``h100-1gpu`` preset (the 0.82B-parameter bf16 model of ``results/gpu.md`` on one H100) at
   m=8 and m=32, against what was measured there at period 1.
2. The 8-accelerator presets (``gpt3-3b-8``, ``gpt3-15b-8``) on a node of eight H100s (989 TFLOP/s
   dense BF16 at the presets' utilization, 53.1 GB/s device-to-host each as measured on one), three
   ways: every GPU with the host to itself (what the simulator assumed before), the eight sharing
   the node's host memory (``node_host_bw``), and two GPUs behind each PCIe switch uplink as well.

Writes ``node-contention.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from baft.simulate.model import simulate_scenario
from baft.simulate.scenario import load_preset
from baft.simulate.units import bandwidth, duration
from common import RESULTS, header, md_table, provenance

H100 = {"peak_flops": 989e12, "host_bw": 53.1e9}
HOST_MEMORY = 370e9  # assumed: 60% of two sockets x 8 channels of DDR5-4800 (614 GB/s peak)
NODES = [
    ("own link each", {}),
    ("host memory shared", {"node_host_bw": HOST_MEMORY}),
    ("and 2 GPUs per switch", {"node_host_bw": HOST_MEMORY, "switch_bw": 53.1e9, "ranks_per_switch": 2}),
]
# results/gpu.md section 4, period 1: (m, none iteration, sync-copy overhead and stall, baft overhead and stall)
MEASURED = {8: ("321 ms", "+279% (stall 429 ms)", "+181% (stall 212 ms)"),
            32: ("1136 ms", "+68% (stall 451 ms)", "+55% (stall 213 ms); +32% run d, another machine")}


def at_period_one(result) -> tuple[float, float]:
    """Predicted overhead of baft and of the synchronous copy when both snapshot every iteration."""
    t = result.iteration_time
    return max(p.stall for p in result.rank_plans) / t, result.copy_time / t


def one_gpu_rows() -> list[list]:
    rows = []
    for m, (iteration, sync, baft) in MEASURED.items():
        result = simulate_scenario(load_preset("h100-1gpu").with_overrides({"m": m}))
        baft_1, sync_1 = at_period_one(result)
        rows.append([m, duration(result.iteration_time), iteration, duration(result.copy_time),
                     f"+{sync_1:.0%}", sync, f"+{baft_1:.0%}", baft, result.policy("baft").period_iterations])
    return rows


def node_rows() -> list[list]:
    rows = []
    for preset in ("gpt3-3b-8", "gpt3-15b-8"):
        for name, sharing in NODES:
            result = simulate_scenario(load_preset(preset).with_overrides({**H100, **sharing}))
            s, baft = result.scenario, result.policy("baft")
            baft_1, sync_1 = at_period_one(result)
            rows.append([preset, name, duration(result.iteration_time), f"{s.state_per_rank / 1e9:.1f} GB",
                         bandwidth(s.copy_bw), duration(result.copy_time), f"+{sync_1:.1%}", f"+{baft_1:.1%}",
                         f"{baft.period_iterations:.0f} ({baft.overhead:.2%})"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lines = ["# Snapshots of a node's GPUs at once, in the simulator", "", *header(provenance()), "",
             "## One H100: predicted against measured (period 1)", "",
             *md_table(["m", "iteration, predicted", "measured (none)", "copy per snapshot", "sync copy, predicted",
                        "measured", "baft, predicted", "measured", "baft period for 1%"], one_gpu_rows()), "",
             "## Eight H100s on one node (the presets' models)", "",
             *md_table(["preset", "node", "iteration", "state per rank", "copy each", "copy per snapshot",
                        "sync copy, period 1", "baft, period 1", "baft period (overhead)"], node_rows()), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "node-contention.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
