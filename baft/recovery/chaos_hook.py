"""The hook that carries out :mod:`baft.recovery.chaos`'s faults inside a rank's iterations."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, RecvActivation, RecvGrad

from baft import faults as fault_log
from baft.errors import BaftError
from baft.manager.control import INFO_NAME
from baft.manager.protocol import ManagerClient
from baft.pipeline.hook import InstructionHook
from baft.recovery.chaos import Fault
from baft.snapshot.optimizers import before_base_step
from baft.snapshot.policies import SnapshotPolicy


COVERED_WAIT = 60.0  # seconds a node fault waits for its node's parity group to be able to rebuild it


class ChaosHook(InstructionHook):
    """Kills this rank when one of its faults comes due. Install it after the snapshot policy."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int, run_dir: Optional[str],
                 node: int = 0, node_root: Optional[str] = None):
        self.faults = [f for f in faults if f.restart == attempt and (f.rank == rank or f.node == node)]
        self.run_dir, self.node_root, self.rank, self.node = run_dir, node_root, rank, node

    def _due(self, engine, phase: str) -> Optional[Fault]:
        step = engine.global_steps + 1  # the step this iteration produces
        return next((f for f in self.faults if f.step == step and f.phase == phase), None)

    def _log(self, fault: Fault, delay: float = 0.0) -> None:
        if not self.run_dir:
            return
        fault_log.append(self.run_dir, fault.what, fault.restart, at=time.time() + delay)

    def _kill(self, fault: Fault, delay: float = 0.0) -> None:
        self._log(fault, delay)
        if delay:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def iteration_start(self, engine):
        if seal := self._due(engine, "seal"):
            for policy in _snapshot_policies(engine):
                policy.sealer.before_seal = lambda: self._kill(seal)  # on the sealing thread, later
        if fault := self._due(engine, "manager"):
            self._log(fault)
            self._kill_manager()
        elif fault := self._due(engine, "node"):
            deadline = time.monotonic() + COVERED_WAIT
            while not self._covered() and time.monotonic() < deadline:
                time.sleep(0.05)
            self._kill_manager()
            shutil.rmtree(self.node_root, ignore_errors=True)  # the node's memory is gone with it
            self._kill(fault)

    def _covered(self) -> bool:
        """Whether enough other members of the node's parity group hold shares of its newest encoded step to rebuild
        it (True where the node has no manager or no group: nothing to wait for)."""
        try:
            with ManagerClient.connect(self.node_root, timeout=2.0) as client:
                parity = client.status()["parity"]
        except BaftError:
            return True
        if not parity:
            return True
        others = [m for m in parity["acked"].get(str(parity["encoded_step"]), []) if m != self.node]
        return len(others) >= parity["k"]

    def _kill_manager(self) -> None:
        try:
            os.kill(json.loads((Path(self.node_root) / INFO_NAME).read_text())["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass  # no manager on this node, or another rank of the node got it first

    def before(self, engine, index, cmd):
        if isinstance(cmd, (RecvActivation, RecvGrad)) and (fault := self._due(engine, "copy")):
            if any(p.stream is not None and p.snapshot is not None for p in _snapshot_policies(engine)):
                self._kill(fault)  # the snapshot's copies are queued on a stream, not yet fenced
        if isinstance(cmd, ForwardPass) and (fault := self._due(engine, "forward")):
            self._kill(fault)
        elif isinstance(cmd, BackwardPass) and (fault := self._due(engine, "backward")):
            self._kill(fault)

    def before_update(self, engine, index, waited):
        fault = self._due(engine, "commit") or self._due(engine, "optimizer")
        if fault is None:
            return

        def commit_then_kill(*_):
            for policy in _snapshot_policies(engine):
                policy.drain()  # snapshots are sealed off the trainer's path: let the commit land
            self._kill(fault, delay=0.002 if fault.phase == "optimizer" else 0.0)
        # the policy, an earlier hook, has fenced: kill as the base optimizer's step begins, or now
        if before_base_step(engine.optimizer, commit_then_kill) is None:
            commit_then_kill()

    def recovering(self, engine):
        if fault := self._due(engine, "recover"):
            self._kill(fault)

    def bubble(self, engine, index, cmd):
        fault = self._due(engine, "copy")  # the host copies while this receive waits
        if fault is None:
            return None
        return lambda landed: self._kill(fault)


def _snapshot_policies(engine) -> list[SnapshotPolicy]:
    return [engine.baft.hooks.policy] if isinstance(engine.baft.hooks.policy, SnapshotPolicy) else []
