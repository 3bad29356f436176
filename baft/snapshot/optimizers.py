"""Where each optimizer DeepSpeed's ``PipelineEngine`` runs keeps its state, and stable names for it.

A snapshot must hold everything the optimizer needs to go on bit for bit: for a plain torch
optimizer its per-parameter state; for DeepSpeed's wrappers also the fp32 master weights
they keep beside the low-precision module weights, and the moments of those masters. Names
come from structure (module parameter names, param-group index, data-parallel partition),
so every process of a job, and every restart, agrees on them; never from object ids.

One adapter per wrapper, found by type (:func:`adapter_for`). A wrapper without an adapter
is refused when baft attaches, with one line naming its class: a partial snapshot would
restore a state that silently differs from the one trained.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from baft.errors import BaftError
from baft.snapshot.layout import TensorEntry


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def entry(name: str, t: torch.Tensor, kind: str, owner: Optional[int] = None) -> TensorEntry:
    return TensorEntry(name, dtype_name(t), tuple(t.shape), t.numel() * t.element_size(), kind, owner)


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (they hold it as ``.optimizer``)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def before_base_step(optimizer, fn):
    """Have ``fn`` run just before the torch optimizer inside DeepSpeed's wrappers changes the state (a step
    pre-hook: its handle), or None where no torch optimizer is at the base (the caller must act now)."""
    base = base_optimizer(optimizer)
    return base.register_step_pre_hook(fn) if isinstance(base, torch.optim.Optimizer) else None


class ScalarState:
    """The per-parameter optimizer state that is not a tensor (DeepSpeed's CPU Adam counts its ``step`` in
    an int), and the running beta products of DeepSpeed's C++ Adam (:class:`CpuAdamProducts`): saved with
    the small items, since the snapshot's layout holds tensors only."""

    products: Optional["CpuAdamProducts"] = None

    def follow_cpu_adam(self) -> None:
        """Follow the C++ Adam's calls from now on (at ``baft.initialize``, before the first step)."""
        self.products = CpuAdamProducts.of(self.optimizer)

    def scalars(self) -> dict:
        """``{"optim/<name>/<key>": value}`` for every non-tensor state value, ``"cpu_adam"``: the C++ Adam's
        last call, where there is one, and ``"unkeyed"``: what the optimizer keeps in its ``state`` under a key that
        is not a parameter (an optimizer of the script's own counting its steps in ``self.state["step"]``, which
        torch's ``state_dict`` keeps)."""
        found = {f"optim/{name}/{key}": value for name, p in self.stateful_params()
                 for key, value in self.optimizer.state.get(p, {}).items() if not torch.is_tensor(value)}
        if self.products is not None and self.products.last is not None:
            found["cpu_adam"] = self.products.last
        unkeyed = {key: value for key, value in self.optimizer.state.items() if not torch.is_tensor(key)}
        if unkeyed:
            found["unkeyed"] = unkeyed
        return found

    def load_scalars(self, saved: dict) -> None:
        saved = dict(saved)
        calls = saved.pop("cpu_adam", None)
        for key in [key for key in self.optimizer.state if not torch.is_tensor(key)]:
            del self.optimizer.state[key]  # as the snapshot's step had them: none there, none now
        self.optimizer.state.update(saved.pop("unkeyed", {}))
        params = self.params_by_name()
        for path, value in saved.items():
            name, key = path[len("optim/"):].rsplit("/", 1)
            self.optimizer.state[params[name]][key] = value
        if self.products is not None:
            self.products.restore(calls)

    def params_by_name(self) -> dict:
        """The parameters a snapshot's optimizer state may be of, by name."""
        return dict(self.stateful_params())


class CpuAdamProducts:
    """DeepSpeed's C++ Adam on CPU (its ``FusedAdam`` there, and ``DeepSpeedCPUAdam``) keeps beta1^t and
    beta2^t as running products, in no state_dict: a call with other betas than the last (a scheduler
    cycling momentum), or with a step that is not the next, recomputes them with ``pow``; the next step
    multiplies. A fresh process recomputes with ``pow`` at its first step, which rounds otherwise, and every
    resumed update would differ. So this follows the calls from a step pre-hook as the C++ does, keeping the
    last as (step, beta1, beta2, the step of the last recompute); a restore replays the calls from that
    recompute on one-element tensors (their update discarded), which leaves the products as the
    uninterrupted run has them."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.fused = getattr(optimizer, "multi_tensor_adam", None)
        self.cpu_adam = getattr(optimizer, "ds_opt_adam", None)
        self.last: Optional[tuple[int, float, float, int]] = None
        optimizer.register_step_pre_hook(self._before_step)

    @classmethod
    def of(cls, optimizer) -> Optional["CpuAdamProducts"]:
        """The follower of ``optimizer``'s C++ Adam, or None where it has none (the CUDA kernel takes beta^t
        from the step it is given)."""
        if getattr(optimizer, "ds_opt_adam", None) is not None:
            return cls(optimizer)
        on_cpu = all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
        return cls(optimizer) if getattr(optimizer, "multi_tensor_adam", None) is not None and on_cpu else None

    def _before_step(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            if any(p.grad is not None for p in group["params"]):
                self._call(self._next_step(group), *group["betas"])

    def _call(self, step: int, beta1: float, beta2: float) -> None:
        betas = (float(np.float32(beta1)), float(np.float32(beta2)))  # the kernel takes floats
        last = self.last
        same = last is not None and betas == last[1:3] and step in (last[0], last[0] + 1)
        self.last = (step, *betas, last[3] if same else step)

    def _next_step(self, group) -> int:
        """The step the kernel is given: one past the group's largest (``FusedAdam`` counts the step of a
        group's last parameter only; the others keep the group's step at their first)."""
        steps = [self.optimizer.state[p]["step"] for p in group["params"] if "step" in self.optimizer.state.get(p, {})]
        return int(max(steps) if steps else group.get("step", 0)) + 1

    def restore(self, last: Optional[tuple]) -> None:
        """Put the products back as they were after the call ``last``; without it (a snapshot of an older baft,
        a DeepSpeed checkpoint), as steps 1..t with today's betas."""
        group = self.optimizer.param_groups[0]
        if last is None:
            steps = [self._next_step(g) - 1 for g in self.optimizer.param_groups]
            if max(steps) == 0:
                return
            last = (max(steps), *group["betas"], 1)
        step, beta1, beta2, recomputed = last
        force = 0.5 if 0.0 in (beta1, beta2) else 0.0  # betas of no real call: the next recomputes
        self._kernel(group, 1, force, force)
        for s in range(int(recomputed), int(step) + 1):
            self._kernel(group, s, beta1, beta2)
        self.last = (int(step), float(beta1), float(beta2), int(recomputed))

    def _kernel(self, group, step: int, beta1: float, beta2: float) -> None:
        p, g, m, v = (torch.zeros(1) for _ in range(4))
        if self.fused is not None:
            self.fused(2048 * 32, self.optimizer._dummy_overflow_buf, [[g], [p], [m], [v]], group["lr"], beta1, beta2,
                       group["eps"], step, self.optimizer.adam_w_mode, 1 if group["bias_correction"] else 0,
                       group["weight_decay"])
        else:
            self.cpu_adam.adam_update(self.optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], p, g, m, v)


class NamedOptimizerState(ScalarState):
    """The base optimizer's parameters under structural names, and their per-parameter state.

    ``named_params()`` gives (name, parameter) in the optimizer's order. Names of the state:
    ``optim/<name>/<state key>``; with ``own_masters`` (a wrapper's fp32 master copies, which
    are not module parameters) the masters themselves too, as ``master/<name>``.
    """

    own_masters = True

    def __init__(self, engine):
        self.wrapper = engine.optimizer
        self.optimizer = base_optimizer(self.wrapper)
        self.params = list(self.named_params(engine))
        self.follow_cpu_adam()

    def named_params(self, engine) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def stateful_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, parameter) for every base-optimizer parameter that may hold state."""
        return iter(self.params)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.stateful_params():
            if self.own_masters:
                yield f"master/{name}", p
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    yield f"optim/{name}/{key}", value

    def entries(self) -> list[TensorEntry]:
        return [entry(name, t, "optimizer") for name, t in self.tensors()]

    def create_state(self, entries) -> None:
        """Allocate the state tensors a snapshot lists (a torch optimizer creates them at its first step)."""
        params = self.params_by_name()
        for e in entries:
            if e.kind != "optimizer" or not e.name.startswith("optim/"):
                continue
            name, key = e.name[len("optim/"):].rsplit("/", 1)
            if name in params:
                _allocate(self.optimizer.state[params[name]], key, e, params[name].device)


class TorchOptimizer(NamedOptimizerState):
    """A torch optimizer over the module's own parameters (fp32 without ZeRO): state per parameter.

    Names: ``optim/<module parameter name>/<state key>`` (the parameters are in the snapshot already).
    """

    own_masters = False

    def __init__(self, engine):
        self.module_params = dict(engine.module.named_parameters())
        self.names = {id(p): name for name, p in self.module_params.items()}
        self.first_groups = len(base_optimizer(engine.optimizer).param_groups)  # as the script made it
        self._walked: Optional[tuple] = None  # the groups' sizes and the state's when the parameters were named
        super().__init__(engine)

    def named_params(self, engine):
        in_groups = set()
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in self.names:
                    raise BaftError(f"{type(self.wrapper).__name__}: parameter {pi} of param group {gi} is "
                                    f"not a parameter of the model; baft cannot name its optimizer state")
                in_groups.add(id(p))
                yield self.names[id(p)], p
        for name, p in self.module_params.items():  # a restore gave them state for a group the script adds later
            if id(p) not in in_groups and p in self.optimizer.state:
                yield name, p

    def stateful_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters of the optimizer's param groups as they are now (the script may add a group after
        ``baft.initialize``: ``add_param_group``), then the module's that are in none and hold optimizer state."""
        walked = (tuple(len(group["params"]) for group in self.optimizer.param_groups), len(self.optimizer.state))
        if walked != self._walked:
            self.params, self._walked = list(self.named_params(None)), walked
        return iter(self.params)

    def params_by_name(self) -> dict:
        """Every parameter of the module: a snapshot's state may be of one in a group the script adds after
        ``baft.initialize``, where a restore comes before."""
        return self.module_params

    def added_groups(self) -> Optional[dict]:
        """The param groups the script added since it made the optimizer, by their parameters' names (what a resumed
        process past the step that added them adds again), or None."""
        groups = self.optimizer.param_groups
        if len(groups) == self.first_groups:
            return None
        return {"first": self.first_groups,
                "names": [[self.names[id(p)] for p in group["params"]] for group in groups[self.first_groups:]]}

    def add_groups(self, added: Optional[dict], saved_groups: list) -> None:
        """Add the param groups ``added`` (:meth:`added_groups` of the snapshot's step) that the optimizer lacks, with
        their hyper-parameters ``saved_groups``: the script added them before that step, and a process resumed past
        it does not again."""
        groups = self.optimizer.param_groups
        if not added or len(groups) >= len(saved_groups) or len(groups) < added["first"]:
            return
        for names, saved in zip(added["names"][len(groups) - added["first"]:], saved_groups[len(groups):]):
            self.optimizer.add_param_group({**saved, "params": [self.module_params[name] for name in names]})


class FP16Masters(NamedOptimizerState):
    """DeepSpeed's ``FP16_Optimizer`` (fused): each param group's fp16 weights are views into one
    flat buffer, whose fp32 master copy (the base optimizer's parameter) every replica keeps whole.

    Names: ``master/group<i>`` and ``optim/group<i>/<state key>``.
    """

    def named_params(self, engine):
        for i, master in enumerate(self.wrapper.fp32_groups_flat):
            yield f"group{i}", master


class FP16UnfusedMasters(NamedOptimizerState):
    """DeepSpeed's ``FP16_UnfusedOptimizer``: one fp32 master per fp16 weight, kept whole by every replica.

    Names: ``master/group<i>/<j>`` and ``optim/group<i>/<j>/<state key>``.
    """

    def named_params(self, engine):
        for i, group in enumerate(self.wrapper.fp32_groups):
            for j, master in enumerate(group):
                yield f"group{i}/{j}", master


class PartitionedMasters(ScalarState):
    """DeepSpeed's ``BF16_Optimizer`` and ``DeepSpeedZeroOptimizer`` (stage 1): the module weights
    (bf16, fp16 or fp32) are views into one flat buffer per param group, and each data-parallel
    replica keeps an fp32 master partition of it, which is the base optimizer's parameter.

    Names: ``master/group<i>/dp<d>`` and ``optim/group<i>/dp<d>/<state key>``, owned by replica ``d``.
    """

    masters_attr = ""  # the wrapper's list of fp32 partitions, one per param group
    partitions_attr = ""  # the wrapper's list of per-replica partitions of each flat buffer

    def __init__(self, engine):
        self.wrapper = engine.optimizer
        self.optimizer = base_optimizer(self.wrapper)
        self.masters: list[torch.Tensor] = getattr(self.wrapper, self.masters_attr)
        groups = self.wrapper.real_dp_process_group
        self.dp_rank = [dist.get_rank(group=g) for g in groups]
        self.replicas = [len(p) for p in getattr(self.wrapper, self.partitions_attr)]
        self.follow_cpu_adam()

    def stateful_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, parameter) for this replica's fp32 master partitions, the base optimizer's parameters."""
        for i, master in enumerate(self.masters):
            yield f"group{i}/dp{self.dp_rank[i]}", master

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, master in enumerate(self.masters):
            d = self.dp_rank[i]
            yield f"master/group{i}/dp{d}", master
            for key, value in sorted(self.optimizer.state.get(master, {}).items()):
                if torch.is_tensor(value):
                    yield f"optim/group{i}/dp{d}/{key}", value

    def entries(self) -> list[TensorEntry]:
        """Every replica's partitions: they are of equal size (DeepSpeed pads the flat buffer)."""
        out = []
        for i, master in enumerate(self.masters):
            state = sorted((k, v) for k, v in self.optimizer.state.get(master, {}).items() if torch.is_tensor(v))
            for d in range(self.replicas[i]):
                out.append(entry(f"master/group{i}/dp{d}", master, "optimizer", owner=d))
                out += [entry(f"optim/group{i}/dp{d}/{key}", value, "optimizer", owner=d) for key, value in state]
        return out

    def create_state(self, entries) -> None:
        for e in entries:
            if e.kind != "optimizer" or not e.name.startswith("optim/group"):
                continue
            group, dp, key = e.name[len("optim/"):].split("/", 2)
            i = int(group[len("group"):])
            if i < len(self.masters) and int(dp[len("dp"):]) == self.dp_rank[i]:
                _allocate(self.optimizer.state[self.masters[i]], key, e, self.masters[i].device)


def _allocate(param_state: dict, key: str, e: TensorEntry, device) -> None:
    if key not in param_state:
        param_state[key] = torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device)


class BF16Masters(PartitionedMasters):
    masters_attr = "fp32_groups_flat_partition"
    partitions_attr = "bf16_partitioned_groups"


class ZeroMasters(PartitionedMasters):
    masters_attr = "single_partition_of_fp32_groups"
    partitions_attr = "parallel_partitioned_bit16_groups"


def _registry() -> list[tuple[type, type]]:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return [(BF16_Optimizer, BF16Masters), (DeepSpeedZeroOptimizer, ZeroMasters), (FP16_Optimizer, FP16Masters),
            (FP16_UnfusedOptimizer, FP16UnfusedMasters), (torch.optim.Optimizer, TorchOptimizer)]


def adapter_for(engine):
    """The adapter for ``engine.optimizer``; a ``BaftError`` naming the class when there is none."""
    optimizer = engine.optimizer
    for cls, adapter in _registry():
        if isinstance(optimizer, cls):
            return adapter(engine)
    raise BaftError(f"optimizer {type(optimizer).__module__}.{type(optimizer).__name__}: baft cannot snapshot its "
                    f"state yet (supported: torch optimizers, BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer, "
                    f"DeepSpeedZeroOptimizer stage 1); "
                    f"train without the \"baft\" section or use a supported configuration")


_ADAPTER = "_baft_adapter"  # the attribute of an optimizer that holds its adapter


def optimizer_adapter(engine):
    """The engine's optimizer adapter: where its state lives and what it is called. Made once per optimizer, and
    kept on it: a recovery in place gives the engine the script holds a new optimizer, made and restored through
    another engine object whose state the script's takes (one adapter: DeepSpeed's C++ Adam's products are
    followed by one)."""
    optimizer = getattr(engine, "optimizer", None)
    adapter = getattr(optimizer, _ADAPTER, None)
    if adapter is None:
        adapter = adapter_for(engine)
        if optimizer is not None:
            setattr(optimizer, _ADAPTER, adapter)
    return adapter
