"""Expected time lost per fault and per day under each checkpointing policy, from the simulator.

    python experiments/lost_time.py [--failures-per-day F] [--presets a,b,...]
                                    [--measured BUBBLEMAP.json [--measured-overhead X]]
                                    [--set key=value ...] [--out experiments/results]

For every preset (default: all bundled ones) and one failure rate (``--failures-per-day``, by
default each preset's own: per-node MTBF from the Llama 3 report times its nodes), the
simulator (``baft.simulate.model``) predicts, per policy:

* ``disk``       synchronous checkpoint to shared storage at Young's optimum sqrt(2·δ·MTBF);
* ``disk-fixed`` the same at the preset's fixed period (the reference's hourly checkpoint);
* ``sync-copy``  in-memory checkpoint that ignores bubbles, at the period that keeps it ≤ 1%;
* ``baft``       bubble-aware in-memory snapshot, period from the planner at 1%;

its checkpoint period, overhead, expected loss per failure (T0..T4) and expected loss per day
(failures/day × loss per failure + overhead × 24 h). ``--measured`` replaces the
``this-machine`` row's costs (per-op times, state size, copy bandwidth) with those of a bubble
map written by ``baft profile``, and prints the predicted-against-measured comparison.

Writes ``lost_time.md`` (the table, with machine, command and date) and ``lost_time.png``
(lost minutes per day, one group of bars per preset) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from baft.errors import BaftError
from baft.pipeline.bubblemap import BubbleMap
from baft.simulate.measured import compare_to_measured, scenario_from_measured
from baft.simulate.model import simulate_scenario
from baft.simulate.scenario import load_preset, parse_overrides, preset_names
from baft.simulate.units import duration as _duration
from baft.simulate.units import size as _bytes
from common import RESULTS, header, provenance

POLICIES = ("disk", "disk-fixed", "sync-copy", "baft")
ORDER = ("gpt3-175b-1024", "gpt3-3b-8", "gpt3-15b-8", "this-machine")


def default_presets() -> str:
    names = preset_names()
    return ",".join([n for n in ORDER if n in names] + [n for n in names if n not in ORDER])


COLOURS = {"disk": "#8c564b", "disk-fixed": "#c49c94", "sync-copy": "#ff7f0e", "baft": "#1f77b4"}


def scenarios(names, failures_per_day, overrides, measured):
    out = []
    for name in names:
        s = load_preset(name)
        if name == "this-machine" and measured is not None:
            s = scenario_from_measured(measured, s)
        changes = dict(overrides)
        if failures_per_day is not None:
            changes["failures_per_day"] = failures_per_day
        out.append(s.with_overrides(changes))
    return out


def markdown(results, header: list[str], comparison=None) -> str:
    lines = [*header, ""]
    lines += [("| preset | iteration | state / rank | failures / day | policy | period | overhead "
               "| T0 | T1+T2+T4 | T3 | lost / failure | lost / day | % of day |"),
              "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        s = r.scenario
        for i, p in enumerate(sorted(r.policies, key=lambda p: POLICIES.index(p.policy))):
            first = i == 0
            lines.append(
                f"| {s.name if first else ''} | {_duration(r.iteration_time) if first else ''} "
                f"| {_bytes(r.state_per_rank) if first else ''} | {f'{r.failures_per_day:.3g}' if first else ''} "
                f"| {p.policy} | {p.period_iterations:.0f} it = {_duration(p.period_s)} | {p.overhead:.2%} "
                f"| {_duration(p.t0)} | {_duration(p.t1 + p.t2 + p.t4)} | {_duration(p.t3)} "
                f"| {_duration(p.lost_per_failure)} | {_duration(p.lost_per_day)} | {p.lost_per_day / 864:.2f}% |")
    lines += ["", ("Policies: disk = synchronous flush to shared storage at Young's period sqrt(2·δ·MTBF) "
              "(δ = checkpoint bytes / write bandwidth); disk-fixed = the preset's fixed period; "
              "sync-copy = whole shard copied to host memory at the step, period keeping it within 1%; "
              "baft = shard copied inside the pipeline bubbles, period from the planner at 1%. "
              "Lost / day = failures/day × lost / failure + overhead × 24 h. "
              "Model, formulas and sources: docs/simulator.rst; every preset figure's source: baft/presets/*.json.")]
    lines += ["", "Reading:"]
    for r in results:
        by = {p.policy: p for p in r.policies}
        base = by.get("disk-fixed") or by.get("disk")
        if base is None:
            continue
        ratio = base.lost_per_day / by["baft"].lost_per_day if by["baft"].lost_per_day > 0 else float("inf")
        best = min(r.policies, key=lambda p: p.lost_per_day)
        lines.append(f"- {r.scenario.name}: baft loses {_duration(by['baft'].lost_per_day)} a day against "
                     f"{_duration(base.lost_per_day)} for {base.policy} ({ratio:.2g}x); least loss: {best.policy}.")
        for note in r.notes:
            lines.append(f"  - {note}")
    if comparison is not None:
        lines += ["", "this-machine, simulator against the measured bubble map:", "", "```", comparison.render(), "```"]
    return "\n".join(lines) + "\n"


def chart(results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.6 * len(results) + 2, 4.5))
    width = 0.8 / len(POLICIES)
    for j, name in enumerate(POLICIES):
        xs, ys = [], []
        for i, r in enumerate(results):
            for p in r.policies:
                if p.policy == name:
                    xs.append(i + (j - (len(POLICIES) - 1) / 2) * width)
                    ys.append(max(p.lost_per_day / 60, 1e-3))
        if xs:
            bars = ax.bar(xs, ys, width, label=name, color=COLOURS[name])
            for bar, y in zip(bars, ys):
                ax.annotate(f"{y:.3g}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)),
                  [f"{r.scenario.name}\n{r.failures_per_day:.3g} failures/day" for r in results], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("expected minutes lost per day (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures-per-day", type=float, default=None,
                        help="failures per day of each job (default: each preset's own)")
    parser.add_argument("--presets", default=default_presets(), help="comma-separated preset names")
    parser.add_argument("--measured", help="a measured bubble map (baft profile) for the this-machine row")
    parser.add_argument("--measured-overhead", type=float, default=None,
                        help="the overhead a baft run measured, shown beside the prediction")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario key in every preset")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    try:
        measured = BubbleMap.load(args.measured) if args.measured else None
        names = [n.strip() for n in args.presets.split(",") if n.strip()]
        results = [simulate_scenario(s) for s in
                   scenarios(names, args.failures_per_day, parse_overrides(args.overrides), measured)]
        comparison = compare_to_measured(measured, args.measured_overhead) if measured is not None else None
    except BaftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    out = Path(args.out)
    prov = provenance()
    rate = "each preset's own" if args.failures_per_day is None else f"{args.failures_per_day:g} per day"
    head = ["# Expected time lost per fault and per day (simulator)", "", *header(prov),
            f"- failure rate: {rate}" + (f"; this-machine costs measured in {args.measured}" if args.measured else "")]
    text = markdown(results, head, comparison)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lost_time.md").write_text(text)
    chart(results, out / "lost_time.png", f"expected time lost per day, failure rate: {rate} ({prov['date']})")
    print(text)
    print(f"wrote {out / 'lost_time.md'} and {out / 'lost_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
