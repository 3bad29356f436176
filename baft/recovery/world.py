"""The process groups of a job that recovers in place: the survivors of a killed rank and its replacement
meet in a new world, and the survivors rebuild their model's groups the way DeepSpeed built them.

Under ``baft train`` every rank of a one-node job is forked by the node's warm server
(:mod:`baft.warm.server`), which replaces a rank killed by a signal with a new fork of the same
command. Worlds are numbered: torchrun's is generation 0; each recovery joins the next one, at the
server's c10d store (``BAFT_STORE``) under a prefix of the job and the generation. The store
remembers each rank's generation, so a replacement joins the one after its predecessor's, as
the survivors do. Group names are counters that restart with the default group
(``destroy_process_group``), so the groups the survivors make again, in the order a new process
makes them (:func:`regroup`, then ``deepspeed.initialize``), meet the replacement's.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from baft.accelerator import collective_device
from baft.config import GENERATION_ENV, STORE_ENV
from baft.errors import says_peer_lost, script_raised
from baft.recovery.record import EARLIER_ENV, torchrun_attempt

JOIN_TIMEOUT = timedelta(seconds=60)  # to wait for every rank of a new world (the replacement runs its script)
ENDED_TIMEOUT = timedelta(seconds=2)  # to reach the store as a rank exits
REPLACED_ENV = "BAFT_WORLD_REPLACED"  # how many ranks of this process's world are replacements
# seconds a survivor has to come to the new world before it is replaced too (see _meet): one computing comes at its
# next send or receive, one blocked in a collective at once (_hang_up); a backstop
STRAGGLER_GRACE = 10.0


def available() -> bool:
    """Whether a killed rank of this job is replaced in place (its launcher allows it and the job runs on one
    node: the warm server then names its store)."""
    return STORE_ENV in os.environ


def generation() -> int:
    return int(os.environ.get(GENERATION_ENV, "0"))


def _job() -> str:
    """Keys of this job's attempt, apart from other jobs forked by the same server."""
    env = os.environ
    return (f"baft/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
            f"/{torchrun_attempt()}")


def _store(timeout: timedelta = JOIN_TIMEOUT) -> dist.TCPStore:
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=False)


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's or a receive's failing because a peer's process is gone."""
    return isinstance(error, RuntimeError) and says_peer_lost(str(error))


def _replaced_on_lost_peer(kind, error, trace) -> None:
    """``sys.excepthook`` of a rank that recovers in place: a peer's death that ends it outside ``train_batch`` (a
    collective of the script's own) gets it replaced, as a killed rank is, instead of a relaunch of every rank."""
    _excepthook(kind, error, trace)
    if lost_peer(error):
        why = getattr(error, "baft_not_in_place", None)
        where = f"and cannot recover in place ({why})" if why else "outside train_batch"
        print(f"baft: rank {os.environ.get('RANK')} lost a peer {where}; a new process takes its place",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_excepthook = sys.excepthook


def register() -> None:
    """As a rank of torchrun's world starts: say at the store which process is this rank (a survivor that never
    comes to a new world is killed by its pid, and replaced: :func:`_meet`), and count the recoveries in place
    of torchrun's earlier attempts (:func:`baft.recovery.record.restart_count`)."""
    store = _store()
    _say_pid(store, int(os.environ["RANK"]))
    _started(store)


def _attempt(attempt: int | str) -> str:
    """The key of how many recoveries in place an attempt of torchrun's made."""
    return f"baft/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt{attempt}/in-place"


def _started(store: dist.Store) -> None:
    """As this process starts as a rank (of torchrun's world, or a replacement): the recoveries in place of
    torchrun's earlier attempts, and its excepthook."""
    attempts = [_attempt(a) for a in range(torchrun_attempt())]
    os.environ[EARLIER_ENV] = str(sum(int(store.get(key)) for key in attempts if store.check([key])))
    sys.excepthook = _replaced_on_lost_peer


def join(replacement: bool = False, backend: str | None = None) -> int:
    """Initialise the default process group as the next generation's world (a replacement: the one after its
    predecessor's); the number of replacements in it. Raises when not every rank joins within
    :data:`JOIN_TIMEOUT`."""
    store = _store()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    key = f"{_job()}/rank{rank}/generation"
    previous = (int(store.get(key)) if store.check([key]) else 0) if replacement else generation()
    nxt = previous + 1
    world = dist.PrefixStore(f"{_job()}/gen{nxt}", store)
    _say_pid(store, rank)
    _meet(world, store, rank, size)
    if backend is None:
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().communication_backend_name()
    dist.init_process_group(backend, store=world, rank=rank, world_size=size, timeout=dist.default_pg_timeout)
    store.set(key, str(nxt))
    store.set(_attempt(torchrun_attempt()), str(nxt))
    os.environ[GENERATION_ENV] = str(nxt)
    if replacement:
        _started(store)
    replaced = torch.tensor([int(replacement)], device=collective_device())
    dist.all_reduce(replaced)
    global _JOINED_AT
    _JOINED_AT = _sequence_number()  # a replacement's script runs next: its collectives are counted from here
    os.environ[REPLACED_ENV] = str(int(replaced.item()))
    return int(replaced.item())


def _meet(world: dist.Store, store: dist.Store, rank: int, size: int) -> None:
    """Wait until every rank of the new world has come. A rank whose process still runs the old world
    :data:`STRAGGLER_GRACE` seconds on is stuck there (its peers hung up on it, :func:`_hang_up`): it is killed,
    and the warm server replaces it. A rank whose process is gone is being replaced: its replacement is awaited;
    one whose process ended its script (:func:`_say_ended`) will not come, and the meeting fails at once."""
    world.set(f"arrived/{rank}", "1")
    start = time.monotonic()
    while True:
        missing = [r for r in range(size) if not world.check([f"arrived/{r}"])]
        if not missing:
            return
        waited = time.monotonic() - start
        if waited > JOIN_TIMEOUT.total_seconds():
            raise RuntimeError(f"ranks {missing} did not come to the new world within {waited:.0f} s")
        ended = [r for r in missing if _ended(store, r)]
        if ended:  # it finished the run (the fault came in its last step) or failed: no process will come
            how = "; ".join(f"rank {r} {_how_ended(store, r)}" for r in ended)
            raise RuntimeError(f"ranks {ended} ended their script before they came to the new world ({how}); every "
                               f"rank starts again")
        if waited > STRAGGLER_GRACE:
            for other in missing:
                _kill_if_running(store, other)
        time.sleep(0.005)


def _say_pid(store: dist.Store, rank: int) -> None:
    """This process as ``rank``'s: its pid and start time (a pid alone may name another process later); and, as
    it exits, that it ended (:func:`_say_ended`)."""
    store.set(f"{_job()}/rank{rank}/pid", _this_process())
    if not _ENDING:
        _ENDING.append(rank)
        atexit.register(_say_ended)


_ENDING: list[int] = []  # the rank whose end this process says at its exit, once registered


def _this_process() -> str:
    return json.dumps([os.getpid(), psutil.Process().create_time()])


def _say_ended() -> None:
    """At this rank's exit (its script finished, or failed: a killed process runs no exit handler): said at the
    store, so that a new world's ranks waiting for it stop waiting (:func:`_meet`). Where the store is gone (its
    server with it), no one waits."""
    error = script_raised()
    how = f"raised {type(error).__name__}" if error is not None else "finished: the fault came in its last step"
    try:
        store = _store(ENDED_TIMEOUT)
        store.set(f"{_job()}/rank{_ENDING[0]}/how", how)
        store.set(f"{_job()}/rank{_ENDING[0]}/ended", _this_process())
    except (RuntimeError, OSError, ValueError):
        pass


def _how_ended(store: dist.Store, rank: int) -> str:
    key = f"{_job()}/rank{rank}/how"
    return store.get(key).decode() if store.check([key]) else "ended"


def _ended(store: dist.Store, rank: int) -> bool:
    """Whether the process that is ``rank`` now has ended its script (:func:`_say_ended`)."""
    pid, ended = f"{_job()}/rank{rank}/pid", f"{_job()}/rank{rank}/ended"
    return store.check([ended]) and store.check([pid]) and store.get(ended) == store.get(pid)


def _process(store: dist.Store, rank: int) -> psutil.Process | None:
    """The process that is ``rank`` now, where it runs."""
    key = f"{_job()}/rank{rank}/pid"
    if not store.check([key]):
        return None
    pid, started = json.loads(store.get(key))
    try:
        process = psutil.Process(pid)
        return process if process.create_time() == started else None
    except psutil.NoSuchProcess:
        return None


def _kill_if_running(store: dist.Store, rank: int) -> None:
    process = _process(store, rank)
    if process is not None:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _hang_up(store: dist.Store, size: int) -> None:
    """Shut down this process's TCP connections with the other ranks. gloo closes a group's connections only once
    nothing holds the group (DeepSpeed's engine and grid still do), so a survivor blocked in a collective with this
    one would wait for it until killed (:func:`_meet`); hung up on, its collective fails as it does when a peer dies,
    and it recovers too."""
    peers = set()
    for rank in range(size):
        process = _process(store, rank)
        if process is None or process.pid == os.getpid():
            continue
        try:
            peers |= {conn.laddr for conn in process.net_connections(kind="tcp")}
        except psutil.Error:  # it died meanwhile: its connections are gone with it
            continue
    for conn in psutil.Process().net_connections(kind="tcp"):
        if not conn.raddr or conn.raddr not in peers:
            continue
        try:  # gloo may have closed it meanwhile, and the number been given to another socket since
            with socket.socket(fileno=os.dup(conn.fd)) as duplicate:
                if (duplicate.getsockname(), duplicate.getpeername()) == (tuple(conn.laddr), tuple(conn.raddr)):
                    duplicate.shutdown(socket.SHUT_RDWR)  # the socket's: the descriptor stays gloo's to close
        except OSError:
            continue


def rejoin() -> int:
    """In a survivor: leave the broken world (its groups' connections close, so a rank still waiting on this
    one hears of the fault too) and join the next; the number of replacements in it (0: no rank was killed)."""
    backend = dist.get_backend()
    _hang_up(_store(), int(os.environ["WORLD_SIZE"]))
    dist.destroy_process_group()
    return join(backend=backend)


def publish(name: str, value) -> None:
    """In a survivor, in the new world: ``value`` (JSON) for the replacements of this world to read."""
    _store().set(f"{_job()}/gen{generation()}/{name}", json.dumps(value))


def published(name: str):
    """In a replacement: what the survivors of its world publish as ``name`` (waited for), or None where every rank
    of its world is a replacement."""
    if int(os.environ.get(REPLACED_ENV, "0")) >= int(os.environ["WORLD_SIZE"]):
        return None
    store, key = _store(), f"{_job()}/gen{generation()}/{name}"
    store.wait([key], JOIN_TIMEOUT)
    return json.loads(store.get(key))


def tied_dtypes(model) -> dict[tuple[str, str], torch.dtype]:
    """The dtype of each tied weight of a ``PipelineModule`` (by tie key and attribute) as its constructor left
    it: a replacement's constructor broadcasts them so, before DeepSpeed converts a survivor's (to bf16, say)."""
    from deepspeed.pipe import PipelineModule

    if not isinstance(model, PipelineModule):
        return {}
    return {(key, attr): model._recursive_getattr(comm["module"], attr).dtype
            for key, comm in model.tied_comms.items() for attr in comm["weight_attr"]}


def groups_before(model) -> int:
    """How many process groups were made before the ``PipelineModule`` ``model`` made its own: the script's (Megatron's
    and GPT-NeoX's model-parallel unit makes its groups first), which a replacement's script makes again and a
    survivor's regroup does not; 0 for another model, or where torch names its groups otherwise."""
    from deepspeed.pipe import PipelineModule

    if not isinstance(model, PipelineModule):
        return 0
    name = dist.distributed_c10d._world.pg_names.get(model.world_group, "")  # named by a count from 0, the world's
    return int(name) - 1 if name.isdigit() else 0


def collectives_before() -> int:
    """How many collectives this process's script called on its default process group so far: at
    ``baft.initialize``, the script's own (a barrier while rank 0 writes the data), which a replacement's script calls
    again and its survivors, inside ``train_batch``, never meet (probe 28: a hang until gloo's timeout); not those a
    replacement's :func:`join` made before its script ran; 0 where the backend does not count them."""
    return _sequence_number() - _JOINED_AT


_JOINED_AT = 0  # the default group's collectives as this process joined a new world (a replacement), before its script


def _sequence_number() -> int:
    if not dist.is_initialized():
        return 0
    try:
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        return 0


def regroup(model, dtypes: dict[tuple[str, str], torch.dtype]) -> None:
    """The process groups a ``PipelineModule`` makes in its constructor, made again in the new world in the
    same order, and the broadcasts of its tied weights, as the constructor makes them (a replacement's
    constructor runs meanwhile) in the ``dtypes`` of :func:`tied_dtypes` (the restore then sets the values);
    nothing for another model."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    if not isinstance(model, PipelineModule):
        return
    model.world_group = dist.new_group(ranks=range(dist.get_world_size()))
    model._grid = PipelineParallelGrid(process_group=model.world_group, topology=model._topo)
    model.tied_comms = model._index_tied_modules()
    for key, comm in model.tied_comms.items():
        for attr in comm["weight_attr"]:
            weight = model._recursive_getattr(comm["module"], attr)
            dtype, source = dtypes.get((key, attr), weight.dtype), min(comm["ranks"])
            # the source sends its weight, as the constructor does (not what an empty tensor held: a restore that
            # found nothing would leave that in the replacement)
            sent = weight.detach().to(dtype) if dist.get_rank() == source else torch.empty_like(weight, dtype=dtype)
            dist.broadcast(sent, src=source, group=comm["group"])
