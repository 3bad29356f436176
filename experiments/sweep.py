"""Where bubble-awareness pays: each policy's overhead against the cost of a synchronous copy, swept.

    python experiments/sweep.py [--micro-batches 4,8] [--tokens 16,32,64,128,256] [--rounds 20]
                                [--halfwidth 0.005] [--point-minutes 8 | --point-rounds N]
                                [--out experiments/results]
                                [--raw DIR [--resume]] [--render SWEEP.json [SWEEP2.json ...] [--raw DIR]]

The state-heavy example (2 stages balanced by compute, d_model 768, 8 blocks, 63M parameters,
micro-batches of one sequence of ``t`` tokens): the fewer tokens per micro-batch, the shorter an iteration next
to the time it takes to copy a stage's state. Every point (m micro-batches, t tokens) is first profiled
(``baft profile``), and baft plans from that measured bubble map, as in the profile-then-train flow a
user follows (the analytic model of a run's first iteration, which baft planned from without a map
before, overstated the last stage's bubble several times over: see README). Then one
``baft compare`` launch alternates ``none`` with each policy in blocks of two iterations
(none none A A none none B B ...; the first of each block is dropped; ``--shuffle`` draws the arms' order
anew every round): ``none/1`` (none again:
the A/A check of the method), ``sync-copy``, ``thread-copy`` (a background copy that ignores the
bubbles, as DataStates-LLM's lazy copy) and ``baft``, each snapshotting every iteration (baft at
its planner's period). Each measured iteration is divided by the ``none`` iterations next to it;
a policy's overhead is the interquartile mean (mean of the middle half) of these ratios - 1,
with a 95% interval resampling whole rounds (``overhead_report.analyse``). Launches of
``--rounds`` rounds repeat until every interval is at most ``--halfwidth`` wide on each side,
or the point's time is spent; or, with ``--point-rounds N``, until the point has N rounds, a
number fixed before measuring (so that no verdict depends on when the sweep chose to stop). A
second, short launch times one save of DeepSpeed's ``save_checkpoint`` and of DCP
``async_save``: the period each needs to stay within 1% is that save over 1% of an iteration.

``--raw DIR`` keeps every launch's records; ``--resume`` adds new launches to those already in
it, so that a measurement too long for one sitting can go on in another; ``--render`` with
``--raw`` analyses a saved sweep again from its launches' records, and with several saved sweeps
writes them as one, each listed as a sitting with its command and date.

The x axis is the synchronous copy's cost: its stall per snapshot over the ``none`` iteration.
Real jobs are placed on it with the simulator (``baft.simulate``). The targets of the issue
are checked on the points and written as PASS / FAIL lines. Writes ``sweep.md``, ``sweep.json``
and ``sweep.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from baft.cli.launch import flags
from baft.pipeline.bubblemap import BubbleMap
from baft.snapshot.planner import period_within
from common import RESULTS, header, md_table, provenance
from overhead_report import AA, BUDGET, analyse

MODEL = {"stages": 2, "d_model": 768, "layers": 8, "heads": 12, "vocab": 4096, "micro_batch_size": 1,
         "partition": "compute"}
ARMS = f"{AA},sync-copy,thread-copy,baft"
DISK = "deepspeed/1000,dcp-async/1000"  # one save per block: its stall is the save
REAL_JOBS = {"gpt3-175b-1024": "GPT-3 175B, 1024 GPUs", "gpt3-15b-8": "15B, one 8-GPU server",
             "gpt3-3b-8": "3B, one 8-GPU server"}


def baft_cli(*args: str) -> None:
    if subprocess.run([sys.executable, "-m", "baft.cli", *args]).returncode != 0:
        raise SystemExit(f"baft {args[0]} failed ({' '.join(args)}); its output is above")


def profile(opts: dict, out: Path) -> BubbleMap:
    """The point's measured bubble map (``baft profile``): what baft's planner plans from, as a user's would."""
    if not out.exists():
        baft_cli("profile", "--example", "gpt", *flags(opts), "--iters", "10", "--out", str(out))
    return BubbleMap.load(out)


def compare(opts: dict, policies: str, rounds: int, out: Path, shuffle: bool = False) -> dict:
    """One ``baft compare --none-between --block 2`` launch (``--shuffle``: a new order every round); the document
    it writes."""
    baft_cli("compare", *flags(opts), "--policies", policies, "--rounds", str(rounds), "--block", "2",
             "--none-between", *(["--shuffle"] if shuffle else []), "--out", str(out))
    return json.loads(out.read_text())


def merge(docs: list[dict]) -> dict:
    """Several launches as one run: rounds and blocks renumbered after each other (pairs never cross launches)."""
    merged = {**docs[0], "records": [], "rounds": 0}
    blocks = 0
    for doc in docs:
        for rec in doc["records"]:
            merged["records"].append({**rec, "round": rec["round"] + merged["rounds"], "block": rec["block"] + blocks})
        merged["rounds"] += doc["rounds"]
        blocks += 1 + max(r["block"] for r in doc["records"])
    return merged


def halfwidth(row: dict) -> float:
    low, high = row["ci95"] or (-math.inf, math.inf)
    return max(row["overhead"] - low, high - row["overhead"])


def launches(raw: Path, m: int, t: int) -> list[dict]:
    """The interleaved launches of one point already in ``raw`` (``--resume``), oldest first."""
    paths = sorted(raw.glob(f"m{m}-t{t}-[0-9]*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    docs = [json.loads(p.read_text()) for p in paths]
    for path, doc in zip(paths, docs):
        if [p["name"] for p in doc["policies"]] != ["none", *ARMS.split(",")]:
            raise SystemExit(f"sweep: {path}: not a launch of this sweep's policies ({ARMS}); resume from its own --raw")
        if doc["policies"] != docs[0]["policies"]:  # one analysis amortizes every launch's snapshots over one period
            raise SystemExit(f"sweep: {path}: its policies ran at other periods than in {paths[0].name} "
                             f"({doc['policies']} against {docs[0]['policies']}); resume from its own --raw")
    return docs


def next_launch(docs: list[dict], args, start: float) -> int:
    """The rounds of a point's next launch, 0 once it has enough: ``--point-rounds`` rounds (its resumed
    launches included), or, without, every interval ``--halfwidth`` tight or ``--point-minutes`` spent."""
    rounds = sum(d["rounds"] for d in docs)
    if args.point_rounds:
        return max(0, min(args.rounds, args.point_rounds - rounds))
    if not docs:
        return args.rounds
    widest = max(halfwidth(r) for r in analyse(merge(docs))["rows"] if r["policy"] != "none")
    print(f"sweep: {rounds} rounds, widest 95% half-width {widest:.2%}", flush=True)
    done = widest <= args.halfwidth or time.time() - start > args.point_minutes * 60
    return 0 if done else args.rounds


def measure_point(model: dict, m: int, t: int, args, raw: Path, launch: bool = True) -> dict:
    """Every policy at one point, launched until :func:`next_launch` says it has enough; and the disk saves.
    With ``--resume`` the launches already in ``raw`` count too, and the point's minutes are those of the new
    launches; without ``launch``, only those (``--render`` with ``--raw``)."""
    opts = {**model, "micro_batches": m, "seq": t}
    reuse = args.resume or not launch
    docs, start = launches(raw, m, t) if reuse else [], time.time()
    disk_path, map_path = raw / f"m{m}-t{t}-disk.json", raw / f"m{m}-t{t}-bubbles.json"
    if not launch and not (docs and disk_path.exists()):
        raise SystemExit(f"sweep: {raw} has no launches of m={m} t={t}, or not their disk launch")
    if launch:
        bmap = profile(opts, map_path)
        opts["bubble_map"] = str(map_path)
    else:
        bmap = BubbleMap.load(map_path) if map_path.exists() else None  # sweeps before maps planned alone
    while launch and (rounds := next_launch(docs, args, start)):
        print(f"sweep: m={m} t={t}: launch {len(docs)}, {rounds} rounds", flush=True)
        docs.append(compare(opts, ARMS, rounds, raw / f"m{m}-t{t}-{len(docs)}.json", args.shuffle))
    doc = merge(docs)
    result = analyse(doc)
    disk_doc = json.loads(disk_path.read_text()) if reuse and disk_path.exists() else compare(opts, DISK, 2, disk_path)
    # minutes of interleaved measurement (the timed rounds, not the launches' set-up)
    measured = sum(d["elapsed_s"] for d in docs)
    return {**point_summary(model, m, t, doc, result, analyse(disk_doc), bmap), "measure_s": measured}


def point_summary(model: dict, m: int, t: int, doc: dict, result: dict, disk: dict, bmap: Optional[BubbleMap]) -> dict:
    """What the sweep reports for one point (the raw records stay in the JSON beside it)."""
    rows = {r["policy"]: r for r in result["rows"]}
    base = result["base_s"]
    plans = doc["plans"].get("baft", [])
    stall = max((p["leftover_bytes"] / p["bandwidth"] for p in plans), default=0.0)
    copy_fits = all(p["nbytes"] / p["bandwidth"] <= 0.8 * p["bubble_time"] for p in plans)
    period = rows["baft"]["period"]
    saves = {r["policy"]: r["stall_s"] for r in disk["rows"] if r["policy"] != "none"}
    return {
        "micro_batches": m, "tokens": t, "iteration_s": base, "rounds": doc["rounds"],
        "sync_copy_cost": rows["sync-copy"]["stall_s"] / base,
        "bubble_fraction": (model["stages"] - 1) / (m + model["stages"] - 1),
        **({"bubble_measured": min(bmap.bubble_fraction(s) for s in range(bmap.stages))} if bmap else {}),
        "policies": {name: {"overhead": r["overhead"], "ci95": r["ci95"], "mean": r["mean_overhead"],
                            "mean_ci95": r["mean_ci95"], "period": r["period"],
                            "stall_s": r["stall_s"], "cpu_outside_bubbles_s": r["in_hook_cpu_s"],
                            "seal_cpu_s": r["seal_cpu_s"]}
                     for name, r in rows.items() if name != "none"},
        "baft_predicted": stall / base / period, "baft_period_predicted": period,
        "baft_period_measured": period_within(rows["baft"]["stall_s"] / base, BUDGET),
        "copy_fits_bubbles": copy_fits,
        "in_bubbles": min((s["copied_in_bubbles_bytes"] / s["state_bytes"] for s in result["stages"]), default=0.0),
        "disk_period_for_1pct": {name: max(1, math.ceil(s / (BUDGET * base))) for name, s in saves.items()},
        "disk_save_s": saves,
    }


def real_jobs() -> dict:
    """Where the simulator puts real jobs on the x axis: a synchronous copy's cost over their iteration."""
    from baft.simulate.model import run

    out = {}
    for preset, label in REAL_JOBS.items():
        result = run(preset=preset)
        out[label] = {"sync_copy_cost": result.copy_time / result.iteration_time,
                      "bubble_fraction": max(s.bubble_fraction for s in result.stages)}
    return out


# ---------------------------------------------------------------------------------------------
# verdicts


def ci_text(p: dict, mean: bool = False) -> str:
    """The overhead and its 95% interval: of the interquartile mean, or (``mean``) of the mean."""
    value, interval = (p["mean"], p["mean_ci95"]) if mean else (p["overhead"], p["ci95"])
    low, high = interval or (math.nan, math.nan)
    return f"{value:+.2%} ({low:+.2%} .. {high:+.2%})"


def needs(pt: dict, half: float) -> str:
    """Where the A/A interval is wider than +-0.5 points: the rounds (and time) that would narrow it so at
    this noise, from an interval's 1 / sqrt(rounds) shrinkage."""
    if half <= 0.005:
        return ""
    rounds = math.ceil(pt["rounds"] * (half / 0.005) ** 2)
    took = f", about {pt['measure_s'] * rounds / pt['rounds'] / 60:.0f} min" if "measure_s" in pt else ""
    return f" (this noise needs about {rounds} rounds{took})"


def aa_lines(points: list[dict]) -> list[str]:
    """The A/A check at every point: none against none must contain 0 within +-0.5 points."""
    out = []
    for pt in points:
        aa = pt["policies"][AA]
        low, high = aa["ci95"] or (-1, 1)
        ok = low <= 0 <= high and max(-low, high) <= 0.005
        out.append(f"{'PASS' if ok else 'FAIL'} A/A at m={pt['micro_batches']} t={pt['tokens']}: "
                   f"none vs none {ci_text(aa)} (mean {ci_text(aa, mean=True)}); the interquartile mean's must contain 0 "
                   f"within +-0.50 points" + needs(pt, (high - low) / 2))
    return out


def target_lines(points: list[dict]) -> list[str]:
    """Targets 1-3 of the issue, one line per point where they apply."""
    out = []
    for pt in points:
        where = f"m={pt['micro_batches']} t={pt['tokens']} (sync copy {pt['sync_copy_cost']:.1%} of an iteration)"
        b, s, th = pt["policies"]["baft"], pt["policies"]["sync-copy"], pt["policies"]["thread-copy"]
        b_high = (b["ci95"] or (0, math.inf))[1]
        if pt["copy_fits_bubbles"]:
            # by both centres: the mean is what a long run pays, with the rare iterations the other drops
            ok = b["period"] == 1 and all(value <= BUDGET and (interval or (0, math.inf))[1] <= 0.015
                                          for value, interval in ((b["overhead"], b["ci95"]), (b["mean"], b["mean_ci95"])))
            out.append(f"{'PASS' if ok else 'FAIL'} target 1 at {where}: bubbles hold the state; baft at period "
                       f"{b['period']} costs {ci_text(b)}, mean {ci_text(b, mean=True)}; needs period 1, <= 1% and "
                       f"upper bound <= 1.5% by both")
            if pt["sync_copy_cost"] >= 0.05:
                s_low, t_low = (s["ci95"] or (0, 0))[0], (th["ci95"] or (0, 0))[0]
                floor = max(b_high, 0.0)
                ok = s_low >= 5 * floor and s_low > b_high and t_low >= 2 * floor
                out.append(f"{'PASS' if ok else 'FAIL'} target 2 at {where}: sync copy {ci_text(s)}, thread copy "
                           f"{ci_text(th)}, baft {ci_text(b)}; needs sync >= 5x and thread >= 2x baft, intervals apart")
        else:
            ok = abs(pt["baft_predicted"] - b["overhead"]) <= 0.01 and \
                pt["baft_period_predicted"] == pt["baft_period_measured"]
            out.append(f"{'PASS' if ok else 'FAIL'} target 3 at {where}: bubbles cannot hold the state; planner "
                       f"predicts {pt['baft_predicted']:+.2%} at period {pt['baft_period_predicted']}, measured "
                       f"{ci_text(b)} (its stall needs period {pt['baft_period_measured']})")
    return out


# ---------------------------------------------------------------------------------------------
# report

STYLE = {"sync-copy": ("#c44e52", "synchronous copy"), "thread-copy": ("#dd8452", "background-thread copy"),
         "baft": ("#4c72b0", "baft"), AA: ("#999999", "A/A: none vs none")}


def draw(points: list[dict], jobs: dict, path: Path) -> None:
    """Overhead against the synchronous copy's cost, one panel per micro-batch count."""
    from matplotlib.figure import Figure

    counts = sorted({p["micro_batches"] for p in points})
    fig = Figure(figsize=(6 * len(counts), 4.6), layout="constrained")
    axes = fig.subplots(1, len(counts), squeeze=False)[0]
    for ax, m in zip(axes, counts):
        mine = sorted((p for p in points if p["micro_batches"] == m), key=lambda p: p["sync_copy_cost"])
        xs = [p["sync_copy_cost"] * 100 for p in mine]
        for name, (colour, label) in STYLE.items():
            ys = [p["policies"][name]["overhead"] * 100 for p in mine]
            lows = [(p["policies"][name]["ci95"] or [math.nan] * 2)[0] * 100 for p in mine]
            highs = [(p["policies"][name]["ci95"] or [math.nan] * 2)[1] * 100 for p in mine]
            ax.plot(xs, ys, "o-", color=colour, label=label, lw=1.5, ms=4)
            ax.fill_between(xs, lows, highs, color=colour, alpha=0.18, lw=0)
            # the band has no width at a lone point: its interval as an error bar too
            ax.errorbar(xs, ys, yerr=[[y - lo for y, lo in zip(ys, lows)], [hi - y for y, hi in zip(ys, highs)]],
                        fmt="none", ecolor=colour, elinewidth=1, capsize=3)
        ax.plot(xs, [p["policies"]["baft"]["mean"] * 100 for p in mine], "s:", color=STYLE["baft"][0], lw=1, ms=4,
                mfc="none", label="baft, mean (the rare long iterations included)")
        ax.plot(xs, [p["baft_predicted"] * 100 for p in mine], "x--", color=STYLE["baft"][0], lw=1, ms=6,
                label="baft, planner's prediction")
        bubble = mine[0]["bubble_fraction"] * 100 if mine else 0
        ax.axvline(bubble, color="black", ls=":", lw=1)
        ax.text(bubble, ax.get_ylim()[1], f" bubble fraction {bubble:.0f}%", fontsize=8, va="top")
        measured = [p["bubble_measured"] * 100 for p in mine if "bubble_measured" in p]
        if measured:  # what the smallest stage measured: the receive waits it can copy in
            if min(measured) < max(measured):
                ax.axvspan(min(measured), max(measured), color="black", alpha=0.08, lw=0)
            else:  # one point: a span would have no width
                ax.axvline(min(measured), color="black", alpha=0.3, lw=0.8)
            ax.text(max(measured), ax.get_ylim()[1] * 0.9, " smallest stage's\n measured bubble", fontsize=7, va="top")
        for label, job in jobs.items():
            ax.axvline(job["sync_copy_cost"] * 100, color="#55a868", lw=0.8, alpha=0.7)
            ax.text(job["sync_copy_cost"] * 100, ax.get_ylim()[0], f" {label}", rotation=90, fontsize=7,
                    va="bottom", color="#2d6a3e")
        ax.set_xscale("log")
        ax.set_xlabel("synchronous copy of a stage's state, % of an iteration")
        ax.set_ylabel("overhead per iteration, %")
        ax.set_title(f"2 stages, {m} micro-batches", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def seal_cpu_text(baft: dict) -> str:
    """baft's CPU time per snapshot outside the bubbles: the trainer's thread + the sealing thread (not
    recorded before the sealing thread was timed)."""
    seal = baft.get("seal_cpu_s")
    return f"{baft['cpu_outside_bubbles_s'] * 1e3:.1f} + {'-' if seal is None else f'{seal * 1e3:.1f}'} ms"


def point_rows(points: list[dict]) -> list[list]:
    rows = []
    for p in sorted(points, key=lambda p: (p["micro_batches"], p["tokens"])):
        pol = p["policies"]
        bubble = f"{p['bubble_measured']:.1%}" if "bubble_measured" in p else "-"
        rows.append([p["micro_batches"], p["tokens"], f"{p['iteration_s'] * 1e3:.0f} ms", f"{p['sync_copy_cost']:.1%}",
                     bubble,
                     ci_text(pol[AA]), ci_text(pol["sync-copy"]), ci_text(pol["thread-copy"]), ci_text(pol["baft"]),
                     ci_text(pol[AA], mean=True), ci_text(pol["baft"], mean=True),
                     pol["baft"]["period"], f"{p['baft_predicted']:+.2%}", f"{p['in_bubbles']:.0%}",
                     seal_cpu_text(pol["baft"]),
                     ", ".join(f"{k.split('/')[0]} {v}" for k, v in p["disk_period_for_1pct"].items()), p["rounds"]])
    return rows


def provenance_lines(data: dict) -> list[str]:
    """Where and how the sweep was measured: one command, or each sitting's (:func:`sittings`); then how it
    was analysed again, and its note."""
    if "sittings" in data:
        machine = data["provenance"]["machine"]
        lines = [f"- machine: {machine}", "- sittings, each one command:",
                 *[f"  - `{s['command']}`: {s['date']} ({s['wall_s']:.0f} s wall), baft revision {s['revision']}"
                   + ("" if s["machine"] == machine else f", on {s['machine']}") for s in data["sittings"]]]
    else:
        lines = header(data["provenance"], data.get("wall_s"))
    if "analysed" in data:
        again = data["analysed"]
        lines.append(f"- analysed again from the launches' records: `{again['command']}`, {again['date']}, "
                     f"baft revision {again['revision']}")
    if "note" in data:
        lines.append(f"- note: {data['note']}")
    return lines


def render(data: dict) -> str:
    points, model = data["points"], data["model"]
    ranks = model["stages"] * model.get("data_parallel", 1)
    lines = ["# Where bubble-awareness pays: overhead against the cost of a synchronous copy", "",
             *provenance_lines(data), "",
             f"Model: the state-heavy example ({', '.join(f'{k} {v}' for k, v in model.items())}), {ranks} ranks on gloo. "
             "Each policy snapshots every iteration (baft at its planner's period, planned from the point's "
             "measured bubble map). Overhead: interquartile mean (mean of the middle half) of each "
             "iteration over the none iterations next to it, - 1, with a 95% interval resampling rounds; "
             "the mean of the same ratios (what a long run pays, the rare long iterations included) for "
             "the A/A check and baft.", "",
             f"![sweep]({data.get('name', 'sweep')}.png)", "",
             *md_table(["m", "tokens", "iteration", "sync copy cost", "smallest stage bubble", "A/A (none vs none)", "sync copy", "thread copy",
                        "baft", "A/A, mean", "baft, mean", "baft period", "baft predicted", "state copied in bubbles (min stage)",
                        "baft CPU outside bubbles (trainer + sealer)", "disk period for 1%", "rounds"], point_rows(points)), "",
             "Real jobs on the same axis (the simulator's synchronous copy over its iteration):", "",
             *md_table(["job", "sync copy cost", "bubble fraction"],
                       [[k, f"{v['sync_copy_cost']:.1%}", f"{v['bubble_fraction']:.1%}"]
                        for k, v in data["real_jobs"].items()]), "",
             "## Verdicts", "", *[f"- {line}" for line in aa_lines(points) + target_lines(points)]]
    return "\n".join(lines) + "\n"


def sittings(docs: list[dict], name: Optional[str]) -> dict:
    """Saved sweeps as one: their points by (m, t), a later sweep's replacing an earlier's, each sweep's
    provenance as a sitting (a point resumed in a later sitting has all its launches in that one's), and the
    latest note any of them has. One sweep's re-analysis (``analysed``) does not describe the merge."""
    if len(docs) == 1:
        return {**docs[0], **({"name": name} if name else {})}
    points = {(p["micro_batches"], p["tokens"]): p for doc in docs for p in doc["points"]}
    notes = [doc["note"] for doc in docs if "note" in doc]
    latest = {k: v for k, v in docs[-1].items() if k not in ("note", "analysed")}
    return {**latest, "points": [points[k] for k in sorted(points)], "name": name or "sweep",
            "sittings": [s for doc in docs
                         for s in doc.get("sittings") or [{**doc["provenance"], "wall_s": doc.get("wall_s")}]],
            **({"note": notes[-1]} if notes else {})}


def write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / data.get("name", "sweep")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    stem.with_suffix(".md").write_text(render(data))
    draw(data["points"], data["real_jobs"], stem.with_suffix(".png"))
    print(render(data))
    print(f"wrote {stem}.md, .json, .png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", default="4,8")
    p.add_argument("--tokens", default="8,16,32,128")
    p.add_argument("--rounds", type=int, default=20, help="rounds per launch")
    p.add_argument("--halfwidth", type=float, default=0.005, help="stop a point once every 95%% interval is this tight")
    p.add_argument("--point-minutes", type=float, default=8, help="at most this long per point")
    p.add_argument("--point-rounds", type=int,
                   help="launch until every point has this many rounds, its resumed launches included, whatever "
                        "the intervals (a number fixed before measuring, instead of --halfwidth and --point-minutes)")
    p.add_argument("--shuffle", action="store_true",
                   help="draw the arms' order anew every round, so that no arm keeps one place in the round")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--zero-stage", type=int, choices=[0, 1], default=0)
    p.add_argument("--data-parallel", type=int, default=1, help="replicas of every stage")
    p.add_argument("--name", help="output stem under --out (NAME.md|json|png; default sweep, or the rendered one's)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--raw", type=Path, help="keep every launch's records here (default: a temporary directory)")
    p.add_argument("--resume", action="store_true",
                   help="count the launches already in --raw (same options) and add to them")
    p.add_argument("--render", type=Path, nargs="+",
                   help="rewrite the outputs of saved sweep JSONs (no training); several: their points as one "
                        "sweep of several sittings, a later file's point replacing an earlier's")
    args = p.parse_args(argv)
    if args.resume and not args.raw:
        p.error("--resume needs --raw, the directory of the launches to add to")
    if args.render:
        data = sittings([json.loads(path.read_text()) for path in args.render], args.name)
        if args.raw:  # analysed again from the launches' records, as the sweep measured them
            data["points"] = [measure_point(data["model"], p["micro_batches"], p["tokens"], args, args.raw,
                                            launch=False) for p in data["points"]]
            data["analysed"] = provenance()
        write(data, Path(args.out))
        return 0
    model = {**MODEL, "precision": args.precision, "zero_stage": args.zero_stage, "data_parallel": args.data_parallel}
    start, prov, jobs = time.time(), provenance(), real_jobs()
    points = []
    with tempfile.TemporaryDirectory(prefix="baft-sweep-") as tmp:
        raw = args.raw or Path(tmp)
        raw.mkdir(parents=True, exist_ok=True)
        for m in map(int, args.micro_batches.split(",")):
            for t in map(int, args.tokens.split(",")):
                points.append(measure_point(model, m, t, args, raw))
                # after every point, so a sweep cut short keeps what it measured
                write({"provenance": prov, "wall_s": time.time() - start, "model": model, "points": points,
                       "real_jobs": jobs, "name": args.name or "sweep"}, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
