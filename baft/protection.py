"""What baft adds to one DeepSpeed pipeline engine, in one object: ``engine.baft``.

A :class:`Protection` holds the run's ``"baft"`` config, the hooks in their named order
(:class:`~baft.pipeline.hook.Hooks`), the snapshot it restored, the script's own state and the
link to the node's snapshot manager (:mod:`baft.manager_link`). Its lifecycle: :meth:`Protection.attach`
(the engine runs baft's schedule and hooks), :meth:`Protection.restore` (the newest snapshot every rank holds, or
the disk baseline's checkpoint), :meth:`Protection.protect` (the snapshot policy and what watches
it), then training; :meth:`Protection.close` tears it all down and gives the engine back as
DeepSpeed made it, so that a new one can be built in the same process.
"""

from __future__ import annotations

from typing import Optional

from baft.config import IN_MEMORY, BaftConfig, node_of
from baft.errors import BaftError
from baft.manager_link import ManagerLink, connect_manager
from baft.pipeline.hook import Hooks
from baft.pipeline.engine import attach, detach
from baft.script.loop import THIS_PROCESS
from baft.recovery.record import Restored
from baft.snapshot.build import make_policy, rank_node_root, warn
from baft.position.reads import TrainBatchReads


class Protection:
    """Everything baft adds to one engine (see the module's docstring)."""

    def __init__(self, engine, config: BaftConfig):
        self.engine, self.config = engine, config
        self.schedule = config.schedule
        self.hooks = Hooks()
        self.client_state = None  # the script's own state (a ClientState), where it gave one
        self.load_guard = None  # what the engine's load_checkpoint calls, once restored (recovery.script_checkpoint)
        self.restored: Optional[Restored] = None
        self.policy = None  # made by restore(): a disk baseline restores through it
        self.manager = None  # this node's ManagerClient, while the policy keeps snapshots in memory
        # what baft.initialize did, to do again in place after a peer was killed, returning the new protection (None
        # where it cannot: the reason is baft.script.loop.THIS_PROCESS.not_in_place)
        self.again = None
        self.reads = TrainBatchReads(engine)  # what train_batch reads, call by call
        self.configured_batch_size = int(engine.train_batch_size())  # the config's, before the script or a restore

    @property
    def data_position(self):
        """What the data position is saved and restored with (:func:`baft.position.kept.data_position`), or None."""
        return self.reads.position

    @data_position.setter
    def data_position(self, position) -> None:
        self.reads.position = position

    @property
    def root(self) -> str:
        """The shared-memory root of this rank's node."""
        return rank_node_root(self.config, self.engine.global_rank)

    def warn(self, message: str) -> None:
        warn(self.engine, message)

    def attach(self) -> "Protection":
        """The engine runs baft's schedule and calls :attr:`hooks` around every instruction; the generators its
        modules hold are among the RNG states baft keeps, and the plain values the script's own modules hold as
        attributes, and the tensors the script's main file holds in globals, are noted as they start (those that change
        are kept)."""
        from baft.script.attributes import hold_module_attributes
        from baft.script.main_globals import hold_globals
        from baft.script.rng import hold_module_generators

        attach(self.engine, self)
        hold_module_generators(self.engine.module)
        hold_module_attributes(self.engine.module)
        hold_globals(self.engine.module)
        return self

    def restore(self, data_iterator=None) -> Optional[Restored]:
        """Put back the newest snapshot every rank holds (for the in-memory policies; on a first start
        under ``adopt``, the job's DeepSpeed checkpoint), or None for a fresh start; its RNG states are
        set as the next iteration starts."""
        from baft.recovery import record
        from baft.snapshot import state

        cfg, engine = self.config, self.engine
        state.check_capturable(engine, data_iterator)  # what baft cannot restore exactly is refused now, in one line
        if cfg.policy in IN_MEMORY:
            self.manager = connect_manager(cfg, engine, self.root, self.warn)
            if self.manager is None and cfg.require_manager:
                raise BaftError(f"baft.require_manager: no snapshot manager answers at {self.root}; start one with "
                                f"'baft manager start' or set require_manager to false")
            self.restored = self._restore_snapshot(data_iterator)
        self.policy = make_policy(engine, cfg, data_iterator, link=ManagerLink(self, self.manager))
        if cfg.policy not in IN_MEMORY:  # the disk baselines restart the usual way: from their newest checkpoint
            record.mark("restore_start")
            loaded = self.policy.restore(engine)
            record.mark("restore_end")
            self.restored = Restored(loaded[0], "disk", 1, rng=loaded[1], items=loaded[2]) if loaded else None
            if loaded and engine.global_rank == 0:
                print(f"baft: resumed from step {loaded[0]} (disk, {cfg.policy})", flush=True)
        if self.restored is not None:
            self.hooks.rng = self.restored.rng
            if self.restored.items is not None and hasattr(self.policy, "keep_items"):
                self.policy.keep_items(self.restored.step, self.restored.items)
        return self.restored

    def replayed(self) -> None:
        """A loop that counts its calls has replayed those before the restored step (:mod:`baft.script.loop`),
        running its own code between them, and is about to train the next: the state that code may have changed
        (a learning rate, a scheduler of its own, its ``client_state``) is put back as it was when that step first
        started. Not the data position: the replayed calls read no batches (a loader's position is put back by
        reading on to it), except where the loop took a new iterator of its resumable loader as it replayed (one
        per epoch): that one is made the restored one, the loader's generator as then; where the restored
        position is a spent epoch's (a disk checkpoint taken as the step ended, before the loop's next
        ``iter()``), a ``BaftError`` says why it cannot."""
        from baft.snapshot import state
        from baft.position.resumable import ResumableLoader

        position = self.data_position
        again = position if isinstance(position, ResumableLoader) and position.taken_since_restore() else None
        if again is not None and again.spent():
            raise BaftError("the loop took a new iterator of its data loader (iter(loader), once an epoch?) as it "
                            "replayed its calls, and the restored step's checkpoint was taken at its epoch's end, "
                            "before that iter(): baft cannot tell the next epoch's order from there. Use the policy "
                            "baft, loop on the engine's step (while engine.global_steps < N), or take one iterator "
                            "before the loop")
        items = self.restored.items if self.restored is not None else None
        if items is not None and items.get("at_exit"):
            # put back as the replay ended (replayed_to_exit): what the loop's code set since is the next step's
            if again is not None and "data" in items:
                again.load_state_dict(state.unblob(items["data"]))
        elif items is not None:
            state.restore_items(self.engine, items, again)

    def replayed_to_exit(self) -> None:
        """A loop that counts its calls has replayed the last before the restored step, and the snapshot of that
        step was taken as the process that trained it ended (:meth:`SnapshotPolicy.snapshot_final`), after the loop's
        code that followed the call, before the code that begins its next iteration: the state that code may have
        changed (a learning rate, a scheduler of its own, its ``client_state``) is put back now, where the loop goes
        on, for its code to set the next step's once (probe 19: put back as that step started, a finished nanoGPT run
        relaunched to train on undid the learning rate its loop set for the next step, silently). What the loop's
        code after the call changes by adding to it (``lr *= 0.5`` where the loss went up) it does again."""
        from baft.snapshot import state

        items = self.restored.items if self.restored is not None else None
        if items is not None and items.get("at_exit"):
            state.restore_items(self.engine, items)

    def protect(self) -> None:
        """Snapshot as the policy says, report the recovery after the first resumed iteration, inject
        the faults ``BAFT_CHAOS`` asks for, and beat for the node's manager to see this rank hang."""
        from baft.recovery import chaos, record

        cfg = self.config
        self.hooks.policy = self.policy
        self.hooks.report = record.RecoveryReport(self.restored, cfg.run_dir)
        faults = chaos.faults_from_env()
        if faults:
            from baft.recovery.chaos_hook import ChaosHook

            rank = self.engine.global_rank
            self.hooks.chaos = ChaosHook(faults, rank, record.restart_count(), cfg.run_dir,
                                         node=node_of(cfg, rank), node_root=self.root)
        if self.manager is not None and (cfg.hang_timeout or cfg.progress_timeout):
            from baft.manager.heartbeat import Heartbeat

            self.hooks.liveness = Heartbeat(self.root, self.engine.global_rank, record.restart_count(), cfg.run_dir,
                                            cfg.hang_timeout, cfg.progress_timeout).start(self.engine)

    def behind(self) -> Optional[str]:
        """Why a survivor cannot go on in place, or None, from the steps every rank holds, read from the node's
        shared memory as the fault is seen (seals that finish since only add steps), or for a disk baseline the
        checkpoints this rank saved: none yet (a fault before the first snapshot committed or the first checkpoint
        was saved: the survivor's state has moved on from the start a replacement makes, and there is nothing to
        take both back to); or its loop took a new iterator of its loader (an epoch's) after the newest of them,
        where a restore would go back to (its iterator would be made the restored one, and the steps its call
        trains from there would read past that epoch's end, from the wrong iterator); or it replaced a scheduler of
        its own since that step (:func:`baft.script.schedulers.replaced_since`)."""
        from baft.script import schedulers
        from baft.snapshot import slots

        if self.config.policy in IN_MEMORY:
            held = [{info.record.step for info in slots.committed(self.root, rank)}
                    for rank in slots.rank_ids(self.root)]
            newest = max(set.intersection(*held), default=None) if held else None
            if newest is None:
                return ("no snapshot every rank holds has committed yet: the survivors' state has moved on from the "
                        "start a replacement makes, and nothing takes both back to one step")
        else:
            restored = [self.restored.step] if self.restored is not None else []
            newest = max([*getattr(self.policy, "saved", ()), *restored], default=None)  # restored: in an earlier engine
            if newest is None:
                return (f"no {self.config.policy} checkpoint has been saved yet: the survivors' state has moved on "
                        f"from the start a replacement makes, and nothing takes both back to one step")
        # a loop that counts its calls trains those steps inside its call, each from the schedulers it first started
        # with (baft.script.loop): its own variables are not read again until then
        replaced = None if THIS_PROCESS.counts_calls else schedulers.replaced_since(self.engine, newest)
        if replaced:
            return replaced
        began = self.reads.epoch_began
        if began is None or newest >= began - 1:
            return None
        return (f"its loop took a new iterator of its data loader for step {began}, after the newest step "
                f"every rank holds ({newest}): the steps its call would train again start in the epoch before")

    def recover(self, error: BaseException) -> bool:
        """Recover this rank in place from ``error``, raised by ``train_batch`` (:mod:`baft.recovery.in_place`);
        False where the error stands."""
        from baft.recovery.in_place import recover

        return recover(self.engine, error)

    def close(self) -> None:
        """Stop every hook (the policy seals and hands over its last snapshot, and closes the manager link) and
        give the engine back as DeepSpeed made it."""
        for hook in self.hooks:
            hook.close()
        self.hooks = Hooks()
        if getattr(self.engine, "baft", None) is self:
            detach(self.engine)

    def _restore_snapshot(self, data_iterator) -> Optional[Restored]:
        from baft.recovery.restore import restore

        cfg, engine = self.config, self.engine
        restored = restore(engine, self.root, self.manager, data_iterator, True if cfg.adopt else cfg.fresh_start,
                           log=self.warn, run_id=cfg.run_id)
        if restored is None and cfg.adopt:  # the first start under baft: from the job's DeepSpeed checkpoint
            from baft.recovery.adopt import adopt

            restored = adopt(engine, cfg.adopt, data_iterator, log=self.warn)
            if engine.global_rank == 0:
                print(f"baft: adopted the DeepSpeed checkpoint of step {restored.step} in {cfg.adopt}", flush=True)
        elif restored is not None and engine.global_rank == 0:
            print(f"baft: resumed from step {restored.step} ({restored.source})", flush=True)
        return restored
