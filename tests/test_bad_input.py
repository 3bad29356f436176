"""User mistakes get one line naming the file or key and the problem; nothing committed is lost."""

import json
import subprocess
import sys

import pytest

from baft.snapshot import slots
from baft.snapshot.planner import Plan, RankPlan
from conftest import TINY, run_worker


def baft_cli(*args):
    return subprocess.run([sys.executable, "-m", "baft.cli", *map(str, args)], capture_output=True, text=True)


def one_line_error(proc, *fragments):
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("baft: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def bubble_map(tmp_path):
    from baft.pipeline.timeline import Costs, analytic_bubble_map

    path = tmp_path / "map.json"
    analytic_bubble_map("1f1b", 2, 8, Costs()).save(path)
    return path


def test_missing_file(tmp_path):
    one_line_error(baft_cli("show", tmp_path / "nope.json"), "nope.json", "no such file")


def test_malformed_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema": "baft.bubblemap", ')
    one_line_error(baft_cli("show", path), "bad.json", "not valid JSON")


def test_newer_schema_version(tmp_path, bubble_map):
    doc = json.loads(bubble_map.read_text())
    doc["version"] = 99
    bubble_map.write_text(json.dumps(doc))
    one_line_error(baft_cli("show", bubble_map), "map.json", "version 99 is newer")


def test_schema_violation_names_the_field(tmp_path, bubble_map):
    doc = json.loads(bubble_map.read_text())
    doc["bubbles"][0]["kind"] = "lunch"
    bubble_map.write_text(json.dumps(doc))
    one_line_error(baft_cli("show", bubble_map), "map.json", "bubbles/0/kind")


def test_map_for_another_stage_count(bubble_map):
    one_line_error(baft_cli("show", bubble_map, "--stages", "3"), "map.json", "2 pipeline stages")


def test_unknown_config_key_names_the_key(tmp_path):
    from baft.config import parse_config
    from baft.errors import ConfigError

    with pytest.raises(ConfigError, match=r"baft\.persist\.evry: unknown key"):
        parse_config({"baft": {"persist": {"evry": 3}}})
    with pytest.raises(ConfigError, match=r"^'Baft': not a DeepSpeed key; did you mean \"baft\"\?"):
        parse_config({"Baft": {"policy": "baft"}, "bf16": {"enabled": True}})
    assert not parse_config({"bf16": {"enabled": True}, "fp16": {}, "amp": {}, "bfloat16": {}}).enabled  # no "baft"
    with pytest.raises(ConfigError, match=r"^baft: expected a section .* got null$"):  # probe 8: "did you mean baft"
        parse_config({"baft": None})
    with pytest.raises(ConfigError, match=r"baft\.fresh_start: expected true, false or \"always\", got 'yes'"):
        parse_config({"baft": {"fresh_start": "yes"}})
    assert parse_config({"baft": {"fresh_start": "always"}}).fresh_start == "always"


@pytest.mark.parametrize("section, message", [
    ({"node_id": -1}, "node_id: must be at least 0, got -1"),
    ({"ranks_per_node": 0}, "ranks_per_node: must be at least 1, got 0"),
    ({"memory_limit": -5}, "memory_limit: must be at least 1, got -5"),
    ({"persist": {"every": -1, "dir": "p"}}, "persist.every: must be at least 0, got -1"),
    ({"persist": {"seconds": -0.5, "dir": "p"}}, "persist.seconds: must be at least 0, got -0.5"),
    ({"run_id": "../other"}, "run_id: expected a name \\(no '/'\\), got '../other'"),
    ({"run_id": ""}, "run_id: expected a name \\(no '/'\\), got ''"),
])
def test_a_value_no_run_can_mean_names_the_key(section, message):
    """Probe 18: a negative node_id was taken, its ranks' snapshots kept where no manager served them."""
    from baft.config import parse_config
    from baft.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^baft\.{message}$"):
        parse_config({"baft": section})


def test_a_config_without_a_baft_section_is_said_to_run_unprotected_under_baft_train(monkeypatch):
    from baft.plugin import LAUNCHER_ENV, unprotected

    monkeypatch.delenv(LAUNCHER_ENV["run_dir"], raising=False)
    assert unprotected({"train_batch_size": 4}) is None  # plain deepspeed or torchrun: nothing to say
    monkeypatch.setenv(LAUNCHER_ENV["run_dir"], "runs/first")  # what baft train tells every rank
    assert unprotected({"train_batch_size": 4, "baft": {"enabled": False}}) is None  # said so in the config
    assert unprotected({"train_batch_size": 4}).startswith('the DeepSpeed config has no "baft" section: the script '
                                                           'runs unprotected')


def test_a_config_that_puts_the_run_elsewhere_than_baft_train_does_is_refused_naming_the_key(monkeypatch, tmp_path):
    """Under ``baft train`` the launch's managers watch its shm root and run id, and its report reads its run
    directory: a config's own ``shm_root`` left the ranks without a manager, unsaid until the first snapshot failed."""
    from baft.config import parse_config
    from baft.errors import ConfigError
    from baft.plugin import LAUNCHER_ENV, _with_launcher_defaults

    monkeypatch.chdir(tmp_path)
    launched = {"run_id": "run-1", "shm_root": "/dev/shm/baft", "run_dir": str(tmp_path / "runs" / "first")}
    for key, value in launched.items():
        monkeypatch.setenv(LAUNCHER_ENV[key], value)

    def config(**section):
        doc = {"baft": {"policy": "baft", **section}}
        return _with_launcher_defaults(parse_config(doc), doc)

    assert (config().run_id, config().shm_root, config().run_dir) == tuple(launched.values())
    assert config(run_dir="runs/first", shm_root="/dev/shm/baft/").run_dir == "runs/first"  # the same places
    with pytest.raises(ConfigError, match=r"^baft\.shm_root '/proc/nope': baft train runs this job with shm_root "
                                          r"'/dev/shm/baft' \(its managers and report look there\); leave shm_root "
                                          r"out of the config under baft train$"):
        config(shm_root="/proc/nope")
    with pytest.raises(ConfigError, match=r"^baft\.run_dir 'runs/mine': "):
        config(run_dir="runs/mine")
    with pytest.raises(ConfigError, match=r"^baft\.run_id 'other': "):
        config(run_id="other")


def test_the_run_dir_is_made_at_initialize_or_refused_naming_the_key(tmp_path):
    """A config's ``run_dir`` that is not there yet is made as the ranks start: a resumed launch's rank 0 wrote its
    recovery record into it before any rank had made it (a traceback, FileNotFoundError, where the script itself
    makes no directory). One that cannot be made is one line naming the key."""
    from baft.errors import ConfigError
    from baft.plugin import _make_run_dir

    nested = tmp_path / "runs" / "job1"
    _make_run_dir(str(nested))
    assert nested.is_dir()
    _make_run_dir(str(nested))  # there already
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^baft\.run_dir '.*a-file/run': cannot be made a directory \(Not a "
                                          r"directory\)$"):
        _make_run_dir(str(tmp_path / "a-file" / "run"))


def test_a_bad_timeout_names_the_key():
    from baft.config import parse_config
    from baft.errors import ConfigError

    expected = r"expected 0 or null \(off\) or at least 1 second"
    with pytest.raises(ConfigError, match=rf"^baft\.hang_timeout: {expected}, got -5$"):
        parse_config({"baft": {"hang_timeout": -5}})
    with pytest.raises(ConfigError, match=rf"^baft\.progress_timeout: {expected}, got 0.2$"):
        parse_config({"baft": {"progress_timeout": 0.2}})
    with pytest.raises(ConfigError, match=r"^baft\.hang_timeout: expected a number, got '60s'$"):
        parse_config({"baft": {"hang_timeout": "60s"}})
    assert (parse_config({"baft": {}}).hang_timeout, parse_config({"baft": {}}).progress_timeout) == (60.0, 600.0)
    off = parse_config({"baft": {"hang_timeout": 0, "progress_timeout": None}})
    assert (off.hang_timeout, off.progress_timeout) == (None, None)


@pytest.mark.slow
def test_plan_for_another_model_is_refused_and_training_plans_from_its_own_receive_waits(tmp_path, shm_root):
    plan = Plan("1f1b", 2, 4, 1, 0.01, [RankPlan(r, r, "0123456789abcdef", 1, 1, 1e9, 1.0) for r in range(2)])
    plan.save(tmp_path / "foreign.plan.json")
    proc = run_worker(2, [*TINY, "--iters", "4", "--policy", "baft", "--plan", str(tmp_path / "foreign.plan.json"),
                          "--shm-root", str(shm_root)])
    assert "was made for state layout 0123456789abcdef" in proc.stderr
    assert "planning from the receive waits of this run instead" in proc.stderr
    root = shm_root / "default" / "node0"
    assert slots.committed(root, 0), "training ran unprotected after refusing the plan"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["example", "script"])
def test_baft_train_stops_at_a_ranks_error_instead_of_restarting_into_it(tmp_path, how):
    """A rank's BaftError is the user's to fix: torchrun is stopped at the first, not restarted --max-restarts times,
    and the screen has the error's line once (the example prints it as a line; a script's traceback ends in it,
    here after its process group is up, which puts torch's "[rankN]: " before every line of it)."""
    from baft.cli.launch import launch_env

    run_dir = tmp_path / "run"
    script = tmp_path / "bad_config.py"
    script.write_text("import deepspeed\nimport torch\nimport baft\n"
                      "deepspeed.init_distributed(dist_backend='gloo')\n"
                      "baft.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 1, "
                      "'baft': {'persist': {'evry': 3}}})\n")
    launch = (["--example", "gpt", *TINY, "--d-model", "30", "--heads", "4"] if how == "example"
              else ["--nprocs", "2", "--", str(script)])
    expected = ("--d-model 30 is not a multiple of --heads 4" if how == "example"
                else "baft.persist.evry: unknown key")
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--iters", "2", "--max-restarts", "3",
                           "--run-dir", str(run_dir), *launch],
                          capture_output=True, text=True, env=launch_env(), timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if expected in line]
    assert len(said) == 1 and said[0].startswith("baft: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "Root Cause" not in proc.stderr
    attempts = {p.name for p in (run_dir / "torchrun").glob("*/attempt_*")}
    assert attempts == {"attempt_0"}, f"torchrun restarted the ranks into the same error: {sorted(attempts)}"
