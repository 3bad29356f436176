"""Experiment 1's report: Markdown tables, findings and the PNG from a run and its analysis."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from overhead_analysis import BUDGET, LABELS, MIN_ROUNDS, target_lines

def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def policy_table(result: dict, config: str = "") -> list[str]:
    head = ("| " + ("config | " if config else "") + "policy | period | median iteration | overhead vs none "
            "(95% CI) | median stall | in-hook time per snapshot: wall, CPU (CPU / none) | waiting for a CPU | snapshot | "
            "bytes / iteration | bytes saved / hour |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        label = f"{r['policy']}: {LABELS.get(r['policy'], r['policy'])}"
        pre = f"| {config} " if config else ""
        if "error" in r:
            lines.append(f"{pre}| {label} | {r['period']} | did not run: {r['error']} | | | | | | | |")
            continue
        oh = ("—" if r["policy"] == "none" else f"{r['overhead']:+.2%} "
              + (f"({r['ci95'][0]:+.1%} .. {r['ci95'][1]:+.1%})" if r["ci95"] else "(too few rounds for an interval)"))
        lines.append(
            f"{pre}| {label} | {r['period']} | {r['median_s'] * 1e3:.0f} ms | {oh} | {r['stall_s'] * 1e3:.1f} ms | "
            f"{r['in_hook_s'] * 1e3:.1f} ms, {r['in_hook_cpu_s'] * 1e3:.1f} ms "
            f"({r['in_hook_cpu_s'] / result['base_uncontended_s']:.2%}) | {r['cpu_wait']:.0%} | "
            f"{fmt_bytes(r['snapshot_bytes'])} | {fmt_bytes(r['bytes_per_iteration'])} | "
            f"{fmt_bytes(r['bytes_per_hour'])} |")
    return lines


def stage_table(result: dict) -> list[str]:
    lines = [("| stage | state | copy bandwidth | bubble (profiled) | bubble (this run, none) | copied in bubbles | "
             "bubble time used (profiled / this run) | flushed before step | stall | in-hook time (of it at start) | "
             "receive wait none → baft |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["stages"]:
        lines.append(
            f"| {s['stage']} (rank {s['rank']}) | {fmt_bytes(s['state_bytes'])} | {s['bandwidth'] / 1e9:.2f} GB/s | "
            f"{s['bubble_profiled_s'] * 1e3:.0f} ms | {s['bubble_this_run_s'] * 1e3:.0f} ms | "
            f"{fmt_bytes(s['copied_in_bubbles_bytes'])} ({s['copied_in_bubbles_bytes'] / s['state_bytes']:.0%}) | "
            f"{s['bubble_used']:.0%} / {s['bubble_used_this_run']:.0%} | {fmt_bytes(s['flushed_bytes'])} | "
            f"{s['stall_s'] * 1e3:.1f} ms | {s['in_hook_s'] * 1e3:.1f} ms ({s['start_s'] * 1e3:.1f} ms) | "
            f"{s['recv_wait_none_s'] * 1e3:.0f} → {s['recv_wait_baft_s'] * 1e3:.0f} ms |")
    return lines


def findings(doc: dict, result: dict) -> list[str]:
    """Where baft's time goes: measured costs behind a snapshot (per rank, untimed, after the run)."""
    bench = doc.get("microbench") or []
    lines = [("| rank | capture_items | SnapshotWriter.begin (read_slots alone) | SnapshotWriter.commit | "
              "commit record | copy | xxh3 checksum | matmul alone → beside the other rank's copy |"),
             "|---|---|---|---|---|---|---|---|"]
    for k, b in enumerate(bench):
        if not b:
            continue
        inter = b.get("interference", {})
        slow = inter.get("beside_copy", 0) / inter["alone"] - 1 if inter.get("alone") else float("nan")
        lines.append(
            f"| {k} | {b.get('capture_items_s', 0) * 1e3:.2f} ms | {b.get('begin_s', 0) * 1e3:.2f} ms "
            f"({b.get('read_slots_s', 0) * 1e3:.2f} ms) | {b.get('commit_s', 0) * 1e3:.2f} ms | "
            f"{fmt_bytes(b.get('commit_file_bytes', 0))} (items {fmt_bytes(b.get('items_json_bytes', 0))}) | "
            f"{b.get('copy_GBps', 0):.2f} GB/s | {b.get('checksum_GBps', 0):.2f} GB/s | "
            f"{inter.get('alone', 0) * 1e3:.0f} → {inter.get('beside_copy', 0) * 1e3:.0f} ms ({slow:+.1%}) |")
    cycles = [(k, b["snapshot_cycle"]) for k, b in enumerate(bench) if b and b.get("snapshot_cycle")]
    if cycles:
        lines += ["", "baft's per-snapshot work on the trainer's thread outside the bubbles, replayed after the run "
                  "(thread CPU time, median of 7): " + "; ".join(
                      f"rank {k}: " + ", ".join(f"{name} {v * 1e3:.2f} ms" for name, v in c.items())
                      + f" = {sum(c.values()) * 1e3:.1f} ms" for k, c in cycles)]
    return lines


def config_name(doc: dict) -> str:
    c = doc["config"]
    return f"{c['size']}/{c['schedule']}"


def describe(doc: dict) -> str:
    c = doc["config"]
    return (f"example GPT, {doc['parameters'] / 1e6:.1f}M parameters (d_model {c['d_model']}, {c['layers']} layers, "
            f"{c['heads']} heads, vocab {c['vocab']}), {c['stages']} pipeline stages, {c['micro_batches']} "
            f"micro-batches of {c['micro_batch_size']} x {c['seq']} = {c['micro_batch_size'] * c['seq']} tokens, "
            f"schedule {c['schedule']}")


def method(doc: dict) -> list[str]:
    return [
        (f"Method: one launch of 2 ranks (gloo, 1 intra-op thread each); the engine is built once and every "
         f"policy's hook constructed up front (shared-memory slots pre-faulted); each policy then runs once, untimed "
         f"(baft: until its planner has run); then {doc['rounds']} rounds in which the policies take turns "
         f"with none between every two ({', '.join(p['name'] for p in doc['policies'] if p['name'] != 'none')}: "
         f"none A none B ...), {doc['block']} iterations per block. "
         "Iteration time is rank 0's wall clock around `train_batch`. Each iteration is divided by the iteration "
         "time of none around it (mean of the medians of the none blocks just before and just after), so drift of "
         "the machine cancels; overhead is the median of these ratios - 1. A policy with a period P > 1 snapshots "
         "in the last iteration of each of its blocks, and its overhead is amortized over P: "
         "((snapshot - 1) + (P - 1)(plain - 1)) / P from the medians of snapshot and plain "
         f"iterations. The 95% interval resamples whole rounds (bootstrap; given from {MIN_ROUNDS} rounds up). "
         "Stall is the hook's own `.stall` (max "
         "over ranks); in-hook time is all time spent in the policy's callbacks on the trainer's thread (max over "
         "ranks; for baft it adds `capture_items`, `SnapshotWriter.begin` and the commit to the stall). Waiting for "
         "a CPU is the share of the iteration a rank's trainer thread was runnable but not running (kernel "
         "schedstat run delay, max over ranks): the load other jobs put on the 2 cores. Disk baselines write to "
         "a temporary directory on the local disk (the two newest saves kept); after each of their blocks, untimed, "
         "a pending DCP save is awaited and `sync` writes the page cache back, so neither spills into the next "
         "policy. Bytes are one whole snapshot of both ranks (disk: the files written; memory: state + JSON items)."),
    ]


def first_note(result: dict) -> str:
    f = result["first_of_block"]
    return (f"Warm-up: the first iteration of a block took {f:+.1%} (median over blocks) against the block's others, "
            + ("so first iterations were discarded." if result["discarded_first"] else
               "no slower, so every iteration is kept."))


def render(doc: dict, result: dict, when: str, command: str, mach: dict) -> str:
    c = doc["config"]
    lines = [f"# Overhead of snapshot policies: {c['size']} model, {c['schedule']}", ""]
    lines += [(f"- Machine: {mach['cores']} cores, {mach['cpu']}, {mach['memory_gb']} GB; python {mach['python']}, "
              f"torch {mach['torch']}, DeepSpeed {mach['deepspeed']}, Linux {mach['kernel']}"),
              f"- Command: `{command}`", f"- Date: {when}; baft revision {mach['revision']}",
              f"- Model: {describe(doc)}",
              (f"- Load average before / after the run: {doc['load_average']['before'][0]:.2f} / "
              f"{doc['load_average']['after'][0]:.2f} (other jobs share this machine; interleaving spreads them over "
              "all policies)"),
              (f"- Duration: profile {doc['profile_seconds']:.0f} s, interleaved run {doc['run_seconds']:.0f} s; "
              f"baft planned from `{Path(doc['bubble_map']).name}`"), ""]
    lines += method(doc) + [""]
    lines += policy_table(result) + [""]
    lines += [first_note(result), ""]
    if doc["errors"]:
        lines += [f"- {k}: did not run here: {v}" for k, v in doc["errors"].items()] + [""]
    if "dcp-async" in doc["drain_seconds"]:
        lines += ["`dcp-async` gives `async_save` a gloo process group of its own: on the default group its "
                  "background thread's planning collectives race the pipeline's p2p and gloo aborts the process "
                  "(\"Received data size doesn't match expected size\"). Waiting for the last pending save and `sync` after each of its blocks (untimed): "
                  + ", ".join(f"{statistics.median(v):.2f} s" for k, v in doc["drain_seconds"].items() if k == "dcp-async")
                  + ".", ""]
    lines += ["## baft per stage", ""] + stage_table(result) + [""]
    lines += [("Bubble time used = bytes copied inside receive waits / the profiled copy bandwidth, over the stage's "
              "profiled bubble time (and over its receive wait measured under `none` in this run). The receive wait "
              "under baft includes the copy; a wait longer than under none means a copy overran its bubble."), ""]
    lines += ["## Targets", ""] + ["    " + line for line in target_lines(result)] + [""]
    lines += [("[wall clock] is the measured iteration time (the targets' own terms). [accounting] counts only the "
               "CPU time the trainer's thread spends in the policy's callbacks (outside the bubbles), over none's "
               f"median iteration with its wait for a CPU taken out ({result['base_uncontended_s'] * 1e3:.0f} ms): "
               "robust to a busy machine, but blind to copies that overrun a bubble, to memory-bandwidth "
               "interference with the other rank and to a background thread stealing the core."), ""]
    lines += ["## Findings", ""] + summary(doc, result) + [""]
    lines += ["## Where the time goes (measured after the run, per rank)", ""] + findings(doc, result) + [""]
    return "\n".join(lines)


def summary(doc: dict, result: dict) -> list[str]:
    """The run's story in a few measured sentences."""
    rows = {r["policy"]: r for r in result["rows"] if "error" not in r}
    out = []
    none, baft, sync = rows.get("none"), rows.get("baft"), rows.get("sync-copy")
    free = result["base_uncontended_s"]
    if none:
        out.append(f"- Noise: the trainer threads waited for a CPU {none['cpu_wait']:.0%} of a median iteration "
                   f"(other jobs on the 2 cores); none's iterations spread by {none['spread']:.1%} (interquartile, "
                   f"normalized by the none around them), so a wall-clock difference of 1% is "
                   f"{'within' if none['spread'] > BUDGET else 'above'} the noise of {none['iterations']} iterations.")
    if baft and sync:
        out.append(f"- Outside the bubbles, baft costs the trainer's thread {baft['in_hook_cpu_s'] * 1e3:.1f} ms of CPU "
                   f"per snapshot ({baft['in_hook_cpu_s'] / free:.2%} of an uncontended iteration of "
                   f"{free * 1e3:.0f} ms); the synchronous copy {sync['in_hook_cpu_s'] * 1e3:.1f} ms "
                   f"({sync['in_hook_cpu_s'] / free:.2%}): {sync['in_hook_cpu_s'] / max(baft['in_hook_cpu_s'], 1e-9):.1f}x.")
    bench = [b for b in doc.get("microbench") or [] if b and b.get("snapshot_cycle")]
    if bench:
        parts = {k: statistics.median(b["snapshot_cycle"][k] for b in bench) for k in bench[0]["snapshot_cycle"]}
        total = sum(parts.values())
        big = max(parts, key=parts.get)
        out.append("- Replayed piece by piece (median of the ranks, thread CPU): "
                   + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items())
                   + f" = {total * 1e3:.1f} ms per snapshot; the largest is {big} ({parts[big] / total:.0%}). "
                   f"The copy itself ({fmt_bytes(bench[0].get('state_bytes', 0))} per rank at "
                   f"{statistics.median(b.get('copy_GBps', 0) for b in bench):.1f} GB/s, xxh3 at "
                   f"{statistics.median(b.get('checksum_GBps', 0) for b in bench):.1f} GB/s) runs inside the bubbles.")
    inter = [b.get("interference") for b in doc.get("microbench") or [] if b and b.get("interference")]
    if inter:
        slow = [i.get("paired", i["beside_copy"] / i["alone"] - 1) for i in inter if i.get("alone")]
        line = (f"- A state copy on one rank changes the other rank's matmul time by "
                f"{' and '.join(f'{x:+.0%} (rank {k})' for k, x in enumerate(slow))} (median of "
                f"{inter[0].get('rounds', 3)} pairs, alternated with the copy off; the two cores share memory "
                f"bandwidth and cache).")
        spread = [i["alone_spread"] for i in inter if "alone_spread" in i]
        if spread:
            line += (f" The same matmul alone, on an otherwise idle rank, spreads by "
                     f"{' and '.join(format(x, '.0%') for x in spread)} (10th to 90th percentile over the median) "
                     "from one timing to the next: the machine's own speed varies by that much, so "
                     + ("the copy's effect on the other rank stands out of that noise."
                        if min(slow) > max(spread) / 2 else "the copy's effect on the other rank is within that noise.")
                     )
        out.append(line)
    for st in result["stages"]:
        out.append(f"- Stage {st['stage']}: baft copied {st['copied_in_bubbles_bytes'] / st['state_bytes']:.0%} of its "
                   f"{fmt_bytes(st['state_bytes'])} inside receive waits, using {st['bubble_used']:.0%} of the "
                   f"profiled bubble time; {fmt_bytes(st['flushed_bytes'])} was left for the flush before the "
                   f"optimizer step (stall {st['stall_s'] * 1e3:.1f} ms: that flush and the commit).")
    return out


def draw(results: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Left: wall-clock overhead with its 95% interval. Right: the policy's time on the trainer's thread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = [r["policy"] for r in results[0][1]["rows"] if r["policy"] != "none"]
    periods = {r["policy"]: r["period"] for r in results[0][1]["rows"]}
    fig, (ax, ax2) = plt.subplots(1, 2, sharey=True, figsize=(13, (0.5 if len(results) == 1 else 0.3) * len(names) * len(results) + 2),
                                  gridspec_kw={"width_ratios": [3, 2]})
    height = 0.8 / len(results)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for i, (label, res) in enumerate(results):
        rows = {r["policy"]: r for r in res["rows"]}
        ys, xs, lo, hi, acc = [], [], [], [], []
        for j, n in enumerate(names):
            r = rows.get(n)
            if not r or "error" in r:
                continue
            ys.append(j + i * height)
            xs.append(r["overhead"] * 100)
            ci = r["ci95"] or [r["overhead"]] * 2
            lo.append(max(0.0, (r["overhead"] - ci[0]) * 100))
            hi.append(max(0.0, (ci[1] - r["overhead"]) * 100))
            acc.append(r["in_hook_cpu_s"] / res["base_uncontended_s"] / r["period"] * 100)
        colour = colours[i % len(colours)]
        ax.barh(ys, xs, height=height, xerr=[lo, hi], color=colour, label=label, capsize=2, ecolor="#555")
        for y, x, h in zip(ys, xs, hi):
            ax.text(x + h + 0.3, y, f"{x:+.1f}%", va="center", fontsize=7)
        ax2.barh(ys, acc, height=height, color=colour, label=label)
        for y, x in zip(ys, acc):
            ax2.text(x, y, f" {x:.2f}%", va="center", fontsize=7)
    ax.set_yticks([j + height * (len(results) - 1) / 2 for j in range(len(names))])
    ax.set_yticklabels([f"{n} (every {periods.get(n)})" for n in names])
    ax.invert_yaxis()
    for a in (ax, ax2):
        a.axvline(BUDGET * 100, color="k", ls="--", lw=1)
        a.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("wall-clock iteration overhead vs none (%), 95% bootstrap interval")
    ax2.set_xlabel("CPU time in the policy's callbacks on the trainer's thread, per iteration\n"
                   "(% of none's iteration without its wait for a CPU)")
    ax2.set_xscale("symlog", linthresh=1)
    ax2.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0, 0.5, 1, 2, 5, 10, 20, 50]))
    ax2.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    fig.suptitle(title + "  (dashed: the 1% budget)", fontsize=10)
    if len(results) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(doc, result, out: Path, when, command, mach) -> Path:
    c = doc["config"]
    stem = out / (f"overhead-{c['size']}-{c['schedule']}" + (f"-{c['tag']}" if c.get("tag") else ""))
    text = render(doc, result, when, command, mach)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"machine": mach, "command": command, "date": when, "config": c, "result": result, "raw": doc}, indent=1))
    draw([(config_name(doc), result)], stem.with_suffix(".png"),
         f"{c['size']} ({doc['parameters'] / 1e6:.0f}M params), {c['schedule']}, 2 stages x 8 micro-batches — {when}")
    return stem


def write_grid(runs, out: Path, when, command, mach) -> None:
    lines = ["# Overhead of snapshot policies: model size x schedule", "",
             (f"- Machine: {mach['cores']} cores, {mach['cpu']}, {mach['memory_gb']} GB; python {mach['python']}, "
             f"torch {mach['torch']}, DeepSpeed {mach['deepspeed']}"), f"- Command: `{command}`", f"- Date: {when}"]
    lines += [f"- {config_name(d)}: {describe(d)}; load average {d['load_average']['before'][0]:.2f} / "
              f"{d['load_average']['after'][0]:.2f}" for d, _ in runs]
    lines += [""] + method(runs[0][0]) + [""]
    head = None
    for d, r in runs:
        t = policy_table(r, config_name(d))
        if head is None:
            head = t[:2]
            lines += head
        lines += t[2:]
    lines += ["", "## baft per stage", ""]
    for d, r in runs:
        lines += [f"### {config_name(d)}", ""] + stage_table(r) + [""]
    lines += ["## Targets", ""]
    for d, r in runs:
        lines += [f"{config_name(d)}:", ""] + ["    " + line for line in target_lines(r)] + [""]
    (out / "overhead-grid.md").write_text("\n".join(lines))
    (out / "overhead-grid.json").write_text(json.dumps(
        {"machine": mach, "command": command, "date": when,
         "runs": [{"config": d["config"], "result": r} for d, r in runs]}, indent=1))
    draw([(config_name(d), r) for d, r in runs], out / "overhead-grid.png", f"overhead per policy — {when}")
