"""Partitioned optimizer state in the snapshot layout, and the optimizer registry's refusal."""

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from baft.errors import BaftError
from baft.snapshot.layout import TensorEntry, plan_layout
from baft.snapshot.optimizers import adapter_for
from baft.snapshot.optimizers import optimizer_adapter
from conftest import run_ranks


def entries(replicated_bytes, partition_bytes, replicas):
    out = [TensorEntry("param/w", "float32", (replicated_bytes // 4,), replicated_bytes, "parameters")]
    for d in range(replicas):
        out.append(TensorEntry(f"master/group0/dp{d}", "float32", (partition_bytes // 4,), partition_bytes,
                               "optimizer", owner=d))
    return out


@given(st.integers(1, 64).map(lambda k: k * 4096), st.integers(1, 32).map(lambda k: k * 4096), st.integers(1, 4))
def test_each_replica_keeps_its_own_partition_and_a_share_of_the_replicated_state(replicated, partition, replicas):
    tensors = entries(replicated, partition, replicas)
    shards = [plan_layout(tensors, chunk_bytes=8192, shard=d, num_shards=replicas) for d in range(replicas)]
    for d, layout in enumerate(shards):
        owned = {c.tensor for c in layout.chunks if c.tensor.startswith("master/")}
        assert owned == {f"master/group0/dp{d}"}, "a replica copies only the partition it holds"
        assert sum(c.nbytes for c in layout.chunks if c.tensor == f"master/group0/dp{d}") == partition
    indices = sorted(c.index for layout in shards for c in layout.chunks)
    assert indices == list(range(shards[0].total_chunks)), "together the shards cover every chunk once"
    assert len({layout.fingerprint for layout in shards}) == 1, "every replica names the stage's state alike"


def test_an_owner_outside_the_replicas_is_refused():
    with pytest.raises(ValueError, match="owned by replica 2, but there are 2 shards"):
        plan_layout(entries(4096, 4096, 3), shard=0, num_shards=2)


def test_an_optimizer_without_adapter_is_refused_in_one_line():
    """The registry lookup alone: an optimizer that is neither torch's nor a known DeepSpeed wrapper."""
    class OnebitLamb:
        pass

    with pytest.raises(BaftError, match=r"optimizer .*OnebitLamb: baft cannot snapshot its state") as err:
        adapter_for(SimpleNamespace(optimizer=OnebitLamb()))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_fp16_wrappers_snapshot_what_they_save_and_resume_bit_for_bit(tmp_path):
    """FP16_Optimizer and FP16_UnfusedOptimizer run on CPU outside a pipeline engine (DeepSpeed's config
    refuses fp16 on CPU; the engine-level kill test of fp16 needs a GPU)."""
    run_ranks(1, "fp16_wrappers.py", ["--out", str(tmp_path / "fp16.json")])
    results = json.loads((tmp_path / "fp16.json").read_text())
    assert {name: r["adapter"] for name, r in results.items()} == {
        "FP16_Optimizer": "FP16Masters", "FP16_UnfusedOptimizer": "FP16UnfusedMasters"}
    for name, r in results.items():
        assert r["missing"] == [], f"{name}: the snapshot lacks {r['missing']} of what DeepSpeed saves"
        assert r["scale"] < 2 ** 24, f"{name}: the loss scale never dropped, so its restore went untested"
        assert r["continues_alike"], f"{name}: the restored wrapper diverged"
        assert any(n.startswith("master/") for n in r["names"]), "the fp32 masters are in the snapshot"


def test_the_scripts_schedulers_are_kept_when_made_later_and_two_of_a_kind_refused_as_first_found(monkeypatch):
    """One of each kind is kept (a subclass of DeepSpeed's too), made before the first snapshot or after it (probe 8: a plateau scheduler made once a
    warm-up ended was never kept, and a resumed run's learning rate differed silently); a restore cannot tell two of
    one class apart (a warm-up and a decay LambdaLR trained unwarned and died at their first resume)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    from baft.script import schedulers

    def engine_with(*kinds):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        made = [kind(optimizer) for kind in kinds]
        return SimpleNamespace(optimizer=optimizer), made

    def lam(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def step(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)

    engine, made = engine_with(lam, step)
    assert sorted(map(id, schedulers.script_schedulers(engine))) == sorted(map(id, made))

    class Warmup(WarmupLR):  # a script's own subclass of DeepSpeed's (it was found by DeepSpeed's module name alone)
        pass

    subclassed, its_made = engine_with(lam, Warmup)
    assert sorted(map(id, schedulers.script_schedulers(subclassed))) == sorted(map(id, its_made))
    # one made after the first snapshot (a plateau scheduler once a warm-up ends) is found at the next, and no
    # snapshot walks the live objects again while nothing more refers to the optimizer
    walks = []
    monkeypatch.setattr(schedulers, "_look", lambda engine, look=schedulers._look: walks.append(1) or look(engine))
    for _ in range(3):
        assert len(schedulers.script_schedulers(engine)) == 2
    late = torch.optim.lr_scheduler.ReduceLROnPlateau(engine.optimizer)
    assert late in schedulers.script_schedulers(engine) and len(walks) == 1, walks
    # one the script replaced by another (a warm-up's scheduler by a decay's as it ends: the first freed, as many
    # references to the optimizer as at the last walk) is found at the next (probe 11: the new one was never kept)
    made[1] = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=4)
    assert sorted(map(id, schedulers.script_schedulers(engine))) == sorted(map(id, [*made, late])), walks
    engine, made = engine_with(lam, lam)
    with pytest.raises(BaftError, match=r"^the script has more than one learning-rate scheduler of a kind on the "
                                        r"engine's optimizer \(\{'LambdaLR': 2\}\).*\(lr_scheduler=\)$"):
        schedulers.script_schedulers(engine)



class CountingSGD(torch.optim.SGD):
    """An optimizer of a script's own that counts its steps in ``self.state`` under a key that is no parameter
    (torch's ``state_dict`` keeps it), and decays its learning rate by that count."""

    def step(self, closure=None):
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        for group in self.param_groups:
            group["lr"] = 0.1 / self.state["global_step"] ** 0.5
        return super().step(closure)


def _counting_engine(steps):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    engine = SimpleNamespace(module=module, optimizer=CountingSGD(module.parameters(), lr=0.1, momentum=0.9))
    for _ in range(steps):
        module(torch.ones(1, 3)).sum().backward()
        engine.optimizer.step()
    return engine


def test_what_an_optimizer_keeps_in_its_state_under_a_key_that_is_no_parameter_is_restored():
    """Probe 17: a step count the script's optimizer kept in ``self.state["global_step"]`` was in no snapshot; a
    resumed run counted from 0 again and decayed its learning rate from the start, silently."""
    from baft.snapshot.state import _torch_blob, _torch_unblob

    saved = _torch_blob(adapter_for(_counting_engine(3)).scalars())
    fresh = _counting_engine(0)
    adapter_for(fresh).load_scalars(_torch_unblob(saved))
    assert fresh.optimizer.state["global_step"] == 3
    survivor = _counting_engine(5)  # one that went on past the snapshot's step goes back to it
    adapter_for(survivor).load_scalars(_torch_unblob(_torch_blob(adapter_for(_counting_engine(0)).scalars())))
    assert "global_step" not in survivor.optimizer.state



def _biases(module):
    return [p for name, p in module.named_parameters() if name.endswith("bias")]


def _grouped_engine(steps, add_group=True):
    """A module whose optimizer the script made over its weights, then gave its biases in a group of their own."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    weights = [p for name, p in module.named_parameters() if name.endswith("weight")]
    engine = SimpleNamespace(module=module, optimizer=torch.optim.SGD(weights, lr=0.1, momentum=0.9))
    optimizer_adapter(engine)  # made at baft.initialize, before the script adds the group
    if add_group:
        engine.optimizer.add_param_group({"params": _biases(module), "lr": 0.01, "momentum": 0.5})
    for _ in range(steps):
        module(torch.ones(1, 3)).sum().backward()
        engine.optimizer.step()
    return engine


def test_a_param_group_the_script_adds_after_initialize_is_snapshotted_and_added_again_by_a_restore():
    """Probe 17: the state of a group added with ``add_param_group`` after ``baft.initialize`` was in no snapshot (its
    momentum started again from zero), and a process resumed past the step that added it trained without it (the
    biases never again), both silently. Now its state is named as any group's; a restore, which comes before the
    script adds it, gives its parameters their state, and adds the group where the script does not again."""
    from baft.snapshot.state import _torch_blob, _torch_unblob

    trained = _grouped_engine(3)
    adapter = optimizer_adapter(trained)
    names = [name for name, _ in adapter.tensors()]
    assert names == [f"optim/{n}/momentum_buffer" for n in ("0.weight", "1.weight", "0.bias", "1.bias")], names
    groups = _torch_unblob(_torch_blob([{k: v for k, v in g.items() if k != "params"}
                                        for g in trained.optimizer.param_groups]))
    added = adapter.added_groups()
    assert added == {"first": 1, "names": [["0.bias", "1.bias"]]}
    for script_adds_it_again in (True, False):  # after baft.initialize, or once, at a step before the restored one
        resumed = _grouped_engine(0, add_group=False)
        restorer = optimizer_adapter(resumed)
        restorer.create_state(adapter.entries())
        assert [name for name, _ in restorer.tensors()] == names  # what a restore's layout fits
        for (_, to), (_, value) in zip(restorer.tensors(), adapter.tensors()):
            to.copy_(value)
        if script_adds_it_again:
            resumed.optimizer.add_param_group({"params": _biases(resumed.module), "lr": 0.01, "momentum": 0.5})
        restorer.add_groups(added, groups)  # as the first resumed iteration starts
        assert list(map(id, resumed.optimizer.param_groups[1]["params"])) == list(map(id, _biases(resumed.module)))
        assert [g["lr"] for g in resumed.optimizer.param_groups] == [0.1, 0.01]
        assert torch.equal(resumed.optimizer.state_dict()["state"][3]["momentum_buffer"],
                           trained.optimizer.state_dict()["state"][3]["momentum_buffer"])


def test_a_param_group_added_mid_run_is_said_to_get_its_state_at_its_first_step_not_never_given_a_gradient():
    """Probe 21: after ``add_param_group`` mid-run, the step before the group's first was said to hold parameters
    "never given a gradient", to be frozen; its parameters have no state yet as the optimizer makes it at their
    first step."""
    from baft.snapshot.state import optimizer_state_missing

    engine = _grouped_engine(2, add_group=False)
    engine.global_steps = 2
    assert optimizer_state_missing(engine) is None
    engine.optimizer.add_param_group({"params": _biases(engine.module), "lr": 0.01})
    said = optimizer_state_missing(engine)
    assert said == ("2 of 4 trainable parameters, in the param groups the script added since it made the optimizer "
                    "(add_param_group), have no optimizer state yet after 2 steps: the optimizer makes it at their "
                    "first step"), said
    engine.module[1].weight.grad = None
    engine.optimizer.state.pop(engine.module[1].weight)  # one of the first groups too: as before
    assert "never given a gradient?" in optimizer_state_missing(engine)


def test_a_scheduler_of_a_class_neither_torchs_nor_deepspeeds_is_kept_and_a_trainer_or_wrapper_is_not():
    """Probe 17: a scheduler class of the script's own (a plain class with step and state_dict, as timm's Scheduler
    is) that its loop stepped was in no snapshot; a resumed run started its count again, silently. A trainer of the
    script's that holds the optimizer and a module, or an optimizer wrapping it (Lookahead), is no scheduler."""
    from baft.script import schedulers

    class Warmup:
        def __init__(self, optimizer):
            self.optimizer, self.t = optimizer, 0

        def step(self):
            self.t += 1

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, state):
            self.t = state["t"]

    class Trainer(Warmup):
        def __init__(self, optimizer, model):
            super().__init__(optimizer)
            self.model = model

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer, self.param_groups, self.state, self.defaults = optimizer, optimizer.param_groups, {}, {}

    module = torch.nn.Linear(2, 1)
    engine = SimpleNamespace(optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    made = [Warmup(engine.optimizer), Trainer(engine.optimizer, module), Lookahead(engine.optimizer)]
    made[0].step()
    assert schedulers.script_schedulers(engine) == [made[0]]
    assert schedulers.capture(engine) == [("test_a_scheduler_of_a_class_neither_torchs_nor_deepspeeds_is_kept_and_a_"
                                           "trainer_or_wrapper_is_not.<locals>.Warmup", {"t": 1})]
    made[0].t = 5
    assert schedulers.restore(engine, [(type(made[0]).__qualname__, {"t": 1})]) is None and made[0].t == 1

    class HeldAsOpt(Warmup):  # probe 26's g15: held under another name, it was not found (its count began again)
        def __init__(self, optimizer):
            super().__init__(None)
            del self.optimizer
            self.opt = optimizer

    engine = SimpleNamespace(optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    held = HeldAsOpt(engine.optimizer)
    assert schedulers.script_schedulers(engine) == [held]


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "OneCycle"])
def test_the_settings_a_loop_changes_on_deepspeeds_own_scheduler_come_back_with_its_count(kind):
    """Probe 28 (K4): DeepSpeed's schedulers keep their count alone in ``state_dict()``; a setting the loop changed
    once (``sched.total_num_steps = 40``: train longer than planned) came back at the config's value in a resumed
    run, silently. Its plain attributes are kept beside it: a scheduler made again from the config, loaded with
    both, gives the rates the changed one gives, bit for bit (the same computation on both sides)."""
    from deepspeed.runtime import lr_schedules

    from baft.script import schedulers

    params = {"WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                "total_num_steps": 20},
              "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5}}[kind]
    changes = {"WarmupDecayLR": {"total_num_steps": 40}, "OneCycle": {"total_size": 30, "step_ratio": 0.25}}[kind]

    def made():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        return getattr(lr_schedules, kind)(optimizer, **params)

    first = made()
    for step in range(12):
        first.step()
        if step == 5:
            for name, value in changes.items():
                setattr(first, name, value)
    kept, count = schedulers.settings(first), first.state_dict()
    assert set(changes) <= set(kept) and "optimizer" not in kept
    resumed = made()
    resumed.load_state_dict(count)
    schedulers.set_settings(resumed, kept)
    schedulers.last_lrs_again(resumed)
    assert resumed.get_last_lr() == first.get_last_lr()
    for _ in range(10):
        first.step()
        resumed.step()
        assert resumed.get_last_lr() == first.get_last_lr()
