"""The example GPT training script that ``baft profile`` and ``baft train`` launch on every rank.

Run under a launcher (``torchrun``), one process per rank. Rank 0 prints one line per
iteration — step, loss (exact float repr), iteration time, stall — and appends the same
record to ``RUN_DIR/losses.jsonl``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import set_random_seed

import baft
from baft.config import DEFAULT_SHM_ROOT, EXECUTORS, LEFTOVERS, POLICIES, TIMEOUTS
from baft.errors import BaftError
from baft.examples.gpt import PARTITIONS, GPTConfig, MicroBatches, SyntheticTokens, gpt_pipeline, stateful_loader
from baft.manager.protocol import ManagerUnavailable
from baft.pipeline.profiler import sync_device
from baft.recovery.record import mark, restart_count


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baft-worker")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--policy", default="none", choices=POLICIES)
    p.add_argument("--period", default="auto")
    p.add_argument("--executor", choices=EXECUTORS, default="auto", help="how baft copies in a bubble")
    p.add_argument("--leftovers", choices=LEFTOVERS, default="fence",
                   help="stream executor: queue the chunks no bubble holds at the fence or at the iteration's start")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--bubble-map", default=None)
    p.add_argument("--plan", default=None)
    p.add_argument("--run-id", default="default")
    p.add_argument("--shm-root", default=DEFAULT_SHM_ROOT)
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulate nodes of this many ranks")
    p.add_argument("--parity-group", default=None, help="ID@host:port,... of the nodes' managers")
    p.add_argument("--parity-k", type=int, default=None)
    p.add_argument("--persist-every", type=int, default=None)
    p.add_argument("--persist-dir", default=None)
    p.add_argument("--fresh-start", choices=("true", "false", "always"), default="true",
                   help="may a start that finds no restorable snapshot begin at step 0 (see baft.fresh_start)")
    p.add_argument("--adopt", default=None, help="a DeepSpeed checkpoint directory to start from (see baft.adopt)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="seconds a rank may be silent before its node's manager kills it (0: never; default 60)")
    p.add_argument("--progress-timeout", type=float, default=None,
                   help="seconds a node's ranks may train without finishing a step (0: never; default 600)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="fp16 needs a GPU: DeepSpeed refuses it on CPU")
    p.add_argument("--partition", choices=PARTITIONS, default="compute",
                   help="balance the stages by estimated compute or by parameter count")
    p.add_argument("--zero-stage", type=int, choices=(0, 1), default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam",
                   help="DeepSpeed's Adam or AdamW (weight decay 0.1), torch implementations")
    p.add_argument("--scheduler", choices=("none", "warmup-decay"), default="none",
                   help="warmup-decay: DeepSpeed's WarmupDecayLR, linear warmup over a quarter of --iters")
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping (global norm); 0: none")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="the token embedding is the output head too (TiedLayerSpec on the first and last stage)")
    p.add_argument("--freeze", type=int, default=0, metavar="N", help="the first N blocks do not train")
    p.add_argument("--activation-checkpoint-interval", type=int, default=0, metavar="K",
                   help="checkpoint activations every K layers (blocks only); 0: none")
    p.add_argument("--loader", choices=("microbatches", "stateful"), default="microbatches",
                   help="stateful: torchdata's StatefulDataLoader over the same samples, shuffled")
    p.add_argument("--describe", action="store_true",
                   help="every rank prints what it trains: optimizer, scheduler, tied and frozen parameters, ...")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--digest", action="store_true",
                   help="every rank prints a SHA-256 of its whole state (weights, masters, moments) at the end")
    # the deepspeed launcher's (torchrun's ranks read LOCAL_RANK from the environment, as this one does)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ds_config(args, dp: int) -> dict:
    period = args.period if args.period == "auto" else int(args.period)
    section = {"policy": args.policy, "schedule": args.schedule, "period": period, "run_id": args.run_id,
               "shm_root": args.shm_root, "executor": args.executor, "leftovers": args.leftovers}
    if args.bubble_map:
        section["bubble_map"] = args.bubble_map
    if args.plan:
        section["plan"] = args.plan
    if args.fresh_start != "true":
        section["fresh_start"] = {"false": False, "always": "always"}[args.fresh_start]
    if args.adopt:
        section["adopt"] = args.adopt
    if args.ranks_per_node:
        section["ranks_per_node"] = args.ranks_per_node
    for key in TIMEOUTS:
        if getattr(args, key) is not None:
            section[key] = getattr(args, key)
    if args.parity_group:
        section["parity"] = {"group": args.parity_group.split(","), "k": args.parity_k}
    if args.persist_dir:
        section["persist"] = {"dir": args.persist_dir, **({"every": args.persist_every} if args.persist_every else {})}
    if args.run_dir:
        section["save_dir"] = str(Path(args.run_dir) / "checkpoints")
        section["run_dir"] = args.run_dir
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "train_batch_size": args.micro_batch_size * args.micro_batches * dp,
        "optimizer": optimizer_config(args),
        "steps_per_print": 10 ** 9,
        "baft": section,
    }
    if args.scheduler == "warmup-decay":
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": max(1, args.iters // 4),
            "warmup_type": "linear", "total_num_steps": args.iters}}
    if args.clip:
        config["gradient_clipping"] = args.clip
    if args.precision in ("bf16", "fp16"):
        config[args.precision] = {"enabled": True}
    if args.zero_stage:
        config["zero_optimization"] = {"stage": args.zero_stage}
    return config


def optimizer_config(args) -> dict:
    """The config's "optimizer" section: torch's implementation, so it runs on CPU too."""
    if args.optimizer == "adamw":
        return {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1, "torch_adam": True}}
    return {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}}


def say_whole_line(text: str) -> None:
    """Print a line that every rank prints, in one write: ``print`` writes the newline apart, so two ranks
    sharing a pipe could join their lines."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def build(args: argparse.Namespace):
    """Initialize the process group, the example GPT pipeline and its data; return (engine, data)."""
    torch.set_num_threads(args.threads)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    mark("init_start")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if world % args.stages:
        raise BaftError(f"{world} processes cannot form {args.stages} pipeline stages")
    if args.d_model % args.heads:
        raise BaftError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    dp = world // args.stages
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                    dropout=args.dropout)
    model = gpt_pipeline(cfg, args.stages, seed=args.seed, tie_embeddings=args.tie_embeddings, freeze=args.freeze,
                         checkpoint_interval=args.activation_checkpoint_interval, partition=args.partition)
    set_random_seed(args.seed + dist.get_rank())  # python, numpy and torch: a run repeats itself exactly
    dataset, shard = SyntheticTokens(cfg, seed=args.seed), model._grid.get_data_parallel_rank()
    make_loader = stateful_loader if args.loader == "stateful" else MicroBatches
    loader = make_loader(dataset, args.micro_batch_size, shard=shard, shards=dp)
    engine, *_ = baft.initialize(model=model, config=ds_config(args, dp), data_iterator=loader)
    if args.describe:
        say_whole_line(f"setup rank {engine.global_rank}: {describe(engine, loader)}")
    return engine, iter(loader)  # a StatefulDataLoader is iterated once a restore has set its position


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        engine, data = build(args)
    except ManagerUnavailable as err:  # a manager that died: a restart may find its replacement
        print(f"baft: {err}", file=sys.stderr)
        return 1
    except BaftError as err:  # the user's to fix: baft train stops at it rather than restart into it
        print(f"baft: error: {err}", file=sys.stderr)
        return 2
    lead = engine.global_rank == 0
    log = _open_log(args.run_dir) if lead else None
    times = []
    protection = getattr(engine, "baft", None)  # none without a "baft" section
    policy = protection.hooks.policy if protection is not None else None
    while engine.global_steps < args.iters:  # a restarted run resumes at its restored step
        start = time.perf_counter()
        lr = engine.get_lr()[0]
        loss = engine.train_batch(data_iter=data)
        sync_device()  # a GPU's iteration ends when its queued work does
        elapsed = time.perf_counter() - start
        # rank 0's own: a collective of the script's outside train_batch would end a survivor of a killed peer
        # (recovery in place replaces it then, rather than keeping its process)
        stall = policy.metrics().stall if policy is not None else 0.0
        times.append(elapsed)
        if lead:
            record = {"step": engine.global_steps, "loss": float(loss), "lr": lr, "iter_s": elapsed,
                      "stall_s": float(stall), "restart": restart_count(), "time": time.time()}
            print(f"step {record['step']:5d}  loss {record['loss']!r}  iter {elapsed * 1e3:8.1f} ms  "
                  f"stall {record['stall_s'] * 1e3:7.2f} ms", flush=True)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
    if args.digest:
        say_whole_line(f"digest rank {engine.global_rank} step {engine.global_steps} {state_digest(engine)}")
    if lead and not times:
        print(f"baft: the run is already at step {engine.global_steps}: nothing to train until --iters {args.iters}; "
              "give a larger --iters to go on, or a new --run-dir to start over", flush=True)
    if lead and times:
        snapshots = ""
        if policy is not None:
            if hasattr(policy, "drain"):
                policy.drain()  # the last snapshot may still be sealing
            taken = len(getattr(policy, "committed_steps", getattr(policy, "saved", [])))
            snapshots = f"; {taken} snapshots committed by rank 0 ({args.policy}, period {policy.period})"
        print(f"summary: median iteration {statistics.median(times) * 1e3:.1f} ms over {len(times)} iterations"
              f"{snapshots}", flush=True)
    return 0


def describe(engine, loader) -> str:
    """What this rank trains, read back from the engine: the optimizer, scheduler and clipping it
    runs, its tied modules, frozen parameters, activation-checkpointed layer groups, and the loader's class."""
    from baft.snapshot.optimizers import base_optimizer
    module, optimizer = engine.module, base_optimizer(engine.optimizer)
    frozen = sum(not p.requires_grad for p in module.parameters())
    checkpointed = sum(module.is_checkpointable_results) if module.activation_checkpoint_interval else 0
    return (f"optimizer {type(optimizer).__name__} weight decay {optimizer.param_groups[0]['weight_decay']}, "
            f"scheduler {type(engine.lr_scheduler).__name__}, clip {engine.gradient_clipping()}, "
            f"tied {','.join(sorted(module.tied_modules)) or '-'}, frozen {frozen} parameters, "
            f"checkpointed {checkpointed} layer groups, loader {type(loader).__name__}")


def state_digest(engine) -> str:
    """SHA-256 over every state tensor of this rank, by name: equal digests mean bit-identical states."""
    from baft.snapshot import state
    digest = hashlib.sha256()
    for name, tensor in sorted(state.state_tensors(engine).items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _open_log(run_dir):
    if not run_dir:
        return None
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return open(Path(run_dir) / "losses.jsonl", "a")


if __name__ == "__main__":
    sys.exit(main())
