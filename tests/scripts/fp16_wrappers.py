"""DeepSpeed's FP16 optimizers on CPU, outside a pipeline engine (whose config refuses fp16 on CPU).

For ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` around torch Adam, with a dynamic loss
scale that starts high enough to overflow: after 3 steps, (1) what baft snapshots equals what
the wrapper's own ``state_dict`` saves — fp32 masters and Adam state, byte for byte — and
(2) a fresh wrapper restored from the snapshot goes on for 3 more steps bit for bit like the
original (fp16 weights, masters, moments, loss scale). Writes ``--out`` (JSON). One rank.
"""

import argparse
import json
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from baft.snapshot import state
from baft.snapshot.optimizers import adapter_for

WRAPPERS = {"FP16_Optimizer": FP16_Optimizer, "FP16_UnfusedOptimizer": FP16_UnfusedOptimizer}


class StandIn(SimpleNamespace):
    """An engine as baft's state capture sees it: hashable by identity, and it takes a weak reference."""

    __hash__ = object.__hash__


def build(wrapper_cls):
    """A stand-in for the engine: what baft's state capture reads (module, optimizer, the batch size, its rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).half()
    wrapper = wrapper_cls(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                          dynamic_loss_args={"init_scale": 2 ** 24, "scale_window": 2, "min_scale": 1,
                                             "delayed_shift": 1}, verbose=False)
    return StandIn(module=model, optimizer=wrapper, train_batch_size=lambda: 8, global_rank=0)


def train(engine, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(5, 8, generator=gen).half()
        loss = engine.module(x).float().pow(2).mean() * 1e3
        engine.optimizer.zero_grad()
        engine.optimizer.backward(loss)
        engine.optimizer.step()


def fingerprint(engine) -> dict:
    """Every byte that must continue alike: the state tensors and the loss scale."""
    tensors = {name: t.detach().reshape(-1).view(torch.uint8).tolist() for name, t in state.state_tensors(engine).items()}
    return {"tensors": tensors, "scale": engine.optimizer.loss_scale_config.cur_scale}


def against_state_dict(engine) -> list[str]:
    """Tensors of the wrapper's own state_dict that the snapshot lacks or holds differently."""
    saved = engine.optimizer.state_dict()
    masters = saved.get("fp32_groups_flat") or [m for group in saved["fp32_groups"] for m in group]
    moments = [value for _, per_param in sorted(saved["optimizer_state_dict"]["state"].items())
               for _, value in sorted(per_param.items()) if torch.is_tensor(value)]
    mine = state.state_tensors(engine)
    ours_masters = [t for name, t in mine.items() if name.startswith("master/")]
    ours_moments = [t for name, t in mine.items() if name.startswith("optim/")]
    problems = []
    if len(ours_masters) != len(masters) or not all(torch.equal(a, b) for a, b in zip(ours_masters, masters)):
        problems.append("fp32 masters")
    if len(ours_moments) != len(moments) or not all(torch.equal(a, b) for a, b in zip(ours_moments, moments)):
        problems.append("optimizer state")
    return problems


def check(wrapper_cls) -> dict:
    original = build(wrapper_cls)
    train(original, range(3))
    tensors = {name: t.clone() for name, t in state.state_tensors(original).items()}
    items = {**state.capture_items(original), **state.capture_rng()}

    restored = build(wrapper_cls)
    state.create_optimizer_state(restored, state.tensor_entries(original))
    live = state.state_tensors(restored)
    for name, t in tensors.items():
        live[name].detach().copy_(t)
    state.restore_items(restored, items)

    train(original, range(3, 6))
    train(restored, range(3, 6))
    return {"adapter": type(adapter_for(original)).__name__, "missing": against_state_dict(original),
            "continues_alike": fingerprint(original) == fingerprint(restored),
            "scale": original.optimizer.loss_scale_config.cur_scale, "names": sorted(tensors)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")  # FP16_UnfusedOptimizer asks DeepSpeed for its rank
    with open(args.out, "w") as f:
        json.dump({name: check(cls) for name, cls in WRAPPERS.items()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
