"""The committed snapshot of step k equals, bit for bit, a synchronous copy taken right after step k."""

import json

import pytest

from baft.pipeline.bubblemap import RankProfile
from baft.pipeline.timeline import Costs, analytic_bubble_map
from baft.snapshot import slots
from conftest import TINY, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("schedule,policy,executor", [("1f1b", "baft", "receive"), ("gpipe", "baft", "receive"),
                                                      ("1f1b", "baft", "stream"), ("1f1b", "thread-copy", "auto")])
def test_committed_snapshot_equals_synchronous_copy(tmp_path, shm_root, schedule, policy, executor):
    run_ranks(2, "snapshot_check.py", [*TINY, "--schedule", schedule, "--policy", policy, "--period", "1",
                                       "--executor", executor, "--iters", "6", "--shm-root", str(shm_root),
                                       "--out", str(tmp_path)])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["mismatches"] == []
        # the snapshot of step k is committed during iteration k+1, before its optimizer step
        assert result["checked"] == [1, 2, 3, 4, 5]
        assert result["commits"] == [1, 2, 3, 4, 5]
        assert result["live_records"] <= 2


@pytest.mark.slow
def test_snapshot_torn_by_a_kill_is_never_committed(tmp_path, shm_root):
    proc = run_ranks(2, "snapshot_check.py", [*TINY, "--policy", "baft", "--period", "1", "--iters", "8",
                                              "--shm-root", str(shm_root), "--out", str(tmp_path),
                                              "--kill-step", "4", "--kill-chunk", "3", "--kill-rank", "1"],
                     check=False)
    assert proc.returncode != 0
    root = shm_root / "default" / "node0"
    held = [s.record.step for s in slots.committed(root, 1)]
    assert 4 not in held
    assert held[0] == 3
    record, data = slots.load_verified(root, 1)
    assert record.step == 3 and record.verify(data) is None
    # the other rank was not killed mid-copy and may hold step 4: the restorable step is the common one
    assert 3 in [s.record.step for s in slots.committed(root, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("leftovers", ["fence", "start"])
def test_stream_executor_queues_each_bubbles_planned_chunks_there_and_the_rest_at_the_fence(tmp_path, shm_root,
                                                                                           leftovers):
    """The device executor's host logic, on CPU (its stream a thread): the plan decides where every byte goes;
    what it leaves is queued at the fence, or with ``leftovers="start"`` when the iteration starts."""
    bmap = analytic_bubble_map("1f1b", 2, 4, Costs(forward=0.01, backward=0.02, p2p=0.0, optimizer=0.005))
    # a copy bandwidth so low that the bubbles hold only part of each stage's ~0.8 MB of state
    bmap.ranks = [RankProfile(rank=s, stage=s, iteration_time=bmap.makespan, copy_bandwidth=1e7) for s in range(2)]
    bmap.save(tmp_path / "map.json")
    run_ranks(2, "snapshot_check.py", [*TINY, "--policy", "baft", "--period", "1", "--executor", "stream",
                                       "--leftovers", leftovers, "--bubble-map", str(tmp_path / "map.json"),
                                       "--iters", "4", "--shm-root", str(shm_root), "--out", str(tmp_path)])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["mismatches"] == [] and result["checked"] == [1, 2, 3]
        placement = result["placement"]
        assert placement and result["leftover_bytes"] > 0, "the map must leave part of the state for the fence"
        assert result["bubble_bytes"] == {index: sum(sizes) for index, sizes in placement.items()}
        assert result["flushed_bytes"] == (result["leftover_bytes"] if leftovers == "fence" else 0)


def test_copy_runs_merge_chunks_adjacent_in_one_tensor_and_in_the_slot():
    from baft.snapshot.copy import copy_runs
    from baft.snapshot.layout import Chunk

    chunks = [Chunk(0, "a", 0, 4, 0), Chunk(1, "a", 4, 4, 4), Chunk(2, "a", 8, 2, 8),  # tensor a, whole
              Chunk(3, "b", 0, 4, 10), Chunk(4, "b", 4, 4, 14)]
    assert copy_runs(chunks, [0, 1, 2, 3, 4]) == [Chunk(0, "a", 0, 10, 0), Chunk(3, "b", 0, 8, 10)]
    # a chunk left out (queued elsewhere) splits its tensor's run
    assert copy_runs(chunks, [0, 2, 3]) == [Chunk(0, "a", 0, 4, 0), Chunk(2, "a", 8, 2, 8), Chunk(3, "b", 0, 4, 10)]
    assert copy_runs(chunks, []) == []


def test_a_stream_checksums_the_long_runs_as_it_copies_them_and_the_seal_the_short_ones(tmp_path):
    """A GPU's checksums of long runs come from the source as it copies; a run under SEALER_SUMS_BELOW (a norm's
    weight, a bias) is summed from the slot by the seal, not by a few kernel launches on the trainer's thread.
    Either way every chunk's checksum is that of the bytes in the slot."""
    import torch

    from baft.snapshot.checksum import TorchSums, digest
    from baft.snapshot.copy import SEALER_SUMS_BELOW, Snapshot, StateSource
    from baft.snapshot.layout import TensorEntry, plan_layout
    from baft.snapshot.slots import SnapshotWriter
    from baft.snapshot.streams import ThreadCopyStream

    gen = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(3 * SEALER_SUMS_BELOW // 4 + 5, generator=gen),  # 3 chunks and a bit
               "bias": torch.randn(100, generator=gen)}
    chunk_bytes = SEALER_SUMS_BELOW
    source = StateSource.__new__(StateSource)  # a source without an engine: its tensors as byte views
    source.chunk_bytes, source._runs, source._run_views = chunk_bytes, {}, {}
    source.views = {name: t.view(torch.uint8) for name, t in tensors.items()}
    source.sums = TorchSums()
    source.layout = plan_layout([TensorEntry(n, "float32", tuple(t.shape), t.numel() * 4, "parameters")
                                 for n, t in tensors.items()], chunk_bytes)
    writer = SnapshotWriter(tmp_path, 0, source.layout, 3)
    stream = ThreadCopyStream()
    snapshot = Snapshot(source, writer, 1, {}, stream)
    assert snapshot.queue(range(len(source.layout.chunks))) == source.layout.nbytes
    stream.synchronize()
    weight = [c.index for c in source.layout.chunks if c.tensor == "weight"]
    assert [i for run in snapshot.sums for i in run.chunks] == weight == [0, 1, 2, 3]
    checksums = snapshot._gathered()
    assert [i for i, c in enumerate(checksums) if c is None] == [4]  # the bias, left for the seal
    snapshot._sum_the_rest(checksums, threads=1)
    slot = snapshot.buffer.numpy()
    assert checksums == [digest(slot[c.offset:c.offset + c.nbytes].tobytes()) for c in source.layout.chunks]
    assert bytes(slot[:source.layout.nbytes]) == b"".join(t.numpy().tobytes() for t in tensors.values())
    writer.close()
