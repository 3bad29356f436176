"""The digest comparison itself: it names the rank, the part and the first step that differ, and an empty or
unrepeated record is a failure, never a pass."""

import json

from baft.recovery.digests import compare, redone_differ


def record(directory, rank, restart, step, at_exit=False, **parts):
    directory.mkdir(parents=True, exist_ok=True)
    line = {"rank": rank, "pid": 1, "restart": restart, "step": step, "parts": parts, **({"at_exit": True} if at_exit
                                                                                           else {})}
    with open(directory / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def uninterrupted(directory, steps=6):
    for step in range(steps + 1):
        for rank in (0, 1):
            record(directory, rank, 0, step, weights=f"w{step}", **{"optimizer.param_groups[0].lr": f"lr{step}"})


def test_equal_runs_compare_equal_and_a_differing_part_is_named_at_its_first_step(tmp_path):
    uninterrupted(tmp_path / "ref")
    uninterrupted(tmp_path / "same")
    assert compare(tmp_path / "ref", tmp_path / "same") == []

    faulted = tmp_path / "faulted"
    for step in range(5):
        for rank in (0, 1):
            record(faulted, rank, 0, step, weights=f"w{step}", **{"optimizer.param_groups[0].lr": f"lr{step}"})
    for step in range(3, 7):  # restored step 3: rank 1's lr is off from step 4 on, its weights equal
        for rank in (0, 1):
            lr = f"lr{step}" if rank == 0 or step < 4 else "wrong"
            record(faulted, rank, 1, step, weights=f"w{step}", **{"optimizer.param_groups[0].lr": lr})
    assert compare(tmp_path / "ref", faulted) == ["rank 1: optimizer.param_groups[0].lr differs from step 4"]


def test_a_difference_before_any_restart_is_the_scripts_own(tmp_path):
    uninterrupted(tmp_path / "ref")
    record(tmp_path / "run", 0, 0, 0, weights="unseeded", **{"optimizer.param_groups[0].lr": "lr0"})
    uninterrupted(tmp_path / "run")
    [line] = compare(tmp_path / "ref", tmp_path / "run")
    assert line.startswith("rank 0: weights differs from step 0, before any restart")


def test_a_run_that_trained_past_the_reference_or_stopped_short_is_named(tmp_path):
    """Each step both ran is equal, but a resumed loop that counted its steps again trained two more."""
    uninterrupted(tmp_path / "ref")
    uninterrupted(tmp_path / "longer", steps=8)
    assert compare(tmp_path / "ref", tmp_path / "longer") == [
        "rank 0: the run's last step is 8, the reference's 6", "rank 1: the run's last step is 8, the reference's 6"]
    assert compare(tmp_path / "longer", tmp_path / "ref")[0] == "rank 0: the run's last step is 6, the reference's 8"


def test_a_run_that_recorded_nothing_fails_the_comparison(tmp_path):
    uninterrupted(tmp_path / "ref")
    assert compare(tmp_path / "ref", tmp_path / "none") == [f"{tmp_path / 'none'}: no digests recorded"]
    assert compare(tmp_path / "none", tmp_path / "ref") == [f"{tmp_path / 'none'}: no digests recorded"]


def test_steps_trained_again_must_equal_their_first_training(tmp_path):
    run = tmp_path / "run"
    uninterrupted(run, steps=4)
    assert redone_differ(run) == [f"{run}: no step is recorded twice, nothing to compare"]
    record(run, 0, 0, 3, weights="w3", **{"optimizer.param_groups[0].lr": "lr3"})  # a second launch from step 3
    assert redone_differ(run) == []
    record(run, 1, 0, 3, weights="other", **{"optimizer.param_groups[0].lr": "lr3"})
    assert redone_differ(run) == ["rank 1: weights differs from step 3 when it is trained again"]


def test_a_steps_state_as_a_process_ended_counts_only_where_no_iteration_started_from_it(tmp_path):
    """Probe 19: a finished run launched again to train on recorded its last step's state as it ended (the learning
    rate its last step had) and again as the next iteration started (the one its loop set for the next step): said to
    differ from the uninterrupted run's, and from itself. Where no iteration started from it (a run's last step), it
    is that step's state."""
    uninterrupted(tmp_path / "ref")
    run = tmp_path / "run"
    for step in range(7):
        for rank in (0, 1):
            if step == 4:  # the first launch ended here: its loop had not set the next step's learning rate yet
                record(run, rank, 0, step, at_exit=True, weights="w4", **{"optimizer.param_groups[0].lr": "lr3"})
            record(run, rank, 0, step, weights=f"w{step}", **{"optimizer.param_groups[0].lr": f"lr{step}"})
    assert compare(tmp_path / "ref", run) == [] and redone_differ(run)[0].endswith("nothing to compare")
    ended = tmp_path / "ended"
    uninterrupted(ended, steps=5)
    for rank in (0, 1):
        record(ended, rank, 0, 6, at_exit=True, weights="w6", **{"optimizer.param_groups[0].lr": "other"})
    assert [line.split(",")[0] for line in compare(tmp_path / "ref", ended)] == [
        "rank 0: optimizer.param_groups[0].lr differs from step 6", "rank 1: optimizer.param_groups[0].lr differs from "
                                                                    "step 6"]
