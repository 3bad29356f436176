"""Bit-identical resume across the jobs people run: cases drawn from the axes real jobs combine.

Each case trains ``tests/scripts/matrix_job.py`` twice at once under ``baft train``: uninterrupted
(``policy none``), and with its faults (SIGKILL of a rank by ``BAFT_CHAOS`` in a phase of a step,
or from outside by this process once the rank reached the step), both recording per-step, per-part
state digests (``BAFT_STATE_DIGESTS``). The case passes when the faulted run resumed after every
fault and every part of every rank's state, at every step both runs reached, is identical
(:func:`baft.recovery.digests.compare`); a case baft refuses at ``initialize`` says why in one line.

    python experiments/matrix.py --cases 20 --seed 1 --out experiments/results

writes ``matrix.md`` and ``matrix.json``: "N of N bit-identical in every part at every step", the
cases, and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from baft.cli.launch import launch_env
from baft.recovery.digests import DIGESTS_ENV, compare, processes

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "matrix_job.py"
AXES = {
    "optimizer": ["adam", "adamw", "sgd", "sgd-plain", "ds-adam"],  # sgd-plain: no momentum, no optimizer state
    "scheduler": ["none", "WarmupLR", "WarmupDecayLR-log", "WarmupDecayLR-linear", "WarmupCosineLR", "OneCycle",
                  "torch"],
    "own_scheduler": [False, True],  # a torch scheduler the script makes on the optimizer and steps after each step
    "precision": ["fp32", "bf16", "zero1-fp32", "zero1-bf16"],
    "data": ["engine", "stateful", "iterator", "set"],  # set: the iterator given by engine.set_dataiterator()
    "dropout": [[True, False], [False, True], [True, True], [False, False]],
    "dropout_rng": ["global", "tracker"],  # tracker: Megatron's, drawn inside DeepSpeed's model-parallel RNG tracker
    "checkpointing": [False, True],
    "tied": [False, True],
    "frozen": [False, True],
    "micro_batches": [2, 4, 8],
    "period": [1, "auto", 3],
    "form": ["path", "dict", "args", "config_params"],
    "recovery": ["in place", "relaunch"],  # baft train --in-place: the survivors keep their processes
    "seed_layers": [False, True],  # PipelineModule(seed_layers=True): every layer's forward seeded from a counter
    "loop": ["steps", "calls"],  # while engine.global_steps < N, or for _ in range(N) (baft.script.loop)
    # buffers a forward changes, on each stage: BatchNorm's; a counter and an average updated in place; the same
    # given anew (self.count = self.count + 1), and every parameter's .data rebound after each step
    "buffers": ["none", "batchnorm", "counter-inplace", "rebind"],
    # the script doubles its batch size from step 3 on (engine.set_train_batch_size, from the engine's step before
    # each call): a fault then relaunches every rank, in place too
    "batch_ramp": [False, True],
}
PHASES = ["forward", "backward", "copy", "seal", "commit", "optimizer", "outside"]
STEPS = 8


@dataclass
class Fault:
    rank: int
    step: int
    phase: str  # a chaos phase, or "outside": SIGKILL from this process once the rank reached the step

    def chaos(self, restart: int) -> str:
        return f"rank={self.rank},step={self.step},phase={self.phase},restart={restart}"


@dataclass
class Case:
    seed: int
    optimizer: str
    scheduler: str
    precision: str
    data: str
    dropout: list
    checkpointing: bool
    tied: bool
    frozen: bool
    micro_batches: int
    period: object
    form: str
    recovery: str
    seed_layers: bool = False
    loop: str = "steps"
    dropout_rng: str = "global"
    own_scheduler: bool = False
    buffers: str = "none"
    batch_ramp: bool = False
    faults: list = field(default_factory=list)
    steps: int = STEPS

    @property
    def ranks(self) -> int:
        return 4 if self.precision.startswith("zero1") else 2

    def job(self) -> dict:
        """What the training script reads (the faults are this runner's)."""
        return {k: v for k, v in asdict(self).items() if k not in ("faults", "recovery")}


def fault_steps(period, phase: str) -> list[int]:
    """The steps a fault in ``phase`` can hit with a snapshot committed before it. The snapshot of step k is
    copied, sealed and committed in iteration k + 1 (with period 3: k = 3, 6); "auto" plans a period of at
    most 3 here, so it gets a step past the first period and no copy or seal phase, which fire only in an
    iteration that snapshots."""
    if period == 1:
        return list(range(3, STEPS))
    if period == 3 and phase in ("copy", "seal"):
        return [7]  # step 6's snapshot, with step 3's committed
    return [] if phase in ("copy", "seal") else list(range(5, STEPS))


def draw_faults(rng: random.Random, ranks: int, period, phases: list[str]) -> list[Fault]:
    """One fault per phase given, each at a step it can hit, at increasing steps (a later fault hits the
    resumed run)."""
    faults, after = [], 0
    for phase in phases:
        steps = [step for step in fault_steps(period, phase) if step > after]
        later = len(phases) - len(faults) - 1  # faults still to place: leave them a step each where it can
        if steps:
            after = rng.choice(steps[:len(steps) - later] or steps)
            faults.append(Fault(rng.randrange(ranks), after, phase))
    return faults


def draw_case(seed: int) -> Case:
    """A case drawn from ``seed``: every axis uniformly, one or two faults."""
    rng = random.Random(seed)
    values = {axis: rng.choice(options) for axis, options in AXES.items()}
    case = Case(seed=seed, **values)
    phases = [p for p in PHASES if fault_steps(case.period, p)]
    case.faults = draw_faults(rng, case.ranks, case.period, rng.sample(phases, rng.choice([1, 2])))
    return case


@dataclass
class Outcome:
    case: Case
    problems: list[str]
    resumed: list[int]  # the step each restart resumed from
    refused: str = ""  # baft's one line, when it refused the job at initialize
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return not self.problems and not self.refused


def _start(case: Case, directory: Path, policy: str, faults: list[Fault]) -> subprocess.Popen:
    env = launch_env({DIGESTS_ENV: str(directory / "digests")})
    chaos = [f.chaos(restart) for restart, f in enumerate(faults) if f.phase != "outside"]
    if chaos:
        env["BAFT_CHAOS"] = ";".join(chaos)
    cmd = [sys.executable, "-m", "baft.cli", "train", "--nprocs", str(case.ranks), "--run-dir", str(directory / "run"),
           "--max-restarts", str(len(faults)), "--in-place" if case.recovery == "in place" else "--relaunch",
           "--", str(SCRIPT), "--case", json.dumps(case.job()),
           "--policy", policy, "--dir", str(directory)]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "baft-train.out", "w") as out:  # a file, not a pipe: nobody reads while the other runs
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, directory: Path, faults: list[Fault]) -> subprocess.CompletedProcess:
    """Wait for a training started by :func:`_start`, killing its ranks from outside where its faults say."""
    for restart, fault in enumerate(faults):
        if fault.phase == "outside":
            _kill_from_outside(directory / "digests", fault, restart, proc)
    proc.wait(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, (directory / "baft-train.out").read_text(), "")


def _kill_from_outside(digests: Path, fault: Fault, restart: int, proc: subprocess.Popen) -> None:
    """SIGKILL the fault's rank once its attempt ``restart`` has begun the iteration after ``fault.step - 1``."""
    path = digests / f"rank{fault.rank}.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            rec = json.loads(line)
            if rec["restart"] == restart and rec["step"] >= fault.step - 1 and "weights" in rec["parts"]:
                os.kill(rec["pid"], signal.SIGKILL)
                return
        time.sleep(0.05)


def run_case(case: Case, directory: Path) -> Outcome:
    """Train the case uninterrupted and with its faults; compare every part at every step."""
    start = time.monotonic()
    # both at once: their ranks take turns on the cores while the other run starts, stops or restarts
    runs = {name: _start(case, directory / name, policy, faults)
            for name, policy, faults in (("reference", "none", []), ("faulted", "baft", case.faults))}
    faulted = _finish(runs["faulted"], directory / "faulted", case.faults)
    reference = _finish(runs["reference"], directory / "reference", [])
    refused = _baft_error(faulted.stdout)  # the uninterrupted run's policy, none, refuses nothing
    if refused or reference.returncode != 0:
        return Outcome(case, [] if refused else [f"the uninterrupted run failed:\n{reference.stdout[-3000:]}"], [],
                       refused, time.monotonic() - start)
    problems = [] if faulted.returncode == 0 else [f"the faulted run failed:\n{faulted.stdout[-3000:]}"]
    records = _recovery(directory / "faulted" / "run")
    resumed = [r["restored_step"] for r in records]
    if len(records) != len(case.faults) or any(r["source"] == "fresh" for r in records):
        problems.append(f"expected {len(case.faults)} resumes from a snapshot, the recovery record has {records}")
    if case.recovery == "in place" and not case.batch_ramp:  # a batch size the script changed relaunches every rank
        problems += survivors_relaunched(records, directory / "faulted" / "digests", case.faults)
    problems += compare(directory / "reference" / "digests", directory / "faulted" / "digests")
    return Outcome(case, problems, resumed, "", time.monotonic() - start)


def survivors_relaunched(records: list[dict], digests: Path, faults: list[Fault]) -> list[str]:
    """What went otherwise than a recovery in place of each fault: the killed rank replaced, every other rank
    the same process after it as before (pids from the state digests)."""
    pids = processes(digests)
    problems = [f"restart {r['restart']} was a {r['kind']}, not in place" for r in records if r["kind"] != "in place"]
    for restart, fault in enumerate(faults):
        before, after = pids.get(restart, {}), pids.get(restart + 1, {})
        moved = sorted(rank for rank in before if rank != fault.rank and after.get(rank) != before[rank])
        if moved:
            problems.append(f"ranks {moved} are other processes after the kill of rank {fault.rank} at step "
                            f"{fault.step}: pids {[before[r] for r in moved]} -> {[after.get(r) for r in moved]}")
        if after.get(fault.rank) == before.get(fault.rank):
            problems.append(f"rank {fault.rank}, killed at step {fault.step}, has its pid still")
    return problems


def _baft_error(output: str) -> str:
    return next((line for line in output.splitlines() if line.startswith("baft: error:")), "")


def _recovery(run_dir: Path) -> list[dict]:
    path = run_dir / "recovery.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def describe(case: Case) -> str:
    dropout = "+".join(f"s{i}" for i, on in enumerate(case.dropout) if on) or "off"
    faults = "; ".join(f"rank {f.rank} step {f.step} {f.phase}" for f in case.faults)
    if case.dropout_rng == "tracker" and dropout != "off":
        dropout += " (tracker)"
    return (f"{case.optimizer}, {case.scheduler}{' + own' if case.own_scheduler else ''}, {case.precision}, "
            f"data {case.data}, dropout {dropout}, {'' if case.buffers == 'none' else f'buffers {case.buffers}, '}"
            f"{'checkpointing' if case.checkpointing else 'no checkpointing'}, {'tied' if case.tied else 'untied'}, "
            f"{'frozen block, ' if case.frozen else ''}{'seed_layers, ' if case.seed_layers else ''}"
            f"m={case.micro_batches}, period {case.period}, {case.form}, loop on {case.loop}, {case.recovery}; "
            f"kill {faults}")


def write_results(outcomes: list[Outcome], out: Path, command: str) -> None:
    identical = sum(o.identical for o in outcomes)
    refused = [o for o in outcomes if o.refused]
    lines = [f"# Bit-identical resume: {identical} of {len(outcomes)} cases identical in every part at every step", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; command: `{command}`", "",
             "| seed | case | resumed from | verdict | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        verdict = "identical" if o.identical else f"refused: {o.refused}" if o.refused else \
            "DIFFERS: " + "; ".join(p.splitlines()[0] for p in o.problems[:4])
        lines.append(f"| {o.case.seed} | {describe(o.case)} | {', '.join(map(str, o.resumed))} | {verdict} | "
                     f"{o.seconds:.0f} |")
    if refused:
        lines += ["", f"{len(refused)} refused at initialize, each with its one line above."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text("\n".join(lines) + "\n")
    (out / "matrix.json").write_text(json.dumps({"command": command, "identical": identical, "cases": len(outcomes),
                                                 "outcomes": [{**asdict(o), "identical": o.identical}
                                                              for o in outcomes]}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1, help="case i is drawn from seed + i")
    parser.add_argument("--work", type=Path, help="where the runs go (default: a new temporary directory: a run "
                                                  "directory used before would resume from its old snapshots)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    from tqdm import tqdm

    work = args.work or Path(tempfile.mkdtemp(prefix="baft-matrix-"))
    outcomes = []
    for i in tqdm(range(args.cases), desc="cases"):
        case = draw_case(args.seed + i)
        outcomes.append(run_case(case, work / f"case{case.seed}"))
        tqdm.write(f"{case.seed}: {'identical' if outcomes[-1].identical else outcomes[-1].problems or outcomes[-1].refused}")
    write_results(outcomes, args.out, "python experiments/matrix.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
