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
``--max-restarts`` times into the same error; so too the script's own usage error (argparse's
``prog: error: ...`` after its usage), and a rank that ends its script (exit status 0) while its peers train on,
which they fail on, twice in a row. That error, or the Python exception a rank died of
outside a training step (a DeepSpeed config assertion, an import error), is the one line
:class:`Outcome` gives for the screen; the tracebacks stay in the log.
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
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Optional

import click

from baft.errors import says_peer_lost

LOG_NAME = "output.log"
KEEP_LAUNCHES = 3  # launches whose torchrun files stay in RUN_DIR/torchrun (output.log has every line anyway)
LOG_LIMIT = 256 << 20  # past this, a launch starts output.log afresh, keeping the old one as output.log.1
PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[${rank}] "
# torchrun's prefix, then the one torch.distributed puts on a rank's traceback once its process group is up
_PREFIX = re.compile(r"\[(\d+)\] (?:\[rank\d+\]: )?")
_BAFT_ERROR = re.compile(r"(?:baft: error: |baft\.errors\.\w+: )(.*)")  # the example's line; a script's traceback
# torchrun's first failure of an attempt, logged after it stopped the ranks and wrote the rest of their files' tails:
# every line of the attempt's ranks comes before it
_FAILED = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: (\d+) ")
_STEP_FRAME = re.compile(r'\s+File ".*", line \d+, in (train_batch|eval_batch)$')  # DeepSpeed's PipelineEngine
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# a traceback's last line, ``ValueError: ...`` or ``pkg.mod.Error``; not a line the rank printed meanwhile on its
# other stream (``baft: resumed from step 2``)
_EXCEPTION = re.compile(r"(?!baft:)[A-Za-z_][\w.]*(:( |$)|\s*$)")
_ENDED = re.compile(r"baft: rank \d+ ended its script at step (\d+)$")  # baft.teardown's, as a rank exits
_USAGE = re.compile(r"[Uu]sage: ")  # argparse's usage (click's), which its error line follows
_USAGE_ERROR = re.compile(r"(?:\S.*: )?[Ee]rror: \S")  # argparse's ``prog: error: ...``, click's ``Error: ...``
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
TERMINATED_GRACE = 2.0  # seconds torchrun has to end on a SIGTERM of its own before baft train sends one
# seconds torchrun has to end once stopped before baft train kills it: its ranks' shutdown (30 s, then SIGKILL), and more
STOP_GRACE = 45.0
READERS_GRACE = 5.0  # seconds torchrun's output has to reach its end once torchrun has
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
        return None if _ENDED.match(text) else text
    if match[1] == "0" and stream == "stdout" and not DEEPSPEED_SETUP.match(text):
        return text
    return None


def baft_error(line: str) -> Optional[tuple[str, str]]:
    """(rank, message) when a line of torchrun's output is a rank's :class:`~baft.errors.BaftError`, else None."""
    match = _PREFIX.match(line)
    error = _BAFT_ERROR.match(line, match.end()) if match else None
    return (match[1], error[1].rstrip()) if error else None


@dataclass(frozen=True)
class Outcome:
    """How a launch under :func:`run_logged` ended."""

    code: int  # torchrun's exit code
    error: Optional[str] = None  # the rank's baft error that stopped it: the user's to fix
    exception: Optional[str] = None  # "rank R: <its last line>": the exception a rank died of outside a training step

    def reason(self) -> str:
        """Why it failed, in one line: the rank's error or exception, else the exit code."""
        return self.error or self.exception or f"exit code {self.code}"


def run_logged(cmd: list[str], env: dict, log_path: Path, rank_lines: int = 20, launcher_lines: int = 12,
               announce: bool = True, stop_grace: float = STOP_GRACE) -> Outcome:
    """Run torchrun's ``cmd`` (with :func:`torchrun_options`): its whole output appended to ``log_path``
    (said first, with ``announce``), :func:`on_screen`'s lines on the screen; on failure, the ranks' and
    torchrun's last lines too, unless a rank's :func:`baft_error` (which stops torchrun) or the exception a
    rank died of says why (:class:`Outcome`, for the caller to say). A torchrun still running ``stop_grace`` seconds
    after it was stopped is killed."""
    if announce:
        click.echo(f"baft: every rank's output goes to {log_path}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env={**env, PREFIX_ENV: PREFIX_TEMPLATE}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", preexec_fn=_dies_with(os.getpid()))
        torchrun = _Torchrun(proc, stop_grace)
        watch = _Watch(log, torchrun.stop, rank_lines, launcher_lines,
                       restarts=next((int(a.split("=", 1)[1]) for a in cmd if a.startswith("--max-restarts=")), None))
        readers = [threading.Thread(target=watch.pump, args=(pipe, name), daemon=True)
                   for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for reader in readers:
            reader.start()
        try:
            code = torchrun.wait()
        except Terminated:
            torchrun.stop(signalled=False)
            try:  # a signal to the whole process group reached torchrun too: a second would cut its shutdown short
                proc.wait(TERMINATED_GRACE)
            except subprocess.TimeoutExpired:
                torchrun.stop()
            raise
        except KeyboardInterrupt:  # Ctrl-C reached torchrun too
            torchrun.stop(signalled=False)
            raise
        finally:  # on Ctrl-C torchrun got the signal too: let it stop its ranks
            torchrun.wait()
            watch.finish(readers)
    outcome = watch.outcome(code)
    if code != 0 and not (outcome.error or outcome.exception):
        watch.print_tails()
    return outcome


class _Torchrun:
    """The torchrun process :func:`run_logged` watches: stopped by SIGTERM (it stops its ranks), killed where it has not
    ended ``grace`` seconds later. torch's agent, hit by the signal as it starts an attempt's ranks, can track neither
    them nor the threads that tail their output, and then waits for those at its exit for ever (a fresh-clone CI's
    ``baft train`` hung so until its test's timeout)."""

    def __init__(self, proc: subprocess.Popen, grace: float):
        self.proc, self.grace = proc, grace
        self.deadline: Optional[threading.Timer] = None

    def stop(self, signalled: bool = True) -> None:
        """SIGTERM torchrun (unless ``signalled``: it has had one from elsewhere), the first time with a deadline."""
        if signalled:
            self.proc.terminate()
        if self.deadline is None:
            self.deadline = threading.Timer(self.grace, self._kill)
            self.deadline.daemon = True
            self.deadline.start()

    def wait(self) -> int:
        """Its exit code, once it has ended or been killed."""
        code = self.proc.wait()
        if self.deadline is not None:
            self.deadline.cancel()
        return code

    def _kill(self) -> None:
        if self.proc.poll() is None:
            click.echo(f"baft: torchrun did not end within {self.grace:g} s of being stopped; killed it", err=True)
            self.proc.kill()


class Terminated(Exception):
    """SIGTERM reached ``baft train`` (a scheduler preempting the job, ``kill``), inside :func:`sigterm_stops`."""


@contextmanager
def sigterm_stops():
    """Within: SIGTERM raises :class:`Terminated` (once; a second is ignored), so a launch ends as after Ctrl-C:
    torchrun stops its ranks, and the managers write the newest snapshot to disk before they free its memory."""
    def terminated(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def run_example_logged(nprocs: int, module_args: list[str], env: dict, log_path: Path,
                       announce: bool = True) -> Outcome:
    """Run ``python -m <module_args>`` on ``nprocs`` ranks through torchrun as :func:`run_logged` does
    (torchrun's per-rank files in a temporary directory, the whole output in ``log_path``); how it ended."""
    from baft.cli.launch import clear_stale_build_locks, torchrun

    clear_stale_build_locks(env.get("TORCH_EXTENSIONS_DIR"))
    with tempfile.TemporaryDirectory(prefix="baft-torchrun-") as files:
        return run_logged(torchrun(nprocs, module_args, options=torchrun_options(Path(files))), env, log_path,
                          announce=announce)


def _said_left_early(rank: str, step: int) -> str:
    return f"rank {rank} ended its script (exit status 0) at step {step} while its peers were training: they failed " \
           "on losing it"


@dataclass(frozen=True)
class _RankException:
    """The line of a Python exception a rank printed (``AssertionError: ...``), and whether it was raised in a
    training step (its traceback passes through the engine's ``train_batch`` or ``eval_batch``)."""

    line: str
    in_step: bool


class _Traceback:
    """One rank's Python traceback as its lines come; a chain of them ("During handling of the above
    exception ...") is one exception, raised in a step if any of its tracebacks passes through one."""

    def __init__(self):
        self.reading = self.in_step = self.chained = False

    def feed(self, text: str) -> Optional[_RankException]:
        """Take the next line of the rank's output; the exception once its line comes."""
        if text.startswith("Traceback (most recent call last):"):
            self.in_step = self.in_step and self.chained
            self.reading, self.chained = True, False
        elif self.reading and text[:1].isspace():  # a frame
            self.in_step = self.in_step or bool(_STEP_FRAME.match(text))
        elif self.reading and _EXCEPTION.match(text):
            self.reading = False
            return _RankException(text.strip(), self.in_step)
        elif text.startswith(_CHAINED):
            self.chained = True
        return None


def _by_rank(item: tuple) -> tuple:
    """``item`` (a rank as torchrun's prefix names it, then what it says) in the ranks' order: rank 2 before 10."""
    return int(item[0]), *item[1:]


class _Watch:
    """Reads torchrun's output as :func:`run_logged` copies it to the log and the screen: the last lines of
    the ranks and of torchrun, the ranks' baft errors and Python exceptions, and the rank torchrun saw fail."""

    def __init__(self, log: IO[str], stop: Callable[[], None], rank_lines: int, launcher_lines: int,
                 restarts: Optional[int] = None):
        self.log, self.stop, self.lock = log, stop, threading.Lock()
        self.restarts_left = restarts  # torchrun's (None: not known), as attempts end
        self.last = {RANKS: deque(maxlen=rank_lines), LAUNCHER: deque(maxlen=launcher_lines)}
        self.error: Optional[str] = None  # the first baft error
        self.tracebacks: dict[str, _Traceback] = {}
        self.in_usage: set[str] = set()  # the ranks whose last lines are the script's usage
        self.exceptions: dict[str, _RankException] = {}  # each rank's last
        self.failed: Optional[tuple[int, str]] = None  # (exit code, rank) of the last attempt's first failure
        # (rank, exception, whether in a training step) raised, not a lost peer's echo: this attempt's so far, and
        # those that ended the attempt before (none where a rank was killed)
        self.raised: set[tuple[str, str, bool]] = set()
        self.ended_before: frozenset[tuple[str, str, bool]] = frozenset()
        self.repeated: Optional[str] = None  # "rank R: <line>" raised between steps that ended two attempts in a row
        # this attempt's ranks that printed an exception, and those that ended their script otherwise (rank -> step);
        # the (rank, step) that ended its script while its peers failed on losing it, in the attempt before
        self.failing: set[str] = set()
        self.left: dict[str, int] = {}
        self.left_before: Optional[tuple[str, int]] = None
        self.finished = False  # no more of torchrun's output is read

    def finish(self, readers: list[threading.Thread]) -> None:
        """Once torchrun has ended: wait for its output's end, which a process of the run that outlives it holds back;
        after :data:`READERS_GRACE` seconds, read no more of it."""
        deadline = time.monotonic() + READERS_GRACE
        for reader in readers:
            reader.join(max(deadline - time.monotonic(), 0.0))
        with self.lock:
            self.finished = True
        if any(reader.is_alive() for reader in readers):
            click.echo(f"baft: a process of the run that outlived torchrun holds its output open; what it writes now "
                       f"is not in {self.log.name}", err=True)

    def pump(self, pipe: IO[str], stream: str) -> None:
        """Copy ``pipe``, torchrun's ``stream``, into the log and its :func:`on_screen` lines onto the screen."""
        for line in pipe:
            with self.lock:
                if self.finished:
                    return
                self.log.write(line)
                self.log.flush()
                text = self._read(line, stream)
                if text is not None:
                    click.echo(text, nl=False, err=stream == "stderr")

    def _read(self, line: str, stream: str) -> Optional[str]:
        """Note what ``line`` says; the text of it to show, if any. The first baft error stops torchrun."""
        match = _PREFIX.match(line)
        if match is None:
            self.last[LAUNCHER].append(line)
            failed = _FAILED.search(line)
            if failed:  # its local rank is the rank: baft train launches one node
                self.failed = (int(failed[1]), failed[2])
                self._same_again()
            return None
        self.last[RANKS].append(line)
        ended = _ENDED.match(line, match.end())
        if ended and match[1] not in self.failing:
            self.left[match[1]] = int(ended[1])
        exception = self.tracebacks.setdefault(match[1], _Traceback()).feed(line[match.end():])
        if exception is not None:
            self.exceptions[match[1]] = exception
            self.failing.add(match[1])
            if not says_peer_lost(exception.line):
                self.raised.add((match[1], exception.line, exception.in_step))
        error = baft_error(line) or self._usage_error(match[1], line[match.end():])
        if error is None:
            return on_screen(line, stream)
        if self.error is None:
            self.error = error[1]
            self.stop()
        return None

    def _usage_error(self, rank: str, text: str) -> Optional[tuple[str, str]]:
        """(rank, message) when ``text``, the rank's line, is its script's usage error: its arguments are wrong in
        every attempt."""
        if rank in self.in_usage and _USAGE_ERROR.match(text):
            self.in_usage.discard(rank)
            return rank, f"rank {rank}: {text.rstrip()} (the script's own usage error: a restart does not help)"
        if _USAGE.match(text) or rank in self.in_usage and text[:1].isspace():  # a long usage goes on indented
            self.in_usage.add(rank)
        else:
            self.in_usage.discard(rank)
        return None

    def _same_again(self) -> None:
        """A rank that ends an attempt with the error that ended the one before (not a signal: a fault), in a
        training step or between steps, will end every one with it: the restarts left are not tried, and the error
        is the run's. The rank torchrun saw fail first may be a peer whose receive failed as the raising rank exited:
        its echo is no attempt's ending."""
        exitcode, failed = self.failed
        ended = frozenset(self.raised) if exitcode > 0 else frozenset()
        left = self._left_early(exitcode, failed)
        again = sorted(ended & self.ended_before, key=_by_rank)
        restarting = self.restarts_left is None or self.restarts_left > 0  # torchrun starts the ranks again now
        if self.restarts_left is not None:
            self.restarts_left -= 1
        if again and self.error is None and self.repeated is None:
            rank, line, in_step = again[0]
            said = f"rank {rank}: {line} (it ended the attempt before too: a restart does not help)"
            if in_step:
                self.error = said
            else:  # the run's exception, as one that ended the last attempt is (with where the tracebacks are)
                self.repeated = said
            if restarting:  # else torchrun ends by itself, its summary in the log
                self.stop()
        elif left and self.left_before and left[0] == self.left_before[0] and self.error is None \
                and self.repeated is None:
            self.repeated = f"{_said_left_early(*left)} (it did so in the attempt before too: a restart does not help)"
            if restarting:
                self.stop()
        self.ended_before, self.raised = ended, set()
        self.left_before, self.left, self.failing = left, {}, set()

    def _left_early(self, exitcode: int, failed: str) -> Optional[tuple[str, int]]:
        """(rank, step) of a rank that ended its script in an attempt that failed of no exception but a lost peer's,
        in another rank (``failed``, the one torchrun saw fail first, with ``exitcode``): its peers trained on
        without it. A script that returns early on one rank (``sys.exit(0)`` at a step, a loop of its own that ends
        sooner) does so again after every restart."""
        if exitcode <= 0 or self.raised:
            return None
        return next(((rank, step) for rank, step in sorted(self.left.items(), key=_by_rank) if rank != failed), None)

    def outcome(self, code: int) -> Outcome:
        """How the launch that exited with ``code`` ended. A failed one's reason: the first baft error, or
        else the exception the rank torchrun saw fail first died of, when raised outside a training step
        (a step's is a fault for restarts to get past, or a survivor's echo of a killed rank), or else one, not an
        echo, that ended the last attempt (no restart was left to get past it; torchrun may have seen the echo
        first)."""
        if code == 0:
            return Outcome(0)
        if self.error is not None:
            return Outcome(code, error=self.error)
        if self.repeated is not None:
            return Outcome(code, exception=self.repeated)
        if self.left_before is not None:
            return Outcome(code, exception=f"{_said_left_early(*self.left_before)} (no restart left)")
        exitcode, rank = self.failed or (0, "")
        exception = self.exceptions.get(rank)
        if exitcode > 0 and exception is not None and not exception.in_step:
            return Outcome(code, exception=f"rank {rank}: {exception.line}")
        if self.ended_before:
            rank, line, in_step = min(self.ended_before, key=_by_rank)
            where = "in a training step, with" if in_step else "with"
            return Outcome(code, exception=f"rank {rank}: {line} ({where} no restart left)")
        return Outcome(code)

    def print_tails(self) -> None:
        """The ranks' and torchrun's last lines."""
        for source, lines in self.last.items():
            if lines:
                click.echo(f"baft: the run failed; the last lines of {source}:", err=True)
                click.echo("".join(lines), err=True, nl=False)
