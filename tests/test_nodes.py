"""Nodes for real: README's multi-node commands on three nodes, each a namespace of its own, losing whole nodes.

Every node (:mod:`nodes`) has its own network stack, ``/dev/shm``, host name and a link to
a bridge; the job is launched on each node with the literal commands of README's "More than
one node" section (``baft torchrun`` with the c10d rendezvous, the bundled example at pp=3, one
rank per node, the three nodes' managers in one parity group with k=2). Losing a node
SIGKILLs every process of its namespace and deletes the namespace, and its shared memory
with it; a replacement is a fresh namespace with the lost node's name.
"""

import re
import shlex
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import nodes
from baft.cli.launch import launch_env
from baft.manager import persist
from baft.recovery.digests import DIGESTS_ENV, compare
from baft.warm import SOCKET_ENV
from conftest import run_worker

README = Path(__file__).parent.parent / "README.rst"
SECTION = "More than one node"


def readme_blocks() -> list[str]:
    """The literal blocks (``::``) of README's "More than one node" section, dedented."""
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    section = text[start:text.index("\n--------\n", start + len(SECTION) + 30)]
    blocks = re.findall(r"::\n\n((?:(?: {4}.*)?\n)+)", section)
    return [textwrap.dedent(block).strip() for block in blocks]


def readme_block(containing: str) -> str:
    return next(block for block in readme_blocks() if containing in block)


def worker_args(launch: str, run_dir: Path) -> list[str]:
    """The example's own arguments in the README's launch, ``$RUN`` made ``run_dir``."""
    words = shlex.split(launch.replace("\\\n", " ").replace("$RUN", str(run_dir)))
    return words[words.index("baft.examples.worker") + 1:]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def digests(text: str, step: int) -> dict[int, str]:
    """Every rank's final state digest (``--digest``) printed at ``step``."""
    return {int(rank): digest for rank, digest in re.findall(rf"^digest rank (\d+) step {step} (\w+)$", text, re.M)}


@pytest.fixture
def cluster(tmp_path):
    why = nodes.unavailable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    bed = nodes.Cluster(3, tmp_path)
    yield bed
    bed.close()


def uninterrupted(launch: str, run_dir: Path) -> tuple[dict[int, str], dict[int, str]]:
    """The same training on one host, never interrupted: losses by step (``repr``) and final digests by rank;
    its per-step digests in ``run_dir/digests``."""
    args = worker_args(launch, run_dir)
    args[args.index("--policy") + 1] = "none"
    proc = run_worker(3, args, timeout=300, env={DIGESTS_ENV: str(run_dir / "digests")})
    return ({r["step"]: repr(r["loss"]) for r in nodes.read_jsonl(run_dir / "losses.jsonl")},
            digests(proc.stdout, int(option(args, "--iters"))))


def test_a_lost_nodes_temporary_files_go_with_it(cluster):
    """A node's commands get a temporary directory of the node's own, deleted with the node, as a machine's ``/tmp``
    goes with it: every lost node's warm server left its socket's directory in the host's ``/tmp`` (probe 18: dozens
    of ``/tmp/baft-warm-*``, three from each run of the test below)."""
    node = cluster.start(0)
    made = node.run([sys.executable, "-c", "import os; from baft.warm import WarmServer; "
                                           "d = WarmServer().directory; os.mkdir(d); print(d)"], env=launch_env())
    assert made.returncode == 0, made.stderr
    directory = Path(made.stdout.strip())
    assert directory.is_dir()
    cluster.lose(0)
    assert not directory.exists(), f"{directory} outlived its node"


@pytest.mark.slow
def test_three_nodes_survive_the_loss_of_each_node_bit_identically(cluster, tmp_path):
    """node1 (a middle stage), then node2 (the last stage), then node0 (rank 0, and the rendezvous endpoint:
    every torchrun exits and the README's launch runs again on every node). Each time the replaced node's
    stage is rebuilt from the other nodes' parity, and every loss logged, redone steps included, and the final
    state of every rank equal the uninterrupted run's bit for bit."""
    launch = readme_block("torchrun --nnodes")
    env = launch_env({"RUN": str(tmp_path / "run"), DIGESTS_ENV: str(tmp_path / "digests")})  # baft on its PATH
    env.pop(SOCKET_ENV, None)  # each node forks its ranks from a server of its own, in its own namespaces
    job = nodes.Job(cluster, launch, env, tmp_path / "run", tmp_path / "logs")
    iters = int(option(worker_args(launch, job.run_dir), "--iters"))
    stop = readme_block("baft manager stop")
    roots = stop.split("--shm-root ")[1].replace("node0", "node{node}")  # every node's manager, as it sees it

    with ThreadPoolExecutor(1) as pool:  # the reference trains beside the job
        reference = pool.submit(uninterrupted, launch, tmp_path / "reference")
        job.start()
        job.wait_for(step=6, recoveries=0)
        job.wait_rebuildable(roots)
        assert job.lose([1]) == {}
        job.wait_for(step=14, recoveries=1)
        job.wait_rebuildable(roots)
        assert job.lose([2]) == {}
        job.wait_for(step=22, recoveries=2)
        job.wait_rebuildable(roots)
        exits = job.lose([0])
        assert sorted(exits) == [1, 2] and 0 not in exits.values(), f"torchrun went on without its rendezvous: {exits}"
        assert job.wait_exit([0, 1, 2], timeout=300) == {0: 0, 1: 0, 2: 0}, job.tails()
        losses, final = reference.result()
    assert len(losses) == iters and len(final) == 3

    recoveries = job.recoveries()
    assert [r["source"] for r in recoveries] == ["parity"] * 3, job.tails()
    assert {r["kind"] for r in recoveries} == {"warm relaunch"}, recoveries  # rank 0 forked by its node's server
    assert recoveries[2]["fault"] == "a new launch"
    for index in (1, 2, 0):
        assert f"rebuilt node {index}" in (job.run_dir / f"manager-node{index}.log").read_text()
    logged = job.losses()
    assert {r["step"] for r in logged} == set(range(1, iters + 1))
    for r in logged:
        assert repr(r["loss"]) == losses[r["step"]], f"step {r['step']} differs: {r}"
    resumed = [now["step"] for before, now in zip(logged, logged[1:]) if now["step"] != before["step"] + 1]
    assert all(step - 1 in {r["restored_step"] for r in recoveries} for step in resumed), (resumed, recoveries)
    assert digests(job.output(), iters) == final
    assert compare(tmp_path / "reference" / "digests", tmp_path / "digests") == []

    for index in range(3):
        done = cluster.nodes[index].run(["sh", "-c", stop.replace("node0", nodes.hostname(index))], env=job.env)
        assert done.returncode == 0, done.stderr
    newest = {index: persist.list_steps(job.run_dir / "persisted" / f"node{index}")[0].step for index in range(3)}
    assert newest == {0: iters, 1: iters, 2: iters}
