"""Train one step of the tiny example under --schedule; save each rank's parameters to --out."""

import sys
from pathlib import Path

import torch

from baft.examples.worker import build, parse_args

out = Path(sys.argv.pop(sys.argv.index("--out") + 1))
sys.argv.remove("--out")
args = parse_args()
engine, data = build(args)
initial = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
loss = engine.train_batch(data_iter=data)
params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
torch.save({"params": params, "initial": initial, "loss": float(loss)}, out / f"rank{engine.global_rank}.pt")
