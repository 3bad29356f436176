"""A rank as torchrun starts it under ``baft train``: ``python client.py ARGV`` runs ``python ARGV`` warm.

Standard library only, run by path. It asks the node's warm server (:mod:`baft.warm.server`, at
``$BAFT_WARM_SOCKET``) to fork the rank with this process's standard streams, environment, working
directory and ``ARGV``, passes every signal torchrun sends on to the rank (telling the server first: a rank
stopped from outside is not replaced in place; SIGSTOP, which no process can catch, the server passes on itself), and
ends as the rank ended: with its exit code, or killed by its
signal. Where the server does not answer it runs ``python ARGV`` in its own place (``exec``), as torchrun would
have, and says so.
"""

import ctypes
import json
import os
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold(argv: list, why: str) -> None:
    print(f"baft: {why}; this rank starts without it", file=sys.stderr, flush=True)
    os.environ.pop("BAFT_WARM_RANK", None)  # a warm torchrun's, which its ranks inherit: this one is not
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # (a signal held meanwhile ends this process, as it would)
    os.execv(sys.executable, [sys.executable, *argv])


def forward(conn: socket.socket, pid: int, sig: int) -> None:
    try:  # first: the server, seeing the rank die of it, knows it was stopped (torchrun stops its workers so)
        conn.sendall(b"s")
    except OSError:  # the server is gone; the rank with it
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # the rank has just exited; its status is on the way
        pass


def die_with_torchrun() -> None:
    """Have a SIGTERM (passed on to the rank) end this client where torchrun dies first: torch's agent, hit by the
    signal that stops it as it starts an attempt's ranks, can die before it tracks them, and the client would wait
    on its rank for ever (a fresh-clone CI's leftover client)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the signal was armed
        sys.exit(1)


def main(argv: list) -> None:
    # a signal that comes before the rank's pid does waits for it, then passes on: the rank had already started and
    # printed, and torchrun's SIGTERM then ended this client by default, the rank killed by the server without its
    # own handler (a test's, under load)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    die_with_torchrun()
    path = os.environ.get("BAFT_WARM_SOCKET")
    if not path:
        cold(argv, "no warm fork server (BAFT_WARM_SOCKET is not set)")
    conn, why = socket.socket(socket.AF_UNIX), "did not answer"
    try:
        conn.connect(path)
        socket.send_fds(conn, [b"F"], [0, 1, 2])
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}
        conn.sendall(json.dumps(request).encode() + b"\n")
        replies = conn.makefile("rb")
        started = replies.readline()
    except OSError as err:
        started, why = b"", f"cannot be reached ({err})"
    if not started:
        cold(argv, f"the warm fork server at {path} {why}")
    rank = [json.loads(started)["pid"]]
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _: forward(conn, rank[0], sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while True:  # a "pid" line: the rank died and the server forked its replacement, which this client now is
        reply = json.loads(replies.readline() or b'{"exit": -9, "server_died": true}')  # the rank died with it
        if "pid" not in reply:
            break
        rank[0] = reply["pid"]
    code = reply["exit"]
    if reply.get("server_died"):
        print(f"baft: the warm fork server at {path} died; rank pid {rank[0]} was killed with it",
              file=sys.stderr, flush=True)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process: the shell's convention
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
