"""The weights a resumed script changes before its first iteration are set back from the snapshot's slot, found by
checksums kept at the restore (no copy of the weights). tests/test_user_script.py proves it on a DeepSpeed pipeline
killed and relaunched (``user_train.py --perturb``); these check the set-back and its refusal on a module of their
own, snapshotted into a real slot."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from baft.errors import BaftError
from baft.recovery.restored_weights import RestoredWeights
from baft.snapshot.copy import Snapshot, StateSource
from baft.snapshot.slots import SnapshotWriter, map_verified


class Grid:
    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_pipe_parallel_world_size(self):
        return 1


def restored(tmp_path, held=lambda chunk: True):
    """An engine of a module with a buffer and Adam's state, snapshotted into a committed slot and restored from it:
    the engine, the slot's writer, and what the restore keeps."""
    module = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    eng = SimpleNamespace(module=module, optimizer=optimizer, grid=Grid(), global_rank=0, stage_id=0, world_size=1,
                          baft=SimpleNamespace(config=SimpleNamespace(run_id="")))
    source = StateSource(eng, 4096)  # the weight in four chunks
    writer = SnapshotWriter(tmp_path, 0, source.layout, 3)
    snapshot = Snapshot(source, writer, 1, {})
    snapshot.copy_first()
    snapshot.fence()
    snapshot.seal(threads=1)
    record, data = map_verified(tmp_path, 0)
    kept = [i for i, chunk in enumerate(record.layout.chunks) if held(chunk)]  # the rest, as if another node's
    record = replace(record, layout=replace(record.layout, chunks=tuple(record.layout.chunks[i] for i in kept)),
                     checksums=[record.checksums[i] for i in kept])
    return eng, writer, RestoredWeights(eng, {0: (record, data)})


def test_only_the_tensors_the_script_changed_are_set_back_bit_for_bit(tmp_path):
    eng, writer, weights = restored(tmp_path)
    linear, norm = eng.module
    kept = {name: t.clone() for name, t in eng.module.state_dict().items()}
    with torch.no_grad():
        linear.weight.add_(torch.randn_like(linear.weight) * 1e-3)  # the loop's noise before its call, again
        norm.running_mean[5] += 1
    assert weights.set_back(eng) == ["param/0.weight", "buffer/1.running_mean"]
    for name, t in eng.module.state_dict().items():
        assert torch.equal(t.view(-1).view(torch.uint8), kept[name].view(-1).view(torch.uint8)), name
    writer.close()


def test_a_slot_reused_since_the_restore_is_an_error_not_a_resume_on_the_scripts_weights(tmp_path):
    eng, writer, weights = restored(tmp_path)
    writer.buffers[0][:4096].fill_(7)  # the weight's first chunk, overwritten by a snapshot begun in the slot
    with torch.no_grad():
        eng.module[0].weight.add_(1)
    with pytest.raises(BaftError, match=r"^rank 0: the script changed the model's param/0\.weight after the restore, "
                                        r"before the first resumed iteration, and the snapshot of step 1 \(rank 0's "
                                        r"shared-memory slot\) no longer holds it: chunk 0 fails its checksum"):
        weights.set_back(eng)
    writer.close()


def test_a_tensor_part_of_which_a_replica_on_another_node_sent_is_set_back_from_a_host_copy(tmp_path):
    """Its snapshot is not all in this node's slots (a data-parallel replica on another node sent the rest at the
    restore): a host copy of that tensor alone is kept, and sets it back."""
    eng, writer, weights = restored(tmp_path, held=lambda chunk: chunk.tensor != "param/0.weight" or chunk.start)
    assert list(weights._copies) == ["param/0.weight"]
    kept = eng.module[0].weight.detach().clone()
    with torch.no_grad():
        eng.module[0].weight.add_(1)
    assert weights.set_back(eng) == ["param/0.weight"]
    assert torch.equal(eng.module[0].weight.view(torch.uint8), kept.view(torch.uint8))
    writer.close()
