"""In a child the warm fork server forked: become the rank its client asked for, as ``python ARGV`` would have
started it, and leave as the interpreter leaves.

Its own session (as torchrun starts a rank), the client's standard streams (passed over the socket), environment,
working directory and ``argv``, generators seeded afresh as a new interpreter's are, and ``SIGKILL`` when the server
dies. It runs the script or module as ``python`` would and exits as the interpreter's shutdown does (non-daemon
threads, ``atexit``, open files flushed), without freeing every module one by one after it.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from baft.config import REPLACEMENT_ENV, WARM_RANK_ENV

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def become_rank(conn: socket.socket, fds: list[int], request: dict, started: bool = False) -> None:
    """In the forked child: become the requested process, run it to the end and exit (never returns); ``started``:
    a spare, whose generators were seeded as it started (:mod:`baft.warm.spares`)."""
    import runpy

    os.setsid()
    die_with_parent(request["server"], signal.SIGKILL)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (s for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper)):
        # a line in one write: unbuffered (PYTHONUNBUFFERED, for torchrun's tee to show it at once), print writes its
        # text and its newline apart, and the tee, reading between them, put the line's rank prefix in its middle
        stream.reconfigure(line_buffering=True, write_through=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], **{WARM_RANK_ENV: "1"})
    if not started:
        as_started()
    if os.environ.get(REPLACEMENT_ENV):  # it joins the survivors' new world before the script runs
        from baft.recovery.world import join

        join(replacement=True)
    argv = request["argv"]
    enter_argv(argv)
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = _exit_code(end)
    except KeyboardInterrupt:
        raise  # the interpreter's own exit, by the signal
    except BaseException as error:
        # as the interpreter does for a script's uncaught exception, before the ``atexit`` handlers read it
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit_without_finalizing(code)


def _exit_code(end: SystemExit) -> int:
    """The exit status the interpreter gives a ``SystemExit`` (printing a message where it carries one)."""
    if end.code is None:
        return 0
    if isinstance(end.code, int):
        return end.code
    print(end.code, file=sys.stderr)
    return 1


_BUFFERED_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _exit_without_finalizing(code: int) -> None:
    """Leave as the interpreter leaves — non-daemon threads joined, ``atexit`` handlers run (the script's, baft's
    teardown, those of the modules the server imported), every open file flushed — but without its
    finalization, which frees module after module: about a second of CPU a rank once torch and DeepSpeed are
    imported, and the end of every launch waits for its ranks."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    # a file the script left open, and the standard streams: the server made them, and froze them out of
    # gc.get_objects (:func:`baft.warm.preload.freeze`)
    opened = [o for o in gc.get_objects() if type(o) in _BUFFERED_WRITERS]
    for stream in [*opened, sys.stdout, sys.stderr]:
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, its descriptor gone, or None
            pass
    ctypes.CDLL(None).fflush(None)  # what native code wrote with C's stdio
    os._exit(code)


def enter_argv(argv: list[str]) -> None:
    """``sys.argv`` and ``sys.path[0]`` as ``python ARGV`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) has them."""
    if argv[0] == "-m":
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
    else:
        sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)


def as_started() -> None:
    """What a new interpreter would have: torch's and numpy's global generators seeded from the OS, as each
    process's are (``random`` reseeds itself at every fork), and the rank's ``OMP_NUM_THREADS`` (the server
    imports with one thread: OpenMP would start its pool, and a fork copies no threads)."""
    import numpy
    import torch

    torch.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
