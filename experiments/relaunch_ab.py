"""Kill to resumed step before and after a change: ``relaunch.py``'s runs, with baft from two trees, alternating.

    python experiments/relaunch_ab.py --before REV --name NAME [--after HEAD] [--rounds 4] [--jobs fp32,bf16]
                                      [--arms warm,cold] [--models tiny] [--out experiments/results]

Each revision (git) is checked out into a temporary worktree, and its runs import baft from there (each launch
runs in that tree, with it on ``PYTHONPATH``: ``python -m`` looks in the working directory first), so this tree
may change while they run. Each round runs every job and arm once per tree: ``before``, ``after``
and ``after again``, in an order that rotates round by round. ``after again`` is the A/A arm: its ratio to
``after`` is the spread of the method itself on this machine. Each run kills rank 1 three times
(:data:`relaunch.FAULT_STEPS`). Per job, arm and tree: the median and range of kill to resumed and the median of
each phase; the ratios after/before and after again/after as geometric means over paired faults (the i-th fault
of a round with the i-th of the other tree's run in the same round), with 95% bootstrap intervals. The verdict
on after/before is "faster" or "slower" where its interval lies below or above 1 and clear of the A/A
interval's spread, "no change shown" otherwise. Writes ``relaunch-ab-NAME.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, comma_choices, header, md_table, provenance
from relaunch import FAULT_STEPS, JOB_NAMES, JOBS, MODELS, RESUMED, one_run, paired_ratio, summarize

REPO = Path(__file__).resolve().parents[1]
TREES = ("before", "after", "after again")
RATIOS = (("after", "before"), ("after again", "after"))
ARMS = {"warm": "warm", "cold": "cold", "in-place": "in place"}  # --arms name -> relaunch.py's arm


def verdict(ratio: tuple[float, tuple[float, float]], same: tuple[float, tuple[float, float]]) -> str:
    """after/before's verdict, given the A/A arm's ratio: the change must be outside both 1 and the A/A spread."""
    _, (low, high) = ratio
    _, (same_low, same_high) = same
    if high < min(1.0, same_low):
        return "faster"
    if low > max(1.0, same_high):
        return "slower"
    return "no change shown"


def render(doc: dict) -> str:
    lines = [f"# Kill to resumed step before and after: {doc['name']}", "", *header(doc["provenance"], doc["wall_s"]),
             f"- before: {doc['before']}; after: {doc['after']}; {doc['rounds']} rounds, each tree's run of every job "
             "and arm once a round, the trees' order rotating",
             *(f"- model {name}: the example GPT, {' '.join(MODELS[name])}" for name in doc["models"]),
             f"- faults: rank 1 SIGKILLed in the backward pass of steps {', '.join(map(str, FAULT_STEPS))} of each run",
             "- kill to resumed = T1 + T2 + T3 + T4 of recovery.jsonl; T1 process restart, T2 process-group init "
             "(the script's init_distributed and deepspeed.initialize), T3 state load, T4 the first resumed iteration",
             ""]
    rows = []
    for key, arms in doc["jobs"].items():
        for arm, trees in arms.items():
            for tree in TREES:
                s = trees[tree]["summary"]
                rows.append([key, arm, tree, s["faults"], f"{s['median']:.2f}", f"{s['min']:.2f}–{s['max']:.2f}",
                             *(f"{s[p]:.2f}" for p in RESUMED)])
    lines += md_table(["job", "recovery", "tree", "faults", "kill to resumed s (median)", "range s",
                       *(f"{p} s" for p in RESUMED)], rows)
    lines += ["", "## Ratios (geometric mean over paired faults, 95% interval)", ""]
    for key, arms in doc["jobs"].items():
        for arm, trees in arms.items():
            ratios = trees["ratios"]
            text = "; ".join(f"{new}/{old} {r:.2f}x ({low:.2f}–{high:.2f})"
                             for (new, old), (r, (low, high)) in zip(RATIOS, ratios.values()))
            lines.append(f"- {key}, {arm}: {text}: **{trees['verdict']}**")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--after", default="HEAD", help="the git revision compared")
    parser.add_argument("--name", required=True, help="names the results: relaunch-ab-NAME.md")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", default="fp32,bf16", help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--arms", default="warm", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--models", default="tiny", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    jobs, arms = comma_choices(parser, "--jobs", args.jobs, JOBS), comma_choices(parser, "--arms", args.arms, ARMS)
    models = comma_choices(parser, "--models", args.models, MODELS)
    revisions = {tree: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True,
                                      text=True, check=True).stdout.strip()
                 for tree, rev in (("before", args.before), ("after", args.after))}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the worktrees are removed then too
    prov, start = provenance(), time.time()
    faults = {(model, job, arm, tree): [] for model in models for job in jobs for arm in arms for tree in TREES}
    with tempfile.TemporaryDirectory(prefix="baft-relaunch-ab-") as tmp:
        trees = {tree: Path(tmp) / tree for tree in revisions}
        for tree, rev in revisions.items():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(trees[tree]), rev],
                           check=True)
        trees["after again"] = trees["after"]
        try:
            for round_ in range(args.rounds):
                for model in models:
                    for job in jobs:
                        for arm in arms:
                            for tree in TREES[round_ % 3:] + TREES[:round_ % 3]:
                                run_dir = Path(tmp) / "runs" / f"{model}-{job}-{arm}-{tree.replace(' ', '-')}-{round_}"
                                got = one_run(model, job, ARMS[arm], run_dir, trees[tree])
                                faults[model, job, arm, tree] += got
                                print(f"round {round_} {model} {job} {arm} {tree}: kill to resumed "
                                      + ", ".join(f"{f['resumed']:.2f}" for f in got) + " s", file=sys.stderr,
                                      flush=True)
        finally:
            for tree in revisions:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[tree])], check=False)
    doc = {"provenance": prov, "name": args.name, **revisions, "rounds": args.rounds, "models": models, "jobs": {}}
    for model in models:
        for job in jobs:
            key = f"{JOB_NAMES[job]}, {model}"
            doc["jobs"][key] = {}
            for arm in arms:
                trees = {tree: {"faults": faults[model, job, arm, tree],
                                "summary": summarize(faults[model, job, arm, tree])} for tree in TREES}
                ratios = {f"{new}/{old}": paired_ratio(trees[new]["faults"], trees[old]["faults"])
                          for new, old in RATIOS}
                doc["jobs"][key][ARMS[arm]] = {**trees, "ratios": ratios, "verdict": verdict(*ratios.values())}
    doc["wall_s"] = time.time() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"relaunch-ab-{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"relaunch-ab-{args.name}.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
