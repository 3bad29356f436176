"""baft report: reading recovery.jsonl, one-line refusals naming file and line, table and PNG."""

import json
import time
from pathlib import Path

import pytest
from matplotlib.image import imread

from baft.errors import BaftError
from baft.cli.report import draw_recovery, render_recovery_text
from baft.recovery.record import FILENAME, load_recoveries

# Records written by the restart hook in real runs on this machine (17M-parameter GPT, 2 stages):
# a kill restored from the manager's memory, a node loss rebuilt from parity, a kill restored from
# disk; collected from three runs into one file, restarts renumbered.
SAMPLE = Path(__file__).parent / "data" / "run-recovery"

RECORD = {"restart": 1, "fault": "kill rank 1 at step 7 (backward)", "killed_at": None, "restored_step": 6,
          "source": "memory", "lost_steps": 1, "T0": 0.5, "T1": 4.0, "T2": 1.5, "T3": 0.25, "T4": 0.75,
          "total": 7.0}


def write_run(tmp_path, *lines) -> Path:
    (tmp_path / FILENAME).write_text("".join(f"{line}\n" for line in lines))
    return tmp_path


def refusal(run_dir) -> str:
    with pytest.raises(BaftError) as err:
        load_recoveries(run_dir)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_sample_run_table_and_median():
    recs = load_recoveries(SAMPLE)
    assert [(r.restart, r.source, r.restored_step, r.lost_steps) for r in recs] == [
        (1, "memory", 8, 1), (2, "parity", 4, 1), (3, "disk", 6, 3)]
    text = render_recovery_text(recs)
    row = next(line for line in text.splitlines() if "parity" in line)
    assert [c.strip() for c in row.strip("│").split("│")] == [
        "2", "kill node 1 at step 6", "warm relaunch", "4 (lost 1)", "parity", "0.11", "6.18", "5.70", "2.48", "0.11", "14.58"]
    median = next(line for line in text.splitlines() if "median" in line)
    assert "cold relaunch" in text and "—" in text  # a record from before kinds were recorded has none
    assert median.split("│")[6:12] == [" 3.62 ", " 6.18 ", " 5.70 ", " 0.62 ", " 3.94 ", " 19.62 "]


def test_single_recovery_has_no_median_row(tmp_path):
    text = render_recovery_text(load_recoveries(write_run(tmp_path, json.dumps(RECORD))))
    assert "median" not in text
    assert "6 (lost 1)" in text and "7.00" in text


def test_unknown_keys_ignored_blank_lines_skipped_total_defaults_to_sum(tmp_path):
    partial = {k: v for k, v in RECORD.items() if k not in ("total", "restart")}
    run = write_run(tmp_path, "", json.dumps({**RECORD, "ranks": [0, 1]}), "   ", json.dumps(partial))
    first, second = load_recoveries(run)
    assert first.total == 7.0
    assert second.total == pytest.approx(7.0) and second.restart == 2
    assert second.phases == (0.5, 4.0, 1.5, 0.25, 0.75)


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({k: v for k, v in RECORD.items() if k != "T3"}), "missing 'T3' (T3 state load, seconds)"),
    (json.dumps({**RECORD, "T2": "1.5s"}), "'T2' must be a number of seconds, got '1.5s'"),
    (json.dumps({**RECORD, "T1": None}), "'T1' must be a number of seconds, got None"),
    (json.dumps({**RECORD, "T4": True}), "'T4' must be a number of seconds, got True"),
    (json.dumps({**RECORD, "T0": -1.0}), "'T0' is -1.0 s; a phase cannot take negative time"),
    (json.dumps({**RECORD, "total": "7"}), "'total' must be a number of seconds, got '7'"),
    (json.dumps({**RECORD, "source": "tape"}), "'source' is 'tape', expected one of memory, parity, disk, fresh"),
    (json.dumps({**RECORD, "restored_step": 6.5}), "'restored_step' must be a non-negative integer, got 6.5"),
    (json.dumps({**RECORD, "killed_at": "noon"}), "'killed_at' must be a unix time or null, got 'noon'"),
    (json.dumps({**RECORD, "kind": "hot"}), "'kind' is 'hot', expected one of in place, warm relaunch, cold relaunch"),
])
def test_malformed_line_is_named(tmp_path, line, problem):
    run = write_run(tmp_path, json.dumps(RECORD), "", line)
    assert refusal(run) == f"{tmp_path / FILENAME}:3: {problem}"


def test_a_line_appended_after_one_cut_short_is_a_line_of_its_own(tmp_path):
    """A fault's or a recovery's line written after one a kill or a full disk cut short: appended to it, the two
    were one line no reader could parse (probe 18: the fault was lost, and a finished ``baft train`` ended in a
    "not valid JSON" error, its recovery table refused)."""
    from baft import faults
    from baft.jsonfile import append_line

    (tmp_path / faults.FILENAME).write_text('{"time": 1.0, "restart": 0, "wh')
    faults.append(tmp_path, "kill rank 1 at step 6 (backward)", restart=0, at=2.0)
    assert [f["what"] for f in faults.read(tmp_path)] == ["kill rank 1 at step 6 (backward)"]
    (tmp_path / FILENAME).write_text(json.dumps(RECORD) + "\n" + '{"restart": 2, "fau')
    append_line(tmp_path / FILENAME, RECORD)
    assert (tmp_path / FILENAME).read_text().splitlines()[2] == json.dumps(RECORD)
    assert refusal(tmp_path).startswith(f"{tmp_path / FILENAME}:2: not valid JSON")  # named, not glued to line 3


def test_missing_or_empty_run(tmp_path):
    assert refusal(tmp_path / "nope") == f"{tmp_path / 'nope'}: no such run directory"
    assert refusal(tmp_path) == f"{tmp_path / FILENAME}: no such file (the run recorded no restart)"
    (tmp_path / "file").write_text("")
    assert "not a directory" in refusal(tmp_path / "file")
    assert refusal(write_run(tmp_path, "")) == f"{tmp_path / FILENAME}: empty (the run recorded no restart)"


def test_draw_recovery_png(tmp_path):
    path = draw_recovery(load_recoveries(SAMPLE), tmp_path / "out" / "recovery.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, channels = imread(path).shape
    assert height >= 250 and width >= 1000 and channels == 4


def test_draw_nothing_is_refused(tmp_path):
    with pytest.raises(BaftError, match="no recoveries to draw"):
        draw_recovery([], tmp_path / "empty.png")


def test_a_process_start_is_read_to_the_clock_tick():
    """A new launch's T1 counts from its process's start (:func:`baft.recovery.record.process_started`): within the
    interpreter's own start of the first line it runs. psutil's ``create_time`` adds a boot time truncated to whole
    seconds, up to a second early (0.75 s on the VM this was written on)."""
    import subprocess
    import sys

    code = ("import time; first_line = time.time()\n"
            "from baft.recovery.record import process_started\n"
            "print(first_line - process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # the start is counted in 10 ms ticks, rounded down; an interpreter starts in ~30 ms, more on a loaded machine
    assert -0.011 < float(out.stdout) < 0.5


def test_a_new_launch_counts_the_lost_work_it_knows_of_not_the_time_the_run_stood_still(tmp_path, monkeypatch):
    """A launch that resumes a run an hour after it stopped: T0 is the work lost after the restored step, from the
    script's losses.jsonl where it writes one (the example does); none known without it, not the hour between."""
    from baft.recovery import record

    now = time.time()
    monkeypatch.setattr(record, "process_started", lambda: now)
    monkeypatch.setattr(record, "clock", {"init_start": now + 1, "init_end": now + 2, "restore_start": now + 2,
                                          "restore_end": now + 3, "first_iteration_end": now + 4})
    for name in ("TORCHELASTIC_RESTART_COUNT", record.ROUND_ENV, record.EARLIER_ENV, record.GENERATION_ENV):
        monkeypatch.delenv(name, raising=False)
    restored = record.Restored(step=5, source="disk", shards=1, items={"ended_at": now - 3600})
    script = record.recovery_record(restored, tmp_path, {})
    # (how many steps the run had done past the restored one is not known either: not said to be none)
    assert (script["fault"], script["T0"], script["T1"], script["lost_steps"]) == ("a new launch", 0.0, 1.0, None)
    (tmp_path / "losses.jsonl").write_text("".join(json.dumps({"step": step, "time": now - 3600 + 10 * (step - 5)})
                                                   + "\n" for step in (4, 5, 6, 7)))
    example = record.recovery_record(restored, tmp_path, {})
    assert (example["T0"], example["lost_steps"]) == (20.0, 2)


def test_a_fault_nothing_logged_counts_from_when_the_surviving_rank_0_saw_it(tmp_path, monkeypatch):
    """A rank killed from outside (no fault logged) in a script that writes no losses.jsonl, recovered in place with
    rank 0 surviving: its process started an hour before; T1 counts from when it saw the fault, not from its start."""
    from baft.recovery import record

    now = time.time()
    monkeypatch.setattr(record, "process_started", lambda: now - 3600)
    monkeypatch.setattr(record, "clock", {"failure_seen": now, "init_start": now + 1, "init_end": now + 2,
                                          "restore_start": now + 2, "restore_end": now + 3, "first_iteration_end": now + 4})
    for name in ("TORCHELASTIC_RESTART_COUNT", record.ROUND_ENV, record.EARLIER_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(record.GENERATION_ENV, "1")
    restored = record.Restored(step=5, source="memory", shards=1, items={"ended_at": now - 0.5})
    got = record.recovery_record(restored, tmp_path, {})
    assert (got["kind"], got["T0"], got["T1"]) == ("in place", 0.5, 1.0) and "detected" not in got, got
