"""Per-step, per-part digests of a rank's training state: the proof that a resumed run is bit-identical.

With ``BAFT_STATE_DIGESTS=DIR`` in its environment, every rank of a run with a ``"baft"``
section appends JSON lines to ``DIR/rank<r>.jsonl``::

    {"rank": 1, "restart": 0, "step": 6, "parts": {"weights": "9f0c...", "rng.torch": "...", ...}}

one at the start of every iteration, for the state of the step it starts from (the moment a
snapshot captures it), and one at its end with the digest of the micro-batches it read
(``batches``, under the step it produced). The parts are read from the engine's public state,
independently of what baft snapshots, so a part baft fails to save or restore shows up here:
module weights, the optimizer's ``state_dict()`` (fp32 masters, moments and step counts, every
``param_groups`` hyper-parameter), the LR scheduler's ``state_dict()``, the loss scaler, every RNG
(python, numpy, torch, CUDA), the engine's counters and the data position.

:func:`compare` reads two such directories, an uninterrupted run's and a faulted one's, and says
for each rank and part the first step whose digest differs ("rank 1: optimizer.param_groups[0].lr
differs from step 9"). Both runs must train the same script on the same machine: the digests
are of exact bits. A run with no uninterrupted twin is checked against itself: :func:`redone_differ`
says where a step trained again after a restore differs from its first training.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
import xxhash
from deepspeed.runtime.pipe.schedule import LoadMicroBatch

from baft.pipeline.hook import InstructionHook
from baft.script.attributes import module_attributes
from baft.script.loop import THIS_PROCESS
from baft.script.main_globals import globals_now
from baft.script.rng import rng_states
from baft.script.schedulers import script_schedulers
from baft.recovery.record import restart_count
from baft.snapshot.state import ENGINE_COUNTERS, loss_scaler

DIGESTS_ENV = "BAFT_STATE_DIGESTS"


_SCALARS = (bool, int, float, str, bytes, type(None))


def _leaves(obj, path: str) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) for every leaf of a nested state: dict keys as ``.key``, list items as ``[i]``, the
    integer keys of a dict (an optimizer's per-parameter ``state``) folded into ``[*]``, and a list of
    plain values (``betas``) one leaf."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            sub = f"{path}[*]" if isinstance(key, int) else f"{path}.{key}"
            yield from _leaves(obj[key], sub)
    elif isinstance(obj, (list, tuple)) and all(isinstance(item, _SCALARS) for item in obj):
        yield path, repr(obj).encode()
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _leaves(item, f"{path}[{i}]")
    elif torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        yield path, f"{t.dtype}{tuple(t.shape)}".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(obj, np.ndarray):
        yield path, f"{obj.dtype}{obj.shape}".encode() + obj.tobytes()
    elif isinstance(obj, _SCALARS):
        yield path, repr(obj).encode()  # repr keeps the type: 0 and 0.0 differ
    elif hasattr(obj, "__dict__"):  # a loss scaler kept in a state_dict as an object
        yield from _leaves({k: v for k, v in vars(obj).items() if not k.startswith("_")}, path)
    else:
        yield path, type(obj).__name__.encode()


def _digest_parts(leaves: Iterator[tuple[str, bytes]]) -> dict[str, str]:
    hashes: dict[str, xxhash.xxh3_64] = {}
    for path, data in leaves:
        hashes.setdefault(path, xxhash.xxh3_64()).update(data)
    return {path: h.hexdigest() for path, h in hashes.items()}


def state_parts(engine, data_iterator=None) -> dict[str, str]:
    """The digest of each part of this rank's training state, by part name."""
    generators = ((f"rng.{name}", data) for name, gen in rng_states().items() for _, data in _leaves(gen, ""))
    nested = {"optimizer": engine.optimizer.state_dict(),
              "counters": {k: getattr(engine, k, None) for k in ENGINE_COUNTERS}}
    if getattr(engine, "lr_scheduler", None) is not None:
        nested["lr_scheduler"] = engine.lr_scheduler.state_dict()
    own = script_schedulers(engine)
    if own:
        # by kind (one of each): the order a walk of the live objects finds them in is not a process's to keep
        nested["script_schedulers"] = {type(scheduler).__qualname__: scheduler.state_dict() for scheduler in own}
    scaler = loss_scaler(engine.optimizer)
    if scaler is not None:
        nested["loss_scaler"] = scaler
    if data_iterator is not None and hasattr(data_iterator, "state_dict"):
        nested["data"] = data_iterator.state_dict()
    if engine.baft.client_state is not None:
        nested["client_state"] = engine.baft.client_state.capture()
    carried = THIS_PROCESS.carried_values(engine)
    if carried is not None:
        nested["carried"] = carried
    reads = getattr(engine.baft, "reads", None)
    reader = reads.reader_state() if reads is not None else None
    if reader is not None:  # a wrapper of the script's around the loader: its epoch count
        nested["reader"] = reader["counts"]
    attributes = module_attributes(engine.module)
    if attributes:
        nested["module_attributes"] = attributes
    script_globals = globals_now()
    if script_globals:
        nested["script_globals"] = script_globals
    weights = (("weights", data) for _, data in _leaves(engine.module.state_dict(), ""))
    return (_digest_parts(weights) | _digest_parts(generators)
            | _digest_parts((path.lstrip("."), data) for path, data in _leaves(nested, "")))


class StateDigests(InstructionHook):
    """Appends this rank's state digests to ``directory/rank<r>.jsonl`` at every step boundary."""

    def __init__(self, directory: str, data_iterator=None):
        self.directory, self.data_iterator = Path(directory), data_iterator
        self.directory.mkdir(parents=True, exist_ok=True)
        self.batches = xxhash.xxh3_64()
        self.engine = None  # set at a step boundary

    def _write(self, engine, parts: dict, at_exit: bool = False) -> None:
        line = {"rank": engine.global_rank, "pid": os.getpid(), "restart": restart_count(), "step": engine.global_steps,
                "parts": parts}
        if at_exit:
            line["at_exit"] = True
        with open(self.directory / f"rank{engine.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def iteration_start(self, engine):
        self.batches = xxhash.xxh3_64()
        self.engine = None
        self._write(engine, state_parts(engine, self.data_iterator))

    def after(self, engine, index, cmd):
        if isinstance(cmd, LoadMicroBatch):  # the first stage loads inputs, the last labels
            loaded = [engine.pipe_buffers[key][cmd.buffer_id] for key, load in
                      (("inputs", engine.is_first_stage()), ("labels", engine.is_last_stage())) if load]
            for _, data in _leaves(loaded, ""):
                self.batches.update(data)

    def iteration_end(self, engine):
        self.engine = engine  # at a step boundary until the next iteration starts
        self._write(engine, {"batches": self.batches.hexdigest()})

    def close(self):
        """The state after the last step (not after an iteration a fault cut short), as the process ends: after the
        loop's code that followed its call, not the code that begins the next iteration (its learning rate), so
        marked; :func:`load` takes it only for a step no iteration started from."""
        if self.engine is not None:
            self._write(self.engine, state_parts(self.engine, self.data_iterator), at_exit=True)


def digests_hook(data_iterator=None):
    """The digest hook when ``BAFT_STATE_DIGESTS`` names a directory, else None."""
    directory = os.environ.get(DIGESTS_ENV)
    return StateDigests(directory, data_iterator) if directory else None


def _records(directory) -> Iterator[dict]:
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def _states(directory) -> list[dict]:
    """The records of ``directory``, less those of a step's state as a process ended where an iteration started
    from that step too (:func:`load`)."""
    records = list(_records(directory))
    started = {(rec["rank"], rec["step"]) for rec in records if not rec.get("at_exit") and len(rec["parts"]) > 1}
    return [rec for rec in records if not (rec.get("at_exit") and (rec["rank"], rec["step"]) in started)]


def processes(directory) -> dict[int, dict[int, int]]:
    """restart -> rank -> the pid that recorded that rank's state in it (a recovery in place keeps a survivor's)."""
    found: dict[int, dict[int, int]] = {}
    for rec in _records(directory):
        found.setdefault(rec["restart"], {})[rec["rank"]] = rec["pid"]
    return found


def load(directory) -> dict[tuple[int, int], dict[str, dict[str, int]]]:
    """(rank, step) -> part -> {digest: the first restart that recorded it} (a step trained twice, before
    and after a fault, has its digests from both). A step's state as a process ended (the last of a run, or where a
    fault between steps ended it) counts only where no iteration started from that step: it was read before the
    loop's code that begins the next (probe 19: a finished run launched again to train on was said to differ at its
    last step, in the learning rate its loop sets for the next)."""
    found: dict = defaultdict(lambda: defaultdict(dict))
    for rec in _states(directory):
        for part, digest in rec["parts"].items():
            seen = found[rec["rank"], rec["step"]][part]
            seen[digest] = min(seen.get(digest, rec["restart"]), rec["restart"])
    return found


def compare(reference, run, last_step: Optional[int] = None) -> list[str]:
    """One line per (rank, part) of ``run`` that differs from the uninterrupted ``reference`` run, naming the
    first step, and saying so where it differed before any restart (the script itself does not repeat it:
    an unseeded generator); also a line for each step up to the reference's last, or part, that only the
    run recorded, and one for each rank whose last step is not the reference's, or ``last_step`` (a resumed
    loop that trained past the end, or stopped short). Steps past the reference's last are not compared. Empty:
    identical in every part at every step both ran, and the run ended where it should."""
    ref, got = load(reference), load(run)
    empty = [f"{directory}: no digests recorded" for directory, found in ((reference, ref), (run, got)) if not found]
    if empty:
        return empty
    last = {rank: step for rank, step in sorted(ref)}
    ran = {rank: step for rank, step in sorted(got)}
    problems = [f"rank {rank}: the run's last step is {ran.get(rank)}, the reference's {step}"
                for rank, step in sorted(last.items()) if last_step is None and ran.get(rank) != step]
    problems += [f"rank {rank}: the run's last step is {ran.get(rank)}, not {last_step}"
                 for rank in sorted(last) if last_step is not None and ran.get(rank) != last_step]
    first: dict[tuple[int, str], tuple[int, bool]] = {}
    for (rank, step), parts in sorted(got.items()):
        if step > last.get(rank, -1):
            continue
        if (rank, step) not in ref:
            problems.append(f"rank {rank}: step {step} is not in the reference run")
            continue
        for one, other, which in ((ref[rank, step], parts, "faulted"), (parts, ref[rank, step], "reference")):
            # a run that starts at this step (from a checkpoint) read no batches for it
            missing = sorted(set(one) - set(other) - {"batches"}) if "weights" in one and "weights" in other else []
            if missing:
                problems.append(f"rank {rank}: {', '.join(missing)} at step {step} not in the {which} run")
        for part, digests in parts.items():
            expected = ref[rank, step].get(part)
            if expected is not None and set(digests) != set(expected):
                before_restart = any(restart == 0 for d, restart in digests.items() if d not in expected)
                first.setdefault((rank, part), (step, before_restart))
    for (rank, part), (step, before_restart) in sorted(first.items()):
        why = ", before any restart: the script itself does not repeat it (an unseeded generator?)" \
            if before_restart else ""
        problems.append(f"rank {rank}: {part} differs from step {step}{why}")
    return problems


def redone_differ(run) -> list[str]:
    """The check of a run that has no uninterrupted twin: one line per (rank, part) whose digests differ
    between the records of a step trained more than once (before a fault and again after its restore),
    naming the first such step, or one line saying no step was trained twice. Empty: every step trained
    again equal to its first training in every part."""
    recorded: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    for rec in _states(run):
        for part, digest in rec["parts"].items():
            recorded[rec["rank"], rec["step"], part].append(digest)
    redone = {key: digests for key, digests in sorted(recorded.items()) if len(digests) > 1}
    if not redone:
        return [f"{run}: no step is recorded twice, nothing to compare"]
    first: dict[tuple[int, str], int] = {}
    for (rank, step, part), digests in redone.items():
        if len(set(digests)) > 1:
            first.setdefault((rank, part), step)
    return [f"rank {rank}: {part} differs from step {step} when it is trained again"
            for (rank, part), step in sorted(first.items())]
