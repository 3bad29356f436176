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
    an int): saved with the small items, since the snapshot's layout holds tensors only."""

    def scalars(self) -> dict:
        """``{"optim/<name>/<key>": value}`` for every non-tensor state value."""
        return {f"optim/{name}/{key}": value for name, p in self.stateful_params()
                for key, value in self.optimizer.state.get(p, {}).items() if not torch.is_tensor(value)}

    def load_scalars(self, saved: dict) -> None:
        params = dict(self.stateful_params())
        for path, value in saved.items():
            name, key = path[len("optim/"):].rsplit("/", 1)
            self.optimizer.state[params[name]][key] = value
        replay_cpu_adam_steps(self.optimizer)


def replay_cpu_adam_steps(optimizer) -> None:
    """DeepSpeed's C++ Adam on CPU (its ``FusedAdam`` there, and ``DeepSpeedCPUAdam``) keeps beta1^t and
    beta2^t as running products, multiplied once a step, in no state_dict; a fresh process computes them
    with ``pow`` at its first step, which rounds otherwise, and every resumed update would differ. Replaying
    steps 1..t of each group on a one-element tensor puts the products back as the uninterrupted run has
    them (the update of the dummy tensor is discarded). A group's step is its largest: DeepSpeed's
    ``FusedAdam`` counts the step of a group's last parameter only, and gives the kernel that one."""
    fused = getattr(optimizer, "multi_tensor_adam", None)
    cpu_adam = getattr(optimizer, "ds_opt_adam", None)
    if fused is None and cpu_adam is None:
        return
    for group in optimizer.param_groups:
        steps = [optimizer.state[p]["step"] for p in group["params"] if "step" in optimizer.state.get(p, {})]
        if not steps or (fused is not None and group["params"][0].device.type != "cpu"):
            continue  # no step yet; or the CUDA kernel, which takes beta^t from the step it is given
        beta1, beta2 = group["betas"]
        for step in range(1, int(max(steps)) + 1):
            p, g, m, v = (torch.zeros(1) for _ in range(4))
            if fused is not None:
                fused(2048 * 32, optimizer._dummy_overflow_buf, [[g], [p], [m], [v]], group["lr"], beta1, beta2,
                      group["eps"], step, optimizer.adam_w_mode, 1 if group["bias_correction"] else 0,
                      group["weight_decay"])
            else:
                cpu_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
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

    def named_params(self, engine) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def stateful_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, parameter) for every base-optimizer parameter that may hold state."""
        return iter(self.params)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.params:
            if self.own_masters:
                yield f"master/{name}", p
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    yield f"optim/{name}/{key}", value

    def entries(self) -> list[TensorEntry]:
        return [entry(name, t, "optimizer") for name, t in self.tensors()]

    def create_state(self, entries) -> None:
        """Allocate the state tensors a snapshot lists (a torch optimizer creates them at its first step)."""
        params = dict(self.params)
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

    def named_params(self, engine):
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise BaftError(f"{type(engine.optimizer).__name__}: parameter {pi} of param group {gi} is "
                                    f"not a parameter of the model; baft cannot name its optimizer state")
                yield names[id(p)], p


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


def _allocate(slot: dict, key: str, e: TensorEntry, device) -> None:
    if key not in slot:
        slot[key] = torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device)


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
