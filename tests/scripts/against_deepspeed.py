"""Train two steps, then check that baft's state tensors hold every tensor DeepSpeed itself saves.

Compares this rank's ``baft.snapshot.state.state_tensors`` (what a snapshot copies) with the module's
``state_dict()`` and the optimizer wrapper's own ``state_dict()`` (what ``save_checkpoint``
writes), byte for byte. Writes ``--out/rank<R>.json``: the wrapper, what was compared, what differs.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from baft.examples.worker import build, parse_args
from baft.snapshot import state

extra = argparse.ArgumentParser()
extra.add_argument("--out", required=True)
mine, rest = extra.parse_known_args()
sys.argv = [sys.argv[0], *rest]
engine, data = build(parse_args())
for _ in range(2):
    engine.train_batch(data_iter=data)

ours = state.state_tensors(engine)
expected = {f"param/{k}": v for k, v in engine.module.state_dict().items()}  # parameters and buffers
wrapper = engine.optimizer
saved = wrapper.state_dict()
dp = engine.grid.get_data_parallel_rank()
if "base_optimizer_state" in saved:  # BF16_Optimizer, DeepSpeedZeroOptimizer: fp32 partitions and their moments
    for i, master in enumerate(saved["single_partition_of_fp32_groups"]):
        expected[f"master/group{i}/dp{dp}"] = master
        for key, value in saved["base_optimizer_state"]["state"][i].items():
            expected[f"optim/group{i}/dp{dp}/{key}"] = value
else:  # a torch optimizer: state by parameter index, in param-group order
    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = [p for g in wrapper.param_groups for p in g["params"]]
    for index, param_state in saved["state"].items():
        for key, value in param_state.items():
            expected[f"optim/{names[id(params[index])]}/{key}"] = value


def same(a, b):
    return torch.is_tensor(a) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


result = {"wrapper": type(wrapper).__name__, "compared": sorted(expected),
          "missing": sorted(k for k in expected if k not in ours and k.replace("param/", "buffer/", 1) not in ours),
          "different": sorted(k for k, v in expected.items()
                              if torch.is_tensor(v) and not same(ours.get(k, ours.get(k.replace("param/", "buffer/", 1))), v))}
Path(mine.out, f"rank{engine.global_rank}.json").write_text(json.dumps(result))
