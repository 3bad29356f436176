"""``baft compare``: launch the benchmark worker (:mod:`baft.benchmark`) on every rank of the example, and
summarize its records: medians per policy and overhead ratios against ``none``."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from baft.config import parse_policies
from baft.errors import BaftError


def overhead(ratios: list[float], fired: list[bool], period: int, centre=statistics.median) -> float:
    """Overhead per iteration from iteration times over the baseline's: at period 1 their ``centre`` - 1;
    at period P, one snapshot iteration and P - 1 plain ones: ((snapshot - 1) + (P - 1)(plain - 1)) / P.
    The median suits a few rounds; the experiments, with hundreds, pass a tighter centre."""
    if period == 1 or not any(fired):
        return centre(ratios) - 1
    snap = [x for x, f in zip(ratios, fired) if f]
    plain = [x for x, f in zip(ratios, fired) if not f] or [1.0]
    return ((centre(snap) - 1) + (period - 1) * (centre(plain) - 1)) / period


def worst(rec: dict, field: str) -> float:
    """The largest of the ranks' ``field`` in one iteration's record (0 where a run before the field had none)."""
    return max(r.get(field, 0.0) for r in rec["ranks"])


def measured(rec: dict, block: int) -> bool:
    """Whether an iteration's record counts: in blocks of several, a block's first does not, as it still
    runs the previous block's work (a snapshot's seal outlives its iteration) and misses its own policy's."""
    return rec["j"] > 0 or block == 1


def summarize(doc: dict) -> list[dict]:
    """Per policy: median iteration (rank 0), and per snapshot the median stall and CPU time in the policy's
    callbacks (max over ranks); overhead versus ``none``'s median iteration. Blocks of several iterations
    drop their first."""
    by_policy: dict[str, list[dict]] = {}
    for rec in doc["records"]:
        if measured(rec, doc["block"]):
            by_policy.setdefault(rec["policy"], []).append(rec)
    none = by_policy.get("none")
    base = statistics.median(r["ranks"][0]["wall"] for r in none) if none else None
    out = []
    for policy in doc["policies"]:
        recs = by_policy[policy["name"]]
        fired = [bool(r["ranks"][0]["fired"]) for r in recs]
        snaps = [r for r, f in zip(recs, fired) if f] or recs
        wall = [r["ranks"][0]["wall"] for r in recs]
        out.append({"policy": policy["name"], "period": policy["period"], "iterations": len(recs),
                    "median_s": statistics.median(wall),
                    "stall_s": statistics.median(worst(r, "stall") for r in snaps),
                    "hook_cpu_s": statistics.median(worst(r, "hook_cpu") for r in snaps),
                    "fence_wait_s": statistics.median(worst(r, "fence_wait") for r in snaps),
                    "seal_s": statistics.median(worst(r, "seal") for r in snaps),
                    "seal_cpu_s": statistics.median(worst(r, "seal_cpu") for r in snaps),
                    "seal_wait_s": statistics.median(worst(r, "seal_wait") for r in snaps),
                    "overhead": overhead([w / base for w in wall], fired, policy["period"]) if base else None})
    return out


def render(summary: list[dict]) -> str:
    """The summary as a plain-text table; on a GPU, with the device's wait at the fence."""
    device = any(s.get("fence_wait_s", 0.0) > 0 for s in summary)
    lines = [f"{'policy':<14} {'period':>6} {'iters':>5} {'median iter':>12} {'stall':>9} "
             + (f"{'device wait':>11} " if device else "") + f"{'CPU in hook':>11} {'overhead':>9}"]
    for s in summary:
        over = "" if s["overhead"] is None else f"{s['overhead']:+.1%}"
        period = s["period"] if s["policy"] != "none" else "-"
        wait = f"{s.get('fence_wait_s', 0.0) * 1e3:>8.1f} ms " if device else ""
        lines.append(f"{s['policy']:<14} {period:>6} {s['iterations']:>5} {s['median_s'] * 1e3:>9.1f} ms "
                     f"{s['stall_s'] * 1e3:>6.1f} ms {wait}{s['hook_cpu_s'] * 1e3:>8.1f} ms {over:>9}")
    return "\n".join(lines)


def launch_compare(model: dict, dp: int, policies: str, rounds: int, block: int, bubble_map, out,
                   none_between: bool = False, shuffle: bool = False) -> list[dict]:
    """``baft compare``: run :mod:`baft.benchmark` on every rank of the example through torchrun; its :func:`summarize`."""
    from baft.cli.launch import flags, launch_env
    from baft.cli.runlog import run_example_logged

    parse_policies(policies)  # a bad name stops here, in one line, rather than on every rank
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="baft-compare-", dir=shm) as fast, \
            tempfile.TemporaryDirectory(prefix="baft-compare-") as disk:  # the disk baselines write to a disk
        result = Path(out) if out else Path(disk) / "compare.json"
        outcome = run_example_logged(model["stages"] * dp, [
            "baft.benchmark", "--policies", policies, "--rounds", str(rounds), "--block", str(block),
            *(["--none-between"] if none_between else []), *(["--shuffle"] if shuffle else []),
            "--out", str(result), "--shm-dir", fast, "--disk-dir", disk, *flags({**model, "bubble_map": bubble_map})],
            launch_env(), result.with_suffix(".log"),
            announce=bool(out))  # a temporary log is gone when the command ends
        if outcome.code != 0 or not result.exists():
            raise BaftError(f"the comparison run failed ({outcome.reason()})")
        return summarize(json.loads(result.read_text()))

