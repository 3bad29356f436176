"""Fault injection: kill random ranks (and simulated nodes) and check that training resumes bit-identically.

    python experiments/fault_injection.py [--runs N] [--seed S] [--model tiny|small] [--iters K]
                                          [--node-every J] [--out experiments/results] [--keep DIR]
                                          [--render faults.json]

Run ``i`` of ``N`` draws its fault from ``(seed, i)`` alone, so a seed reproduces the same
faults: a rank (0 or 1), a step (2..K) and a phase (forward, backward, copy, seal, commit,
optimizer) through :func:`random_fault`; every ``J``-th run instead kills a whole
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

``--namespace-nodes`` loses real nodes instead: each job runs on three nodes, each a
network, mount, IPC and UTS namespace of its own (``tests/nodes.py``: its own ``/dev/shm``,
host name and link to a bridge), launched as README's "More than one node" says (``torchrun``
with the c10d rendezvous on every node, pp=3, one rank per node, the managers in one parity
group with k=2) and ``--persist-every 5``. A node is lost by SIGKILLing every process of its
namespace and deleting it, shared memory with it; its replacement, a fresh namespace of the
same name, runs the same launch (every node relaunches when node0, the rendezvous endpoint,
is lost). Each of ``--jobs`` jobs loses each node once, in an order and at steps drawn from
``(seed, job)``, then two nodes at once (parity covers one: the restore falls back to the
steps every node persisted); one more job without persistence loses one node, then two,
and must stop with the one-line refusal. Every loss logged (redone steps too) and every
rank's final state are compared with one uninterrupted run; ``faults-nodes.md|json`` say
how many node losses were survived out of how many, and each recovery's breakdown::

    python experiments/fault_injection.py --namespace-nodes --jobs 4 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baft.cli.launch import example_args, launch_env, torchrun
from baft.recovery import chaos
from common import HERE, RESULTS, clean_shm, first_recovery, header, md_table, provenance, read_jsonl, train

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

def random_fault(seed: int, ranks: int, first_step: int, last_step: int, restart: int = 0) -> chaos.Fault:
    """A fault drawn from ``seed``: the same seed gives the same fault."""
    rng = random.Random(seed)
    return chaos.Fault(rng.randrange(ranks), rng.randint(first_step, last_step), rng.choice(chaos.PHASES), restart)


def draw_fault(seed: int, index: int, iters: int, node_every: int) -> tuple[str, list[str]]:
    """The fault of run ``index`` (text for --fault) and any extra train options, from (seed, index) alone."""
    run_seed = seed * 1_000_003 + index
    if node_every and index % node_every == node_every - 1:
        rng = random.Random(run_seed)
        return f"node={rng.randrange(RANKS)},step={rng.randint(2, iters)}", ["--nodes", str(RANKS)]
    f = random_fault(run_seed, RANKS, 2, iters)
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


# ----------------------------------------------------------------------------- namespace nodes

NODES = 3  # pp=3, one rank per node
PERSIST_EVERY = 5
SHM_ROOTS = "/dev/shm/baft/default/node{node}"  # each node's manager, as the node sees it (the example's run id)
LAUNCH = """export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=eth0
torchrun --nnodes 3 --nproc-per-node 1 --max-restarts 4 \\
    --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job --rdzv-conf keep_alive_interval=1 \\
    -m baft.examples.worker {worker}"""


def node_worker_args(model: list[str], iters: int, run_dir: Path, policy: str, persist: bool) -> list[str]:
    """The example's arguments on every node: pp=3, the three managers in one parity group (k=2)."""
    args = ["--stages", str(NODES), *model, "--iters", str(iters), "--policy", policy, "--period", "1",
            "--parity-group", ",".join(f"{n}@node{n}:7100" for n in range(NODES)), "--parity-k", "2",
            "--run-dir", str(run_dir), "--digest"]
    return args + (["--persist-every", str(PERSIST_EVERY), "--persist-dir", str(run_dir / "persisted")] if persist else [])


def digests(text: str, step: int) -> dict[str, str]:
    """Every rank's final state digest (``--digest``), by rank."""
    return {rank: digest for rank, digest in re.findall(rf"^digest rank (\d+) step {step} (\w+)$", text, re.M)}


def node_reference(model: list[str], iters: int, run_dir: Path) -> tuple[dict[int, str], dict[str, str]]:
    """One uninterrupted run of the same training on this host: losses by step and final digests by rank."""
    cmd = torchrun(NODES, example_args({}) + node_worker_args(model, iters, run_dir, "none", False))
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    return reference_losses(run_dir), digests(proc.stdout, iters)


def draw_losses(seed: int, job: int) -> list[tuple[list[int], int]]:
    """Job ``job``'s losses, from (seed, job) alone: each node once in a drawn order, then two nodes; each as
    (nodes, steps trained after the previous recovery)."""
    rng = random.Random(seed * 1_000_003 + job)
    singles = rng.sample(range(NODES), NODES)
    return [([n], rng.randint(4, 10)) for n in singles] + [(sorted(rng.sample(range(NODES), 2)), rng.randint(4, 10))]


def persisted_common(run_dir: Path) -> set[int]:
    """The steps every node has on disk."""
    from baft.manager import persist

    return set.intersection(*({p.step for p in persist.list_steps(run_dir / "persisted" / f"node{n}")}
                              for n in range(NODES)))


def lose_nodes(job, lost: list[int], after: int, persist: bool, recovered: int) -> dict:
    """Wait until the job recorded its ``recovered``-th recovery and logged ``after`` steps past its restored
    step, and until parity covers any one node (for a loss parity cannot cover: until every node persisted a
    common step, 2 minutes at most); then lose the nodes. What was lost, when and where, and how many
    recoveries the job had recorded."""
    job.wait_for(0, recovered, timeout=600)
    base = job.recoveries()[-1]["restored_step"] if recovered else 0
    job.wait_for(base + after, recovered, timeout=600)
    if len(lost) == 1:
        job.wait_rebuildable(SHM_ROOTS)
    deadline = time.monotonic() + 120
    while persist and len(lost) > 1 and not persisted_common(job.run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    records, at = len(job.recoveries()), job.losses()[-1]["step"]
    killed = time.time()
    relaunched = bool(job.lose(lost))
    return {"nodes": lost, "at_step": at, "killed_at": killed, "relaunch": relaunched, "records_before": records,
            "persisted": sorted(persisted_common(job.run_dir)) if persist else []}


def after_loss(event: dict, recoveries: list[dict], losses: list[dict], ref: dict[int, str], until: dict) -> dict:
    """What became of a loss: its recovery (the newest recorded before the next loss: restored step, source,
    T0..T4), the downtime from the kill to the first step logged after it, and whether every loss logged after
    it, up to the next loss, matched."""
    recovery = (recoveries[event["records_before"]:until.get("records_before")] or [{}])[-1]
    logged = [r for r in losses if event["killed_at"] < r["time"] <= until.get("killed_at", float("inf"))]
    mismatches = [r["step"] for r in logged if ref.get(r["step"]) != repr(float(r["loss"]))]
    restored = recovery.get("restored_step")
    # the resumed run logs restored + 1 once; a step the survivors finished just after the kill may come first
    resumed = [r["time"] for r in logged if restored is not None and r["step"] == restored + 1][-1:]
    at = max([event["at_step"]] + [r["step"] for r in logged if resumed and r["time"] < resumed[0]])
    return {**event, "at_step": at, "restored_step": restored, "source": recovery.get("source"),
            "recorded_as": recovery.get("fault"), "lost_steps": at - restored if restored is not None else None,
            **{k: recovery.get(k) for k in TIMES},
            "downtime": resumed[0] - event["killed_at"] if resumed else None,
            "matched": bool(resumed) and not mismatches, "mismatches": mismatches[:5]}


def node_job(cluster_work: Path, index: int, seed: int, model: list[str], iters: int, persist: bool,
             ref: tuple[dict[int, str], dict[str, str]]) -> dict:
    """One job on three namespace nodes and its losses; the losses' outcomes and the final digests."""
    import nodes

    run_dir = cluster_work / "run"
    script = LAUNCH.format(worker=" ".join(node_worker_args(model, iters, run_dir, "baft", persist)))
    env = launch_env()  # this Python's bin first on PATH: torchrun, as the README's launch names it
    plan = draw_losses(seed, index) if persist else draw_losses(seed, index)[-2:]
    cluster = nodes.Cluster(NODES, cluster_work)
    job = nodes.Job(cluster, script, env, run_dir, cluster_work / "logs")
    events, refused, ended, error = [], None, {}, None
    try:
        job.start()
        for lost, after in plan:
            events.append(lose_nodes(job, lost, after, persist, recovered=len(events)))
            if len(lost) > 1 and not persist:  # more than parity covers, nothing on disk: the job must stop
                ended = job.wait_exit(range(NODES), timeout=600)
                lines = set(re.findall(r"^baft: error: rank \d+: (this run has snapshots but none can be restored.*)$",
                                       job.output(), re.M))
                refused = {"exits": ended, "lines": sorted(lines), "seconds": time.time() - events[-1]["killed_at"]}
        ended = ended or job.wait_exit(range(NODES), timeout=600)
    except (AssertionError, subprocess.TimeoutExpired) as err:  # the job did not get over a loss: say so, go on
        error = str(err).splitlines()[0]
        (cluster_work / "tails.log").write_text(job.tails())
    finally:
        cluster.close()
    recoveries, losses, final = job.recoveries(), job.losses(), digests(job.output(), iters)
    outcomes = [after_loss(e, recoveries, losses, ref[0], (events[i + 1:] or [{}])[0]) for i, e in enumerate(events)]
    return {"job": index, "persist": persist, "exits": ended, "error": error, "losses": outcomes, "refused": refused,
            "digests_match": final == ref[1], "digests": final}


def node_table(jobs: list[dict]) -> str:
    head = ["job", "nodes lost", "at step", "relaunch", "restored step", "source", "lost steps",
            *(f"{k} s" for k in TIMES), "recorded as", "downtime s", "matched"]
    rows = [[j["job"], ",".join(f"node{n}" for n in e["nodes"]), e["at_step"], "yes" if e["relaunch"] else "-",
             _or_dash(e["restored_step"]), e["source"] or "refused", _or_dash(e["lost_steps"]),
             *(fmt_s(e[k]) for k in TIMES), e.get("recorded_as") or "-", fmt_s(e["downtime"]), verdict(j, e)]
            for j in jobs for e in j["losses"]]
    return "\n".join(md_table(head, rows))


def verdict(job: dict, event: dict) -> str:
    """matched, or why not: a loss of more nodes than parity covers, with nothing persisted, must be refused."""
    if event["matched"]:
        return "yes"
    if len(event["nodes"]) > 1 and not job["persist"]:
        return "refused, as it must" if job["refused"] and job["refused"]["lines"] else "NOT refused"
    return "NO"


def node_summary(jobs: list[dict]) -> dict:
    """Node losses survived out of how many: one node (parity), two with persistence (disk); the jobs that
    lost two nodes with nothing persisted, which must refuse; final digests of the jobs that finished."""
    single = [e for j in jobs for e in j["losses"] if len(e["nodes"]) == 1]
    on_disk = [e for j in jobs if j["persist"] for e in j["losses"] if len(e["nodes"]) > 1]
    unpersisted = [j for j in jobs if not j["persist"]]
    finished = [j for j in jobs if j["persist"]]
    survived = sum(e["matched"] for e in single) + sum(e["matched"] and e["source"] == "disk" for e in on_disk)
    return {
        "single": f"{sum(e['matched'] for e in single)} of {len(single)}",
        "double_disk": f"{sum(e['matched'] and e['source'] == 'disk' for e in on_disk)} of {len(on_disk)}",
        "refused": f"{sum(bool(j['refused'] and j['refused']['lines']) for j in unpersisted)} of {len(unpersisted)}",
        "survived": survived, "losses": len(single) + len(on_disk),
        "digests": f"{sum(j['digests_match'] for j in finished)} of {len(finished)}",
    }


def write_node_outputs(data: dict, out: Path) -> bool:
    """Print and write faults-nodes.md and faults-nodes.json; whether every loss went as it must."""
    jobs, summary = data["jobs"], node_summary(data["jobs"])
    data["summary"] = summary
    text = node_table(jobs)
    line = (f"{summary['survived']} of {summary['losses']} node losses survived bit-identically (one node: "
            f"{summary['single']}; two nodes, from disk: {summary['double_disk']}); final state of every rank equal "
            f"to the uninterrupted run's in {summary['digests']} jobs; two nodes lost without persistence refused "
            f"in {summary['refused']} jobs")
    print("\n" + text + "\n\n" + line)
    refusals = [f"- job {j['job']}: after losing {', '.join('node' + str(n) for n in j['losses'][-1]['nodes'])}, "
                f"every torchrun exited ({j['refused']['exits']}) {j['refused']['seconds']:.0f} s after the loss; "
                f"each rank said: `{j['refused']['lines'][0] if j['refused']['lines'] else 'NOTHING'}`"
                for j in jobs if j["refused"]]
    md = [
        "# Node losses on namespace nodes: resume from parity or disk, bit for bit",
        "",
        *header(data, data["wall_s"]),
        (f"- model: `{' '.join(data['model_args'])}`, pp=3 over 3 nodes (one rank each), {data['iters']} steps, "
         f"`--policy baft --period 1`, parity k=2 of n=3, `--persist-every {PERSIST_EVERY}` (all but the last job); "
         f"losses drawn from seed {data['seed']}"),
        ("- each node a network, mount, IPC and UTS namespace of its own (`tests/nodes.py`): its own `/dev/shm`, "
         "loopback, host name and veth to a bridge in a hub namespace; launched on every node as README's "
         "\"More than one node\" says (`torchrun --rdzv-backend c10d --rdzv-endpoint node0:29400 "
         "--rdzv-conf keep_alive_interval=1`, `GLOO_SOCKET_IFNAME=eth0`)"),
        ("- a node is lost: SIGKILL to every process of its namespace, then the namespace deleted (its shared memory "
         "with it); a fresh namespace of the same name and address replaces it and runs the same launch; when node0 "
         "(the rendezvous endpoint) is among the lost, the other nodes' torchrun exit and every node launches again "
         "(*relaunch*). Every job loses each node once, then two at once (after every node persisted a common step)"),
        ("- *matched*: every loss logged after the loss (redone steps included) equals the uninterrupted run's at its "
         "step (`repr(float)`); *at step*: the newest step logged before the job resumed (the survivors may finish "
         "the step in flight); *restored step*, *source*, "
         "T0..T4 from `recovery.jsonl` (T0 rollback, T1 process restart, T2 process-group init, T3 state load, "
         "T4 first resumed iteration); *downtime*: from the kill to the first resumed step logged"),
        ("- *recorded as*: baft's label of the restart in `recovery.jsonl`. torchrun often restarts the survivors' "
         "ranks for the replacement (a membership change) before it sees them fail, which leaves "
         "`TORCHELASTIC_RESTART_COUNT` at 0, so baft calls such a restart \"a new launch\" and counts its T1 from "
         "the new process's start, not from the loss; the downtime column is the wall time the job stood still"),
        ("- losses wait until every manager holds shares of one step of every node (`Job.wait_rebuildable`): a "
         "node lost before that, in a job's first second or two here, cannot be rebuilt. Managers encode in the "
         "background and skip steps when they fall behind (here 3 trainers and 3 managers share 2 cores at "
         "~50 ms per step), so the step every node can rebuild may lag behind the newest (the lost steps column)"),
        "",
        text,
        "",
        f"**{line}.**",
        "",
        *refusals,
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults-nodes.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "faults-nodes.md").write_text("\n".join(md))
    print(f"wrote {out / 'faults-nodes.md'} and {out / 'faults-nodes.json'}")
    persisted_jobs = [j for j in jobs if j["persist"]]
    return (summary["survived"] == summary["losses"] and all(j["digests_match"] for j in persisted_jobs)
            and all(j["refused"] and j["refused"]["lines"] for j in jobs if not j["persist"]))


def namespace_main(args) -> int:
    """``--namespace-nodes``: jobs on three namespace nodes, losing each node, then two."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import nodes

    why = nodes.unavailable()
    if why:
        print(f"cannot make network namespaces here: {why}", file=sys.stderr)
        return 2
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="baft-node-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    model = MODELS[args.model]
    started, prov = time.time(), provenance()
    print(f"machine: {prov['machine']}\ncommand: {prov['command']}\nwork directory: {work}", flush=True)
    ref = node_reference(model, args.iters, work / "reference")
    print(f"reference run (--policy none): {args.iters} steps, final loss {ref[0][args.iters]}", flush=True)
    jobs = []
    for index in range(args.jobs + 1):
        persist = index < args.jobs
        jobs.append(node_job(work / f"job{index:02d}", index, args.seed, model, args.iters, persist, ref))
        for e in jobs[-1]["losses"]:
            print(f"job {index}  lost {e['nodes']} at step {e['at_step']}: restored {e['restored_step']} "
                  f"({e['source']}), downtime {fmt_s(e['downtime'])} s, {'matched' if e['matched'] else 'NOT matched'}",
                  flush=True)
    data = {**prov, "model": args.model, "model_args": model, "iters": args.iters, "seed": args.seed,
            "wall_s": round(time.time() - started, 1), "reference_losses": ref[0], "reference_digests": ref[1],
            "jobs": jobs}
    ok = write_node_outputs(data, Path(args.out))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 3


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
    p.add_argument("--namespace-nodes", action="store_true",
                   help="lose whole nodes of a 3-node job, each node a namespace of its own (needs root)")
    p.add_argument("--jobs", type=int, default=4, help="--namespace-nodes: jobs with persistence (plus one without)")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        if "jobs" in data:
            write_node_outputs(data, Path(args.out))
        else:
            write_outputs(data, Path(args.out))
        return 0
    if args.namespace_nodes:
        if "--iters" not in " ".join(argv if argv is not None else sys.argv):
            args.iters = 70
        return namespace_main(args)
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
