"""Starting, stopping and asking a snapshot manager: the API behind ``baft manager start|stop|status``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from baft.errors import BaftError
from baft.jsonfile import read_json
from baft.manager.config import ManagerConfig, human
from baft.manager.protocol import ManagerClient, ManagerUnavailable, socket_path

INFO_NAME = "manager.json"  # in the shm root: the running manager's pid, node and socket
LOG_NAME = "manager.log"


def log_file(shm_root, log_path=None) -> Path:
    """Where a manager logs: ``log_path``, or ``<shm root>/manager.log``."""
    return Path(log_path) if log_path is not None else Path(shm_root) / LOG_NAME


def spawn(config: ManagerConfig, log_path=None) -> subprocess.Popen:
    """Start ``python -m baft.manager`` detached, appending its output to :func:`log_file`."""
    config.validate()
    log_path = log_file(config.shm_root, log_path)
    try:
        config.shm_root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BaftError(f"--shm-root {config.shm_root}: cannot create ({err.strerror})") from None
    try:  # a run directory the launch has not made yet (a user's own torchrun): the manager logs there first
        log_path.parent.mkdir(parents=True, exist_ok=True)
        logfile = open(log_path, "ab")
    except OSError as err:
        raise BaftError(f"{log_path}: cannot create the manager's log ({err.strerror})") from None
    with logfile:
        return subprocess.Popen([sys.executable, "-m", "baft.manager", *config.argv()], stdin=subprocess.DEVNULL,
                                stdout=logfile, stderr=logfile, start_new_session=True)


def wait_ready(shm_root, timeout: float = 60.0, proc: Optional[subprocess.Popen] = None, log_path=None) -> dict:
    """Wait until the manager of ``shm_root`` answers; its status. A manager that exits instead raises
    the error it logged (in ``log_path``, or ``<shm root>/manager.log``)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            logged = _last_error(log_file(shm_root, log_path))
            raise BaftError(logged or f"manager exited with status {proc.returncode}")
        try:
            with ManagerClient.connect(shm_root, timeout=2.0) as client:
                return client.status()
        except ManagerUnavailable:
            if time.monotonic() > deadline:
                raise BaftError(f"{shm_root}: manager did not answer within {timeout:g} s") from None
            time.sleep(0.05)


def _last_error(logfile: Path) -> Optional[str]:
    try:
        lines = [line for line in logfile.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    except OSError:
        return None
    return lines[-1].removeprefix("error: ") if lines else None


def start(config: ManagerConfig, timeout: float = 60.0, log_path=None) -> int:
    """Start a manager for ``config`` in the background, wait until it answers; its pid.
    Its output goes to ``log_path`` (default ``<shm root>/manager.log``)."""
    proc = spawn(config, log_path)
    wait_ready(config.shm_root, timeout, proc, log_path)
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop(shm_root, timeout: float = 120.0) -> None:
    """Stop the manager of ``shm_root``: it persists what is due, then unlinks its shared memory."""
    info_path = Path(shm_root) / INFO_NAME
    pid = read_json(info_path)["pid"] if info_path.exists() else None
    try:
        with ManagerClient.connect(shm_root, timeout=5.0) as client:
            client.shutdown()
    except ManagerUnavailable:
        raise BaftError(f"{shm_root}: no manager running (nothing answers at {socket_path(shm_root)})") from None
    if pid is not None:
        _wait_exit(shm_root, pid, timeout, "shutdown")


def _wait_exit(shm_root, pid: int, timeout: float, asked: str) -> None:
    """Wait until the manager ``pid`` has exited after being ``asked`` to."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise BaftError(f"{shm_root}: manager (pid {pid}) still running {timeout:g} s after {asked}")
        time.sleep(0.05)


def retire(shm_root, timeout: float = 120.0) -> Optional[int]:
    """Stop the manager of ``shm_root``, if one answers, leaving its snapshots in shared memory for the
    next manager (SIGTERM: it persists what is due and unlinks nothing); its pid, or None."""
    try:
        pid = status(shm_root)["pid"]
    except ManagerUnavailable:
        return None
    os.kill(pid, signal.SIGTERM)
    _wait_exit(shm_root, pid, timeout, "SIGTERM")
    return pid


def kill_silent(shm_root) -> Optional[int]:
    """Kill the manager of ``shm_root`` that no longer answers but is there (stopped, frozen), as its ``manager.json``
    names it; its pid, or None where no such process is left."""
    try:
        pid = read_json(Path(shm_root) / INFO_NAME)["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (BaftError, KeyError, OSError):
        return None
    if str(shm_root).encode() not in argv or not _alive(pid):  # its pid taken by another process since
        return None
    os.kill(pid, signal.SIGKILL)
    _wait_exit(shm_root, pid, 10.0, "SIGKILL")
    return pid


def status(shm_root, timeout: float = 5.0) -> dict:
    """The status of the manager of ``shm_root`` (see :func:`format_status`)."""
    with ManagerClient.connect(shm_root, timeout=timeout) as client:
        return client.status()


def format_status(st: dict) -> str:
    """``baft manager status`` as text: steps held, sizes, checksums, parity, persistence, memory."""
    mem = st["memory"]
    lines = [f"node {st['node_id']} (pid {st['pid']}, up {st['uptime']:.0f} s) shm {st['root']}"
             + (f", listening {st['address']}" if st["address"] else "")]
    for rank, r in st["ranks"].items():
        held = ", ".join(f"step {s['step']} ({s['verified']})" for s in r["slots"]) or "nothing committed"
        lines.append(f"  rank {rank}: {human(r['nbytes'])} per snapshot; {held}")
    if not st["ranks"]:
        lines.append("  no ranks yet")
    lines.append(f"  memory: {human(mem['total'])} held (slots {human(mem['slots'])}, shares {human(mem['shares'])}), "
                 f"{human(mem['reserved'])} reserved, limit {human(mem['limit']) if mem['limit'] else 'none'}")
    lines.append(f"  parity: {st['parity']['line'] if st['parity'] else 'off'}")
    lines.append(f"  persist: {st['persist']['line'] if st['persist'] else 'off'}")
    return "\n".join(lines)
