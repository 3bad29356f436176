"""Persisted snapshots: atomic, verified on read, refused when foreign, corrupt, or unwritable."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from baft.errors import BaftError
from baft.manager import persist
from baft.snapshot.layout import CommitRecord, TensorEntry, checksum, plan_layout
from baft.snapshot.slots import SnapshotWriter, load_verified

TOPO = {"pipe": 2, "data": 1, "world": 2}


def load_latest(directory, ranks=None, expect=None, log=None):
    """The newest persisted snapshot whose files all verify, as a restore reads it: a corrupt or truncated one is
    reported through ``log`` (naming the file and chunk) and the next older one tried; one from another run, model
    or topology is refused."""
    for found in persist.list_steps(directory, log):
        persist.check_identity(found, expect)
        try:
            return persist.read_snapshot(found.path, ranks)
        except BaftError as err:
            if log:
                log(str(err))
    return None


def make_snapshot(rank, step, shard=0, num_shards=1, seed=None, run_id="run-a", scale=1, tensors=None):
    tensors = tensors or [
        TensorEntry("layer.weight", "float32", (64 * scale, 33), 64 * scale * 33 * 4, "parameters"),
        TensorEntry("layer.bias", "bfloat16", (31,), 62, "parameters"),
        TensorEntry("adam.exp_avg", "float32", (64 * scale, 33), 64 * scale * 33 * 4, "optimizer"),
        TensorEntry("step", "int64", (), 8, "other"),
    ]
    layout = plan_layout(tensors, chunk_bytes=4096, shard=shard, num_shards=num_shards)
    gen = torch.Generator().manual_seed(seed if seed is not None else step * 100 + rank)
    buffer = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    sums = [checksum(buffer[c.offset:c.offset + c.nbytes]) for c in layout.chunks]
    record = CommitRecord(step, rank, rank, layout, sums, items={"rng": [rank, step], "data": {"epoch": 0, "index": step}},
                          dp_rank=shard, topology=TOPO, run_id=run_id, model="m0", wall_time=1.0)
    return record, buffer


def node(step, **kw):
    return [make_snapshot(0, step, **kw), make_snapshot(1, step, **kw)]


def same(a, b):
    return [(r.to_json(), bytes(x)) for r, x in a] == [(r.to_json(), bytes(x)) for r, x in b]


def test_round_trip_is_the_store_form(tmp_path):
    snaps = node(5)
    path = persist.write_snapshot(tmp_path / "ckpt", snaps, node_id=0)
    assert path.name == "step-00000005"
    assert same(persist.read_snapshot(path), snaps)
    # the same (CommitRecord, bytes) form the shared-memory store returns
    writer = SnapshotWriter(tmp_path / "shm", 0, snaps[0][0].layout)
    writer.begin(5)[:] = torch.frombuffer(bytearray(snaps[0][1]), dtype=torch.uint8)
    writer.commit(snaps[0][0], writer.slot)
    from_shm = load_verified(tmp_path / "shm", 0)
    assert from_shm[0].to_json() == persist.read_snapshot(path, ranks=[0])[0][0].to_json()
    assert from_shm[1] == persist.read_snapshot(path, ranks=[0])[0][1]
    writer.close()


def test_plain_safetensors_user_sees_named_tensors(tmp_path):
    snaps = node(3)
    path = persist.write_snapshot(tmp_path, snaps)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["schema"] == "baft.snapshot" and manifest["version"] == 1 and manifest["step"] == 3
    tensors = safetensors.torch.load_file(path / manifest["ranks"][0]["file"])
    assert tensors["layer.weight"].shape == (64, 33) and tensors["layer.weight"].dtype == torch.float32
    assert tensors["layer.bias"].dtype == torch.bfloat16
    record, buffer = snaps[0]
    w = record.layout.chunks[0]
    assert tensors["layer.weight"].reshape(-1).view(torch.uint8)[:w.nbytes].numpy().tobytes() == buffer[:w.nbytes]
    assert manifest["ranks"][0]["record"]["items"]["data"] == {"epoch": 0, "index": 3}


def test_sharded_ranks_store_byte_ranges(tmp_path):
    big = [TensorEntry("big", "float32", (10000,), 40000, "parameters"), TensorEntry("b", "float16", (3,), 6, "other")]
    snaps = [make_snapshot(r, 1, shard=r, num_shards=2, tensors=big) for r in (0, 1)]
    path = persist.write_snapshot(tmp_path, snaps)
    assert same(persist.read_snapshot(path), snaps)
    first = safetensors.torch.load_file(path / "rank0.safetensors")
    second = safetensors.torch.load_file(path / "rank1.safetensors")
    assert set(first) == {"big#bytes=0:20480"} and set(second) == {"big#bytes=20480:40000", "b"}
    whole = torch.cat([first["big#bytes=0:20480"], second["big#bytes=20480:40000"]]).view(torch.float32)
    assert whole.numpy().tobytes() == snaps[0][1][:20480] + snaps[1][1][:40000 - 20480]


def test_retention_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        persist.write_snapshot(tmp_path, node(step), keep=2)
    assert [s.step for s in persist.list_steps(tmp_path)] == [5, 4]
    assert not list(tmp_path.glob(".tmp-*"))


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    persist.write_snapshot(tmp_path, node(2, seed=1))
    snaps = node(2, seed=2)
    persist.write_snapshot(tmp_path, snaps)
    assert same(load_latest(tmp_path), snaps)


@pytest.mark.parametrize("where", ["persisted", "truncated"])
def test_corrupt_newest_is_refused_naming_the_chunk_and_older_used(tmp_path, where):
    older = node(1)
    persist.write_snapshot(tmp_path, older)
    newest = persist.write_snapshot(tmp_path, node(2))
    file = newest / "rank1.safetensors"
    data = bytearray(file.read_bytes())
    if where == "persisted":
        header_len = int.from_bytes(data[:8], "little")
        begin, _ = json.loads(data[8:8 + header_len])["adam.exp_avg"]["data_offsets"]
        data[8 + header_len + begin + 5000] ^= 0x40  # in adam.exp_avg's second 4 KB chunk
        file.write_bytes(bytes(data))
        expect = r"rank1\.safetensors: snapshot of step 2 refused: chunk 5 \(adam\.exp_avg bytes 4096\.\.8192\)"
    else:
        file.write_bytes(bytes(data[:-10]))
        expect = r"rank1\.safetensors: holds \d+ bytes, the manifest says"
    logs = []
    loaded = load_latest(tmp_path, log=logs.append)
    assert same(loaded, older)
    assert len(logs) == 1 and "\n" not in logs[0]
    import re
    assert re.search(expect, logs[0]), logs[0]
    with pytest.raises(BaftError, match=expect):
        persist.read_snapshot(newest)


def test_foreign_directory_is_refused_in_one_line(tmp_path):
    persist.write_snapshot(tmp_path, node(4, run_id="run-b"))
    with pytest.raises(BaftError, match="from run 'run-b', this run is 'run-a'") as err:
        load_latest(tmp_path, expect=persist.Identity("run-a"))
    assert "\n" not in str(err.value)
    other = persist.Identity("run-b", "m0", {"pipe": 4, "data": 1})
    with pytest.raises(BaftError, match="taken with 2 pipeline stages, this run has 4"):
        load_latest(tmp_path, expect=other)
    # what a restarted trainer announces (no world size), and another replica count: both accepted
    for topology in ({"pipe": 2, "data": 1}, {"pipe": 2, "data": 2}):
        assert load_latest(tmp_path, expect=persist.Identity("run-b", "m0", topology)) is not None
    with pytest.raises(BaftError, match="from model 'm0', this model is 'm9'"):
        load_latest(tmp_path, expect=persist.Identity("run-b", "m9"))


def test_every_stage_of_a_node_finds_its_own_model_in_its_snapshot(tmp_path):
    """A node holds ranks of several stages, whose model fingerprints differ: each rank's is accepted,
    another model's still refused."""
    import dataclasses

    snaps = [(dataclasses.replace(record, model=f"stage{record.rank}"), buffer) for record, buffer in node(4)]
    persist.write_snapshot(tmp_path, snaps)
    for rank in (0, 1):
        expect = persist.Identity("run-a", f"stage{rank}", {"pipe": 2})
        assert same(load_latest(tmp_path, ranks=[rank], expect=expect), [snaps[rank]])
    with pytest.raises(BaftError, match="from model 'stage0', this model is 'stage7'"):
        load_latest(tmp_path, expect=persist.Identity("run-a", "stage7"))


def test_half_written_directory_is_never_taken(tmp_path):
    persist.write_snapshot(tmp_path, node(1))
    # what a writer killed mid-write leaves behind: a temp dir with partial files
    half = tmp_path / ".tmp-step-00000002-999999"
    half.mkdir()
    (half / "rank0.safetensors").write_bytes(b"\0" * 100)
    assert [s.step for s in persist.list_steps(tmp_path)] == [1]
    assert load_latest(tmp_path)[0][0].step == 1
    persist.write_snapshot(tmp_path, node(3), keep=5)
    assert not half.exists()


WRITER = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    from test_persist import node
    from baft.errors import BaftError
    from baft.manager import persist
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))
    try:
        persist.write_snapshot({dir!r}, node(2, scale=4), keep=1)
    except BaftError as err:
        print(err)
        sys.exit(3)
""")


def test_full_disk_is_one_line_and_keeps_the_previous_snapshot(tmp_path):
    older = node(1)
    persist.write_snapshot(tmp_path, older)
    code = WRITER.format(tests=str(Path(__file__).parent), dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    line = proc.stdout.strip()
    assert "\n" not in line and "cannot persist step 2" in line and str(tmp_path) in line
    assert "File too large" in line
    assert [s.step for s in persist.list_steps(tmp_path)] == [1]
    assert same(load_latest(tmp_path), older)
    assert not list(tmp_path.glob(".tmp-*"))


def _mount_tiny_tmpfs(path):
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("cannot mount a tmpfs here (needs root)")


def test_really_full_filesystem(tmp_path):
    mnt = tmp_path / "tiny"
    _mount_tiny_tmpfs(mnt)
    try:
        with pytest.raises(BaftError, match="No space left on device") as err:
            persist.write_snapshot(mnt, node(1, scale=4))
        assert "\n" not in str(err.value)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_unwritable_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(BaftError, match=r"file/ckpt: cannot persist step 1 \(Not a directory\)") as err:
        persist.write_snapshot(blocker / "ckpt", node(1))
    assert "\n" not in str(err.value)


def test_read_only_directory_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        ro.mkdir()
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True,
                           capture_output=True, timeout=10)
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("root cannot be denied by permissions and cannot mount here")
    else:
        ro.mkdir(mode=0o555)
    try:
        with pytest.raises(BaftError, match=r"cannot persist step 1 \((Read-only file system|Permission denied)\)"):
            persist.write_snapshot(ro, node(1))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)


def test_inspect_persisted_and_shared_memory_snapshots(tmp_path):
    from baft.recovery.inspect import SnapshotCorrupt, inspect

    snaps = node(6)
    step = persist.write_snapshot(tmp_path / "ckpt", snaps)
    text = inspect(step)
    assert "step 6 (persisted)" in text and "run 'run-a'" in text
    assert "layer.weight" in text and "[64, 33]" in text and "bfloat16" in text
    assert text.count("checksums: ok") == 2
    assert inspect(tmp_path / "ckpt") == text

    writer = SnapshotWriter(tmp_path / "shm", 0, snaps[0][0].layout)
    writer.begin(6)[:] = torch.frombuffer(bytearray(snaps[0][1]), dtype=torch.uint8)
    writer.commit(snaps[0][0], writer.slot)
    writer.close()
    shm_text = inspect(tmp_path / "shm" / "rank0")
    assert "slot 0: step 6" in shm_text and "checksums: ok" in shm_text
    assert "rank 0 (shared memory)" in inspect(tmp_path / "shm")

    with open(tmp_path / "shm" / "rank0" / "slot0.bin", "r+b") as f:
        f.seek(snaps[0][0].layout.chunks[1].offset)
        f.write(b"\xff\xfe")
    with pytest.raises(SnapshotCorrupt, match=r"rank0/slot0\.bin: snapshot of step 6 refused: chunk 1 \(layer\.weight bytes 4096\.\.8192\)") as err:
        inspect(tmp_path / "shm" / "rank0")
    assert "\n" not in str(err.value) and "layer.weight" in err.value.report

    file = step / "rank0.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"rank0\.safetensors: snapshot of step 6 refused: chunk \d+"):
        inspect(step)
    assert "FAILED" not in inspect(step, verify=False)

    with pytest.raises(BaftError, match="not a baft snapshot"):
        inspect(tmp_path)

