"""The snapshot manager as real processes: it outlives trainers, rebuilds lost nodes, persists safely."""

import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from baft.errors import BaftError
from baft.manager import control, erasure, persist, server
from baft.manager.config import ManagerConfig, parse_args, parse_group
from baft.manager.protocol import ManagerClient
from baft.snapshot import slots
from baft.snapshot.layout import CommitRecord, TensorEntry, checksum, plan_layout

TOPO = {"pipe": 2, "data": 1, "world": 2}
RUN = "run-a"


def layout_for(nbytes):
    """A stage of two tensors, ``nbytes`` in all, cut in 256 KB chunks."""
    half = nbytes // 8 * 4
    tensors = [TensorEntry("w", "float32", (half // 4,), half, "parameters"),
               TensorEntry("m", "float32", ((nbytes - half) // 4,), nbytes - half, "optimizer")]
    return plan_layout(tensors, chunk_bytes=256 << 10)


def data_for(rank, step, nbytes):
    return np.random.default_rng(rank * 100003 + step).bytes(nbytes)


def record_for(rank, step, layout, data):
    sums = [checksum(data[c.offset:c.offset + c.nbytes]) for c in layout.chunks]
    return CommitRecord(step, rank, rank % 2, layout, sums, items={"rng": [rank, step], "data": {"index": step}},
                        topology=TOPO, run_id=RUN, model="model-0", wall_time=float(step))


class Trainer:
    """What a trainer rank does: hello, then fill a slot and commit, through the real store."""

    def __init__(self, root, rank, nbytes, client=None):
        self.root, self.rank, self.layout = Path(root), rank, layout_for(nbytes)
        self.client = client or ManagerClient.connect(root)
        self.client.hello(rank, self.layout.nbytes, run_id=RUN, model="model-0", topology=TOPO)
        self.writer = slots.SnapshotWriter(root, rank, self.layout)

    def step(self, step, corrupt_chunk=None):
        data = data_for(self.rank, step, self.layout.nbytes)
        record = record_for(self.rank, step, self.layout, data)
        buffer = self.writer.begin(step)
        buffer.numpy()[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        if corrupt_chunk is not None:
            buffer[self.layout.chunks[corrupt_chunk].offset + 7] ^= 1
        slot = self.writer.slot
        self.writer.commit(record, slot)
        self.client.commit(self.rank, step, slot)
        return record, data

    def close(self):
        self.writer.close()
        self.client.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout=30.0, what="condition", poll=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def managers():
    """Start manager processes; SIGKILL any still running at the end."""
    procs = []

    def run(*configs):
        started = [control.spawn(c) for c in configs]
        procs.extend(started)
        for config, proc in zip(configs, started):
            control.wait_ready(config.shm_root, 60, proc)
        return started

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def in_process():
    """Run a manager on a thread of the test process (for what needs no process to die)."""
    running = []

    def run(config):
        m = server.Manager(config)
        m.open()
        thread = threading.Thread(target=m.serve, daemon=True)
        thread.start()
        running.append((m, thread))
        return m

    yield run
    for m, thread in running:
        m.request_stop(unlink=True)
        thread.join(60)


def held(root):
    with ManagerClient.connect(root) as c:
        return c.held()


def same_snapshot(got, record, data):
    return got is not None and got[0].to_json() == record.to_json() and bytes(got[1]) == data


# ---- erasure across nodes ----------------------------------------------------------------------


def test_three_node_group_rebuilds_a_killed_node_bit_for_bit(tmp_path, managers):
    ports = [free_port() for _ in range(3)]
    group = parse_group(",".join(f"127.0.0.1:{p}" for p in ports))
    configs = [ManagerConfig(node_id=i, shm_root=tmp_path / f"n{i}", group=group, parity_k=2) for i in range(3)]
    procs = managers(*configs)
    nbytes = 1 << 20
    trainers = {r: Trainer(configs[r // 2].shm_root, r, nbytes + r * 4096) for r in range(6)}
    sent = {}
    for step in (1, 2):
        for r, t in trainers.items():
            sent[(r, step)] = t.step(step)

    def encoded(i):
        st = control.status(configs[i].shm_root)
        return st["parity"]["encoded_step"] == 2 and len(st["parity"]["acked"].get("2", [])) == 3
    for i in range(3):
        wait_for(lambda: encoded(i), what=f"node {i} parity of step 2")
    assert "survives this node's loss" in control.status(configs[2].shm_root)["parity"]["line"]

    # node 2 is lost: its manager and its trainers' shared memory
    procs[2].kill()
    procs[2].wait()
    for r in (4, 5):
        trainers[r].close()
    shutil.rmtree(configs[2].shm_root)

    with ManagerClient.connect(configs[0].shm_root) as c:
        with pytest.raises(BaftError, match=r"^unknown node id 9: this manager's group has members 0, 1, 2$"):
            c.rebuild(9)
        reply, bundle = c.rebuild(2)
    assert reply["step"] == 2 and reply["checksum"] == erasure.bundle_checksum(bundle)
    rebuilt = erasure.unpack_bundle(bundle)
    assert [r.rank for r, _ in rebuilt.snapshots] == [4, 5]
    for record, buffer in rebuilt.snapshots:
        want_record, want_data = sent[(record.rank, 2)]
        assert record.to_json() == want_record.to_json() and bytes(buffer) == want_data

    # a replacement node 2 (new manager, empty shared memory) restores its ranks from the survivors
    fresh = ManagerConfig(node_id=2, shm_root=tmp_path / "n2-new", group=group, parity_k=2)
    replacement_manager, = managers(fresh)
    # before any of its ranks says hello, it already lists what the group's parity can rebuild for them
    assert held(fresh.shm_root) == {str(r): {"memory": [], "parity": [2, 1], "disk": []} for r in (4, 5)}
    replacement = Trainer(fresh.shm_root, 4, nbytes + 4 * 4096)
    with ManagerClient.connect(fresh.shm_root) as c:
        assert c.held()["4"]["parity"] == [2, 1]
        first, second = c.restore(4), c.restore(5)
    assert (first["source"], first["step"]) == ("parity", 2)
    assert (second["source"], second["step"]) == ("memory", 2)
    for r in (4, 5):
        assert same_snapshot(slots.load_verified(fresh.shm_root, r, 2), *sent[(r, 2)])
    replacement.close()

    # with node 1 and the replacement node 2 gone too (the replacement may already have re-encoded its
    # restored snapshot), only node 0's share of node 2's bundle is left: k=2 cannot be met, said in one line
    for proc in (procs[1], replacement_manager):
        proc.kill()
        proc.wait()
    with ManagerClient.connect(configs[0].shm_root) as c, pytest.raises(BaftError, match="fewer than k=2") as err:
        c.rebuild(2)
    assert "\n" not in str(err.value)
    for r in (0, 1, 2, 3):
        trainers[r].close()


def test_mismatched_group_is_refused_in_one_line(tmp_path, managers):
    ports = [free_port() for _ in range(3)]
    three = parse_group(",".join(f"127.0.0.1:{p}" for p in ports))
    managers(ManagerConfig(node_id=0, shm_root=tmp_path / "a", group=three, parity_k=2))
    two = parse_group(",".join(f"127.0.0.1:{p}" for p in ports[:2]))
    with pytest.raises(BaftError, match=r"--group mismatch: node 1 has n=2, k=1.*node 0 has n=3, k=2") as err:
        control.start(ManagerConfig(node_id=1, shm_root=tmp_path / "b", group=two, parity_k=1))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["--node-id", "5", "--group", "h:1,h:2,h:3"], "--node-id 5: not a member of --group (members 0, 1, 2)"),
    (["--node-id", "0", "--group", "h:1,h:2,h:3", "--parity-k", "3"], "--parity-k 3: must be at least 1 and below the group size 3"),
    (["--node-id", "0", "--group", "h:1,h:2", "--parity-k", "0"], "--parity-k 0: must be at least 1"),
    (["--node-id", "0", "--group", "0@h:1,0@h:2"], "--group: node id 0 is listed twice"),
    (["--node-id", "0", "--group", "h1,h:2"], "--group: 'h1' is not host:port"),
    (["--node-id", "0", "--parity-k", "1"], "--parity-k 1: needs --group"),
    (["--node-id", "0", "--persist-every", "10"], "--persist-every/--persist-seconds: need --dir"),
    (["--node-id", "-1"], "--node-id -1: must be a non-negative integer"),
    (["--node-id", "0", "--memory-limit", "lots"], "--memory-limit: 'lots' is not a byte count"),
])
def test_bad_configuration_is_one_line(tmp_path, argv, message):
    with pytest.raises(BaftError) as err:
        parse_args(argv + (["--shm-root", str(tmp_path)] if "--shm-root" not in argv else []))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_command_line_error_is_one_line_on_stderr(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "baft.manager", "--node-id", "7", "--group", "127.0.0.1:1,127.0.0.1:2",
                           "--shm-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --node-id 7: not a member of --group (members 0, 1)"]


# ---- the manager outlives its trainers ---------------------------------------------------------

TRAINERS = textwrap.dedent("""
    # One process holding four ranks' writers, each stopped at another moment of its iteration,
    # then SIGKILLed: the files are all the manager has, as after four trainers were killed.
    import sys, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    from test_manager import Trainer, data_for
    root = sys.argv[1]
    moments = {{0: ("mid-copy", 3), 1: ("after-commit", 0), 2: ("after-begin", 0), 3: ("mid-copy", 7)}}
    for rank, (moment, chunks) in moments.items():
        t = Trainer(root, rank, {nbytes})
        t.step(1)
        t.step(2)
        if moment == "after-commit":
            continue
        buffer = t.writer.begin(3)
        data = np.frombuffer(data_for(rank, 3, t.layout.nbytes), dtype=np.uint8)
        for c in t.layout.chunks[:chunks]:
            buffer.numpy()[c.offset:c.offset + c.nbytes] = data[c.offset:c.offset + c.nbytes]
    print("READY", flush=True)
    time.sleep(600)
""")


def test_trainers_sigkilled_at_any_moment_lose_nothing_committed(tmp_path, managers):
    root = tmp_path / "shm"
    managers(ManagerConfig(node_id=0, shm_root=root))
    nbytes = 2 << 20
    code = TRAINERS.format(tests=str(Path(__file__).parent), nbytes=nbytes)
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", "the trainers failed"
    finally:
        proc.kill()
        proc.wait()
    layout = layout_for(nbytes)
    for r in range(4):
        assert wait_for(lambda: held(root)[str(r)]["memory"] == [2, 1], what=f"rank {r} held")
        with ManagerClient.connect(root) as c:
            reply = c.restore(r)
        assert (reply["source"], reply["step"]) == ("memory", 2)
        want = data_for(r, 2, layout.nbytes)
        assert same_snapshot(slots.load_verified(root, r), record_for(r, 2, layout, want), want)
    st = control.status(root)
    assert all(s["verified"] == "ok" and s["step"] in (1, 2) for r in st["ranks"].values() for s in r["slots"])


def test_corrupt_shared_memory_chunk_is_refused_and_older_used(tmp_path, managers):
    root = tmp_path / "shm"
    managers(ManagerConfig(node_id=0, shm_root=root))
    t = Trainer(root, 0, 1 << 20)
    t.step(1)
    t.step(2)
    wait_for(lambda: held(root)["0"]["memory"] == [2, 1], what="steps 1 and 2 verified")
    t.step(3, corrupt_chunk=2)  # the trainer's copy went wrong before commit: background check refuses it
    wait_for(lambda: any(s["step"] == 3 and s["verified"] != "pending"
                         for s in control.status(root)["ranks"]["0"]["slots"]), what="step 3 checked")
    verdict = next(s["verified"] for s in control.status(root)["ranks"]["0"]["slots"] if s["step"] == 3)
    assert verdict == "chunk 2 (m bytes 0..262144) fails its checksum"
    assert held(root)["0"]["memory"] == [2, 1]
    # a bit flips in step 2's committed slot after it was verified: restore re-verifies
    slot2 = next(i.slot for i in slots.committed(root, 0) if i.record.step == 2)
    chunk = t.layout.chunks[1]
    with open(root / "rank0" / f"slot{slot2}.bin", "r+b") as f:
        f.seek(chunk.offset + 100)
        byte = f.read(1)
        f.seek(chunk.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    with ManagerClient.connect(root) as c:
        reply = c.restore(0)
        assert (reply["source"], reply["step"]) == ("memory", 1)
        assert any("step 3 refused: chunk 2 (m bytes 0..262144)" in line for line in reply["refused"])
        assert any("step 2 refused: chunk 1 (w bytes 262144..524288)" in line for line in reply["refused"])
        with pytest.raises(BaftError, match=r"step 2 is held nowhere valid .*chunk 1 \(w bytes") as err:
            c.restore(0, step=2)
    assert "\n" not in str(err.value)
    want = data_for(0, 1, t.layout.nbytes)
    assert same_snapshot(slots.load_verified(root, 0, 1), record_for(0, 1, t.layout, want), want)
    t.close()


def test_sigterm_keeps_shared_memory_for_the_next_manager_and_stop_unlinks(tmp_path, managers):
    root = tmp_path / "shm"
    first = managers(ManagerConfig(node_id=0, shm_root=root))[0]
    t = Trainer(root, 0, 1 << 20)
    sent = t.step(1)
    t.close()
    first.terminate()
    assert first.wait(30) == 0
    assert (root / "rank0" / "slot0.bin").exists()
    managers(ManagerConfig(node_id=0, shm_root=root))
    with ManagerClient.connect(root) as c:
        assert wait_for(lambda: c.held()["0"]["memory"] == [1], what="adopted step 1")
        assert c.restore(0)["step"] == 1
    assert same_snapshot(slots.load_verified(root, 0), *sent)
    control.stop(root)
    assert not (root / "rank0").exists() and not (root / "manager.sock").exists()
    with pytest.raises(BaftError, match="no manager running"):
        control.stop(root)


def test_a_stopped_manager_is_killed_before_another_takes_over_its_snapshots(tmp_path, managers):
    """A run's manager that stops answering (SIGSTOP) is replaced as one that died is, as the run ends; before, the
    stopped process outlived the run, said to have died, and once continued it served a root the new one had freed."""
    import signal

    from baft.manager.nodes import revive_all

    root = tmp_path / "shm"
    config = ManagerConfig(node_id=0, shm_root=root)
    first = managers(config)[0]
    t = Trainer(root, 0, 1 << 20)
    sent = t.step(1)
    t.close()
    first.send_signal(signal.SIGSTOP)
    try:
        assert revive_all([config]) == [(0, first.pid)]
        first.wait(10)  # gone (reaped by the kill's wait), not stopped
        with ManagerClient.connect(root) as c:
            assert wait_for(lambda: c.held()["0"]["memory"] == [1], what="adopted step 1")
        assert same_snapshot(slots.load_verified(root, 0), *sent)
        assert revive_all([config]) == []
    finally:
        first.send_signal(signal.SIGCONT)
        try:  # the manager revive_all started, which the fixture does not know
            control.stop(root)
        except BaftError:
            pass


def test_unreachable_manager_warns_once_and_training_goes_on(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ManagerClient.try_connect(tmp_path / "nobody") is None
        assert ManagerClient.try_connect(tmp_path / "nobody") is None
    assert len(caught) == 1 and "no snapshot manager reachable" in str(caught[0].message)


# ---- memory and directory checks before training -------------------------------------------------


def test_memory_limit_gives_three_slots_where_four_do_not_fit_and_is_refused_below(tmp_path, caplog):
    m = server.Manager(ManagerConfig(node_id=0, shm_root=tmp_path / "shm", memory_limit=10 << 20))
    m.open()
    try:
        assert len(m.hello(0, 2 << 20)["slots"]) == 4  # 4 slots x 2 MB fit
        with caplog.at_level("WARNING", logger="baft.manager"):
            # a node of two such ranks would not fit with four slots each (16 MB): this one takes three
            assert len(m.hello(0, 2 << 20, node_ranks=2)["slots"]) == 3
            assert len(m.hello(0, 3 << 20)["slots"]) == 3  # 3 slots x 3 MB fit, 4 do not
        assert [r.message for r in caplog.records] == 2 * [
            "rank 0: --memory-limit 10.0 MB allows 3 snapshot slots, not 4: each of its snapshots waits for the "
            "previous one's seal"]
        with pytest.raises(BaftError, match=r"rank 1: node 0 needs 15\.0 MB .*over --memory-limit 10\.0 MB") as err:
            m.hello(1, 2 << 20)
        assert "\n" not in str(err.value)
        assert not (tmp_path / "shm" / "rank1").exists()
    finally:
        m.request_stop(unlink=True)
        m.serve()


def test_without_a_memory_limit_the_slots_are_sized_to_what_the_host_has_free(tmp_path, caplog):
    """No limit set: four slots where they fit the host's free memory, three where only three do, and a
    snapshot three times the host's whole memory refused at hello (not an OOM kill as the slots fill)."""
    import psutil

    m = server.Manager(ManagerConfig(node_id=0, shm_root=tmp_path / "shm"))
    m.open()
    try:
        assert len(m.hello(0, 1 << 20)["slots"]) == 4
        room = slots.host_room(tmp_path / "shm", 1)
        # slot files are sparse until written: three of 2/7 of the room cost nothing here
        with caplog.at_level("WARNING", logger="baft.manager"):
            assert len(m.hello(1, room * 2 // 7)["slots"]) == 3
        assert "rank 1: the " in caplog.text and "this host has free for them allows 3 snapshot slots" in caplog.text
        with pytest.raises(BaftError, match=r"rank 2: node 0 needs .* this host has free for them") as err:
            m.hello(2, psutil.virtual_memory().total)
        assert "\n" not in str(err.value) and not (tmp_path / "shm" / "rank2").exists()
    finally:
        m.request_stop(unlink=True)
        m.serve()


def test_a_rank_without_a_manager_takes_the_slots_the_host_has_room_for(tmp_path, capsys):
    room = slots.host_room(tmp_path / "shm", 0)
    assert 0 < room <= shutil.disk_usage(tmp_path).free
    assert slots.slot_count(room // 4, room, "here") == 4
    assert slots.slot_count(room // 3, room, "here") == 3
    assert "baft: here: room for 3 snapshot slots" in capsys.readouterr().err
    with pytest.raises(BaftError, match=r"^here: 3 snapshot slots of .* GiB do not fit the .* GiB this host has free"):
        slots.slot_count(room // 3 + 1, room, "here")


def test_foreign_snapshot_directory_is_refused_at_hello(tmp_path):
    layout = layout_for(1 << 16)
    data = data_for(0, 9, layout.nbytes)
    other = record_for(0, 9, layout, data)
    other.run_id = "run-b"
    persist.write_snapshot(tmp_path / "ckpt", [(other, data)])
    m = server.Manager(ManagerConfig(node_id=0, shm_root=tmp_path / "shm", dir=tmp_path / "ckpt", persist_every=1))
    m.open()
    try:
        with pytest.raises(BaftError, match=r"step-00000009: snapshot from run 'run-b', this run is 'run-a'") as err:
            m.hello(0, layout.nbytes, run_id=RUN)
        assert "\n" not in str(err.value)
    finally:
        m.request_stop(unlink=True)
        m.serve()


@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_unreadable_newest_persisted_manifest_is_refused_at_hello(tmp_path, damage):
    """A step directory is renamed into place whole: one whose manifest is gone or garbled was changed since. Its
    step was skipped, and a relaunch went back to an older step, or started from step 0, without a word."""
    layout = layout_for(1 << 16)
    for step in (8, 9):
        data = data_for(0, step, layout.nbytes)
        persist.write_snapshot(tmp_path / "ckpt", [(record_for(0, step, layout, data), data)])
    manifest = tmp_path / "ckpt" / "step-00000009" / persist.MANIFEST
    manifest.unlink() if damage == "deleted" else manifest.write_text("{\"schema\": ")
    m = server.Manager(ManagerConfig(node_id=0, shm_root=tmp_path / "shm", dir=tmp_path / "ckpt"))
    m.open()
    try:
        with pytest.raises(BaftError, match=r"step-00000009/manifest.json: .*: the newest snapshot this node "
                                            r"persisted cannot be read; put the file back, or move") as err:
            m.hello(0, layout.nbytes, run_id=RUN)
        assert "\n" not in str(err.value)
    finally:
        m.request_stop(unlink=True)
        m.serve()


def test_a_damaged_rank_file_of_a_persisted_step_refuses_that_rank_alone(tmp_path, in_process):
    """Probe 20: a rank's restore from disk read every rank's file of the step, so one truncated file refused its
    intact peer too, naming that file (and a relaunch said "manager could not restore rank 0" of the intact rank)."""
    layout = layout_for(1 << 16)
    sent = {r: data_for(r, 9, layout.nbytes) for r in (0, 1)}
    persist.write_snapshot(tmp_path / "ckpt", [(record_for(r, 9, layout, d), d) for r, d in sent.items()])
    damaged = tmp_path / "ckpt" / "step-00000009" / "rank1.safetensors"
    with open(damaged, "r+b") as f:
        f.truncate(100)
    config = ManagerConfig(node_id=0, shm_root=tmp_path / "shm", dir=tmp_path / "ckpt")
    in_process(config)
    with ManagerClient.connect(config.shm_root) as c:
        reply = c.restore(0)
        with pytest.raises(BaftError, match=rf"^restore rank 1: .*; {damaged}: holds 100 bytes, the manifest says"):
            c.restore(1)
    assert (reply["source"], reply["step"]) == ("disk", 9)
    assert same_snapshot(slots.load_verified(config.shm_root, 0, 9), record_for(0, 9, layout, sent[0]), sent[0])


def test_unwritable_snapshot_directory_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    m = server.Manager(ManagerConfig(node_id=0, shm_root=tmp_path / "shm", dir=tmp_path / "file" / "ckpt",
                                      persist_every=1))
    with pytest.raises(BaftError, match=r"--dir .*file/ckpt: not writable \(Not a directory\)"):
        m.open()


# ---- persistence -------------------------------------------------------------------------------


def test_manager_killed_during_a_disk_write_keeps_the_previous_snapshot(tmp_path, managers):
    root, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    config = ManagerConfig(node_id=0, shm_root=root, dir=ckpt, persist_every=1, keep=3)
    proc = managers(config)[0]
    nbytes = 32 << 20
    trainers = [Trainer(root, r, nbytes) for r in (0, 1)]
    first = [t.step(1) for t in trainers]
    wait_for(lambda: control.status(root)["persist"]["last_step"] == 1, what="step 1 persisted")
    for t in trainers:
        t.step(2)
    partial = wait_for(lambda: list(ckpt.glob(".tmp-step-00000002-*")), timeout=60, what="the write of step 2",
                       poll=0.001)
    proc.kill()
    proc.wait()
    assert not (ckpt / "step-00000002").exists(), "step 2 visible after a kill mid-write: not atomic (or the write beat the kill)"
    assert partial[0].exists()
    assert [s.step for s in persist.list_steps(ckpt)] == [1]
    loaded = persist.read_snapshot(persist.list_steps(ckpt)[0].path)
    assert [r.step for r, _ in loaded] == [1, 1]
    for got, want in zip(loaded, first):
        assert same_snapshot(got, *want)
    # the next manager adopts the shared memory, writes step 2 whole, and clears the leftover
    managers(config)
    wait_for(lambda: control.status(root)["persist"]["last_step"] == 2, timeout=60, what="step 2 persisted")
    assert not partial[0].exists()
    assert [r.step for r, _ in persist.read_snapshot(persist.list_steps(ckpt)[0].path)] == [2, 2]
    for t in trainers:
        t.close()


def test_full_disk_is_reported_and_memory_snapshots_kept(tmp_path, managers):
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ckpt)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("cannot mount a small tmpfs here (needs root); persist.write_snapshot's own test covers it")
    try:
        root = tmp_path / "shm"
        managers(ManagerConfig(node_id=0, shm_root=root, dir=ckpt, persist_every=1))
        t = Trainer(root, 0, 1 << 20)
        sent = t.step(1)
        error = wait_for(lambda: control.status(root)["persist"]["error"], what="the failed write")
        assert "cannot persist step 1 (No space left on device)" in error and "\n" not in error
        assert "FAILED" in control.format_status(control.status(root))
        with ManagerClient.connect(root) as c:
            assert c.restore(0)["source"] == "memory"
        assert same_snapshot(slots.load_verified(root, 0), *sent)
        assert list(ckpt.iterdir()) == []
        t.close()
    finally:
        subprocess.run(["umount", str(ckpt)], check=False)


def test_persist_every_n_writes_multiples_of_n_and_the_newest_on_stop(tmp_path, in_process):
    root, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    m = in_process(ManagerConfig(node_id=0, shm_root=root, dir=ckpt, persist_every=3, keep=2))
    t = Trainer(root, 0, 1 << 18)
    for step in range(1, 9):
        t.step(step)
        wait_for(lambda: step in held(root)["0"]["memory"], what=f"step {step} verified")
    wait_for(lambda: m.status()["persist"]["last_step"] == 6, what="step 6 persisted")
    assert [s.step for s in persist.list_steps(ckpt)] == [6, 3]
    t.close()
    m.request_stop(unlink=True)
    wait_for(lambda: not (root / "rank0").exists(), what="stop")
    assert [s.step for s in persist.list_steps(ckpt)] == [8, 6]
    want = data_for(0, 8, t.layout.nbytes)
    newest = persist.read_snapshot(persist.list_steps(ckpt)[0].path)
    assert same_snapshot(newest[0], record_for(0, 8, t.layout, want), want)


def test_restarted_rank_is_accepted_after_persistence_with_any_replica_count(tmp_path, in_process):
    """A restart says hello again to a manager that has persisted this run: same pipeline depth, any
    number of data-parallel replicas and world size, is the same run; another depth is refused."""
    root, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    in_process(ManagerConfig(node_id=0, shm_root=root, dir=ckpt, persist_every=1))
    t = Trainer(root, 0, 1 << 18)
    t.step(1)
    wait_for(lambda: persist.list_steps(ckpt), what="step 1 persisted")
    for topology in ({"pipe": TOPO["pipe"], "data": 1}, {**TOPO, "data": 2, "world": 2 * TOPO["pipe"]}):
        t.client.hello(0, t.layout.nbytes, run_id=RUN, model="model-0", topology=topology)
    with pytest.raises(BaftError, match=f"taken with {TOPO['pipe']} pipeline stages, this run has 8"):
        t.client.hello(0, t.layout.nbytes, run_id=RUN, model="model-0", topology={**TOPO, "pipe": 8})
    t.close()


def test_persist_seconds_writes_the_newest_when_due(tmp_path, in_process):
    root, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    m = in_process(ManagerConfig(node_id=0, shm_root=root, dir=ckpt, persist_seconds=0.5))
    t = Trainer(root, 0, 1 << 18)
    t.step(1)
    t.step(2)
    wait_for(lambda: m.status()["persist"]["last_step"] == 2, what="step 2 persisted")
    t.close()
