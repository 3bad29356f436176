"""A user's mistake under ``baft train`` gets one line on the screen, once, and leaves nothing behind.

What ``baft train`` can check (the script, the DeepSpeed config its arguments name) it checks before it
starts a manager or a rank; what only a rank finds (a DeepSpeed config assertion) is the exception's
line, with the rank and where the full output is, instead of every rank's traceback and torchrun's summary.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from baft.cli.launch import SHM_ROOT, launch_env, run_id
from baft.cli.preflight import config_files, later_imports, script_source, unprotected_initialize, wraps_optimizer
from baft.cli.runlog import LOG_NAME

# A user's script: a 2-stage pipeline of linear layers under baft.initialize, its DeepSpeed config from --config.
SCRIPT = """
import argparse

import deepspeed
import torch.nn as nn
from deepspeed.pipe import PipelineModule

import baft

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--n", type=int)  # what torchrun would take for its own (--nnodes, --nproc-per-node, ...)
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
model = PipelineModule(layers=[nn.Linear(4, 4), nn.Linear(4, 1)], num_stages=2, loss_fn=nn.MSELoss())
engine, *_ = baft.initialize(model=model, config=args.config)
"""
CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "baft": {"policy": "baft"}}
NOT_ON_SCREEN = ("Traceback", "[rank", "Root Cause", "ChildFailedError", "error_file", "=====")
OTHER_RUNS = "of other runs that no manager serves"  # another run's leftovers on this machine: not this test's


def baft_train(tmp_path, *command, max_restarts=0):
    """``baft train --nprocs 2`` of ``command`` (a script and its arguments) into ``tmp_path/run``."""
    return subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts",
                           str(max_restarts), "--run-dir", str(tmp_path / "run"), "--", *map(str, command)],
                          capture_output=True, text=True, env=launch_env(), timeout=300)


def user_files(tmp_path, **config):
    """The user's script and its DeepSpeed config (:data:`CONFIG` with ``config``'s keys replaced)."""
    script, path = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(SCRIPT)
    path.write_text(json.dumps({**CONFIG, **config}))
    return script, path


def screen(proc) -> list[str]:
    """What ``baft train`` showed, line by line."""
    return [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if OTHER_RUNS not in line]


def assert_one_line(proc, expected: str) -> str:
    """The screen holds the error once, as baft's one line, and none of the tracebacks or torchrun's summary."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = screen(proc)
    for noise in NOT_ON_SCREEN:
        assert not any(noise in line for line in lines), (noise, lines)
    said = [line for line in lines if re.search(expected, line)]
    assert len(said) == 1 and said[0].startswith("baft: error: "), lines
    return said[0]


def assert_nothing_left(tmp_path):
    """No process of the run still runs, and its shared memory is gone."""
    run = tmp_path / "run"
    marks = (str(tmp_path), run_id(run))
    procs = [p for p in psutil.process_iter(["cmdline"]) if any(m in arg for arg in p.info["cmdline"] or ()
                                                                    for m in marks)]
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [p.info["cmdline"] for p in alive]
    shm = Path(SHM_ROOT) / run_id(run)
    assert not shm.exists() or not any(shm.iterdir()), sorted(shm.rglob("*"))


@pytest.mark.parametrize("case", ["baft key", "baft key, -m module", "baft section", "missing", "not JSON"])
def test_a_bad_config_is_one_line_before_anything_launches(tmp_path, case):
    """A script launched as ``-m MODULE`` too (its ranks said the key without the file, after the launch)."""
    script, config = user_files(tmp_path, baft={"polcy": "baft"})
    if case == "baft section":  # misspelled, the run went on unprotected without a word
        config.write_text(json.dumps({**{k: v for k, v in CONFIG.items() if k != "baft"}, "bafts": CONFIG["baft"]}))
        command, expected = [script, "--config", config], r"ds_config.json: 'bafts': not a DeepSpeed key; did you mean"
    elif case == "missing":
        command, expected = [script, f"--deepspeed_config={tmp_path / 'nope.json'}"], "nope.json: no such file$"
    elif case == "not JSON":
        config.write_text('{"train_batch_size": 4,')
        command, expected = [script, "--config", config], "ds_config.json: not valid JSON"
    elif case == "baft key, -m module":
        command, expected = ["-m", "train", "--config", config], r"ds_config.json: baft\.polcy: unknown key \(known: "
    else:
        command, expected = [script, "--config", config], r"ds_config.json: baft\.polcy: unknown key \(known: "
    proc = baft_train(tmp_path, *command)
    said = assert_one_line(proc, expected)
    assert screen(proc) == [said], "more than the error on the screen"
    assert not (tmp_path / "run").exists(), "the launch went ahead"
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("options, expected", [(["--spares", "2"], r"--spares: .* give --in-place too$"),
                                               (["--in-place", "--cold"], r"--in-place: .* --cold turns off$"),
                                               (["--nodes", "2"], r"--nodes 2 simulates nodes for the example only")])
def test_options_that_cannot_go_together_are_one_line_before_anything_launches(tmp_path, options, expected):
    script, config = user_files(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", *options, "--run-dir", str(tmp_path / "run"),
                           "--", str(script), "--config", str(config)],
                          capture_output=True, text=True, env=launch_env(), timeout=300)
    said = assert_one_line(proc, expected)
    assert screen(proc) == [said] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kept, policy, expected", [
    ("persisted", "torch-save", r"run/persisted: this run's snapshots \(up to step 9\) of an in-memory policy, which "
                                r"policy 'torch-save' does not restore \(it would train from step 0\): launch with"),
    ("checkpoints", "baft", r"run/checkpoints: this run's checkpoints of a disk policy, which policy 'baft' does not "
                            r"restore \(it would train from step 0\): launch with the policy the run trained under"),
])
def test_a_launch_under_a_policy_that_keeps_its_progress_elsewhere_is_refused(tmp_path, kept, policy, expected):
    """Probe 18: a run persisted by baft's policy relaunched under torch-save (or the reverse) found nothing of its
    own and trained from step 0, without a word."""
    from test_persist import node

    from baft.manager import persist

    if kept == "persisted":
        persist.write_snapshot(tmp_path / "run" / "persisted" / "node0", node(9))
    else:
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / "step9-rank0.pt").write_bytes(b"")
    script, config = user_files(tmp_path, baft={"policy": policy})
    proc = baft_train(tmp_path, script, "--config", config)
    said = assert_one_line(proc, expected)
    assert screen(proc) == [said], "more than the error on the screen"


@pytest.mark.parametrize("options", [["--max-restarts", "-1"], ["--nprocs", "0"]])
def test_a_count_no_launch_can_take_is_refused_before_anything_launches(tmp_path, options):
    """Probe 18: ``--max-restarts -1`` ended in torchrun's AssertionError and "training failed (exit code 1)",
    ``--nprocs -2`` in its traceback; ``--nprocs 0`` launched the default count."""
    script, config = user_files(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", *options, "--run-dir", str(tmp_path / "run"),
                           "--", str(script), "--config", str(config)],
                          capture_output=True, text=True, env=launch_env(), timeout=300)
    assert proc.returncode == 2 and f"Invalid value for '{options[0]}'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source, line", [
    ("import deepspeed\n\nengine, *_ = deepspeed.initialize(model=m, config=c)\n", 3),
    ("import deepspeed as ds\nimport baft.config\nds.initialize(model=m)\n", 3),
    ("from deepspeed import initialize as start\nif True:\n    start(model=m)\n", 3),
    ("import deepspeed\nimport baft\ndeepspeed.init_distributed()\nbaft.initialize(model=m)\n", None),
    ("import deepspeed\nfrom baft import initialize\ninitialize(model=m)\n", None),
    ("import baft, deepspeed\ninit = baft.initialize if protect else deepspeed.initialize\ninit(model=m)\n", None),
    ("from my_trainer import build\nengine = build()\n", None),  # reached through the script's own modules
    ("import deepspeed\ndef f(:\n", None),  # its ranks report its own SyntaxError
])
def test_a_script_that_calls_deepspeed_initialize_instead_of_baft_is_named_with_its_line(tmp_path, source, line):
    script = tmp_path / "train.py"
    script.write_text(source)
    said = unprotected_initialize(str(script))
    if line is None:
        assert said is None, said
    else:
        assert said == (f"{script}:{line} calls deepspeed.initialize, not baft.initialize: its ranks take no "
                        "snapshots, and a restart begins again at step 0 (baft.initialize takes the same arguments)")


@pytest.mark.parametrize("module, source", [
    ("train", "train.py"),
    ("jobs.train", "jobs/train.py"),
    ("jobs", "jobs/__main__.py"),  # python -m runs a package's __main__
    ("train.nothing", None),  # a module named as a package: its ranks say so
    ("missing", None),
])
def test_a_module_launched_with_dash_m_is_read_from_the_file_python_would_run(tmp_path, monkeypatch, module, source):
    """``baft train -- -m MODULE`` warns of a module that calls deepspeed.initialize as of a script (it ran
    unprotected without a word), finding the module from the working directory as ``python -m`` does, with
    nothing imported: a package's ``__init__`` that raised would stop the launch."""
    calls = "import deepspeed\n\nengine, *_ = deepspeed.initialize(model=m, config=c)\n"
    (tmp_path / "jobs").mkdir()
    for path in ("train.py", "jobs/train.py", "jobs/__main__.py"):
        (tmp_path / path).write_text(calls)
    (tmp_path / "jobs" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.chdir(tmp_path)
    found = script_source(["-m", module, "--config", "ds.json"])
    assert found == (str(tmp_path / source) if source else None)
    if source:
        assert unprotected_initialize(found).startswith(f"{tmp_path / source}:3 calls deepspeed.initialize")
    assert script_source(["train.py", "--steps", "3"]) == "train.py"
    assert script_source(["-m", "baft.examples.worker"]) is not None
    assert unprotected_initialize(script_source(["-m", "baft.examples.worker"])) is None


def test_a_missing_script_is_one_line_before_anything_launches(tmp_path):
    proc = baft_train(tmp_path, tmp_path / "nonexistent.py")
    said = assert_one_line(proc, "nonexistent.py: no such file$")
    assert screen(proc) == [said] and not (tmp_path / "run").exists()
    assert_nothing_left(tmp_path)
    # the interpreter named as torchrun's users do not (probe 14: "python: no such file")
    script, _ = user_files(tmp_path)
    proc = baft_train(tmp_path, "python3", script)
    said = assert_one_line(proc, re.escape(f"python3: baft train runs the script with torchrun, which starts Python "
                                           f"itself: drop 'python3' from the command (baft train -- {script} ...)") + "$")
    assert screen(proc) == [said] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_deepspeed_config_assertion_is_its_line_once_with_the_rank_and_the_log(tmp_path):
    """The ranks find it (DeepSpeed asserts train_batch_size = micro-batch x accumulation x replicas); torchrun
    restarts them into it, so every rank's traceback is in the log twice, and the screen has its line once. The
    script calls deepspeed.initialize: the launch says so before it starts (it would train unprotected)."""
    script, config = user_files(tmp_path, train_batch_size=7)
    script.write_text(SCRIPT.replace("baft.initialize", "deepspeed.initialize"))
    proc = baft_train(tmp_path, script, "--config", config, "--n", 1, max_restarts=1)
    log = tmp_path / "run" / LOG_NAME
    assertion = ("AssertionError: Check batch related parameters. train_batch_size is not equal to "
                 "micro_batch_per_gpu * gradient_acc_step * world_size 7 != 4 * 1 * 1")
    said = assert_one_line(proc, re.escape(assertion))
    # the same between steps in both attempts: a third would end the same way
    assert re.fullmatch(rf"baft: error: rank [01]: {re.escape(assertion)} \(it ended the attempt before too: a restart "
                        rf"does not help\); every rank's output is in {log}", said), said
    assert screen(proc) == [f"baft: every rank's output goes to {log}",  # stdout, then stderr
                            f"baft: warning: {unprotected_initialize(str(script))}", said]
    text = log.read_text()
    assert text.count(assertion) >= 2 and "Traceback" in text and "Root Cause" in text, "the log keeps everything"
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_rank_that_ends_its_script_early_is_named_once_after_one_restart(tmp_path):
    """Probe 20: rank 1's ``sys.exit(0)`` at step 3 left rank 0 failing on the lost peer; torchrun restarted into it
    ``--max-restarts`` times and the run ended in rank 0's traceback tail, naming no rank. Now a restart, the same
    again, and the run ends in one line that names the rank and its step."""
    script, config = user_files(tmp_path)
    script.write_text(SCRIPT + "import itertools, sys, torch\n"
                      "batches = itertools.repeat((torch.ones(4, 4), torch.ones(4, 1)))\n"
                      "while engine.global_steps < 6:\n"
                      "    if engine.global_steps == 3 and engine.global_rank == 1:\n        sys.exit(0)\n"
                      "    engine.train_batch(data_iter=batches)\n")
    proc = baft_train(tmp_path, script, "--config", config, max_restarts=3)
    log = tmp_path / "run" / LOG_NAME
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = screen(proc)
    assert not any(noise in line for line in lines for noise in NOT_ON_SCREEN), lines
    said = ("baft: error: rank 1 ended its script (exit status 0) at step 3 while its peers were training: they failed "
            "on losing it ({}); every rank's output is in " + str(log))
    # one restart, the same again, and the end: torchrun stopped there, also where the SIGTERM came as it still wrote
    # its line that the attempt failed (a fresh-clone CI: its logging caught the signal's exception, 3 restarts)
    assert sum("resumed from step" in line for line in lines) == 1, lines
    assert lines[-1] == said.format("it did so in the attempt before too: a restart does not help"), lines
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_the_examples_options_given_for_a_script_are_said_not_read_and_its_run_is_still_managed(tmp_path):
    """``--policy none --period 3 --iters 5`` of a script's run were silently ignored (its ranks snapshot as their
    config says), and ``--policy none`` started no manager: its snapshots stayed in shared memory after the run,
    served by none, and nothing was persisted."""
    script, config = user_files(tmp_path)
    script.write_text(SCRIPT + "import itertools, torch\n"
                      "batches = itertools.repeat((torch.ones(4, 4), torch.ones(4, 1)))\n"
                      "while engine.global_steps < 2:\n    engine.train_batch(data_iter=batches)\n")
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--policy", "none", "--period",
                           "3", "--iters", "5", "--run-dir", str(tmp_path / "run"), "--", str(script), "--config",
                           str(config)], capture_output=True, text=True, env=launch_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = [line for line in screen(proc) if "the example's options" in line]
    assert said == ["baft: warning: --iters, --policy, --period: the example's options, which a script's run does not "
                    "read: it takes baft.policy, baft.period from its DeepSpeed config and its steps from its own "
                    "code"], screen(proc)
    assert (tmp_path / "run" / "persisted").is_dir(), "no manager kept the run's last step"
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("args, found", [
    (["--config", "ds.json", "--steps", "3"], ["ds.json"]),
    (["--deepspeed_config=ds.json"], ["ds.json"]),
    (["--deepspeed_config", "ds"], ["ds"]),  # DeepSpeed's own flag: a config whatever its name
    (["--config", "model.yaml"], []),  # a script's own config
    (["--config"], []),
])
def test_the_deepspeed_configs_a_scripts_arguments_name(args, found):
    assert config_files(args) == found



@pytest.mark.parametrize("config, wraps", [
    ({"train_batch_size": 8}, False),
    ({"bf16": {"enabled": True}}, True),
    ({"bfloat16": {"enabled": True}}, True),  # DeepSpeed's other spelling
    ({"fp16": {"enabled": True}}, True),
    ({"fp16": {"enabled": False}, "zero_optimization": {"stage": 1}}, True),
    ({"bf16": {"enabled": False}, "zero_optimization": {"stage": 0}}, False),
    ({"bf16": "yes"}, False),  # not a section: DeepSpeed refuses it on the ranks, with its own message
])
def test_whether_deepspeed_wraps_a_scripts_optimizer_is_read_from_its_config(tmp_path, config, wraps):
    """So that the warm server imports what a bf16 or ZeRO job's ranks import before it forks them, and nothing for a
    job whose ranks never do (:func:`baft.cli.preflight.later_imports`)."""
    (tmp_path / "ds.json").write_text(json.dumps(config))
    assert wraps_optimizer(["train.py", "--deepspeed_config", str(tmp_path / "ds.json")]) is wraps
    assert wraps_optimizer(["train.py", "--steps", "3"]) is None  # its config is the script's own business


@pytest.mark.parametrize("source, wraps", [
    ('config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"}}\n', False),
    ('config = {"train_batch_size": 8, "bf16": {"enabled": args.bf16}}\n', None),  # enabled or not: the ranks know
    ('config = {"train_batch_size": 8}\nconfig["zero_optimization"] = {"stage": 1}\n', None),
    ('config = {"train_batch_size": 8, **json.load(open("extra.json"))}\n', None),  # the rest from a file
    ('config = load(args.config)\n', None),  # no config written in the script
    ('config = {"train_batch_size": 8\n', None),  # not Python: its ranks say so
])
def test_whether_a_script_that_writes_its_config_wraps_its_optimizer_is_read_from_its_source(tmp_path, source, wraps):
    """A config the script writes as a dict and that names neither bf16, fp16 nor ZeRO: the warm server never imports
    what a wrapped optimizer needs (once idle, a rank killed in a launch's first seconds waited for that import)."""
    (tmp_path / "train.py").write_text(source)
    assert wraps_optimizer([str(tmp_path / "train.py"), "--steps", "3"]) is wraps


@pytest.mark.parametrize("argv, later", [
    (["-m", "baft.examples.worker", "--precision", "bf16"], "now"),
    (["-m", "baft.examples.worker", "--stages", "3", "--zero-stage", "1"], "now"),
    (["-m", "baft.examples.worker", "--stages", "3"], "never"),  # fp32, no ZeRO: DeepSpeed wraps nothing
    (["-m", "baft.examples.worker", "--zero-stage", "x"], "idle"),  # its ranks refuse it
    (["-m", "my_trainer", "--precision", "bf16"], "idle"),  # another module's options are its own
    (["-m", "my_trainer", "--deepspeed_config", "BF16"], "now"),  # but a DeepSpeed config it is given is read
])
def test_when_the_warm_server_imports_what_a_wrapped_optimizer_needs(argv, later, tmp_path):
    """``baft torchrun -m baft.examples.worker ARGS`` (the README's multi-node launch): the example's own options
    say whether its ranks wrap the optimizer, read without importing the example (and DeepSpeed with it)."""
    (tmp_path / "bf16.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    argv = [str(tmp_path / "bf16.json") if arg == "BF16" else arg for arg in argv]
    assert later_imports(False, None, argv) == later
