"""experiments/sweep.py's verdicts: the issue's A/A check and targets, on hand-made points."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import sweep  # noqa: E402  (experiments/ is not a package)
from overhead_report import interquartile_mean  # noqa: E402

from baft.cli.compare import overhead


def point(aa, baft, sync=(0.09, 0.08, 0.10), thread=(0.06, 0.05, 0.07), fits=True, rounds=40, predicted=0.0,
          period=1, measured_period=1, sync_cost=0.08, baft_mean=None):
    def policy(o, mean=None):  # the mean as the interquartile mean unless given
        mean = mean or o
        return {"overhead": o[0], "ci95": [o[1], o[2]], "mean": mean[0], "mean_ci95": [mean[1], mean[2]],
                "period": period}
    return {"micro_batches": 4, "tokens": 8, "rounds": rounds, "measure_s": 600.0, "sync_copy_cost": sync_cost,
            "copy_fits_bubbles": fits, "baft_predicted": predicted, "baft_period_predicted": period,
            "baft_period_measured": measured_period,
            "policies": {sweep.AA: policy(aa), "baft": policy(baft, baft_mean), "sync-copy": policy(sync),
                         "thread-copy": policy(thread)}}


def test_aa_passes_only_within_half_a_point_around_zero():
    good, biased, wide = (point(aa, (0, 0, 0)) for aa in
                          [(0.001, -0.003, 0.004), (-0.006, -0.009, -0.002), (0.0, -0.01, 0.01)])
    lines = sweep.aa_lines([good, biased, wide])
    assert lines[0].startswith("PASS") and "needs" not in lines[0]
    assert lines[1].startswith("FAIL")  # 0 outside the interval, though it is narrow
    assert lines[2].startswith("FAIL")
    # +-1 point after 40 rounds: +-0.5 needs four times the rounds, and four times the 10 minutes
    assert "about 160 rounds, about 40 min" in lines[2]


def test_targets_one_and_two_where_the_bubbles_hold_the_state():
    cheap = point((0, -0.004, 0.004), baft=(0.008, 0.004, 0.012), sync=(0.09, 0.08, 0.10), thread=(0.05, 0.04, 0.06))
    t1, t2 = sweep.target_lines([cheap])
    assert t1.startswith("PASS target 1") and t2.startswith("PASS target 2")
    # an upper bound over 1.5% fails target 1; sync copy under 5x baft's upper bound fails target 2
    dear = point((0, -0.004, 0.004), baft=(0.012, 0.008, 0.02), sync=(0.09, 0.08, 0.10))
    t1, t2 = sweep.target_lines([dear])
    assert t1.startswith("FAIL target 1") and t2.startswith("FAIL target 2")
    # the mean counts the rare long iterations the interquartile mean drops: over budget there fails target 1
    tailed = point((0, -0.004, 0.004), baft=(0.008, 0.004, 0.012), baft_mean=(0.014, 0.008, 0.02))
    t1 = sweep.target_lines([tailed])[0]
    assert t1.startswith("FAIL target 1") and "mean +1.40% (+0.80% .. +2.00%)" in t1
    # below a 5% synchronous copy, target 2 does not apply
    assert len(sweep.target_lines([point((0, 0, 0), baft=(0.001, 0, 0.002), sync_cost=0.03)])) == 1


def test_target_three_where_the_bubbles_cannot_hold_the_state():
    near = point((0, 0, 0), baft=(0.012, 0.01, 0.014), fits=False, predicted=0.005, period=2, measured_period=2)
    far = point((0, 0, 0), baft=(0.03, 0.02, 0.04), fits=False, predicted=0.005, period=2, measured_period=2)
    other_period = point((0, 0, 0), baft=(0.012, 0.01, 0.014), fits=False, predicted=0.005, period=2,
                         measured_period=3)
    lines = sweep.target_lines([near, far, other_period])
    assert [line.split()[0] for line in lines] == ["PASS", "FAIL", "FAIL"]
    assert all("target 3" in line for line in lines)


def test_resume_counts_only_this_sweeps_launches(tmp_path):
    ours = {"policies": [{"name": n} for n in ["none", *sweep.ARMS.split(",")]], "records": []}
    for i in (1, 0, 10):
        (tmp_path / f"m4-t8-{i}.json").write_text(json.dumps({**ours, "launch": i}))
    (tmp_path / "m4-t8-disk.json").write_text(json.dumps({"policies": [{"name": "none"}]}))
    (tmp_path / "m8-t8-0.json").write_text(json.dumps(ours))
    assert [d["launch"] for d in sweep.launches(tmp_path, 4, 8)] == [0, 1, 10]
    (tmp_path / "m4-t8-2.json").write_text(json.dumps({"policies": [{"name": "none"}, {"name": "baft"}]}))
    with pytest.raises(SystemExit, match="m4-t8-2.json: not a launch of this sweep's policies"):
        sweep.launches(tmp_path, 4, 8)


def test_resume_refuses_a_launch_planned_at_another_period(tmp_path):
    def launch(baft_period):
        return {"policies": [{"name": n, "period": baft_period if n == "baft" else 1}
                             for n in ["none", *sweep.ARMS.split(",")]], "records": []}
    for i, period in enumerate([2, 2, 3]):
        (tmp_path / f"m8-t32-{i}.json").write_text(json.dumps(launch(period)))
    with pytest.raises(SystemExit, match="m8-t32-2.json: its policies ran at other periods than in m8-t32-0.json"):
        sweep.launches(tmp_path, 8, 32)


def test_a_fixed_number_of_rounds_stops_whatever_the_intervals():
    args = argparse.Namespace(rounds=20, point_rounds=230, halfwidth=0.005, point_minutes=0.0)
    assert sweep.next_launch([], args, start=0.0) == 20
    assert sweep.next_launch([{"rounds": 150}, {"rounds": 60}], args, start=0.0) == 20
    assert sweep.next_launch([{"rounds": 150}, {"rounds": 70}], args, start=0.0) == 10  # the last launch is cut to fit
    assert sweep.next_launch([{"rounds": 230}], args, start=0.0) == 0
    assert sweep.next_launch([{"rounds": 240}], args, start=0.0) == 0
    args.point_rounds = None
    assert sweep.next_launch([], args, start=0.0) == 20  # without, a point's first launch always runs


def test_overhead_is_the_mean_of_the_middle_half_of_the_ratios():
    assert interquartile_mean([1.0, 1.02, 1.04, 5.0]) == 1.03  # the stretched iteration is ignored
    assert interquartile_mean([0.1, 1.0, 1.0, 1.0, 1.1, 1.1, 1.1, 9.0]) == 1.05
    # period 3: one snapshot iteration (+9%) and two plain ones (+0%) per snapshot
    ratios, fired = [1.09, 1.0, 1.09, 1.0, 1.09, 1.0], [True, False] * 3
    assert abs(overhead(ratios, fired, 3, interquartile_mean) - 0.03) < 1e-12


def test_sweeps_of_several_sittings_render_as_one():
    def saved(command, points):
        return {"provenance": {"machine": "m", "command": command, "date": "d", "revision": "r"}, "wall_s": 60.0,
                "model": {"stages": 2}, "real_jobs": {}, "name": command,
                "points": [measured_point(m, t, r) for m, t, r in points]}

    def measured_point(m, t, rounds):
        pt = point((0, -0.001, 0.001), (0.01, 0.005, 0.015), rounds=rounds)
        pt["policies"]["baft"]["cpu_outside_bubbles_s"] = 0.001
        return pt | {"micro_batches": m, "tokens": t, "iteration_s": 0.7, "in_bubbles": 1.0, "disk_period_for_1pct": {}}
    first, second = saved("first", [(4, 32, 150), (8, 32, 100)]), saved("second", [(8, 8, 160), (8, 32, 170)])
    data = sweep.sittings([first, second], None)
    assert [(p["micro_batches"], p["tokens"], p["rounds"]) for p in data["points"]] == [(4, 32, 150), (8, 8, 160),
                                                                                       (8, 32, 170)]
    assert [s["command"] for s in data["sittings"]] == ["first", "second"] and data["name"] == "sweep"
    text = sweep.render(data)
    assert "- `first`: d (60 s wall), baft revision r" in text and "- `second`" in text
    assert [s["command"] for s in sweep.sittings([data, saved("third", [])], "x")["sittings"]] == ["first", "second",
                                                                                                   "third"]
    assert sweep.sittings([first], None)["name"] == "first"  # one sweep renders as it was
    # the file being extended keeps its note when the sitting added to it has none; a re-analysis of the
    # added sitting alone is not the merge's
    noted, analysed = {**first, "note": "kept"}, {**second, "analysed": first["provenance"]}
    merged = sweep.sittings([noted, analysed], None)
    assert merged["note"] == "kept" and "analysed" not in merged
    assert sweep.sittings([noted, {**analysed, "note": "newer"}], None)["note"] == "newer"
