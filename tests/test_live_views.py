"""A snapshot holds every tensor as it was at its step boundary: it views the tensors the engine holds as it
begins (a buffer or optimizer state tensor replaced, a parameter's ``.data`` rebound), and copies the module's
buffers, which a forward changes, before the iteration's first forward. The matrix cases with ``buffers`` prove
it on DeepSpeed pipelines (tests/test_matrix.py); these check the source and the copy on a module of their own."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

from baft.errors import BaftError
from baft.snapshot.copy import Snapshot, StateSource
from baft.snapshot.slots import SnapshotWriter
from baft.snapshot.streams import ThreadCopyStream


class Grid:
    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


def engine():
    """What a :class:`StateSource` reads of an engine: a module with buffers, and a torch optimizer with state."""
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    module.register_buffer("count", torch.zeros(()))
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return SimpleNamespace(module=module, optimizer=optimizer, grid=Grid())


def slot_bytes(snapshot, name):
    """The bytes of tensor ``name`` in the snapshot's slot."""
    chunk = next(c for c in snapshot.source.layout.chunks if c.tensor == name)
    return bytes(snapshot.buffer[chunk.offset:chunk.offset + chunk.nbytes].numpy())


def test_a_snapshot_views_the_tensors_the_engine_holds_as_it_begins():
    eng = engine()
    source = StateSource(eng, 1 << 20)
    module, optimizer = eng.module, eng.optimizer
    module.count = module.count + 1  # a buffer given anew
    module[0].weight.data = module[0].weight.data.clamp(-0.1, 0.1)  # a parameter's .data rebound
    state = optimizer.state[module[0].bias]
    state["exp_avg"] = state["exp_avg"] + 1  # an optimizer state tensor replaced
    source.refresh()
    for name, now in (("buffer/count", module.count), ("param/0.weight", module[0].weight),
                      ("optim/0.bias/exp_avg", state["exp_avg"])):
        assert source.views[name].data_ptr() == now.data_ptr(), name


def test_a_tensor_whose_shape_changed_is_an_error_naming_it():
    eng = engine()
    source = StateSource(eng, 1 << 20)
    eng.module.count = torch.zeros(2)
    with pytest.raises(BaftError, match=r"buffer/count is now float32 \[2\], was float32 \[\] when the first"):
        source.refresh()


def test_optimizer_state_made_after_the_first_snapshot_is_an_error_naming_it():
    """A parameter trained only since the first snapshot (unfrozen mid-run): its new state has no place in the layout."""
    eng = engine()
    bias = eng.module[0].bias
    state = eng.optimizer.state.pop(bias)  # frozen when the first snapshot laid the state out
    source = StateSource(eng, 1 << 20)
    eng.optimizer.state[bias] = state
    with pytest.raises(BaftError, match=r"^state tensor optim/0\.bias/exp_avg \(float32 \[4\]\) is new since the first "
                                        r"snapshot laid the state out \(the optimizer's state of a parameter trained"):
        source.refresh()


@pytest.mark.parametrize("stream", [None, ThreadCopyStream()], ids=["host", "stream"])
def test_the_buffers_are_copied_as_the_snapshot_begins_the_rest_left_for_the_bubbles(tmp_path, stream):
    eng = engine()
    source = StateSource(eng, 1 << 20)
    writer = SnapshotWriter(tmp_path, 0, source.layout, 3)
    snapshot = Snapshot(source, writer, 1, {}, stream)
    before = {name: bytes(view.numpy()) for name, view in source.views.items()}
    copied = snapshot.copy_first()
    buffers = [t.name for t in source.layout.tensors if t.kind == "other"]
    assert sorted(buffers) == ["buffer/1.num_batches_tracked", "buffer/1.running_mean", "buffer/1.running_var",
                               "buffer/count"]
    assert copied == sum(t.nbytes for t in source.layout.tensors if t.kind == "other")
    assert {source.layout.chunks[i].tensor for i in snapshot.pending}.isdisjoint(buffers)
    eng.module(torch.randn(3, 4))  # the iteration's first forward
    snapshot.fence()
    for name in buffers:
        assert slot_bytes(snapshot, name) == before[name], name
    writer.close()


def test_queued_copies_read_the_tensors_of_each_snapshots_begin_into_the_same_slot_again():
    """A chunk set's views are made once per slot, and anew once a tensor is rebound."""
    eng = engine()
    source = StateSource(eng, 1 << 20)
    buffer = torch.zeros(source.layout.nbytes, dtype=torch.uint8)
    writer = SimpleNamespace(slot=0, begin=lambda step: buffer)  # one slot, as the policy's reuse of it
    stream = ThreadCopyStream()
    weight = eng.module[0].weight
    for step in (1, 2, 3):
        source.refresh()
        snapshot = Snapshot(source, writer, step, {}, stream)
        snapshot.queue(list(snapshot.pending))
        stream.synchronize()
        assert slot_bytes(snapshot, "param/0.weight") == bytes(weight.detach().numpy()), step
        weight.data = weight.data + step  # rebound: the next snapshot copies from the new tensor


class Counted(nn.Module):
    """A module of this file's (the script's own): a count a forward keeps, a width set once, in plain attributes."""

    def __init__(self, rank):
        super().__init__()
        self.linear, self.calls, self.rank = nn.Linear(2, 2), 0, rank

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def test_the_plain_attributes_a_forward_changes_are_kept_and_a_survivor_is_taken_back(monkeypatch):
    """A snapshot keeps what changed since the process started (the count, a torch ``Dropout``'s ``p`` the loop set to
    0 once: probe 23), not what was set once (a rank: another rank's would not be its own; the Linear's width); a
    restore sets the kept ones and puts the rest back as they started."""
    from baft.script import attributes

    monkeypatch.setattr(attributes, "_AT_START", [])
    model = nn.Sequential(Counted(rank=3), nn.Dropout(0.1))
    attributes.hold_module_attributes(model)
    assert attributes.changed_module_attributes(model) is None
    for _ in range(3):
        model(torch.ones(1, 2))
    model[1].p = 0.0
    kept = attributes.changed_module_attributes(model)
    assert kept == {"0.calls": 3, "1.p": 0.0} and attributes.module_attributes(model)["0.linear.in_features"] == 2
    model[0].rank, model[0].calls, model[1].p = 5, 9, 0.5  # a survivor's, changed since: taken back to the snapshot's
    attributes.restore_module_attributes(model, kept)
    assert (model[0].calls, model[0].rank, model[1].p) == (3, 3, 0.0)


def test_the_models_submodules_are_walked_again_only_where_they_changed(monkeypatch):
    """Every snapshot reads the submodules' attributes: the walk (``named_modules``, the classes' MROs: 2-3 ms at 480
    modules) is kept while no submodule was replaced, added or given another class, each of which a snapshot sees."""
    from baft.script import attributes

    for held in ("_AT_START", "_CLASSES_AT_START", "_CLASS_VALUES_AT_START", "_LAST_WALK"):
        monkeypatch.setattr(attributes, held, [])
    model = nn.Sequential(Counted(rank=0), nn.Dropout(0.1))
    attributes.hold_module_attributes(model)
    walk = attributes._walked(model)
    assert attributes._walked(model) is walk and attributes.replaced_modules(model) is None
    model[1] = nn.Identity()
    assert attributes.replaced_modules(model) == {"1": "torch.nn.modules.linear.Identity"}
    model[1].extra = nn.ReLU(inplace=True)  # a child of a module that held none
    assert attributes.module_attributes(model)["1.extra.inplace"] is True

    class Other(Counted):
        pass

    model[0].__class__ = Other
    assert attributes.replaced_modules(model)["0"].endswith(".Other")
    assert attributes._walked(nn.Sequential()) is not attributes._walked(model)  # another model


class Running(nn.Module):
    """A running mean a forward keeps in a plain tensor attribute (not a buffer: probe 26), a list it appends to, a
    table too large to keep in a plain attribute, and the same table registered as a buffer, as the size line says."""

    def __init__(self):
        super().__init__()
        self.linear, self.running, self.seen, self.table = nn.Linear(2, 2), torch.zeros(2), [], torch.zeros(1 << 17)
        self.register_buffer("kept", torch.zeros(1 << 17), persistent=False)

    def forward(self, x):
        self.running = 0.9 * self.running + 0.1 * x.mean(0)
        self.seen.append(len(self.seen))
        self.table.add_(1)
        self.kept.add_(1)
        return self.linear(x)


def test_tensor_and_list_attributes_a_forward_changes_are_kept_and_one_too_large_is_said_once(monkeypatch, capsys):
    """Probe 26: a running mean in ``self.running = 0.9 * self.running + ...`` and a list appended to were in no
    snapshot, resumed from their first values, silently. Kept where they changed (a tensor by its identity and version,
    on CPU; the list by a copy taken at start), set back into the tensor the module holds; a changed tensor over
    the size limit is said once, naming it and the buffer that would be kept (the snapshot's: ``persistent=False``)."""
    from baft.script import attributes, held
    from baft.snapshot.state import _module_tensors

    monkeypatch.setattr(attributes, "_AT_START", [])
    monkeypatch.setattr(held, "_SAID", set())
    model = nn.Sequential(Running())
    attributes.hold_module_attributes(model)
    assert attributes.changed_module_attributes(model) is None
    for _ in range(2):
        model(torch.ones(1, 2))
    kept = attributes.changed_module_attributes(model, rank=1)
    assert set(kept) == {"0.running", "0.seen"} and kept["0.seen"] == [0, 1], kept
    assert torch.equal(kept["0.running"], torch.full((2,), 0.19)) and kept["0.running"] is not model[0].running
    assert attributes.changed_module_attributes(model, rank=1).keys() == kept.keys()
    said = capsys.readouterr().out
    assert said.count("baft: rank 1: the model's 0.table (a plain attribute, not a buffer) is a tensor of 0.5 MiB "
                      "(over 256 KiB) that changed since start: no snapshot keeps one so large") == 1, said
    assert said.count('self.register_buffer("table", tensor, persistent=False)') == 1, said
    assert "buffer/0.kept" in [key for key, *_ in _module_tensors(model, 0, 1)]
    model(torch.ones(1, 2))  # a survivor's, moved past the snapshot's step: taken back, into the tensor it holds
    now = model[0].running
    attributes.restore_module_attributes(model, kept)
    assert model[0].running is now and torch.equal(now, kept["0.running"]) and model[0].seen == [0, 1]
    attributes.restore_module_attributes(model, None)  # a snapshot from before the forwards: as they started
    assert torch.equal(model[0].running, torch.zeros(2)) and model[0].seen == []


def test_a_global_tensor_of_the_script_the_loop_updates_is_kept(monkeypatch, capsys):
    """Probe 26: class weights the loss reads from a global of the script's (``W = torch.ones(4)``), which the loop
    updates in place (``W.mul_(0.9).add_(...)``) or rebinds (``W = 0.9 * W + ...``), were in no snapshot. Kept where
    changed, set by a restore into the tensor the global holds; the others back as they started; a parameter the
    script also holds in a global is the snapshot's, not looked at; one too large is said once."""
    import sys
    import types

    from baft.script import held, main_globals

    model = nn.Linear(2, 2)
    main = types.ModuleType("__main__")
    main.W, main.V, main.P, main.BIG = torch.ones(4), torch.zeros(2), model.weight, torch.zeros(1 << 17)
    main.BIAS = model.bias.data  # the model's state, under another name
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(main_globals, "_AT_START", [])
    monkeypatch.setattr(held, "_SAID", set())
    main_globals.hold_globals(model)
    assert set(main_globals._AT_START[0]) == {"W", "V", "BIG"} and main_globals.changed_globals() is None
    w = main.W
    main.W.mul_(0.5)
    main.V = 0.9 * main.V + 1
    main.BIG.add_(1)
    with torch.no_grad():
        model.weight.add_(1)
    kept = main_globals.changed_globals(rank=0)
    assert set(kept) == {"W", "V"} and torch.equal(kept["W"], torch.full((4,), 0.5)), kept
    assert capsys.readouterr().out.count("baft: rank 0: the script's global BIG is a tensor of 0.5 MiB") == 1
    main.W, main.V = torch.ones(4), torch.zeros(2)  # a new process's, as its script makes them
    made = main.W
    main_globals.restore_globals(kept)
    assert main.W is made and torch.equal(main.W, kept["W"]) and torch.equal(main.V, kept["V"])
    main_globals.restore_globals(None)  # a snapshot from before the updates: as they started
    assert torch.equal(main.W, torch.ones(4)) and torch.equal(main.V, torch.zeros(2)) and w is not main.W


class WarmedLoss:
    """A loss of the script's that is a plain callable class, not a module, counting its calls (a warm-up)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y) * min(1.0, self.calls / 40)


def test_the_plain_values_of_a_loss_that_is_no_module_are_kept(monkeypatch):
    """Probe 26's g11: a PipelineModule's ``loss_fn`` of a plain callable class (an attribute, not a submodule) counting
    its calls was in no snapshot, and a resumed run warmed its loss up again, silently."""
    from baft.script import attributes

    monkeypatch.setattr(attributes, "_AT_START", [])
    model = nn.Sequential(nn.Linear(2, 1))
    model.loss_fn = WarmedLoss()
    attributes.hold_module_attributes(model)
    for _ in range(3):
        model.loss_fn(model(torch.ones(1, 2)), torch.zeros(1, 1))
    kept = attributes.changed_module_attributes(model)
    assert kept == {"loss_fn.calls": 3}, kept
    model.loss_fn.calls = 7  # a survivor's, moved on since: taken back to the snapshot's
    attributes.restore_module_attributes(model, kept)
    assert model.loss_fn.calls == 3
    attributes.restore_module_attributes(model, None)  # a snapshot from before its first call: as it started
    assert model.loss_fn.calls == 0


class CountingHook:
    """A forward hook object of the script's that counts its calls; torch alone holds it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1

    def pre(self, module, inputs):
        self.calls += 10


class GradCount:
    """A gradient hook object of the script's that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, grad):
        self.calls += 1


def test_the_plain_values_of_a_hook_object_only_torch_holds_are_kept(monkeypatch):
    """Probe 28's K1: a forward hook object (or one whose method is the hook) registered on a layer, or a gradient
    hook's on a parameter, counting its calls, which no variable of the script's holds, and K5: a loss given as a
    method of a plain object of the script's (``loss_fn=crit.loss``): in no snapshot, a resumed run counted again from
    0, silently."""
    from baft.script import attributes

    monkeypatch.setattr(attributes, "_AT_START", [])
    monkeypatch.setattr(attributes, "_LAST_WALK", [])
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[1].register_forward_hook(CountingHook())
    model[1].register_forward_pre_hook(CountingHook().pre)
    attributes.hold_module_attributes(model)
    for _ in range(3):
        model(torch.ones(1, 2))
    kept = attributes.changed_module_attributes(model)
    assert kept == {"1[_forward_hooks/0].calls": 3, "1[_forward_pre_hooks/0].calls": 30}, kept
    hooks = [getattr(h, "__self__", h) for kind in ("_forward_hooks", "_forward_pre_hooks")
             for h in getattr(model[1], kind).values()]
    for hook in hooks:  # a survivor's, moved on since: taken back to the snapshot's
        hook.calls = 77
    attributes.restore_module_attributes(model, kept)
    assert [hook.calls for hook in hooks] == [3, 30]
    attributes.restore_module_attributes(model, None)  # a snapshot from before their first call: as they started
    assert [hook.calls for hook in hooks] == [0, 0]
    # a gradient hook object on a parameter (K1's update), and a loss given as a method of a plain object (K5)
    monkeypatch.setattr(attributes, "_AT_START", [])
    monkeypatch.setattr(attributes, "_LAST_WALK", [])
    grads, crit = GradCount(), CountingHook()
    model = nn.Sequential(nn.Linear(2, 1))
    model[0].weight.register_hook(lambda g: None)  # a function: no object of the script's
    model[0].bias.register_hook(grads)
    model.loss_fn = crit.pre
    attributes.hold_module_attributes(model)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        model.loss_fn(None, None)
    kept = attributes.changed_module_attributes(model)
    assert kept == {"0[bias/0].calls": 2, "loss_fn.calls": 20}, kept
    grads.calls = crit.calls = 77
    attributes.restore_module_attributes(model, kept)
    assert (grads.calls, crit.calls) == (2, 20)


class Lazy(nn.Module):
    """A layer of the script's that makes its noise generator as it first runs forward (torch's, or numpy's)."""

    def __init__(self, kind=torch.Generator):
        super().__init__()
        self.gen, self.kind = None, kind

    def forward(self, x):
        if self.gen is None:
            self.gen = self.kind().manual_seed(1) if self.kind is torch.Generator else np.random.default_rng(1)
        noise = torch.randn(x.shape, generator=self.gen) if self.kind is torch.Generator else \
            torch.from_numpy(self.gen.standard_normal(x.shape)).float()
        return x + noise


def test_a_generator_a_layer_makes_as_it_first_runs_forward_is_kept_as_one_made_before(monkeypatch, capfd):
    """Probe 26's g12: no snapshot held it (made after baft.initialize noted the model's generators), and a resumed
    run drew from one made again, silently (relaunched, or in place: a restore set the attribute back to None). A
    torch generator is held as it appears, and a restore where the layer has none yet makes it, as the snapshot had
    it; a numpy one is said once."""
    from baft.script import attributes, rng

    monkeypatch.setattr(rng, "_HELD", [])
    monkeypatch.setattr(rng, "_LATER", [])
    for held in ("_AT_START", "_CLASSES_AT_START", "_CLASS_VALUES_AT_START", "_LAST_WALK"):
        monkeypatch.setattr(attributes, held, [])
    model, x = nn.Sequential(nn.Identity(), Lazy()), torch.zeros(1, 2)
    rng.hold_module_generators(model)
    attributes.hold_module_attributes(model)
    model(x)
    states = rng.rng_states()
    kept = attributes.changed_module_attributes(model)
    expected = model(x)
    resumed = nn.Sequential(nn.Identity(), Lazy())  # a new process's, before its first forward
    monkeypatch.setattr(rng, "_HELD", [])
    monkeypatch.setattr(attributes, "_AT_START", [])
    rng.hold_module_generators(resumed)
    attributes.hold_module_attributes(resumed)
    attributes.restore_module_attributes(resumed, kept)
    rng.set_rng_states(states)
    attributes.restore_module_attributes(resumed, kept)  # again as the first resumed iteration starts: kept
    assert torch.equal(resumed(x), expected), "the noise the uninterrupted run drew"
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(rng, "_HELD", [])
    numpy_made = nn.Sequential(Lazy(kind=np.random.Generator))
    rng.hold_module_generators(numpy_made)
    for _ in range(2):
        numpy_made(torch.ones(1, 2))
        rng.rng_states()
    err = capfd.readouterr().err
    assert err.count("baft:") == 1 and "baft: rank 0: the model's 0.gen is a generator its module made after " \
                                       "baft.initialize" in err, err


class Scaled(Counted):
    """A class attribute the script's loop may change for every instance at once (``Scaled.factor = 0.5``)."""

    factor = 1.0


def test_a_class_attribute_the_loop_changes_once_is_kept(monkeypatch):
    """Probe 23 left it: ``Block.scale = 0.5`` at a step, resumed after it, trained with the first value, silently.
    Kept where it changed (its class and its base of the script's own), set back as it started where not."""
    from baft.script import attributes

    for held in ("_AT_START", "_CLASSES_AT_START", "_CLASS_VALUES_AT_START"):
        monkeypatch.setattr(attributes, held, [])
    monkeypatch.setattr(Scaled, "factor", 1.0)
    model = nn.Sequential(Scaled(rank=0), nn.Linear(2, 2))
    attributes.hold_module_attributes(model)
    assert attributes.changed_module_attributes(model) is None
    Scaled.factor = 0.5
    kept = attributes.changed_module_attributes(model)
    assert kept == {f"{__name__}.Scaled:factor": 0.5}, kept
    Scaled.factor = 1.0  # a new process's, as its script makes it
    attributes.restore_module_attributes(model, kept)
    assert Scaled.factor == 0.5
    attributes.restore_module_attributes(model, None)  # a snapshot from before the change: as it started
    assert Scaled.factor == 1.0


def test_a_submodule_the_script_replaced_is_said_where_a_restore_would_train_with_another(monkeypatch):
    """Probe 23: a loss the loop swaps for another at a step (``engine.module.loss_fn = nn.SmoothL1Loss()``), resumed
    after it, trained with the one the script makes, silently. The snapshot names the replaced submodules, and where
    the model's are not as it had them once the loop's code before the first resumed call ran, the run stops in one
    line; a loop that replaces it before each call does so again, and goes on."""
    from baft.script import attributes

    monkeypatch.setattr(attributes, "_AT_START", [])
    monkeypatch.setattr(attributes, "_CLASSES_AT_START", [])
    model = nn.Sequential(nn.Linear(2, 2), nn.MSELoss())
    attributes.hold_module_attributes(model)
    assert attributes.replaced_modules(model) is None
    model[1] = nn.SmoothL1Loss()
    replaced = attributes.replaced_modules(model)
    assert replaced == {"1": "torch.nn.modules.loss.SmoothL1Loss"}
    assert attributes.not_as_replaced(model, replaced) is None  # the loop replaced it again
    model[1] = nn.MSELoss()  # as a resumed process makes it
    why = attributes.not_as_replaced(model, replaced)
    assert why.startswith("the model's 1 here is MSELoss, where at the restored step it was SmoothL1Loss"), why
    assert attributes.not_as_replaced(model, None) is None  # a snapshot from before the swap: as it started

