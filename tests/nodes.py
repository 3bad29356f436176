"""A test bed of nodes on one host: each node a network, mount, IPC and UTS namespace of its own.

A node has its own loopback, one veth link to a bridge in a hub network namespace (nothing
is added to the host's own network stack), its own ``/dev/shm`` (a tmpfs mounted inside its
mount namespace), its own hostname (``node0``, ``node1``, ...) and an ``/etc/hosts`` that
names every node of the cluster, so commands run on it as they would on a machine of a
cluster: ``torchrun --rdzv-endpoint node0:29400`` finds the node that hosts the rendezvous by
its name. The host's file systems stay visible in every node, as a shared file system would, but
each node has a temporary directory of its own (``TMPDIR``), as a machine has its own ``/tmp``.

Losing a node (:meth:`Cluster.lose`) SIGKILLs every process of its network namespace and
deletes the namespace: its shared memory and its temporary directory go with it, as with a
machine that died, and nothing of it is left for a restart to find (before, the socket directory
of every lost node's warm server stayed in the host's ``/tmp``). A replacement (:meth:`Cluster.start`
with the same index) is a fresh namespace that takes the lost node's name, IP and MAC address.

A :class:`Job` is one node's launch command (a shell script: ``torchrun --rdzv-backend c10d
...``) running on every node, as a user starts a multi-node job; :meth:`Job.lose` loses nodes
and does what the user does then.

Namespaces need root and ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux);
:func:`unavailable` says why they cannot be made here, for a test to skip with.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from common import read_jsonl  # noqa: E402  (experiments/ is not a package; one reader of torn JSON lines)

SUBNET = "10.77.0"  # only ever configured on veths inside the cluster's own namespaces
INTERFACE = "eth0"  # each node's link to the hub (GLOO_SOCKET_IFNAME)
SHM_SIZE = "1g"


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here, or None when they can."""
    missing = [tool for tool in ("ip", "unshare", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 util-linux mount)"
    probe = f"baft-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    made = subprocess.run(["unshare", "--mount", "--uts", "--ipc", "true"], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create mount, UTS and IPC namespaces: {made.stderr.strip() or made.returncode}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def hostname(index: int) -> str:
    return f"node{index}"


def address(index: int) -> str:
    return f"{SUBNET}.{10 + index}"


def mac(index: int) -> str:
    return f"02:77:00:00:00:{index:02x}"  # locally administered


@dataclass
class Node:
    """One running node: its index (its hostname is ``node<index>``), namespace and holder process."""

    index: int
    netns: str
    holder: subprocess.Popen  # keeps the mount, IPC and UTS namespaces; PID 1-like for nsenter
    tmp: Path  # its own temporary directory, which its commands get as TMPDIR

    @property
    def name(self) -> str:
        return hostname(self.index)

    @property
    def address(self) -> str:
        return address(self.index)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs inside this node."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--uts", "--ipc", "--",
                "env", f"TMPDIR={self.tmp}", *argv]

    def popen(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        """Start ``argv`` on this node, its output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.command(argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)

    def run(self, argv: list[str], env: Optional[dict] = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``argv`` on this node to completion; its output captured."""
        return subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout)

    def path(self, inside: str) -> Path:
        """Where ``inside`` (a path as this node sees it, e.g. in its ``/dev/shm``) is seen from the host."""
        return Path(f"/proc/{self.holder.pid}/root") / Path(inside).relative_to("/")

    def pids(self) -> list[int]:
        """Every process in this node's network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class Cluster:
    """Nodes joined by one bridge in a hub namespace; every namespace is removed by :meth:`close`."""

    def __init__(self, size: int, workdir: Path):
        self.size = size
        self.tag = os.urandom(3).hex()
        self.hub = f"baft-{self.tag}-hub"
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = self.workdir / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{address(i)} {hostname(i)}\n" for i in range(size)))
        self.nodes: dict[int, Node] = {}
        self._generation = 0
        _ip("netns", "add", self.hub)
        try:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except subprocess.CalledProcessError:
            self.close()
            raise

    def start(self, index: int) -> Node:
        """A fresh node ``index``: a namespace with its link, hostname, hosts file and empty ``/dev/shm``."""
        if index in self.nodes:
            raise RuntimeError(f"{hostname(index)} is running; lose it first")
        self._generation += 1
        netns, port = f"baft-{self.tag}-n{index}g{self._generation}", f"v{self.tag}g{self._generation}"
        _ip("netns", "add", netns)
        try:
            self._link(index, netns, port)
        except subprocess.CalledProcessError:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)  # its veth goes with it
            raise
        setup = (f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && mount --bind {self.hosts} /etc/hosts "
                 f"&& hostname {hostname(index)} && echo ready && exec sleep infinity")
        holder = subprocess.Popen(["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--ipc",
                                   "--propagation", "private", "sh", "-c", setup],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # in the host's /tmp, not under workdir: a warm server's socket path there is short of AF_UNIX's 108 bytes
        tmp = Path(tempfile.mkdtemp(prefix=f"{netns}-"))
        node = Node(index, netns, holder, tmp)
        self.nodes[index] = node
        if holder.stdout.readline().strip() != "ready":
            self.lose(index)
            raise RuntimeError(f"{hostname(index)} did not start: {holder.stderr.read().strip()}")
        return node

    def _link(self, index: int, netns: str, port: str) -> None:
        """Node ``index``'s loopback and its veth to the hub's bridge, with the node's addresses."""
        # the replacement keeps the lost node's hardware address too: the other nodes' ARP caches still hold it
        # (a gratuitous ARP on link-up is lost while the bridge port comes up, and the caches would swallow the
        # first connections to the replacement for tens of seconds)
        _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "address", mac(index),
            "netns", netns)
        _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{address(index)}/24", "dev", INTERFACE)
        _ip("-n", netns, "link", "set", INTERFACE, "up")
        _ip("-n", netns, "link", "set", "lo", "up")

    def lose(self, index: int) -> None:
        """Node ``index`` dies: every process on it SIGKILLed, its namespaces (and shared memory) gone."""
        node = self.nodes.pop(index)
        deadline = time.monotonic() + 30
        while pids := node.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name}: processes {pids} outlived SIGKILL")
            time.sleep(0.05)
        node.holder.wait()
        subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        shutil.rmtree(node.tmp, ignore_errors=True)

    def close(self) -> None:
        """Lose every node and remove the hub."""
        for index in list(self.nodes):
            self.lose(index)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)


class Job:
    """``script``, one node's launch of a multi-node job, running on every node of ``cluster``.

    Each launch's output goes to its own file in ``logs``; ``run_dir`` is the directory the job
    shares between its nodes (``losses.jsonl``, ``recovery.jsonl``, the managers' logs). Node
    ``endpoint`` hosts the rendezvous.
    """

    def __init__(self, cluster: Cluster, script: str, env: dict, run_dir: Path, logs: Path, endpoint: int = 0):
        self.cluster, self.script, self.env = cluster, script, env
        self.run_dir, self.logs, self.endpoint = Path(run_dir), Path(logs), endpoint
        self.launches: dict[int, subprocess.Popen] = {}
        self.count = 0
        self.logs.mkdir(parents=True, exist_ok=True)

    def launch(self, index: int) -> None:
        """Run the script on node ``index``."""
        self.count += 1
        log = self.logs / f"{hostname(index)}-launch{self.count}.log"
        self.launches[index] = self.cluster.nodes[index].popen(["sh", "-c", self.script], self.env, log)

    def start(self) -> None:
        """Start every node and launch the job on each."""
        for index in range(self.cluster.size):
            self.cluster.start(index)
            self.launch(index)

    def lose(self, indexes) -> dict[int, int]:
        """Nodes ``indexes`` are lost and replaced by fresh nodes of the same names, which run the launch.

        Where the rendezvous endpoint's node is among them, the other nodes' ``torchrun`` exit
        with it, and the launch runs again on every node; the survivors' exit codes (else none).
        """
        for index in indexes:
            self.cluster.lose(index)
        exits = {}
        if self.endpoint in indexes:
            exits = self.wait_exit([i for i in range(self.cluster.size) if i not in indexes])
        for index in indexes:
            self.cluster.start(index)
        for index in (range(self.cluster.size) if exits else indexes):
            self.launch(index)
        return exits

    def rebuildable_steps(self, root: str) -> set[int]:
        """The steps at which parity rebuilds any one lost node: every node's manager (its shared-memory root
        ``root``, with ``{node}`` for the node's index) holds a share of every node's bundle of them."""
        from baft.errors import BaftError
        from baft.manager.protocol import ManagerClient

        steps = None
        for index, node in self.cluster.nodes.items():
            try:
                with ManagerClient.connect(node.path(root.format(node=index)), timeout=2.0) as client:
                    shares = client.status()["parity"]["shares"]
            except BaftError:  # no manager (yet)
                return set()
            held = set.intersection(*(set(shares.get(str(origin), ())) for origin in range(self.cluster.size)))
            steps = held if steps is None else steps & held
        return steps or set()

    def wait_rebuildable(self, root: str, timeout: float = 120) -> None:
        """Until parity could rebuild any one lost node (:meth:`rebuildable_steps`): a node lost before that,
        in a job's first second or two here, cannot be rebuilt."""
        deadline = time.monotonic() + timeout
        while not self.rebuildable_steps(root):
            assert time.monotonic() < deadline, f"no step the managers' parity covers on every node\n{self.tails()}"
            time.sleep(0.1)

    def losses(self) -> list[dict]:
        return read_jsonl(self.run_dir / "losses.jsonl")

    def recoveries(self) -> list[dict]:
        return read_jsonl(self.run_dir / "recovery.jsonl")

    def wait_for(self, step: int, recoveries: int, timeout: float = 240) -> None:
        """Until rank 0 logged ``step`` after the job's ``recoveries``-th recovery; AssertionError when a
        launch ends first or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            losses = self.losses()
            if len(self.recoveries()) >= recoveries and losses and losses[-1]["step"] >= step:
                return
            ended = {i: p.returncode for i, p in self.launches.items() if p.poll() is not None}
            assert not ended, f"torchrun ended on nodes {ended} before step {step}\n{self.tails()}"
            assert time.monotonic() < deadline, f"no step {step} after {recoveries} recoveries\n{self.tails()}"
            time.sleep(0.05)

    def wait_exit(self, indexes, timeout: float = 240) -> dict[int, int]:
        """The exit codes of the launches on ``indexes``, once they ended."""
        deadline = time.monotonic() + timeout
        for index in indexes:
            self.launches[index].wait(timeout=max(1.0, deadline - time.monotonic()))
        return {index: self.launches[index].returncode for index in indexes}

    def output(self) -> str:
        """Every launch's output."""
        return "".join(path.read_text(errors="replace") for path in sorted(self.logs.glob("*.log")))

    def tails(self) -> str:
        """The end of every launch's and manager's log, for a failure message."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}"
                          for path in sorted([*self.logs.glob("*.log"), *self.run_dir.glob("manager-*.log")]))
