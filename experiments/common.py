"""What the experiments share and the library has no use for: provenance, quiet ``baft train`` runs, Markdown."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from baft.cli.launch import SHM_ROOT, launch_env, run_id
from baft.recovery.record import FILENAME, load_recoveries
from machine import command_line, describe, now

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def revision() -> str:
    """The commit the run used, and whether baft/ differed from it (others may edit it meanwhile)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(HERE.parent), *args], check=False, capture_output=True,
                              text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + (" (baft/ modified in the working tree)" if git("status", "--porcelain", "--", "baft") else "")


def provenance() -> dict:
    """Machine, command, date and baft revision of a run, for its JSON and its Markdown header."""
    return {"machine": describe(), "command": command_line(), "date": now(), "revision": revision()}


def header(prov: dict, wall_s: float | None = None) -> list[str]:
    """The Markdown lines every result starts with."""
    took = f" ({wall_s:.0f} s wall)" if wall_s is not None else ""
    code = f"; baft revision {prov['revision']}" if prov.get("revision") else ""
    return [f"- machine: {prov['machine']}", f"- command: `{prov['command']}`", f"- date: {prov['date']}{took}{code}"]


def md_table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def train(run_dir: Path, args: list[str], timeout: float = 900.0, env: dict | None = None,
          script: list[str] | None = None, cwd: Path | None = None) -> tuple[int, float]:
    """``baft train --example gpt ARGS --run-dir RUN_DIR`` (``script``: ``baft train ARGS --run-dir RUN_DIR --
    SCRIPT``), its output in RUN_DIR/train.log: (exit code, seconds); ``env``: more environment for it; ``cwd``: the
    directory it runs in (``python -m`` imports baft from there first, then from ``PYTHONPATH``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    program = ["--", *script] if script else ["--example", "gpt"]
    cmd = [sys.executable, "-m", "baft.cli", "train", *args, "--run-dir", str(run_dir), *program]
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        try:
            code = subprocess.run(cmd, check=False, env=launch_env(env), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, time.time() - start


def clean_shm(run_dir: Path) -> None:
    """Remove what is left of a run's shared memory (``baft train`` stops its managers, not a killed node's)."""
    shutil.rmtree(Path(SHM_ROOT) / run_id(run_dir), ignore_errors=True)


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (losses.jsonl, chaos.jsonl), skipping a line torn by a kill."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def first_recovery(run_dir: Path) -> dict:
    """The run's first recovery record (restored step, source, T0..T4), or {} if it recorded none."""
    if not (run_dir / FILENAME).exists():
        return {}
    return dataclasses.asdict(load_recoveries(run_dir)[0])


def interval(log_ratios: list[float], resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the geometric mean ratio, resampling pairs."""
    rng = np.random.default_rng(seed)
    logs = np.array(log_ratios)
    means = logs[rng.integers(0, len(logs), (resamples, len(logs)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return math.exp(low), math.exp(high)


def geometric_mean_ratio(log_ratios: list[float]) -> tuple[float, tuple[float, float]]:
    """The geometric mean of the pairs' ratios, from their logarithms, with its 95% :func:`interval`."""
    return math.exp(float(np.mean(log_ratios))), interval(log_ratios)


def comma_choices(parser, option: str, value: str, known) -> list[str]:
    """The names a comma-separated ``option`` gives, each one of ``known``; the parser's one-line error otherwise."""
    given = value.split(",")
    unknown = [name for name in given if name not in known]
    if unknown:
        parser.error(f"{option}: unknown {unknown[0]!r}; choose from {', '.join(known)}")
    return given
