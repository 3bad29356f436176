"""Kill to resumed step on three nodes: ``baft torchrun`` (warm ranks) against plain ``torchrun``.

    python experiments/multinode_relaunch.py [--rounds 4] [--out experiments/results]

Each run is README's "More than one node" job on three nodes, each a network, mount, IPC and UTS namespace of its
own (``tests/nodes.py``), one rank per node (pp=3), the tiny model, a snapshot every step, launched on every node by
the arm's launcher: ``baft torchrun`` (each node's ranks forked from a warm server of its own) or ``torchrun`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each restart's ranks started as new interpreters). Rank 1's process (not
its node) is SIGKILLed in the backward pass of step 5; every node's torchrun restarts its ranks. Kill to resumed is
from the kill (``chaos.jsonl``) to the end of the first resumed step (its line in ``losses.jsonl``): under plain
torchrun a node restarted for another node's fault counts no restart, so its ranks' recovery record takes them for a
new launch (``baft.recovery.record.torchrun_attempt``), and only ``baft torchrun``'s phases T1..T4 are shown.

The arms are ``torchrun``, ``baft torchrun`` and ``baft torchrun`` again (the A/A arm), their order rotating each
round; the ratio is the geometric mean over the rounds' paired runs, with its 95% interval, and a verdict only where
it clears both 1 and the A/A arm's interval. Writes ``multinode-relaunch.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from baft import faults as fault_log
from baft.cli.launch import launch_env
from baft.recovery import chaos
from baft.recovery.record import PHASES, load_recoveries
from common import HERE, RESULTS, header, md_table, provenance, read_jsonl
from relaunch import MODELS, RESUMED, paired_ratio
from relaunch_ab import verdict

NODES = 3
ITERS = 16
FAULT_RANK, FAULT_STEP = 1, 5
LAUNCHERS = {"torchrun": "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; torchrun",
             "baft torchrun": "baft torchrun"}
ARMS = ("torchrun", "baft torchrun", "baft torchrun again")
RATIOS = (("baft torchrun", "torchrun"), ("baft torchrun again", "baft torchrun"))
LAUNCH = """export GLOO_SOCKET_IFNAME=eth0
{launcher} --nnodes 3 --nproc-per-node 1 --max-restarts {restarts} \\
    --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job --rdzv-conf keep_alive_interval=1 \\
    -m baft.examples.worker --stages 3 {model} --iters {iters} --policy baft --period 1 \\
    --parity-group 0@node0:7100,1@node1:7100,2@node2:7100 --parity-k 2 --run-dir {run_dir}"""


def one_run(arm: str, work: Path) -> dict:
    """One job on three fresh namespace nodes, one rank killed once: its kill to resumed, and its recovery record."""
    import nodes

    run_dir = work / "run"
    launcher = LAUNCHERS[arm.removesuffix(" again")]
    script = LAUNCH.format(launcher=launcher, restarts=1, model=" ".join(MODELS["tiny"]), iters=ITERS, run_dir=run_dir)
    fault = f"rank={FAULT_RANK},step={FAULT_STEP},phase=backward,restart=0"
    env = launch_env({chaos.ENV: fault})  # this Python's bin first on PATH: baft and torchrun
    env.pop("BAFT_WARM_SOCKET", None)  # each node's server its own, in the node's namespaces
    cluster = nodes.Cluster(NODES, work)
    job = nodes.Job(cluster, script, env, run_dir, work / "logs")
    try:
        job.start()
        exits = job.wait_exit(range(NODES), timeout=900)
    finally:
        cluster.close()
    recoveries, killed = load_recoveries(run_dir), fault_log.read(run_dir)
    if any(exits.values()) or len(recoveries) != 1 or len(killed) != 1:
        raise SystemExit(f"{arm}: exits {exits}, {len(recoveries)} recoveries, {len(killed)} faults logged; the end "
                         f"of its logs:\n{job.tails()}")
    record = recoveries[0]
    resumed = [r["time"] for r in read_jsonl(run_dir / "losses.jsonl") if r["step"] == record.restored_step + 1]
    return {"kind": record.kind, "restart": record.restart, "restored_step": record.restored_step,
            "source": record.source, **{p: getattr(record, p) for p in PHASES},
            "resumed": resumed[-1] - killed[0]["time"]}


def render(doc: dict) -> str:
    lines = ["# Kill to resumed step on three nodes: baft torchrun against torchrun", "",
             *header(doc["provenance"], doc["wall_s"]),
             f"- {doc['rounds']} rounds, each arm's run once a round, the arms' order rotating",
             f"- three nodes, each a network, mount, IPC and UTS namespace (`tests/nodes.py`), one rank each (pp=3): "
             f"the example GPT, {' '.join(MODELS['tiny'])}, {ITERS} steps, a snapshot every step",
             f"- fault: rank {FAULT_RANK}'s process SIGKILLed in the backward pass of step {FAULT_STEP}",
             "- kill to resumed: from the kill to the end of the first resumed step; T1 process restart, T2 "
             "process-group init, T3 state load, T4 the first resumed iteration (baft torchrun's recovery records; "
             "plain torchrun's take a node restarted for another's fault for a new launch)", ""]
    rows = []
    for arm in ARMS:
        runs = doc["arms"][arm]
        times = [r["resumed"] for r in runs]
        phases = [f"{statistics.median(r[p] for r in runs):.2f}" if arm != "torchrun" else "" for p in RESUMED]
        rows.append([arm, len(runs), ", ".join(sorted({r["kind"] for r in runs})), f"{statistics.median(times):.2f}",
                     f"{min(times):.2f}–{max(times):.2f}", *phases])
    lines += md_table(["launcher", "runs", "kind (rank 0's record)", "kill to resumed s (median)", "range s",
                       *(f"{p} s" for p in RESUMED)], rows)
    lines += ["", "## Ratios (geometric mean over the rounds' paired runs, 95% interval)", ""]
    for (new, old), (ratio, (low, high)) in zip(RATIOS, doc["ratios"]):
        lines.append(f"- {new}/{old}: {ratio:.2f}x ({low:.2f}–{high:.2f})")
    lines.append(f"- verdict: baft torchrun is **{doc['verdict']}**")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / "tests"))
    import nodes

    why = nodes.unavailable()
    if why:
        raise SystemExit(f"no namespace nodes here: {why}")
    start, runs = time.time(), {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="baft-multinode-") as tmp:
        for round_ in range(args.rounds):
            for arm in ARMS[round_ % len(ARMS):] + ARMS[:round_ % len(ARMS)]:
                runs[arm].append(one_run(arm, Path(tmp) / f"r{round_}-{arm.replace(' ', '-')}"))
                print(f"round {round_ + 1}/{args.rounds} {arm}: {runs[arm][-1]['resumed']:.2f} s", flush=True)
    ratios = [paired_ratio(runs[new], runs[old]) for new, old in RATIOS]
    doc = {"provenance": provenance(), "wall_s": time.time() - start, "rounds": args.rounds, "arms": runs,
           "ratios": ratios, "verdict": verdict(ratios[0], ratios[1])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multinode-relaunch.json").write_text(json.dumps(doc, indent=1))
    (args.out / "multinode-relaunch.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
