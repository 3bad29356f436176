"""A rank for tests/test_warm.py: says what it was started with, then does what its first argument asks."""

import atexit
import json
import os
import signal
import sys
import time

import numpy
import torch

what = sys.argv[1] if len(sys.argv) > 1 else "exit"
if what == "sleep":  # until a signal: SIGTERM ends it with its own handler's exit code
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))

report = {"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"), "threads": torch.get_num_threads(),
          "torch": torch.rand(2).tolist(), "numpy": numpy.random.rand(2).tolist(), "pid": os.getpid(),
          "parent": os.getppid(), "whole_lines": sys.stdout.line_buffering and not sys.stdout.write_through}
print(json.dumps(report), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "sleep":
    time.sleep(120)
if what == "pipes":  # descriptors opened by the rank stay its own until its very end
    pipes = [os.pipe() for _ in range(8)]

    def still_open():
        for r, w in pipes:
            os.write(w, b"x")
            assert os.read(r, 1) == b"x"
        print("pipes intact at exit", flush=True)
    atexit.register(still_open)
if what == "leave":  # exit as scripts do: a file left open, a worker thread still writing, an atexit handler
    import threading

    log = open(sys.argv[2], "w")  # never closed: the interpreter's exit flushes it
    log.write("written, never flushed\n")

    def late():
        time.sleep(0.5)
        print("non-daemon thread done", flush=True)
    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran"))  # to a block-buffered stdout: the exit flushes it
    ending = sys.argv[3]
    if ending == "raise":
        raise ValueError("the script failed")
    sys.exit(None if ending == "none" else ending)

