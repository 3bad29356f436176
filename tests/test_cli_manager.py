"""``baft manager start|status|stop`` and ``baft inspect`` from the command line, on real processes."""

import subprocess
import sys

import pytest

from baft.snapshot import slots
from conftest import TINY, run_worker


def baft_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "baft.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_manager_commands_and_inspect(shm_root, tmp_path):
    root = shm_root / "default" / "node0"
    started = baft_cli("manager", "start", "--shm-root", root, "--dir", tmp_path / "persisted",
                       "--persist-every", "2")
    assert started.returncode == 0, started.stderr
    try:
        run_worker(2, [*TINY, "--iters", "6", "--policy", "baft", "--period", "1", "--shm-root", str(shm_root)])
        status = baft_cli("manager", "status", "--shm-root", root)
        assert status.returncode == 0 and "rank 1" in status.stdout, status.stdout
        shown = baft_cli("inspect", slots.rank_dir(root, 1))
        assert shown.returncode == 0 and "step 5" in shown.stdout, shown.stdout + shown.stderr
    finally:
        stopped = baft_cli("manager", "stop", "--shm-root", root)
    assert stopped.returncode == 0, stopped.stderr
    assert not (root / "rank0").exists(), "stop frees the shared memory"
    persisted = sorted((tmp_path / "persisted").glob("step-*"))
    assert persisted, "the manager persisted nothing"
    verified = baft_cli("inspect", persisted[-1])
    assert verified.returncode == 0, verified.stderr
    tensor_file = next(persisted[-1].glob("rank1.safetensors"))
    data = bytearray(tensor_file.read_bytes())
    data[-5] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    corrupt = baft_cli("inspect", persisted[-1])
    assert corrupt.returncode == 2 and "Traceback" not in corrupt.stderr
    assert "rank1.safetensors" in corrupt.stderr


def test_manager_start_refuses_bad_flags_in_one_line(tmp_path):
    bad = baft_cli("manager", "start", "--shm-root", tmp_path / "r", "--group", "127.0.0.1:1,127.0.0.1:2",
                   "--node-id", "7")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--node-id 7: not a member of --group" in bad.stderr


@pytest.mark.slow
def test_ls_lists_and_clean_frees_snapshots_no_manager_serves(shm_root):
    run_worker(2, [*TINY, "--iters", "3", "--policy", "baft", "--period", "1", "--shm-root", str(shm_root)])
    root = shm_root / "default" / "node0"  # trained with no manager: the ranks' own slots stay
    listed = baft_cli("manager", "ls", shm_root)
    assert listed.returncode == 0
    line = next(line for line in listed.stdout.splitlines() if line.startswith(str(root)))
    assert "no manager" in line and "rank 0 step 3" in line and "rank 1 step 3" in line, line
    assert "1 with no manager" in listed.stdout

    missing = baft_cli("manager", "clean", shm_root / "nothing-here")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"{shm_root / 'nothing-here'}: no such directory" in missing.stderr

    cleaned = baft_cli("manager", "clean", root)
    assert cleaned.returncode == 0, cleaned.stderr
    assert f"removed {root}" in cleaned.stdout and "rank 1 step 3" in cleaned.stdout
    assert not root.parent.exists(), "the run's directory, empty once its node root is gone, is removed too"
    assert "0 node root(s)" in baft_cli("manager", "ls", shm_root).stdout


@pytest.mark.slow
def test_clean_empty_removes_only_roots_with_nothing_committed(shm_root):
    from baft.snapshot.slots import rank_dir

    empty, holding = shm_root / "old" / "node0", shm_root / "kept" / "node0"
    (empty / "manager.log").parent.mkdir(parents=True)
    (empty / "manager.log").write_text("node 0 serving\n")
    rank_dir(empty, 0).mkdir()
    (rank_dir(empty, 0) / "slot0.bin").write_bytes(b"\0" * 64)  # filled, never committed
    run_worker(2, [*TINY, "--iters", "2", "--policy", "baft", "--period", "1", "--shm-root", str(shm_root),
                   "--run-id", "kept"])
    assert slots.committed(holding, 1)
    cleaned = baft_cli("manager", "clean", "--empty", shm_root)
    assert cleaned.returncode == 0 and "removed 1 node root(s)" in cleaned.stdout, cleaned.stdout + cleaned.stderr
    assert not empty.exists() and slots.committed(holding, 1), "only the root with nothing committed went"


def test_the_scan_passes_over_a_run_whose_root_is_removed_as_it_is_scanned(tmp_path):
    """Another run on the machine ending (its root removed) as ``baft train`` scanned the roots for unserved snapshots
    stopped that launch with a FileNotFoundError (seen in the suite beside a second suite's runs)."""
    import shutil
    import threading

    from baft.manager import inventory

    (tmp_path / "run-kept" / "node0" / "rank0").mkdir(parents=True)
    stop = threading.Event()

    def another_run():
        while not stop.is_set():
            for rank in range(4):
                (tmp_path / "run-ending" / "node0" / f"rank{rank}").mkdir(parents=True, exist_ok=True)
                (tmp_path / "run-ending" / "node0" / f"rank{rank}" / "slot0.bin").write_bytes(b"0" * 64)
            shutil.rmtree(tmp_path / "run-ending", ignore_errors=True)

    thread = threading.Thread(target=another_run)
    thread.start()
    try:
        for _ in range(300):
            assert tmp_path / "run-kept" / "node0" in [root.path for root in inventory.scan(tmp_path)]
    finally:
        stop.set()
        thread.join()
