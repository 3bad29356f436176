"""The ranks' output under ``baft train``: all of it into the run's log, what a user reads onto the screen.

torchrun tees every rank's stdout and stderr (``--tee 3``), each line prefixed with the rank
(:data:`PREFIX_TEMPLATE`); its per-rank, per-attempt files go to ``RUN_DIR/torchrun/``
(:func:`trim_run_logs` keeps those of the last few launches).
:func:`run_logged` appends all of torchrun's output (every rank and the launcher itself) to
``RUN_DIR/output.log`` and shows on the screen only what :func:`on_screen` keeps: rank 0's
stdout without DeepSpeed's setup lines (op builds, layer partitions), and baft's own lines
from any rank. A surviving rank's traceback after a kill stays in the log; a failed run
prints the ranks' last lines and torchrun's (its summary names the rank that failed first).
A rank's :class:`~baft.errors.BaftError` is the user's to fix, so no restart can get past it:
:func:`run_logged` stops torchrun at the first one instead of letting it restart every rank
``--max-restarts`` times into the same error.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import IO, Callable, Optional

import click

LOG_NAME = "output.log"
KEEP_LAUNCHES = 3  # launches whose torchrun files stay in RUN_DIR/torchrun (output.log has every line anyway)
LOG_LIMIT = 256 << 20  # past this, a launch starts output.log afresh, keeping the old one as output.log.1
PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[${rank}] "
_PREFIX = re.compile(r"\[(\d+)\] ")
_BAFT_ERROR = re.compile(r"(?:baft: error: |baft\.errors\.\w+: )(.*)")  # the example's line; a script's traceback
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
RANKS, LAUNCHER = "the ranks' output", "torchrun's output"  # the two tails a failed run prints

# What DeepSpeed prints while it sets up, as rank 0 prints it (in the log, not on the screen).
DEEPSPEED_SETUP = re.compile("|".join([
    r"DeepSpeed \S+ built successfully$",  # its communication op, built or loaded from the cache
    r"SEED_LAYERS=",
    r"Using topology: ",
    r"stage=\d+ layers=\d+$",  # the layer partition: one line per stage, its layers, the loss
    r"\s+\d+: \S+$",
    r"\s+loss: \S+$",
    r"\[\d{4}-\d\d-\d\d [\d:,]+\] \[INFO\]",  # its logger
]))


def torchrun_options(run_dir: Path) -> list[str]:
    """torchrun's options that tee every rank's output, its files under ``run_dir/torchrun``."""
    return [f"--log-dir={run_dir / 'torchrun'}", "--tee=3"]


def trim_run_logs(run_dir: Path) -> None:
    """Before a launch into ``run_dir``: keep torchrun's files of the newest ``KEEP_LAUNCHES - 1`` launches,
    and move an ``output.log`` over ``LOG_LIMIT`` bytes to ``output.log.1`` (replacing an older one)."""
    launches = sorted((p for p in (run_dir / "torchrun").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in launches[:max(len(launches) - (KEEP_LAUNCHES - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    log = run_dir / LOG_NAME
    if log.exists() and log.stat().st_size > LOG_LIMIT:
        log.replace(log.with_name(LOG_NAME + ".1"))


def on_screen(line: str, stream: str) -> Optional[str]:
    """The text of a line of torchrun's ``stream`` ("stdout" or "stderr") to show, or None to keep it in the log only.

    Shown: rank 0's stdout except DeepSpeed's setup lines, and every rank's lines that begin with ``baft:``.
    """
    match = _PREFIX.match(line)
    if match is None:  # the launcher's own lines
        return None
    text = line[match.end():]
    if text.startswith("baft:"):
        return text
    if match[1] == "0" and stream == "stdout" and not DEEPSPEED_SETUP.match(text):
        return text
    return None


def baft_error(line: str) -> Optional[tuple[str, str]]:
    """(rank, message) when a line of torchrun's output is a rank's :class:`~baft.errors.BaftError`, else None."""
    match = _PREFIX.match(line)
    error = _BAFT_ERROR.match(line, match.end()) if match else None
    return (match[1], error[1].rstrip()) if error else None


def run_logged(cmd: list[str], env: dict, log_path: Path, rank_lines: int = 20, launcher_lines: int = 12,
               announce: bool = True) -> int:
    """Run torchrun's ``cmd`` (with :func:`torchrun_options`): its whole output appended to ``log_path``
    (said first, with ``announce``), :func:`on_screen`'s lines on the screen; on failure, the ranks' and
    torchrun's last lines too, unless a rank's :func:`baft_error` stopped torchrun (the error says it all).
    Its exit code."""
    if announce:
        click.echo(f"baft: every rank's output goes to {log_path}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    last = {RANKS: deque(maxlen=rank_lines), LAUNCHER: deque(maxlen=launcher_lines)}
    lock = threading.Lock()
    errors: list[tuple[str, str]] = []
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env={**env, PREFIX_ENV: PREFIX_TEMPLATE}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", preexec_fn=_dies_with(os.getpid()))

        def stop_at_first(error: tuple[str, str]) -> bool:
            errors.append(error)
            if len(errors) == 1:
                proc.terminate()  # torchrun stops its ranks on SIGTERM
            return len(errors) == 1
        readers = [threading.Thread(target=_pump, args=(pipe, name, log, last, lock, stop_at_first), daemon=True)
                   for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for reader in readers:
            reader.start()
        try:
            code = proc.wait()
        finally:  # on Ctrl-C torchrun got the signal too: let it stop its ranks
            proc.wait()
            for reader in readers:
                reader.join()
    if errors:
        click.echo(f"baft: no restart gets past rank {errors[0][0]}'s error, so the launch stopped there; every "
                   f"rank's output is in {log_path}", err=True)
    elif code != 0:
        for source, lines in last.items():
            if lines:
                click.echo(f"baft: the run failed; the last lines of {source}:", err=True)
                click.echo("".join(lines), err=True, nl=False)
    return code


def _dies_with(parent: int):
    """For ``preexec_fn``: the child gets SIGTERM when ``parent`` dies, even by SIGKILL (Linux), so a killed
    ``baft train`` leaves no training running on unwatched (torchrun stops its ranks on SIGTERM); the
    run's manager, in a session of its own, keeps the snapshots for the next launch."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
    return set_death_signal


def run_example_logged(nprocs: int, module_args: list[str], env: dict, log_path: Path, announce: bool = True) -> int:
    """Run ``python -m <module_args>`` on ``nprocs`` ranks through torchrun as :func:`run_logged` does
    (torchrun's per-rank files in a temporary directory, the whole output in ``log_path``); its exit code."""
    from baft.cli.launch import torchrun

    with tempfile.TemporaryDirectory(prefix="baft-torchrun-") as files:
        return run_logged(torchrun(nprocs, module_args, options=torchrun_options(Path(files))), env, log_path,
                          announce=announce)


def _pump(pipe: IO[str], stream: str, log: IO[str], last: dict[str, deque], lock: threading.Lock,
          on_error: Callable[[tuple[str, str]], bool]) -> None:
    """Copy ``pipe`` into the log and the tails, :func:`on_screen`'s lines onto the screen; a rank's
    :func:`baft_error` goes to ``on_error``, and onto the screen as one line if it is the first."""
    for line in pipe:
        text, error = on_screen(line, stream), baft_error(line)
        with lock:
            if error:
                text = f"baft: error: {error[1]}\n" if on_error(error) else None
            log.write(line)
            log.flush()
            last[RANKS if _PREFIX.match(line) else LAUNCHER].append(line)
            if text is not None:
                click.echo(text, nl=False, err=stream == "stderr")
