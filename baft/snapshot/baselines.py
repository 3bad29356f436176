"""The disk checkpoints baft is compared with: DeepSpeed's ``save_checkpoint``, ``torch.save``, DCP ``async_save``.

Each is an engine hook that saves the whole state after the optimizer step every ``period``
steps, the way jobs checkpoint today, and restores the newest checkpoint every rank has.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from baft.accelerator import collective_device
from baft.errors import BaftError
from baft.pipeline.hook import InstructionHook
from baft.snapshot import state
from baft.snapshot.metrics import Periodic, PolicyMetrics
from baft.snapshot.optimizers import entry

KEEP = 2  # checkpoints kept: a rank killed as it saved leaves the one before as the newest every rank has
ITEMS_KEY = "baft_items"  # where the deepspeed baseline keeps the small items (RNG, data position) in client_state


def replicas_items(engine, items: dict) -> dict:
    """For ``client_state``, which one replica of each stage writes: every replica's small items.

    Data-parallel replicas share a checkpoint file but not their RNG states (a job seeds each
    rank its own), so each must get its own back.
    """
    every = [None] * engine.grid.get_data_parallel_world_size()
    dist.all_gather_object(every, items, group=engine.grid.get_data_parallel_group())
    return {"replicas": every}


def own_items(engine, saved: dict) -> dict:
    """This replica's small items from :func:`replicas_items`."""
    return saved["replicas"][engine.grid.get_data_parallel_rank()]


class DiskCheckpoint(InstructionHook, Periodic):
    """The usual practice: a full checkpoint to disk every ``period`` steps, after the step. A subclass is one way
    of writing it (:meth:`save`) and reading the newest one back (:meth:`restore`); :func:`disk_checkpoint` picks
    the one a policy names."""

    kind = ""  # the policy's name

    def __init__(self, save_dir: str, period: int, data_iterator=None):
        self.save_dir, self.period, self.data_iterator = Path(save_dir), period, data_iterator
        self.stall = 0.0
        self.saved: list[int] = []
        self.saved_before = 0  # saved when this iteration started

    def iteration_start(self, engine):
        self.stall = 0.0
        self.saved_before = len(self.saved)

    def metrics(self) -> PolicyMetrics:
        """This baseline's counters after the latest iteration."""
        return PolicyMetrics(snapshots=len(self.saved), snapshotted=len(self.saved) > self.saved_before,
                             stall=self.stall)

    def iteration_end(self, engine):
        step = engine.global_steps
        if not self.wanted(step):
            return
        start = time.perf_counter()
        # as the step ends, before the loop's code after its call: the values it carries are not as a resumed call's
        items = state.capture_items(engine, self.data_iterator, carried=False)
        self.save(engine, step, {**items, **state.capture_rng()})
        self.saved.append(step)
        self._prune(engine, step)
        self.stall += time.perf_counter() - start

    def save(self, engine, step: int, items: dict) -> None:
        """Write ``step``'s checkpoint: the engine's state and its small ``items`` (RNG, data position)."""
        raise NotImplementedError

    def restore(self, engine) -> Optional[tuple[int, InstructionHook, dict]]:
        """Load the newest checkpoint every rank has (the usual restart): its step, the hook that sets its RNG
        states at the next iteration's start, and its small state (what a loop that counts its calls puts back
        once it has replayed them); None when no rank has a checkpoint."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until the last save has landed (written before :meth:`save` returned, but for DCP's)."""

    def _checkpoints(self, engine) -> list[Path]:
        """The checkpoints this rank prunes: rank 0 the directories every rank writes into (a DeepSpeed tag's, a
        DCP checkpoint's, whose newest may not be there yet: it is written in the background)."""
        return [p for p in self.save_dir.glob("*step*") if p.is_dir()] if engine.global_rank == 0 else []

    def _prune(self, engine, step: int) -> None:
        """Remove all but the newest ``KEEP`` checkpoints, ``step``'s among them."""
        steps = {path: _step_of(path) for path in self._checkpoints(engine)}
        kept = sorted(set(steps.values()) | {step})[-KEEP:]
        for path, saved in steps.items():
            if saved not in kept:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def _restored(self, engine, step: int, items: dict) -> tuple[int, InstructionHook, dict]:
        return step, state.restore_items(engine, items, self.data_iterator), items

    def _newest_common(self, mine: list[int]) -> Optional[int]:
        """The newest step every rank has a checkpoint of; None where no rank has any. Ranks that have some
        but none in common are an error: starting from step 0 would drop their progress."""
        newest = torch.tensor([max(mine, default=0), -max(mine, default=0)], dtype=torch.int64,
                              device=collective_device())
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        common, most = int(newest[0]), -int(newest[1])
        if most == 0:
            return None
        if common == 0:
            raise BaftError(f"{self.save_dir}: some ranks have {self.kind} checkpoints (up to step {most}) and others "
                            f"none; refusing to start again from step 0")
        return common


class DeepSpeedCheckpoint(DiskCheckpoint):
    """DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``, the small items in its ``client_state``."""

    kind = "deepspeed"

    def save(self, engine, step: int, items: dict) -> None:
        engine.save_checkpoint(str(self.save_dir), tag=f"global_step{step}",
                               client_state={ITEMS_KEY: replicas_items(engine, items)})

    def restore(self, engine):
        path, client = engine.load_checkpoint(str(self.save_dir)) if self.save_dir.exists() else (None, None)
        if path is None:
            return None
        return self._restored(engine, engine.global_steps, own_items(engine, client[ITEMS_KEY]))


class TorchSaveCheckpoint(DiskCheckpoint):
    """``torch.save`` of each rank's state to a file of its own (``step7-rank0.pt``)."""

    kind = "torch-save"

    def save(self, engine, step: int, items: dict) -> None:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"tensors": state.state_tensors(engine), "items": items}, self._file(engine, step))

    def restore(self, engine):
        step = self._newest_common([_step_of(p) for p in self._checkpoints(engine)])
        if step is None:
            return None
        saved = torch.load(self._file(engine, step), weights_only=False)
        state.create_optimizer_state(engine, _entries_of(saved["tensors"]))
        live = state.state_tensors(engine)
        for name, tensor in saved["tensors"].items():
            live[name].copy_(tensor)
        return self._restored(engine, step, saved["items"])

    def _checkpoints(self, engine) -> list[Path]:
        """Each rank's own files."""
        return list(self.save_dir.glob(f"step*-rank{engine.global_rank}.pt"))

    def _file(self, engine, step: int) -> Path:
        return self.save_dir / f"step{step}-rank{engine.global_rank}.pt"


class DcpAsyncCheckpoint(DiskCheckpoint):
    """``torch.distributed.checkpoint.async_save``: staged before the call returns, written in the background."""

    kind = "dcp-async"

    def __init__(self, save_dir: str, period: int, data_iterator=None):
        super().__init__(save_dir, period, data_iterator)
        self.pending = None  # the previous save, still being written
        # async_save plans its save with collectives from a background thread: on the default gloo
        # group they would race the pipeline's p2p and abort, so they get a group of their own
        self.group = dist.new_group(backend="gloo")
        self.stager = None  # the last save's, staging into pinned host memory where there is a GPU

    def save(self, engine, step: int, items: dict) -> None:
        from torch.distributed.checkpoint import async_save

        self.wait()
        # plain tensors: DCP's stager deep-copies a Parameter's Python attributes too (DeepSpeed's mappings)
        tensors = {f"rank{engine.global_rank}/{k}": v.detach() for k, v in state.state_tensors(engine).items()}
        tensors[f"rank{engine.global_rank}/items"] = json.dumps(items)  # saved as bytes beside the tensors
        self.pending = async_save(tensors, checkpoint_id=str(self.save_dir / f"step{step}"),
                                  process_group=self.group, async_stager=self._stager())

    def restore(self, engine):
        # a checkpoint is complete once DCP wrote its .metadata, after every rank's data
        step = self._newest_common([_step_of(p) for p in self.save_dir.glob("step*") if (p / ".metadata").is_file()])
        if step is None:
            return None
        return self._restored(engine, step, self._load(engine, self.save_dir / f"step{step}"))

    def _stager(self):
        """DCP's stager with pinned staging buffers on a GPU (the fast path DCP offers), staged before
        ``async_save`` returns: the next optimizer step may change the state right after. A new one per save,
        closed once the save lands: torch 2.11's ``async_save`` closes the stager it is given, and a closed
        stager cannot copy a dict again (``KeyError: <class 'type'>`` at the second save, on an H200)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=gpu))
        return self.stager

    def wait(self):
        """Until the last save has landed (a DCP save is written in the background)."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def close(self):
        self.wait()  # the last async save must land before its process group goes

    def _load(self, engine, path: Path) -> dict:
        from torch.distributed.checkpoint import FileSystemReader, load

        prefix = f"rank{engine.global_rank}/"
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state.create_optimizer_state(engine, [
            entry(key[len(prefix):], torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta"), "optimizer")
            for key, md in saved.items() if key.startswith(prefix + "optim/") and hasattr(md, "size")])
        target = {prefix + k: v for k, v in state.state_tensors(engine).items()}
        target[prefix + "items"] = ""
        load(target, checkpoint_id=str(path), process_group=self.group)
        return json.loads(target[prefix + "items"])


BASELINES = {cls.kind: cls for cls in (DeepSpeedCheckpoint, TorchSaveCheckpoint, DcpAsyncCheckpoint)}


def disk_checkpoint(kind: str, save_dir: str, period: int, data_iterator=None) -> DiskCheckpoint:
    """The baseline a policy names (``deepspeed``, ``torch-save``, ``dcp-async``), saving to ``save_dir``."""
    return BASELINES[kind](save_dir, period, data_iterator)


def _step_of(path: Path) -> int:
    """The step a checkpoint's file or directory is of: ``step7-rank0.pt`` (torch-save), ``step7`` (DCP),
    ``global_step7`` (DeepSpeed's tag)."""
    return int(path.name.split("step")[1].split("-")[0])


def _entries_of(tensors: dict):
    return [entry(name, t, "optimizer" if name.startswith("optim/") else "parameters") for name, t in tensors.items()]

