"""The environment baft launches ranks in."""

import os
import platform
import re
import subprocess
import sys
import time

import pytest

from baft.cli.launch import KEEP_FREED_MEMORY, KEEP_FREED_MEMORY_ENV, launch_env

# Resident memory (MiB) after a 256 MiB tensor is freed: glibc returns it to the kernel unless told not to.
AFTER_FREE = """
import torch
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss()
x = torch.ones(2**26)
del x
print(rss() - before)
"""


def resident_after_free(env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", AFTER_FREE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_ranks_keep_freed_memory_instead_of_faulting_it_back_in():
    plain = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY}
    assert resident_after_free(plain) < 64  # glibc unmapped the freed tensor
    assert resident_after_free(launch_env()) > 192  # the rank keeps it for the next iteration
    # and a user who asks for glibc's behaviour gets it
    assert resident_after_free(launch_env({**plain, KEEP_FREED_MEMORY_ENV: "0"})) < 64


def test_a_users_own_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    env = launch_env()
    assert env["MALLOC_TRIM_THRESHOLD_"] == "131072"
    assert env["MALLOC_MMAP_THRESHOLD_"] == KEEP_FREED_MEMORY["MALLOC_MMAP_THRESHOLD_"]


def test_ranks_find_the_ninja_of_the_python_environment_that_launched_them(monkeypatch):
    """As in an activated environment (``baft train`` run by its path, say from cron): ranks building DeepSpeed's ops
    with another ninja than the suite's rebuilt them at every start (two ninja versions, one build log)."""
    tools = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert launch_env()["PATH"] == os.pathsep.join([tools, "/usr/bin", "/bin"])
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", tools]))  # already there: left where the user put it
    assert launch_env()["PATH"] == os.pathsep.join(["/usr/bin", tools])


def test_a_launch_keeps_the_last_launches_torchrun_files_and_rotates_a_long_output_log(tmp_path, monkeypatch):
    from baft.cli import runlog

    launches = []
    for i in range(5):
        launch = tmp_path / "torchrun" / f"launch{i}" / "attempt_0" / "0"
        launch.mkdir(parents=True)
        (launch / "stdout.log").write_text(f"launch {i}\n")
        os.utime(launch.parents[1], (1000 + i, 1000 + i))
        launches.append(launch.parents[1])
    (tmp_path / "output.log").write_text("x" * 100)
    monkeypatch.setattr(runlog, "LOG_LIMIT", 99)
    runlog.trim_run_logs(tmp_path)
    kept = sorted(p.name for p in (tmp_path / "torchrun").iterdir())
    assert kept == [p.name for p in launches[-(runlog.KEEP_LAUNCHES - 1):]], kept
    assert (tmp_path / "output.log.1").read_text() == "x" * 100 and not (tmp_path / "output.log").exists()
    (tmp_path / "output.log").write_text("short")
    runlog.trim_run_logs(tmp_path)
    assert (tmp_path / "output.log").read_text() == "short", "a log under the limit is kept"


def test_a_ranks_exception_is_its_tracebacks_last_line_not_a_line_it_printed_meanwhile():
    from baft.cli.runlog import _Traceback

    lines = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>',
             "baft: resumed from step 2 (memory)",  # stdout, between the traceback's lines on stderr
             "    raise ValueError('bad lr')", "ValueError: bad lr"]
    reader = _Traceback()
    found = [e for e in (reader.feed(line) for line in lines) if e is not None]
    assert [e.line for e in found] == ["ValueError: bad lr"]
    assert [reader.feed(line) for line in ["Traceback (most recent call last):", "KeyboardInterrupt"]][-1].line \
        == "KeyboardInterrupt"


def test_a_fault_asked_for_that_the_run_never_reached_is_named():
    from baft.recovery.chaos import not_fired, parse_fault

    asked = [parse_fault("rank=1,step=5,phase=backward"), parse_fault("rank=7,step=5,phase=backward"),
             parse_fault("rank=1,step=9,phase=optimizer,restart=1"), parse_fault("node=1,step=4")]
    logged = [{"what": asked[0].what, "restart": 0}, {"what": asked[3].what, "restart": 0},
              {"what": "hang: rank 1 (pid 42) silent for 3.0 s", "restart": 1}]
    assert not_fired(asked, logged) == asked[1:3]


@pytest.mark.parametrize("spec, message", [
    ("rank=-1,step=3,phase=backward", "rank must be 0 or more, got -1"),
    ("rank=1,step=-3,phase=backward", "step must be 0 or more, got -3"),
    ("node=-2,step=3", "node must be 0 or more, got -2"),
    ("step=3,phase=backward", "rank= is missing"),
    ("rank=1,phase=backward", "step= is missing"),
    ("rank=1,step=x,phase=backward", "rank, node, step and restart must be integers"),
])
def test_a_fault_no_run_can_reach_is_refused_naming_what_is_wrong(spec, message):
    """Probe 18: ``rank=-1`` trained the whole run, then said the fault never happened; a missing ``rank=`` was said
    to be no integer."""
    from baft.errors import ConfigError
    from baft.recovery.chaos import parse_fault

    with pytest.raises(ConfigError, match=rf"^fault '{re.escape(spec)}': {re.escape(message)}$"):
        parse_fault(spec)


def test_an_error_that_ends_two_attempts_in_a_row_ends_the_run():
    """A rank's ValueError in a training step is a fault to restart past once; the same again, it is the run's error,
    also where torchrun saw its peer fail first (the peer's receive failed as the raising rank exited)."""
    import io

    from baft.cli.runlog import _Watch

    raised = ["[1] Traceback (most recent call last):\n", '[1]   File "e.py", line 9, in train_batch\n',
              "[1] ValueError: step 6: lr must be positive\n"]
    echo = ["[0] [rank0]: Traceback (most recent call last):\n", '[0] [rank0]:   File "e.py", line 9, in train_batch\n',
            "[0] [rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:{port}. This is typically\n"]
    failed = "[W] torch.distributed.elastic ... [default0] failed (exitcode: {code}) local_rank: {rank} (pid: 42) of bin\n"
    attempt = [*raised, failed.format(code=1, rank=1)]
    peer_first = [*raised, echo[0], echo[1], echo[2].format(port=9856), failed.format(code=1, rank=0)]
    killed = failed.format(code=-9, rank=0)
    for ending in (attempt, peer_first):
        stopped = []
        watch = _Watch(io.StringIO(), lambda: stopped.append(True), 5, 5)
        for line in [*ending, killed, *ending]:  # a kill between: not the same ending twice in a row
            watch._read(line, "stderr")
        assert not stopped and watch.error is None
        for line in ending:
            watch._read(line.replace("9856", "34506"), "stderr")
        assert stopped and watch.error == ("rank 1: ValueError: step 6: lr must be positive (it ended the attempt "
                                           "before too: a restart does not help)")
    watch = _Watch(io.StringIO(), lambda: None, 5, 5)
    for line in peer_first:  # the last attempt's, no restart left: its line is the run's reason
        watch._read(line, "stderr")
    assert watch.outcome(1).exception == ("rank 1: ValueError: step 6: lr must be positive (in a training step, with "
                                          "no restart left)")
    # raised between steps (probe 8: a shard's check before its third step), with torchrun seeing the peer's echo
    # first: the same twice ends the run; the last attempt's is its reason
    between = [raised[0], '[1]   File "e.py", line 4, in main\n', "[1] RuntimeError: corrupt shard before step 3\n"]
    stopped, watch = [], _Watch(io.StringIO(), lambda: stopped.append(True), 5, 5)
    for line in [*between, *echo[:2], echo[2].format(port=9856), failed.format(code=1, rank=0)]:
        watch._read(line, "stderr")
    assert not stopped and watch.outcome(1).exception == ("rank 1: RuntimeError: corrupt shard before step 3 (with "
                                                          "no restart left)")
    for line in [*between, *echo[:2], echo[2].format(port=34506), failed.format(code=1, rank=0)]:
        watch._read(line, "stderr")
    assert stopped and watch.outcome(1).exception == ("rank 1: RuntimeError: corrupt shard before step 3 (it ended "
                                                      "the attempt before too: a restart does not help)")
    stopped, watch = [], _Watch(io.StringIO(), lambda: stopped.append(True), 5, 5)
    for _ in range(2):  # ranks 10 and 2 raise the same between steps, twice: the lowest rank is named, not "10" < "2"
        for rank in (10, 2):
            for line in between:
                watch._read(line.replace("[1]", f"[{rank}]"), "stderr")
        watch._read(failed.format(code=1, rank=10), "stderr")
    assert stopped and watch.outcome(1).exception.startswith("rank 2: RuntimeError: corrupt shard"), watch.repeated
    watch = _Watch(io.StringIO(), lambda: None, 5, 5)
    for port in (9856, 34506):  # a peer's echo alone, twice, is no error of the run's
        for line in [*echo[:2], echo[2].format(port=port), failed.format(code=1, rank=0)]:
            watch._read(line, "stderr")
    assert watch.error is None and watch.outcome(1).exception is None


def test_a_scripts_usage_error_stops_the_run_at_once_as_its_line():
    """Probe 20: argparse's ``error: unrecognized arguments`` (exit 2) was restarted into ``--max-restarts`` times and
    then shown as the ranks' last lines. Its line after the usage (wrapped, indented) is the run's error, and stops
    torchrun; an ``error:`` line with no usage before it is not."""
    import io

    from baft.cli.runlog import _Watch

    stopped, watch = [], _Watch(io.StringIO(), lambda: stopped.append(True), 5, 5)
    for line in ["[1] my error: not a usage's\n", "[0] usage: train.py [-h] --config CONFIG\n",
                 "[1] usage: train.py [-h]\n", "[0]                 [--steps STEPS]\n", "[1] loading\n",
                 "[1] train.py: error: not after a usage\n"]:
        watch._read(line, "stderr")
    assert not stopped and watch.error is None
    watch._read("[0] train.py: error: unrecognized arguments: --bogus\n", "stderr")
    assert stopped and watch.error == ("rank 0: train.py: error: unrecognized arguments: --bogus (the script's own "
                                       "usage error: a restart does not help)")
    assert watch.outcome(1).error == watch.error


def test_a_rank_that_ends_its_script_early_twice_in_a_row_ends_the_run_naming_it():
    """Probe 20: a rank's ``sys.exit(0)`` at a step left its peer failing on the lost peer; torchrun restarted into it
    every time and the run ended on the peer's exit code, naming no rank. The rank's line as it exits (hidden from the
    screen) names it: once, a restart; twice in a row, the run's reason. A rank that ends its script while a peer is
    killed, or after an exception, or the failed rank itself, is none."""
    import io

    from baft.cli.runlog import _Watch, on_screen

    echo = ["[0] [rank0]: Traceback (most recent call last):\n", '[0] [rank0]:   File "e.py", line 9, in train_batch\n',
            "[0] [rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:9856. This is typically\n",
            "[0] baft: rank 0 ended its script at step 3\n"]
    failed = "[W] torch.distributed.elastic ... [default0] failed (exitcode: {code}) local_rank: {rank} (pid: 42) of bin\n"
    left = ["[1] baft: rank 1 ended its script at step 3\n", *echo, failed.format(code=1, rank=0)]
    assert on_screen(left[0], "stderr") is None
    said = "rank 1 ended its script (exit status 0) at step 3 while its peers were training: they failed on losing it"
    stopped, watch = [], _Watch(io.StringIO(), lambda: stopped.append(True), 5, 5)
    for line in left:
        watch._read(line, "stderr")
    assert not stopped and watch.outcome(1).exception == f"{said} (no restart left)"
    for line in left:
        watch._read(line, "stderr")
    assert stopped and watch.outcome(1).exception == f"{said} (it did so in the attempt before too: a restart does " \
                                                     "not help)"
    raised = ['[1] Traceback (most recent call last):\n', "[1] ValueError: bad lr\n"]
    for others in ([*left[:-1], failed.format(code=-9, rank=0)],  # its peer killed in the last step
                   [*raised, *left],  # it ended its script of the ValueError
                   [left[0], failed.format(code=1, rank=1)]):  # it ended it with sys.exit(1)
        watch = _Watch(io.StringIO(), lambda: None, 5, 5)
        for line in [*others, *others]:
            watch._read(line, "stderr")
        assert "ended its script" not in (watch.outcome(1).exception or ""), others


def test_a_build_lock_a_stopped_build_left_is_removed_and_said(tmp_path, capfd):
    """A run killed as DeepSpeed built its op left torch's lock (a bare file), and every later run's ranks waited on it
    for ever, silently (by hand, this session: a suite held still 15 min). One over two minutes old with no process
    working in its directory is removed and said; a fresh one, or one a build (its ninja, here a sleep) works beside,
    stays."""
    from baft.cli.launch import STALE_BUILD_LOCK, clear_stale_build_locks

    stale, fresh, building = (tmp_path / op / "lock" for op in ("deepspeed_shm_comm", "fused_adam", "cpu_adam"))
    for lock in (stale, fresh, building):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK - 60
    for lock in (stale, building):
        os.utime(lock, (old, old))
    ninja = subprocess.Popen(["sleep", "60"], cwd=building.parent)
    try:
        assert clear_stale_build_locks(str(tmp_path)) == [stale]
    finally:
        ninja.kill()
    assert not stale.exists() and fresh.exists() and building.exists()
    assert capfd.readouterr().err == (f"baft: removed {stale}, left 3 min ago by a build of DeepSpeed's "
                                      f"deepspeed_shm_comm op stopped halfway (no process builds there): every rank "
                                      f"would have waited on it for ever\n")


# A torchrun that does not end when stopped: a rank's baft error, then SIGTERM ignored; a process it started (its
# pid into argv[1]) holds its output open after it is gone.
UNSTOPPABLE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
holder = subprocess.Popen(["sleep", "60"])
open(sys.argv[1], "w").write(str(holder.pid))
print("[0] baft: error: step 2: the plan names a stage this run lacks", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_a_torchrun_that_does_not_end_when_stopped_is_killed_and_the_run_ends(tmp_path, monkeypatch, capsys):
    """``baft train`` stops torchrun (SIGTERM) at a rank's baft error and waited for its end, and for the end of its
    output, unbounded: a torchrun left waiting at its exit (torch's agent signalled as it starts an attempt's ranks)
    hung ``baft train`` until its test's timeout. Killed after its grace, the run ends with the rank's error, and what
    still holds its output is said."""
    from baft.cli import runlog

    monkeypatch.setattr(runlog, "READERS_GRACE", 0.5)
    holder = tmp_path / "holder"
    outcome = runlog.run_logged([sys.executable, "-c", UNSTOPPABLE, str(holder)], dict(os.environ),
                                tmp_path / "output.log", announce=False, stop_grace=1.0)
    os.kill(int(holder.read_text()), 9)
    assert outcome.code == -9 and outcome.error == "step 2: the plan names a stage this run lacks", outcome
    assert capsys.readouterr().err.splitlines() == [
        "baft: torchrun did not end within 1 s of being stopped; killed it",
        f"baft: a process of the run that outlived torchrun holds its output open; what it writes now is not in "
        f"{tmp_path / 'output.log'}"]


def put_back_torchruns_agent(monkeypatch) -> None:
    """After the test, torch's agent and its signal handler as they were (``baft.cli.torchrun.main`` changes them)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    for owner, name in ((api, "_terminate_process_handler"), (LocalElasticAgent, "_initialize_workers"),
                        (LocalElasticAgent, "_monitor_workers")):
        monkeypatch.setattr(owner, name, getattr(owner, name))


def test_torchrun_as_baft_runs_it_names_rendezvous_events_as_torch_does_and_waits_less(monkeypatch):
    """``baft.cli.torchrun`` replaces three things of torch's rendezvous (each restart spent 0.3-1.2 s in the first
    two): the event name read off ``inspect.stack()``, by the same name read off the frame; under ``--standalone`` the
    random wait that skews nodes rejoining together; and a poll's wait of a second."""
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from baft.cli import torchrun

    def record(name_of):  # as DynamicRendezvousHandler._record names its event, two frames up
        return name_of()

    def _add_to_participants(name_of):
        return record(name_of)

    assert _add_to_participants(torchrun._method_name) == _add_to_participants(dynamic_rendezvous.get_method_name)
    assert _add_to_participants(torchrun._method_name) == "_add_to_participants"
    assert torchrun._method_name(depth=10 ** 6) == "no_method_name"

    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)  # put back after
    put_back_torchruns_agent(monkeypatch)
    # a node waiting for the others polls the rendezvous every 0.05 s on a few nodes (torch: every second, so a
    # restart of a job on several nodes waited up to a second past the last node's joining), once a second on many
    for argv, skewed, poll in ((["--standalone", "--nproc-per-node=2", "--", "train.py"], False, 0.05),
                               (["--nnodes=2", "--", "train.py", "--standalone"], True, 0.05),
                               (["--nnodes", "64:128", "train.py"], True, 128 / 500),
                               (["--nnodes=1000", "train.py"], True, 1)):
        waits, ran = [], []
        monkeypatch.setattr(dynamic_rendezvous, "_delay", waits.append)
        monkeypatch.setattr(torch.distributed.run, "main", ran.append)
        torchrun.main(argv)
        assert ran == [argv]
        dynamic_rendezvous._delay((0, 0.3))
        dynamic_rendezvous._delay(1)
        assert waits == ([(0, 0.3)] if skewed else []) + [poll], argv


def test_torchrun_as_baft_runs_it_serves_the_ranks_a_new_store_each_rendezvous_round(monkeypatch):
    """torch 2.13's agent serves its ranks one store for every attempt, and an attempt's keys send the next one's gloo
    to dead peers; unshared, rank 0 serves it as it starts and the others wait out a connect backoff (0.1-0.7 s of
    half the warm relaunches). ``baft.cli.torchrun`` has the agent make a new one each round; on this torch it can."""
    from types import SimpleNamespace

    import torch.distributed.run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from baft.config import ROUND_ENV
    from baft.recovery import record

    from baft.cli import torchrun
    from baft.cli.launch import launch_env

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    for owner, name in ((handler, "next_rendezvous"), (dynamic_rendezvous, "get_method_name"),
                        (dynamic_rendezvous, "_delay")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # put back after
    put_back_torchruns_agent(monkeypatch)
    monkeypatch.delenv(torchrun.UNSHARED_STORE_ENV, raising=False)
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: None)
    torchrun.main(["--standalone", "--", "train.py"])
    assert torchrun.UNSHARED_STORE_ENV not in os.environ and torchrun.UNSHARED_STORE_ENV not in launch_env()

    class Round(handler):
        def __init__(self):  # what the first round left: a server, and the address the ranks were given
            self._shared_tcp_store_server, self._bootstrap_store_info = "server", "info"
            self._state_holder = SimpleNamespace(state=SimpleNamespace(round=2), _cache_duration=1)

    seen = []
    monkeypatch.setattr(handler, "next_rendezvous", lambda self: seen.append(
        (self._shared_tcp_store_server, self._bootstrap_store_info)))
    monkeypatch.setenv(ROUND_ENV, "0")  # and taken away after: the suite's later ranks are no attempt 2
    assert torchrun._each_round(handler, poll=0.05)
    joining = Round()
    joining.next_rendezvous()
    assert seen == [(None, None)]  # torch's own round then makes both again
    # the ranks it starts are told the round joined, the same on every node (each node's agent counts only its own
    # ranks' failures as restarts); the state is read again after 0.05 s, not served as it was a second ago
    assert os.environ[ROUND_ENV] == "2" and record.torchrun_attempt() == 2
    assert joining._state_holder._cache_duration == 0.05

    class Other:  # a torch whose handler keeps no such store: the store stays unshared
        def __init__(self):
            self.store = None

        def next_rendezvous(self):
            pass

    assert not torchrun._each_round(Other, poll=0.05)


def test_torchrun_as_baft_runs_it_holds_a_death_signal_until_the_agent_next_starts_watches_or_waits(monkeypatch):
    """torch's handler raised a death signal's exception wherever its agent was as it came: in ``logging``, which caught
    it, and the agent restarted the ranks as if no signal had come (a fresh-clone CI: 3 restarts where ``baft train``
    had stopped the run after 1), or as the agent stopped an attempt's ranks, between an ``Event``'s lock acquired and
    its ``with`` block, and the agent's shutdown waited for that lock for ever (``baft train`` hung: a fresh-clone CI,
    and 1 of 28 such runs by hand, py-spy showing ``TailLog.stop`` in ``Condition.__enter__``). The signal is held, and
    raised as the agent next starts or watches its ranks, or waits in a rendezvous."""
    import signal
    import threading
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing import api

    from baft.cli import torchrun

    class Agent:
        def _initialize_workers(self, group):
            return "started"

        def _monitor_workers(self, group):
            return "watched"

    put_back_torchruns_agent(monkeypatch)
    raise_held = torchrun._death_signal_held(api, Agent)
    delay = torchrun._shorter_waits(lambda seconds: None, nodes=2, poll=0.05, first=raise_held)
    assert Agent()._initialize_workers(None) == "started" and Agent()._monitor_workers(None) == "watched"
    delay(1)
    event = threading.Event()
    with event._cond:  # the signal comes as the agent holds a lock: nothing is raised there
        api._terminate_process_handler(signal.SIGTERM, None)
    event.set()
    for wait in (Agent()._initialize_workers, Agent()._monitor_workers, delay):
        with pytest.raises(api.SignalException, match="got signal") as raised:
            wait(None)
        assert raised.value.sigval == signal.SIGTERM
    assert torchrun._death_signal_held(SimpleNamespace(), Agent) is None  # a torch without that handler: as it is


def test_baft_torchrun_starts_each_python_rank_as_a_warm_servers_client(monkeypatch):
    """``baft torchrun``: torchrun's program ``python -u [-m] PROGRAM ARGS`` becomes ``python -u CLIENT [-m] PROGRAM
    ARGS``, the ranks' environment naming the node's server; a program of another kind runs as torchrun runs it."""
    from types import SimpleNamespace

    from baft.cli import torchrun
    from baft.warm import CLIENT, SOCKET_ENV, WarmServer

    monkeypatch.setattr(WarmServer, "running", classmethod(lambda cls, env: cls("/tmp/node-server.sock")))
    made = {}
    run_module = SimpleNamespace(config_from_args=lambda args: made[args])
    servers = []
    torchrun._ranks_warm(run_module, servers)
    made["module"] = ("config", sys.executable, ["-u", "-m", "baft.examples.worker", "--stages", "3"])
    made["no-python"] = ("config", "./train.sh", ["--steps", "3"])
    made["other python"] = ("config", "/opt/python3", ["-u", "train.py"])
    before = dict(os.environ)
    try:
        assert run_module.config_from_args("module") == (
            "config", sys.executable, ["-u", CLIENT, "-m", "baft.examples.worker", "--stages", "3"])
        assert os.environ[SOCKET_ENV] == "/tmp/node-server.sock"  # the ranks' environment, torchrun's own
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert servers == []  # a server that runs already is left running
    for kind in ("no-python", "other python"):
        assert run_module.config_from_args(kind) == made[kind], kind
