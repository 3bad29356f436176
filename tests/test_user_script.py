"""The documented path for a user's own script: profile it, show it, train it, kill it, resume."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from baft.cli.launch import launch_env, torchrun
from baft.cli.runlog import LOG_NAME
from baft.manager.control import stop
from baft.recovery.digests import DIGESTS_ENV, processes, redone_differ

SCRIPT = Path(__file__).parent / "scripts" / "user_train.py"


def config(tmp_path, name="ds_config.json", **baft):
    """A DeepSpeed config; with no keyword arguments it has no "baft" section at all."""
    path = tmp_path / name
    doc = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10 ** 9}
    path.write_text(json.dumps({**doc, "baft": baft} if baft else doc))
    return path


def finals(output: str) -> dict[int, tuple[str, ...]]:
    """Each rank's parameters, the average loss its meter kept, its MetricLogger's meters and the mean its logging
    helper kept, at the end."""
    # each field up to where it ends: a plain run's ranks write each line's text and its newline apart, so one rank's
    # line may run on into the other's
    return {int(m[0]): m[1:] for m in re.findall(r"rank (\d) final step 8 loss \S+ params (\w+) average loss (\S+) "
                                                 r"engine \w+ metrics (loss \S+ lr \S+) logged ([-+\d.e]+)",
                                                 output)}


@pytest.mark.slow
def test_profile_show_train_kill_resume_a_user_script(tmp_path):
    """Profiled, shown, trained beside a plain run, killed and recovered in place by a spare; each stage draws noise
    from a generator a layer of its holds, and the loop multiplies the learning rate by a factor before each call
    (probe 11: the generator was not kept, and the resumed loop multiplied the restored rate again, silently); the
    engine's batch_fn, which the script set after baft.initialize, is the survivor's still (probe 29: dropped with
    the engine made again, its labels unscaled, silently). The loop sets a class attribute the noise layers of both stages read (``Noise.scale``) at step 2, before the restored
    step, which the snapshot keeps: the survivor recovers in place (session 39: read as state baft does not keep, it
    was replaced too), and the replacement trains with it as the uninterrupted run did. Probe 28, in place: a plateau
    callback in a list the loop goes through, its best started at -math.inf: set back (the ranks' rates differed). Probe 26, in place: the
    survivor's running mean in a plain tensor attribute of its noise layer, the list it appends to, and the script's
    global tensors its loss and layers read, which its loop updates in place or rebinds, had moved past the restored
    step: set back as the snapshot had them. Probe 28, in place: the counts of forward hooks of the script's (in a
    global dict's item, in a hook object) and an EMA kept with torch's AveragedModel (in the final digest): set back."""
    cfg = config(tmp_path, "profiled.json", period=1)
    bmap = tmp_path / "mine.json"
    cli = [sys.executable, "-m", "baft.cli"]
    prof = subprocess.run([*cli, "profile", "--iters", "3", "--out", str(bmap), "--",
                           *torchrun(2, [str(SCRIPT), "--config", str(cfg)], module=False)],
                          capture_output=True, text=True, env=launch_env(), timeout=300)
    assert prof.returncode == 0, prof.stderr[-3000:]
    assert (tmp_path / "mine.plan.json").exists()
    show = subprocess.run([*cli, "show", str(bmap)], capture_output=True, text=True)
    assert show.returncode == 0 and "stage" in show.stdout.lower()

    # no "baft" section: DeepSpeed's own engine class, nothing attached (only the clean exit); it runs beside
    # the protected run, whose restart leaves the cores idle
    plain = subprocess.Popen(torchrun(2, [str(SCRIPT), "--config", str(config(tmp_path, "plain.json")), "--class-once",
                                          "2", "--statistics"], module=False),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    run_dir = tmp_path / "run"
    # a memory limit the running manager (baft train's) does not have: said, not silently dropped. A snapshot every
    # step, placed in the measured bubbles: the period the planner would choose from them depends on this machine's
    # load as it profiled (a busy one's chose a period past the kill, and the recovery found nothing to restore)
    cfg = config(tmp_path, "protected.json", bubble_map=str(bmap), memory_limit=2 ** 36, period=1)
    imports = tmp_path / "imports.jsonl"  # each process that imported the script's own module user_data, and when
    faulty = subprocess.run([*cli, "train", "--nprocs", "2", "--max-restarts", "1", "--run-dir", str(run_dir),
                             "--in-place", "--fault", "rank=0,step=5,phase=forward", "--", str(SCRIPT),
                             "--config", str(cfg), "--class-once", "2", "--statistics"], capture_output=True, text=True,
                            env=launch_env({DIGESTS_ENV: str(tmp_path / "digests"), "USER_DATA_IMPORTS": str(imports)}),
                            timeout=300)
    out, err = plain.communicate(timeout=300)
    clean = subprocess.CompletedProcess(plain.args, plain.returncode, out, err)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert clean.stdout.count("engine PipelineEngine") == 2
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert ("runs with settings of its own, not this config's memory_limit 68719476736 (the manager's: none): "
            "`baft train` starts it with its options") in faulty.stderr, faulty.stderr[-3000:]
    recovery = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    assert recovery[0]["source"] == "memory" and recovery[0]["restored_step"] >= 3
    assert recovery[0]["kind"] == "in place"
    assert recovery[0]["T0"] > 0, recovery  # the work lost since the restored step ended (no losses.jsonl here)
    # rank 1 kept its process; rank 0's replacement was the spare, which had imported the script's module before
    # the kill (and not again after it)
    pids = processes(tmp_path / "digests")
    assert pids[1][1] == pids[0][1] and pids[1][0] != pids[0][0], pids
    imported = [json.loads(line) for line in imports.read_text().splitlines()]
    replacement = [rec["time"] for rec in imported if rec["pid"] == pids[1][0]]
    assert len(replacement) == 1 and replacement[0] < recovery[0]["killed_at"], (imported, recovery[0])
    # the screen shows rank 0's lines; every rank's are in the run's log
    assert finals((run_dir / LOG_NAME).read_text()) == finals(clean.stdout) and len(finals(clean.stdout)) == 2
    assert finals(faulty.stdout) == {0: finals(clean.stdout)[0]}
    assert redone_differ(tmp_path / "digests") == []  # the steps trained again equal their first training


@pytest.mark.slow
def test_every_node_starts_its_own_manager_when_configs_name_their_node(tmp_path, shm_root):
    """Each rank its own node (``node_id`` = rank, as each node's config on a cluster), a persisted run, no
    manager running: the first rank of every node starts that node's manager, so every rank has one."""
    cfg = config(tmp_path, persist={"dir": str(tmp_path / "persisted"), "every": 1}, shm_root=str(shm_root),
                 run_id="nodes", run_dir=str(tmp_path / "run"), require_manager=True)
    (tmp_path / "run").mkdir()
    proc = subprocess.run(torchrun(2, [str(SCRIPT), "--config", str(cfg), "--node-per-rank", "--steps", "3"],
                                   module=False), capture_output=True, text=True, env=launch_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for node in (0, 1):
        assert f"no manager answers for node {node}; starting one" in proc.stderr, proc.stderr[-3000:]
        assert (tmp_path / "run" / f"manager-node{node}.log").exists()
    assert "no snapshot manager reachable" not in proc.stderr
    assert "runs with settings of its own" not in proc.stderr, "the managers the config started are as it asks"
    assert sorted(p.name for p in (tmp_path / "persisted").iterdir()) == ["node0", "node1"]
    for node in (0, 1):  # started by the ranks, they outlive the job until stopped (baft train stops its own)
        stop(shm_root / "nodes" / f"node{node}")


@pytest.mark.slow
def test_the_parts_baft_cannot_save_are_refused_in_one_line_at_initialize(tmp_path):
    proc = subprocess.run(torchrun(2, [str(SCRIPT), "--config", str(config(tmp_path, period=1, run_id="stateless")),
                                       "--stateless", "scheduler", "data"], module=False),
                          capture_output=True, text=True, env=launch_env(), timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "BaftError:" in line]
    assert lines, proc.stderr[-3000:]
    for named in ("lr_scheduler __main__.Halving", "data_iterator builtins.generator"):
        assert all(f"{named}: baft cannot save its state, so a resumed run would silently differ" in line
                   for line in lines), proc.stderr[-3000:]
    assert "step 1" not in proc.stdout  # refused before training


@pytest.mark.slow
def test_an_evaluation_iterator_kept_across_evaluations_is_said(tmp_path):
    """Round nine's probe: a loop on the engine's step that evaluates from one held-out iterator every two steps
    resumed with its evaluations reading other batches, silently. Said once at its second evaluation; an iterator
    made anew at each evaluation is not."""
    said = "eval_batch reads the iterator an evaluation after step 2 read"
    for how in ("kept", "anew"):
        proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "0",
                               "--run-dir", str(tmp_path / how), "--", str(SCRIPT), "--config",
                               str(config(tmp_path, period=1)), "--steps", "6", "--evaluate", how],
                              capture_output=True, text=True, env=launch_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = (tmp_path / how / LOG_NAME).read_text()  # every rank's output: rank 0 says it, once
        assert log.count(said) == (how == "kept"), (how, log[-3000:])


@pytest.mark.slow
def test_a_batch_size_the_script_changed_once_is_restored(tmp_path):
    """Round nine's probe: a script that doubles its batch size once (``set_train_batch_size`` at step 3), resumed
    after it, trained on at the configured size, silently: the snapshot keeps the engine's batch size. Probe 21: the
    noise the loop adds to the weights before each call was added twice to the first resumed step, silently (the
    snapshot is taken as the step starts, after it): the weights are set back as restored as that step starts. Probe
    23: the loop turns the layers' noise off at the same step (a global of the script's the layers' forward reads,
    not the loop), and halves a gain a config module of the script's holds (``user_data.GAIN``), which a run resumed
    after it trained with as they started, silently: the loop carries them. Probe 26: a running mean in a plain tensor
    attribute of the noise layers, a list they append to, a global tensor the loss reads that the loop updates in
    place and one the layers read that it rebinds, resumed from their first values, silently: kept. Probe 28: the
    forward hooks' counts and the AveragedModel's EMA, each resumed from its start, silently: kept; so is a plateau
    callback's best in a list the loop goes through, started at -math.inf; an EMA object of a class the script defines
    after ``baft.initialize`` (``Shadow``), which the loop carries, had every relaunched rank die unpickling it in the
    restore: set back at the loop's first call."""
    runs = {}
    for name, fault in (("reference", []), ("killed", ["--fault", "rank=1,step=7,phase=backward"])):
        proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "1",
                               "--run-dir", str(tmp_path / name), *fault, "--", str(SCRIPT), "--config",
                               str(config(tmp_path, period=1)), "--batch-once", "3", "--noise-off-once", "3",
                               "--gain-once", "3", "--perturb", "--statistics"],
                              capture_output=True, text=True, env=launch_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = finals((tmp_path / name / LOG_NAME).read_text())
    assert "resumed from step" in proc.stdout + proc.stderr
    log = (tmp_path / "killed" / LOG_NAME).read_text()
    assert re.search(r"rank 0: the script changed the model's param/\S+, .* after the restore, before this iteration "
                     r"\(at \S+user_train.py:\d+ \(engine.module.parameters\(\)\)\)", log), log[-3000:]
    assert len(runs["reference"]) == 2 and runs["killed"] == runs["reference"], runs


@pytest.mark.slow
def test_a_layer_the_script_froze_once_is_frozen_after_a_restore_in_place(tmp_path):
    """Probe 15: a script that freezes a layer once (``requires_grad_(False)`` at step 4), resumed after it, trained
    it again, silently; in place, a survivor's ZeRO-1 made again without it refused every snapshot ("master/group0/dp0
    ... not in that size"). The snapshot keeps which parameters are frozen, and a survivor makes its engine again
    with them as they were at ``baft.initialize``. Killed twice: restored before the freeze (the survivor trains
    steps 4 and 5 again, frozen from step 4), then after it (the replacement is frozen by the restore). Probe 23: the
    script turns its dropout off at the same step (torch's ``nn.Dropout``, ``p = 0``), which a replacement restored
    after it trained with again, silently: the snapshot keeps the plain attributes of torch's modules too."""
    cfg = tmp_path / "zero1.json"
    cfg.write_text(json.dumps({**json.loads(config(tmp_path, period=1).read_text()),
                               "zero_optimization": {"stage": 1}}))
    faults = ["--in-place", "--fault", "rank=0,step=5,phase=forward,restart=0",
              "--fault", "rank=0,step=8,phase=forward,restart=1"]
    runs = {name: subprocess.Popen([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "2",
                                    "--run-dir", str(tmp_path / name), *fault, "--", str(SCRIPT), "--config", str(cfg),
                                    "--freeze-once", "4", "--dropout-off-once", "4"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
            for name, fault in (("reference", []), ("killed", faults))}
    finished = {}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-3000:])
        finished[name] = finals((tmp_path / name / LOG_NAME).read_text())
    recovered = [json.loads(line) for line in (tmp_path / "killed" / "recovery.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["restored_step"] < 4) for r in recovered] == [("in place", True), ("in place", False)]
    assert len(finished["reference"]) == 2 and finished["killed"] == finished["reference"], finished


@pytest.mark.slow
def test_the_scripts_own_schedulers_resume_when_made_before_initialize_stepped_before_the_call_or_replaced(tmp_path):
    """Round eleven's probe, killed twice and recovered in place: a scheduler made before ``baft.initialize`` (restored
    there) and stepped before each call was stepped once more by the resumed loop; a warm-up scheduler the loop
    replaced by another as it ended (freed: as many references to the optimizer) left the new one in no snapshot;
    a survivor's ``CyclicLR`` loaded twice (at the restore and as the iteration starts) lost a key of its state; a
    survivor whose loop had replaced its scheduler since the restored step stopped the run, saying to make its
    schedulers before the loop. Each resumed silently with other learning rates, or died. Probe 17: a weight-decay
    schedule of a class of the script's own was in no snapshot, nor a param group added at the first step, which a
    replacement trained without. Every step trained again must equal its first."""
    script = Path(__file__).parent / "scripts" / "own_schedulers.py"
    digests = tmp_path / "digests"
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "2",
                           "--run-dir", str(tmp_path / "run"), "--in-place",
                           # restored from step 2, in the warm-up, which rank 1 had ended (replaced too); then from
                           # step 6, after it
                           "--fault", "rank=0,step=4,phase=forward,restart=0",
                           "--fault", "rank=0,step=8,phase=forward,restart=1",
                           "--", str(script)],
                          capture_output=True, text=True, env=launch_env({DIGESTS_ENV: str(digests)}), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recovery = [json.loads(line) for line in (tmp_path / "run" / "recovery.jsonl").read_text().splitlines()]
    assert [r["restored_step"] for r in recovery] == [2, 6] and {r["kind"] for r in recovery} == {"in place"}, recovery
    log = (tmp_path / "run" / LOG_NAME).read_text()
    assert log.count("rank 1 lost a peer and cannot recover in place (its loop replaced a learning-rate scheduler of "
                     "its own ({'LinearLR': 1, 'StepLR': 1, 'WeightDecayWarmup': 1} -> {'CyclicLR': 1, 'StepLR': 1, "
                     "'WeightDecayWarmup': 1}) after the newest step "
                     "every rank holds (2)") == 1
    pids = processes(digests)
    assert pids[2][1] == pids[1][1] != pids[0][1], pids  # rank 1 replaced at the first kill, kept at the second
    assert redone_differ(digests) == []
