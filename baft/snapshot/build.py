"""Build the snapshot policy a config asks for.

``make_policy`` returns an engine hook. For ``baft`` it plans from the configured plan or
bubble map; without one, it plans from the receive waits it times in this run's second
iteration (the first warms up); a plan or map that does not fit this run is refused with one
line, and baft plans from the first iteration's receive waits instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from baft.accelerator import collective_device
from baft.config import BaftConfig, node_of, node_root
from baft.errors import BaftError
from baft.pipeline.bubblemap import BubbleMap
from baft.pipeline.hook import InstructionHook
from baft.pipeline.profiler import InstructionTimer, measured_bubbles, median_profile
from baft.snapshot.baselines import disk_checkpoint
from baft.snapshot.copiers import copier_for
from baft.snapshot.planner import DEFAULT_BUDGET, Plan, RankPlan, check_plan, choose_period, plan_rank
from baft.snapshot.policies import BubbleExecutor, SyncCopy, ThreadCopy
from baft.snapshot.sizes import measure_copy_bandwidth


def warn(engine, message: str) -> None:
    print(f"baft: rank {engine.global_rank}: {message}", file=sys.stderr, flush=True)


def rank_node_root(cfg: BaftConfig, rank: int) -> str:
    """The shared-memory root of the node that keeps ``rank``'s snapshots (:func:`baft.config.node_root`)."""
    return str(node_root(cfg.shm_root, cfg.run_id, node_of(cfg, rank)))


def make_policy(engine, cfg: BaftConfig, data_iterator=None, link=None) -> InstructionHook:
    """The hook that takes snapshots as ``cfg.policy`` says; ``link`` tells the manager of commits."""
    period = cfg.period if isinstance(cfg.period, int) else None
    common = dict(chunk_bytes=cfg.chunk_bytes, data_iterator=data_iterator, link=link)
    if cfg.policy == "baft":
        root = rank_node_root(cfg, engine.global_rank)
        return PlannedExecutor(cfg, root, period=period or 1, fixed_period=period,
                               copier=copier_for(cfg.executor, engine.device, cfg.leftovers), **common)
    if cfg.policy in ("sync-copy", "thread-copy"):
        cls = SyncCopy if cfg.policy == "sync-copy" else ThreadCopy
        return cls(rank_node_root(cfg, engine.global_rank), period=period or 1, **common)
    save_dir = cfg.save_dir or str(Path(cfg.run_dir) / "checkpoints" if cfg.run_dir
                                    else Path(rank_node_root(cfg, engine.global_rank)) / "disk")
    return disk_checkpoint(cfg.policy, save_dir, period or 1, data_iterator)


class PlannedExecutor(BubbleExecutor):
    """The bubble-aware executor that plans itself once the state exists: after one iteration with a
    plan or bubble map configured; without one, after two (a warm-up, then the one it plans from).
    Until then it snapshots every iteration, copying in whatever receive waits there are.

    The number depends on the configuration only, so that every rank plans at the same step: the
    ranks agree on the period there, in one collective.
    """

    def __init__(self, cfg: BaftConfig, root: str, fixed_period: Optional[int] = None, **kwargs):
        super().__init__(root, **kwargs)
        self.cfg, self.fixed_period = cfg, fixed_period
        self.timer = InstructionTimer()  # this run's receive waits, planned from without a map
        self.timed_before_planning = 1 if cfg.plan or cfg.bubble_map else 2
        self.planned = False
        self.plan_source = ""

    def iteration_start(self, engine):
        if not self.planned and len(self.timer.iterations) >= self.timed_before_planning:
            self.make_plan(engine)
        if not self.planned:
            self.timer.iteration_start(engine)
        super().iteration_start(engine)

    def before(self, engine, index, cmd):
        if not self.planned:
            self.timer.before(engine, index, cmd)
        super().before(engine, index, cmd)

    def after(self, engine, index, cmd):
        if not self.planned:
            self.timer.after(engine, index, cmd)
        super().after(engine, index, cmd)

    def before_update(self, engine, index, waited):
        if not self.planned:
            self.timer.before_update(engine, index, waited)
        super().before_update(engine, index, waited)

    def iteration_end(self, engine):
        if not self.planned:
            self.timer.iteration_end(engine)
        super().iteration_end(engine)

    def make_plan(self, engine) -> None:
        self.prepare(engine)
        layout = self.source.layout
        mine = None
        try:
            mine = self._plan_from_files(engine, layout)
        except BaftError as err:
            warn(engine, f"{err}; planning from the receive waits of this run instead")
        if mine is None:
            mine = self._plan_from_measured_waits(engine, layout)
            self.plan_source = f"receive waits timed in this run's iteration {len(self.timer.iterations)}"
        mine.seal, mine.slots = self.sealer.seconds, self.writer.slots
        self.plan = mine
        period = self.fixed_period or choose_period([mine], DEFAULT_BUDGET)
        agreed = torch.tensor([period], dtype=torch.int64, device=collective_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank must snapshot the same steps
        self.period = int(agreed.item())
        self.planned = True

    def _plan_from_files(self, engine, layout) -> Optional[RankPlan]:
        cfg = self.cfg
        sizes = [c.nbytes for c in layout.chunks]
        if cfg.plan:
            plan = Plan.load(cfg.plan)
            mine = check_plan(plan, engine.global_rank, engine.num_stages, layout.fingerprint, layout.nbytes,
                              len(layout.chunks))
            self.plan_source = cfg.plan
            return mine
        if cfg.bubble_map:
            bmap = BubbleMap.load(cfg.bubble_map, stages=engine.num_stages)
            expected = bmap.model.get("layout", {}).get(str(engine.stage_id))
            if expected and expected != layout.fingerprint:
                raise BaftError(f"{cfg.bubble_map}: profiled a different model (stage {engine.stage_id} "
                                f"layout {expected}, this run's is {layout.fingerprint})")
            if bmap.schedule != engine.baft.schedule or bmap.micro_batches != engine.micro_batches:
                raise BaftError(f"{cfg.bubble_map}: profiled {bmap.schedule} with {bmap.micro_batches} micro-batches, "
                                f"this run is {engine.baft.schedule} with {engine.micro_batches}")
            profile = bmap.rank_profile(engine.stage_id, engine.grid.get_data_parallel_rank()) \
                or bmap.rank_profile(engine.stage_id)
            self.plan_source = cfg.bubble_map
            return plan_rank(bmap.stage_bubbles(engine.stage_id), sizes, profile.copy_bandwidth,
                             profile.iteration_time, engine.global_rank, engine.stage_id, layout.fingerprint)
        return None

    def _plan_from_measured_waits(self, engine, layout) -> RankPlan:
        """This rank's receive waits in its last timed iteration and its copy bandwidth, measured as
        ``baft profile`` measures them."""
        trace = {"rank": engine.global_rank, "stage": engine.stage_id, "dp_rank": 0,
                 "iterations": self.timer.iterations, "state_bytes": {}, "copy_bandwidth": 0.0}
        own = median_profile(trace, skip=len(self.timer.iterations) - 1)
        return plan_rank(measured_bubbles(own), [c.nbytes for c in layout.chunks], measure_copy_bandwidth(engine),
                         own.iteration_time, engine.global_rank, engine.stage_id, layout.fingerprint)
