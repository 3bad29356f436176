"""What keeping the restored weights costs a restore and the first resumed iteration: checksums
(:class:`baft.recovery.restored_weights.RestoredWeights`) against the host copy of every parameter and buffer
that d10bec1 kept (``module_values``, then ``set_module_values``, copied here for the comparison).

    python experiments/restored_weights_cost.py [--layers 12] [--width 2048] [--repeats 9] [--device cpu|cuda]

A stack of ``--layers`` square linear layers (12 x 2048: 201 MB of fp32) is snapshotted into a committed
shared-memory slot; then, best and median of ``--repeats`` (one torch thread):

* at the restore alone: what each keeps;
* the restore's part and the first iteration's check together, with nothing changed since, and with noise added
  to every weight in between (the noise's own time is printed, the same on both sides).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

from baft.recovery.restored_weights import RestoredWeights
from baft.snapshot.copy import Snapshot, StateSource
from baft.snapshot.slots import SnapshotWriter, committed, map_verified, open_slot
from baft.snapshot.state import byte_view, module_tensors


class Grid:
    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_pipe_parallel_world_size(self):
        return 1


def module_values(engine) -> dict:
    """d10bec1's: a host copy of every parameter and buffer."""
    return {name: t.detach().to("cpu", copy=True) for name, _, t in module_tensors(engine)}


def set_module_values(engine, kept: dict) -> list[str]:
    """d10bec1's: each tensor moved back to the device, compared, set back where it differs."""
    changed = []
    for name, _, t in module_tensors(engine):
        value = kept[name].to(t.device)
        if not torch.equal(byte_view(t), byte_view(value)):
            t.copy_(value)
            changed.append(name)
    return changed


def timed(fn, repeats: int, device: str) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)],
                           nn.LayerNorm(args.width)).to(args.device)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(2, args.width, device=args.device)).sum().backward()
    optimizer.step()
    engine = SimpleNamespace(module=module, optimizer=optimizer, grid=Grid(), global_rank=0, stage_id=0, world_size=1,
                             baft=SimpleNamespace(config=SimpleNamespace(run_id="")))
    root = f"/dev/shm/baft-restored-weights-{os.getpid()}"
    source = StateSource(engine, 1 << 20)
    writer = SnapshotWriter(root, 0, source.layout, 3)
    try:
        snapshot = Snapshot(source, writer, 1, {})
        snapshot.copy_first()
        snapshot.fence()
        snapshot.seal(threads=1)
        assert map_verified(root, 0) is not None
        info = committed(root, 0)[0]

        def restored() -> RestoredWeights:  # the restore's verified record and open map, as it hands them on
            return RestoredWeights(engine, {0: (info.record, open_slot(root, 0, info.slot))})

        noise = [(p, torch.randn_like(p) * 1e-3) for p in module.parameters()]

        def perturb() -> None:
            with torch.no_grad():
                for p, n in noise:
                    p.add_(n)

        def before(changed: bool) -> None:
            kept = module_values(engine)
            if changed:
                perturb()
            set_module_values(engine, kept)

        def after(changed: bool) -> None:
            weights = restored()
            if changed:
                perturb()
            weights.set_back(engine)

        nbytes = sum(byte_view(t).numel() for _, _, t in module_tensors(engine))
        print(f"{nbytes / 1e6:.0f} MB of parameters and buffers in {len(list(module_tensors(engine)))} tensors on "
              f"{args.device}; seconds, best and median of {args.repeats}")
        rows = [("at the restore alone", lambda: module_values(engine), lambda: restored().close())]
        rows += [(f"restore and check, {what}", lambda c=changed: before(c), lambda c=changed: after(c))
                 for what, changed in (("nothing changed", False), ("noise on every weight", True))]
        for what, old, new in rows:
            print(f"{what:40} host copy {'%.3f / %.3f' % timed(old, args.repeats, args.device)}   "
                  f"checksums {'%.3f / %.3f' % timed(new, args.repeats, args.device)}")
        print(f"{'the noise alone':40} {'%.3f / %.3f' % timed(perturb, args.repeats, args.device)}")
    finally:
        writer.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
