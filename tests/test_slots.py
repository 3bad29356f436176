"""A rank's snapshot slots: which one a snapshot fills, with one snapshot still sealing or none."""

import pytest

from baft.snapshot.layout import CommitRecord, TensorEntry, plan_layout
from baft.snapshot.slots import SnapshotWriter, committed

LAYOUT = plan_layout([TensorEntry("w", "uint8", (64,), 64, "parameters")], chunk_bytes=32)


def commit(writer, step, slot):
    writer.commit(CommitRecord(step, 0, 0, LAYOUT, ["0"] * len(LAYOUT.chunks)), slot)


def newest(root):
    return [s.record.step for s in committed(root, 0)]


def test_with_four_slots_the_next_snapshot_is_copied_while_one_seals_and_the_two_newest_survive(tmp_path):
    writer = SnapshotWriter(tmp_path, 0, LAYOUT, 4)
    assert writer.in_flight == 2
    for step in (1, 2):
        writer.begin(step)
        commit(writer, step, writer.slot)
    writer.begin(3)
    sealing = (3, writer.slot)
    for step in range(4, 12):
        writer.begin(step)  # step - 1 is still sealing
        assert writer.slot != sealing[1]
        assert newest(tmp_path)[:2] == [step - 2, step - 3], "a crash now keeps the two newest committed"
        with pytest.raises(RuntimeError, match="2 snapshots in flight in 4 slots"):
            writer.begin(step + 1)
        commit(writer, *sealing)
        sealing = (step, writer.slot)
    writer.close()


def test_with_three_slots_a_snapshot_begins_only_once_the_previous_one_is_committed(tmp_path):
    writer = SnapshotWriter(tmp_path, 0, LAYOUT, 3)
    assert writer.in_flight == 1
    for step in range(1, 8):
        writer.begin(step)
        with pytest.raises(RuntimeError, match="1 snapshots in flight in 3 slots"):
            writer.begin(step + 1)
        assert newest(tmp_path)[:2] == [s for s in (step - 1, step - 2) if s > 0]
        commit(writer, step, writer.slot)
    writer.close()


def test_a_slot_begun_and_never_committed_is_ignored_by_a_reader(tmp_path):
    writer = SnapshotWriter(tmp_path, 0, LAYOUT, 4)
    writer.begin(1)
    writer.buffers[writer.slot][:] = 1
    commit(writer, 1, writer.slot)
    writer.begin(2)  # killed mid-copy: its old commit record is gone, no new one written
    assert newest(tmp_path) == [1]
    writer.close()


def test_fewer_than_three_slots_is_refused(tmp_path):
    with pytest.raises(ValueError, match="2 snapshot slots: baft uses 3 to 4"):
        SnapshotWriter(tmp_path, 0, LAYOUT, 2)
