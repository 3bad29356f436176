"""Warm ranks (:mod:`baft.warm`): a rank forked from the warm server behaves as the process torchrun would start."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from baft.cli.launch import launch_env
from baft.warm import SOCKET_ENV, WarmServer, warmable
from conftest import SCRIPTS, warm

RANK = str(SCRIPTS / "warm_rank.py")


def start(*args, env=None, server=None, **popen) -> subprocess.Popen:
    server = server or warm()
    return subprocess.Popen([sys.executable, *server.program([RANK, *args])], text=True,
                            env={**launch_env(), "RANK": "3", "OMP_NUM_THREADS": "2", **server.env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout`` seconds: a kill is delivered, not instant."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def report(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_warm_rank_has_the_clients_argv_cwd_environment_streams_and_exit_code(tmp_path):
    proc = start("exit", "7", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    got = json.loads(out.splitlines()[0])
    assert proc.returncode == 7
    assert got["argv"] == [RANK, "exit", "7"] and got["cwd"] == str(tmp_path) and got["rank"] == "3"
    assert got["threads"] == 2  # the rank's OMP_NUM_THREADS, not the server's one thread
    assert got["whole_lines"], "each line in one write: torchrun's tee reads no half line"
    assert err.strip() == "to stderr"
    assert got["pid"] != proc.pid  # forked: the client stands in for it


@pytest.fixture(scope="module")
def buffered():
    """A warm server and an environment whose standard output is block-buffered, as a plain ``python`` writing
    to a pipe has it (``baft train`` sets ``PYTHONUNBUFFERED``): the server's own ``sys.stdout`` is the ranks'."""
    env = {key: value for key, value in launch_env().items() if key != "PYTHONUNBUFFERED"}
    with WarmServer().start(env) as server:
        yield server, env


@pytest.mark.parametrize("ending,code,message", [("none", 0, ""), ("raise", 1, "ValueError: the script failed"),
                                                  ("a message", 1, "a message")])
def test_a_warm_rank_ends_as_the_interpreter_would(tmp_path, buffered, ending, code, message):
    """Without the interpreter's finalization (a second of CPU a rank) but with everything a script relies on at
    exit: the same exit status and message as ``python script.py``, threads joined, atexit run, files flushed
    (the standard output the script's last line is buffered in too)."""
    server, env = buffered
    for how, proc in (("python", subprocess.Popen([sys.executable, RANK, "leave", str(tmp_path / "python.log"), ending],
                                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)),
                      ("warm", start("leave", str(tmp_path / "warm.log"), ending, server=server, env=env))):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, (how, err)
        assert out.splitlines()[1:] == ["non-daemon thread done", "atexit ran"], (how, out)
        assert (tmp_path / f"{how}.log").read_text() == "written, never flushed\n", how
        assert err.strip().splitlines()[-1] == message if message else err.strip() == "to stderr", (how, err)


def test_warm_ranks_draw_fresh_random_numbers_as_new_processes_do():
    first, second = (start("exit", "0") for _ in range(2))
    a, b = report(first), report(second)
    assert a["torch"] != b["torch"] and a["numpy"] != b["numpy"]
    assert first.wait(60) == 0 and second.wait(60) == 0


def test_a_module_runs_as_python_m_runs_it():
    proc = subprocess.run([sys.executable, *warm().program(["-m", "json.tool", "--sort-keys"])], input='{"b": 1, "a": 2}',
                          env={**launch_env(), **warm().env()}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["{", '"a":', "2,", '"b":', "1", "}"]


def test_signals_to_the_client_reach_the_rank():
    proc = start("sleep")
    report(proc)
    proc.send_signal(signal.SIGTERM)  # what torchrun sends to stop a rank
    assert proc.wait(30) == 42  # the rank's own SIGTERM handler ran


def test_killing_the_client_kills_the_rank_and_killing_the_rank_ends_the_client_alike():
    client = start("sleep")
    rank = report(client)["pid"]
    client.kill()  # torchrun's SIGKILL after its grace period, or a user's kill of what ps shows
    assert client.wait(30) == -signal.SIGKILL
    assert gone(rank)

    client = start("sleep")
    os.kill(report(client)["pid"], signal.SIGKILL)  # the rank itself dies: torchrun sees the same death
    assert client.wait(30) == -signal.SIGKILL


def test_a_rank_killed_is_replaced_in_place_and_one_its_client_stops_is_not(tmp_path):
    """A worker of a one-node job that recovers in place (``BAFT_REPLACE_RANKS``): killed, it is replaced; stopped
    through its client, as torchrun stops every rank before it relaunches them, it ends with its client. (It was
    replaced while its budget lasted, and torchrun waited 30 s for the replacement, which waited for its peers.)"""
    script = tmp_path / "rank.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
    job = {"BAFT_REPLACE_RANKS": "2", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": os.urandom(4).hex()}
    client = subprocess.Popen([sys.executable, *warm().program([str(script)])], text=True, stdout=subprocess.PIPE,
                              env={**launch_env(), **warm().env(), **job})
    first = int(client.stdout.readline())
    os.kill(first, signal.SIGKILL)  # a fault: the replacement joins a world of one and runs the script
    second = int(client.stdout.readline())
    client.terminate()
    assert client.wait(10) == -signal.SIGTERM
    assert second != first and gone(second)


def test_what_ps_shows_of_a_rank_is_its_own_command_and_environment():
    client = start("sleep")
    report(client)
    shown = psutil.Process(client.pid)
    assert RANK in shown.cmdline() and shown.environ()["RANK"] == "3"
    client.kill()
    client.wait(30)


def test_descriptors_of_the_rank_survive_its_exit_while_other_ranks_are_connected():
    others = [start("sleep") for _ in range(3)]  # the server holds their connections as the rank is forked
    for other in others:
        report(other)
    proc = start("pipes")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "pipes intact at exit" in out
    for other in others:
        other.terminate()
        other.wait(30)


def test_without_a_server_the_client_becomes_the_rank_and_says_so(tmp_path):
    server = WarmServer()  # never started: nothing listens at its socket
    proc = start("exit", "3", server=server)
    got, (_, err) = report(proc), proc.communicate(timeout=120)
    assert proc.returncode == 3 and got["pid"] == proc.pid  # exec'd in place
    assert "warm fork server" in err and "this rank starts without it" in err


def test_a_stopped_server_ends_its_ranks_and_the_next_start_is_cold():
    server = WarmServer().start(launch_env())
    try:
        client = start("sleep", server=server)
        rank = report(client)["pid"]
        server.close()
        assert client.wait(30) == -signal.SIGKILL  # the rank died with its server: nothing left unwatched
        assert gone(rank)
        late = start("exit", "0", server=server)
        assert late.wait(120) == 0 and "starts without it" in late.stderr.read()
    finally:
        server.close()
    assert not Path(server.directory).exists()


@pytest.mark.slow
def test_baft_train_forks_from_a_running_server_it_is_named_and_starts_its_own_where_none_answers(tmp_path):
    """``BAFT_WARM_SOCKET`` of a live server: the launch's ranks are its children and it runs on after the launch;
    a path where nothing answers (a server gone): the launch starts and stops its own, and no rank starts cold."""
    shared = WarmServer().start(launch_env())
    try:
        for name, socket_path in (("shared", shared.socket), ("gone", str(tmp_path / "nothing.sock"))):
            run_dir = tmp_path / name
            proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "1", "--no-manager",
                                   "--max-restarts", "0", "--run-dir", str(run_dir), "--", RANK, "exit", "0"],
                                  capture_output=True, text=True, env=launch_env({SOCKET_ENV: socket_path}), timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            log = (run_dir / "output.log").read_text()
            got = json.loads(next(line[line.index("{"):] for line in log.splitlines() if '"parent"' in line))
            assert (got["parent"] == shared.process.pid) is (name == "shared"), (name, got)
            assert "starts without it" not in log + proc.stderr
        assert shared.process.poll() is None, "a launch leaves a server it did not start running"
    finally:
        shared.close()


@pytest.mark.parametrize("argv, expected", [(["train.py", "--x"], True), (["-m", "pkg.train"], True),
                                            (["--no-python", "./a.out"], False), (["-m"], False), ([], False)])
def test_only_python_scripts_and_modules_are_forked(argv, expected):
    assert warmable(argv) is expected


def test_a_server_that_imported_a_thread_refuses_to_fork_and_names_the_thread():
    """Where an import starts a thread (on a GPU machine one did), the server says which, and ranks start cold."""
    code = ("import threading, time; from baft.warm.preload import unforkable; assert unforkable() is None; "
            "threading.Thread(target=time.sleep, args=(5,), name='importer-pool', daemon=True).start(); "
            "print(unforkable())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cannot fork after its imports (other threads: importer-pool; CUDA initialised: False)" in out.stdout


def test_where_a_gpu_driver_is_there_the_server_imports_torch_alone_and_stays_forkable(tmp_path):
    """DeepSpeed's import loads NVML where a GPU driver is there, which started a driver thread on an H200: the server
    then imports torch's modules alone (each rank imports DeepSpeed itself), and can fork."""
    driver = tmp_path / "nvidiactl"
    driver.touch()
    code = ("import sys; import baft.warm.preload as s; s.GPU_DRIVER_FILES = (sys.argv[1],); s.preload('now'); "
            "print([m in sys.modules for m in ('torch.distributed', 'torch._dynamo', 'deepspeed', 'baft.plugin')])")
    out = subprocess.run([sys.executable, "-c", code, str(driver)], capture_output=True, text=True,
                         env=launch_env(), timeout=120)
    assert out.returncode == 0, out.stderr  # preload exits with the refusal where it could not fork
    assert out.stdout.split("\n")[-2] == "[True, True, False, False]"


def test_what_only_some_jobs_import_is_imported_before_forking_once_idle_or_never_as_the_launcher_says():
    """:data:`PRELOAD_LATER` (DeepSpeed's imports as it wraps an optimizer, ~1.8 s) imported "now", before the server
    forks; left for when it is idle ("idle", where the launcher does not know the job: a rank that dies while it
    imports is reported once it is done); or "never", for a job that never imports it."""
    code = ("import sys; import baft.warm.preload as s\n"
            "print('later', s.preload('idle') == list(s.PRELOAD_LATER), s.PRELOAD_LATER[0] in sys.modules)\n"
            "print('later', s.preload('never'), s.PRELOAD_LATER[0] in sys.modules)\n"
            "print('later', s.preload('now'), s.PRELOAD_LATER[0] in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stdout.splitlines() if line.startswith("later ")]  # DeepSpeed prints too
    assert said == ["later True False", "later [] False", "later [] True"]


def test_the_servers_forks_read_its_detection_of_the_cpu_and_start_no_process_for_it(tmp_path):
    """py-cpuinfo detects the CPU in a new interpreter at every call (1.5 s), and DeepSpeed's CPU op builders call it
    twice each time a process loads an op (FusedAdam for a config's "Adam" on CPU): 3 s of every rank's
    deepspeed.initialize, at every relaunch and in every replacement in place. The server detects it once."""
    import cpuinfo

    driver = tmp_path / "nvidiactl"  # the server's shortest preload: torch alone
    driver.touch()
    code = ("import json, subprocess, sys; import baft.warm.preload as s; s.GPU_DRIVER_FILES = (sys.argv[1],); "
            "s.preload('now')\n"
            "def started(*args, **kwargs): raise AssertionError(f'a process started: {args}')\n"
            "subprocess.Popen = started\n"
            "import cpuinfo\n"
            "info = [cpuinfo.get_cpu_info() for _ in range(2)]\n"
            "info[0]['flags'].clear()  # a caller's change is its own\n"
            "print(json.dumps(info[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(driver)], capture_output=True, text=True,
                         env=launch_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    forked, fresh = json.loads(out.stdout.splitlines()[-1]), cpuinfo.get_cpu_info()
    assert (forked["arch"], forked["flags"]) == (fresh["arch"], fresh["flags"]) and fresh["flags"]


def test_a_spare_imports_what_a_script_imports_at_its_top_level_from_its_source(tmp_path):
    """:func:`baft.warm.spares.script_imports` reads the imports a script would make as it starts, never running it:
    plain, dotted, from-imports (a name may be a submodule), those in top-level try and if blocks; not a
    relative import, nor one inside a function; nothing from a file that does not parse."""
    from baft.warm.spares import script_imports

    script = tmp_path / "train.py"
    script.write_text("import os, json as j\nimport torch.nn\nfrom deepspeed.pipe import PipelineModule\n"
                      "from . import sibling\ntry:\n    import fancy\nexcept ImportError:\n    fancy = None\n"
                      "if True:\n    from model import *\ndef main():\n    import inside\nraise SystemExit('not run')\n")
    assert script_imports(script) == ["os", "json", "torch.nn", "deepspeed.pipe", "deepspeed.pipe.PipelineModule",
                                      "fancy", "model"]
    (tmp_path / "broken.py").write_text("import os\ndef (:\n")
    assert script_imports(tmp_path / "broken.py") == [] and script_imports(tmp_path / "missing.py") == []


def test_a_rank_killed_by_a_signal_nothing_passed_on_is_its_attempts_fault(tmp_path):
    """The OOM killer's SIGKILL or a user's: in no fault log, so the restart's record counted its phases from the new
    rank 0's start (a relaunch) or from rank 0's (in place). The server that reaps it logs it, once an attempt, and
    not over a fault an injection or a manager logged."""
    from baft import faults
    from baft.warm.server import Rank, _log_death

    def rank(attempt):
        return Rank(conn=None, request={"env": {"BAFT_RUN_DIR": str(tmp_path), "RANK": "1",
                                                "TORCHELASTIC_RESTART_COUNT": str(attempt)}}, fds=[])

    _log_death(rank(0), -signal.SIGKILL)
    _log_death(rank(0), -signal.SIGKILL)  # an echo, or a second rank of the same attempt
    faults.append(tmp_path, "kill rank 1 at step 7 (backward)", 1)  # injected, logged before its kill
    _log_death(rank(1), -signal.SIGKILL)
    logged = [(f["restart"], f["what"]) for f in faults.read(tmp_path)]
    assert logged == [(0, "rank 1 killed by SIGKILL"), (1, "kill rank 1 at step 7 (backward)")]


def test_a_rank_that_dies_while_the_idle_server_imports_is_reported_as_it_dies(tmp_path):
    """What the server imports once idle (``later``: DeepSpeed's optimizer modules, 1.8 s) ran in its one loop, and a
    rank killed meanwhile was reported to its client, so to torchrun, only once the import was done: a fault in the
    first seconds of a launch waited for it (T1 3-4 s instead of 0.5 s, probe rounds' early kills)."""
    (tmp_path / "slow_import.py").write_text(
        "import pathlib, time\npathlib.Path(__file__).with_name('importing').touch()\n"
        "for _ in range(300):\n    time.sleep(0.1)\n")
    path = tmp_path / "server" / "warm.sock"
    path.parent.mkdir()
    server = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\nsys.path.insert(0, sys.argv[1])\nfrom baft.warm.server import ForkServer\n"
        "listener = socket.socket(socket.AF_UNIX)\nlistener.bind(sys.argv[2])\nlistener.listen(8)\n"
        "ForkServer(sys.argv[2], listener, later=['slow_import']).run()"), str(tmp_path), str(path)],
        env=launch_env())
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        script = tmp_path / "rank.py"
        script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
        client = subprocess.Popen([sys.executable, *WarmServer.program([str(script)])], text=True,
                                  stdout=subprocess.PIPE, env={**launch_env(), SOCKET_ENV: str(path), "RANK": "0"})
        rank = int(client.stdout.readline())
        while not (tmp_path / "importing").exists() and time.monotonic() < deadline:  # idle a second: it imports
            time.sleep(0.05)
        assert (tmp_path / "importing").exists(), "the server did not import once idle"
        os.kill(rank, signal.SIGKILL)
        assert client.wait(15) == -signal.SIGKILL
    finally:
        server.kill()
