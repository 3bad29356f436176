"""``baft train``: a training run under baft, on one node: the node's managers, the warm server, torchrun with
its restarts, and what the run keeps when it ends."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import click

from baft.cli.launch import SHM_ROOT
from baft.cli.options import example_options, executor_options, user_errors
from baft.config import IN_MEMORY, LAUNCHER_ENV, POLICIES
from baft.errors import BaftError

PERSISTED = "persisted"  # RUN_DIR/persisted: where the managers write the snapshots they keep on disk
# the example's options a script's run does not read: the baft key a script's DeepSpeed config sets instead of each,
# and what the script decides itself
SCRIPT_KEYS = {"policy": "policy", "period": "period", "executor": "executor", "leftovers": "leftovers",
               "bubble_map": "bubble_map", "plan_file": "plan", "schedule": "schedule"}
SCRIPT_OWN = {"iters": "its steps", **dict.fromkeys(("micro_batches", "micro_batch_size", "seq", "d_model", "layers",
                                                      "heads", "vocab", "precision", "partition", "zero_stage"),
                                                     "its model")}


@click.command()
@click.option("--example", type=click.Choice(["gpt"]), help="Train the bundled example instead of a script.")
@example_options
@click.option("--iters", default=20, show_default=True, help="The example: train until this optimizer step.")
@click.option("--policy", default="baft", show_default=True, type=click.Choice(POLICIES),
              help="The example's snapshot policy; a script sets baft.policy.")
@click.option("--period", default="auto", show_default=True,
              help="The example: snapshot every K steps, or 'auto' (planner); a script sets baft.period.")
@executor_options
@click.option("--bubble-map", type=click.Path(dir_okay=False), help="Measured bubble map to plan from.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), help="Plan file to follow.")
@click.option("--run-dir", default="runs/latest", show_default=True, type=click.Path(file_okay=False),
              help="Where losses.jsonl, recovery.jsonl and checkpoints go.")
@click.option("--max-restarts", default=3, show_default=True, type=click.IntRange(min=0),
              help="Elastic restarts after a failure.")
@click.option("--nprocs", type=click.IntRange(min=1), help="Processes for a script (default: stages x data-parallel).")
@click.option("--manager/--no-manager", default=True, show_default=True,
              help="Start this node's snapshot manager for the run (stopped at the end).")
@click.option("--warm/--cold", default=True, show_default=True,
              help="Fork every rank, and every restarted rank, from a process that has imported torch and DeepSpeed.")
@click.option("--in-place/--relaunch", "in_place", default=False, show_default=True,
              help="A killed rank of a one-node warm job is replaced and its peers recover in their own processes; "
                   "for a script whose loop stops on engine.global_steps (README: Recovery in place).")
@click.option("--spares", default=1, show_default=True, type=click.IntRange(min=0),
              help="With --in-place: processes kept ready to replace a killed rank, the script's imports done "
                   "(0: a replacement is forked when a rank dies, and imports them itself).")
@click.option("--persist-every", type=int, help="The manager writes every N-th snapshot to RUN_DIR/persisted.")
@click.option("--nodes", default=1, show_default=True,
              help="The example: simulated nodes, one manager each, in one parity group over loopback.")
@click.option("--hang-timeout", type=float,
              help="The example: seconds a rank may be silent before its node's manager kills it (default 60; "
                   "0: never). A script sets baft.hang_timeout in its config.")
@click.option("--fault", "faults", multiple=True, help="Inject a fault: rank=R,step=S,phase=P[,restart=N].")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False),
              help="Every rank writes its per-instruction trace, with baft's copies, here (baft show DIR draws it).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@user_errors
def train(example, iters, policy, period, executor, leftovers, bubble_map, plan_file, run_dir, max_restarts, nprocs,
          manager, warm, in_place, spares, persist_every, nodes, hang_timeout, faults, trace_dir, command, dp, **model):
    """Train under a snapshot policy, restarting from the newest snapshot after a failure.

    Either ``--example gpt`` or, after ``--``, a training script (and its arguments) that
    calls ``baft.initialize``; it runs under torchrun with ``--max-restarts``, each rank forked from a
    warm process of the node (``--cold``: started afresh, as plain torchrun starts it). Every rank's
    output goes to ``RUN_DIR/output.log``; the screen shows rank 0's output (the example
    prints one line per iteration, also appended to ``RUN_DIR/losses.jsonl``) and baft's lines.
    """
    _check_options(example, command, warm, in_place, hang_timeout, nodes)
    from baft.cli.launch import clear_stale_build_locks
    from baft.cli.preflight import later_imports
    from baft.recovery import chaos
    from baft.warm import WarmServer

    asked = [chaos.parse_fault(fault) for fault in faults]
    procs = nprocs or model["stages"] * dp
    run, run_id, env = _run_dir_and_env(run_dir, procs, nodes, faults, trace_dir)
    clear_stale_build_locks(env["TORCH_EXTENSIONS_DIR"])  # before the warm server and the ranks load DeepSpeed's ops
    _refuse_another_policys_progress(run, *(_policy_and_save_dir(command) if command else (policy, None)))
    server = WarmServer.running(env) or WarmServer()
    managed = manager and (policy in IN_MEMORY or not example)  # a script's policy is its config's
    configs = _manager_configs(run, run_id, nodes, persist_every) \
        if managed or example and (nodes > 1 or persist_every) else []
    program = list(command)
    if example:
        program = _example_program(
            {**model, "iters": iters, "policy": policy, "period": period, "executor": executor,
             "leftovers": leftovers, "run_dir": str(run), "bubble_map": bubble_map, "plan": plan_file,
             "run_id": run_id, "shm_root": SHM_ROOT, "ranks_per_node": procs // nodes, "hang_timeout": hang_timeout},
            configs, nodes, persist_every, run)
    warm, cmd = _warm_command(program, env, server, procs, max_restarts, run, warm, in_place, spares)
    later = later_imports(in_place, model if example else None, command)
    outcome, log = _run(cmd, env, run, run_id, server, configs if managed else [], warm, later)
    _report(outcome, asked, run, log, trace_dir)


def _check_options(example, command, warm: bool, in_place: bool, hang_timeout, nodes: int) -> None:
    """Refuse options that contradict each other, and a script that cannot run under baft (a warning where it
    does not call ``baft.initialize``), each in one line, before anything is started."""
    from baft.cli.preflight import check_script_launch, script_source, unprotected_initialize

    if bool(example) == bool(command):
        raise BaftError("give either --example gpt or a training script after --, not both or neither")
    if in_place and not warm:
        raise BaftError("--in-place: a killed rank is replaced by the node's warm server, which --cold turns off")
    context = click.get_current_context()
    given = context.get_parameter_source("spares") is not click.core.ParameterSource.DEFAULT
    if given and not in_place:
        raise BaftError("--spares: spares replace a killed rank in place; give --in-place too")
    if command:
        check_script_launch(list(command))
        source = script_source(list(command))
        said = unprotected_initialize(source) if source else None
        if said:
            click.echo(f"baft: warning: {said}", err=True)
        if hang_timeout is not None:
            raise BaftError("--hang-timeout is the example's: a script sets baft.hang_timeout in its DeepSpeed config")
        if nodes > 1:  # the ranks would need the parity group of managers this launch makes, which no config names
            raise BaftError(f"--nodes {nodes} simulates nodes for the example only: a script's ranks would all keep "
                            "their snapshots on node 0, and a node fault would find none to rebuild")
        unread = _unread_by_scripts(context)
        if unread:
            click.echo(f"baft: warning: {unread}", err=True)


def _unread_by_scripts(context) -> str:
    """One line naming the example's options given on the command line of a script's run, which its ranks never
    read (``--period 3`` left the config's period, ``--policy none`` the config's policy), and where the script sets
    them; empty where none is given."""
    given = [param for param in context.command.params if param.name in {**SCRIPT_KEYS, **SCRIPT_OWN}
             and context.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT]
    if not given:
        return ""
    keys = [f"baft.{SCRIPT_KEYS[p.name]}" for p in given if p.name in SCRIPT_KEYS]
    own = list(dict.fromkeys(SCRIPT_OWN[p.name] for p in given if p.name in SCRIPT_OWN))
    takes = [f"{', '.join(keys)} from its DeepSpeed config" if keys else "", f"{' and '.join(own)} from its own code"
             if own else ""]
    return (f"{', '.join(p.opts[0] for p in given)}: the example's options, which a script's run does not read: "
            f"it takes {' and '.join(filter(None, takes))}")


def _run_dir_and_env(run_dir, procs: int, nodes: int, faults, trace_dir) -> tuple[Path, str, dict]:
    """The run directory (made here, unless shared memory keeps an earlier run's snapshots of it), its run id,
    and the environment every rank is launched with."""
    from baft.cli.launch import launch_env
    from baft.cli.launch import run_id as launch_run_id
    from baft.config import TRACE_DIR_ENV
    from baft.recovery import chaos

    run = Path(run_dir).resolve()
    run_id = launch_run_id(run)
    if not run.exists():
        _refuse_an_earlier_runs_snapshots(run, Path(SHM_ROOT) / run_id)
    run.mkdir(parents=True, exist_ok=True)
    if procs % nodes:
        raise BaftError(f"--nodes {nodes}: {procs} processes cannot be split evenly over {nodes} nodes")
    env = launch_env({LAUNCHER_ENV["run_id"]: run_id, LAUNCHER_ENV["shm_root"]: SHM_ROOT,
                      LAUNCHER_ENV["run_dir"]: str(run),
                      **({chaos.ENV: ";".join(faults)} if faults else {}),
                      **({TRACE_DIR_ENV: str(_fresh_trace_dir(trace_dir))} if trace_dir else {})})
    return run, run_id, env


def _manager_configs(run: Path, run_id: str, nodes: int, persist_every):
    """One manager's config per node, each persisting under ``RUN_DIR/persisted``."""
    from baft.manager.nodes import node_configs

    return node_configs(SHM_ROOT, run_id, nodes, run / PERSISTED, persist_every)


def _example_program(args: dict, configs, nodes: int, persist_every, run: Path) -> list[str]:
    """What torchrun runs for ``--example``: the worker with ``args``, and, with several nodes or
    ``--persist-every``, the parity group and persistence of the managers' ``configs``."""
    from baft.cli.launch import example_args

    if nodes > 1 or persist_every:
        args.update(parity_group=",".join(str(m) for m in configs[0].group) or None,
                    parity_k=configs[0].parity_k, persist_every=persist_every, persist_dir=str(run / PERSISTED))
    return ["-m", *example_args(args)]


def _warm_command(program: list[str], env: dict, server, procs: int, max_restarts: int, run: Path, warm: bool,
                  in_place: bool, spares: int) -> tuple[bool, list[str]]:
    """Whether the ranks fork from the warm ``server`` (``env`` gets what they need to find it), and the torchrun
    command that runs ``program`` on ``procs`` ranks."""
    from baft.cli.launch import torchrun
    from baft.cli.runlog import torchrun_options
    from baft.config import REPLACE_ENV, SPARES_ENV
    from baft.warm import warmable

    warm = warm and warmable(program)
    if warm:
        program = server.program(program)
        env.update(server.env())
        if in_place:  # each killed rank is replaced in place while torchrun's restarts are left
            env.update({REPLACE_ENV: str(max_restarts), SPARES_ENV: str(spares)})
    cmd = torchrun(procs, program, max_restarts=max_restarts, module=False, options=torchrun_options(run))
    if warm:  # torchrun itself forked too: its import of torch, and its exit's freeing of it, come off every launch
        cmd = server.command(cmd)
    return warm, cmd


def _run(cmd: list[str], env: dict, run: Path, run_id: str, server, configs, warm: bool, later: str):
    """Run ``cmd`` with the managers of ``configs`` and the warm server (importing
    :func:`~baft.cli.preflight.later_imports` ``later``), holding ``run`` for this launch alone; its outcome and the
    log of every rank's output. SIGTERM stops it, with exit code 128 + SIGTERM."""
    from baft.cli.launch import exclusive_run
    from baft.cli.runlog import LOG_NAME, Terminated, run_logged, sigterm_stops, trim_run_logs
    from baft.manager.nodes import retire_all, revive_all, start_all, stop_all

    log = run / LOG_NAME
    try:
        with sigterm_stops(), exclusive_run(run), server:
            for pid in retire_all(configs):
                click.echo(f"baft: stopped the manager an earlier launch of {run} left running (pid {pid}); "
                           "this launch's managers adopt its snapshots")
            _warn_unserved_snapshots(SHM_ROOT, run_id)
            trim_run_logs(run)
            if warm:
                server.start(env, later=later)
            start_all(configs, log_dir=run)
            outcome = None
            try:
                outcome = run_logged(cmd, env, log)
            finally:
                for node, silent in revive_all(configs, log_dir=run):
                    what = f"stopped answering (pid {silent}, killed)" if silent else "died"
                    click.echo(f"baft: node {node}'s manager {what} during the run; a new one took over its snapshots "
                               "to keep them", err=True)
                stop_all(configs)
                _say_what_is_kept(configs, run, outcome)
    except Terminated:
        click.echo(f"baft: stopped by SIGTERM; every rank's output is in {log}", err=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    return outcome, log


def _report(outcome, asked, run: Path, log: Path, trace_dir) -> None:
    """Say how the run ended: its recoveries, the ``--fault``s ``asked`` that never fired, and where its trace is;
    a BaftError where it failed."""
    from baft.recovery import chaos

    if (run / "recovery.jsonl").exists():
        from baft.cli.report import render_recovery_text
        from baft.recovery.record import load_recoveries

        try:
            click.echo(render_recovery_text(load_recoveries(run)))
        except BaftError as err:  # the table's, not the run's: a finished run ended in this error
            click.echo(f"baft: warning: no recovery table: {err}", err=True)
    if outcome.error:
        raise BaftError(outcome.error)
    if outcome.code == 0:
        from baft import faults as fault_log

        for fault in chaos.not_fired(asked, fault_log.read(run)):
            click.echo(f"baft: --fault {fault} never happened: the run has no such rank or node, or attempt "
                       f"{fault.restart} never came to step {fault.step}'s {fault.phase}", err=True)
    if outcome.code != 0:
        raise BaftError(f"{outcome.exception or f'training failed (exit code {outcome.code})'}; "
                        f"every rank's output is in {log}")
    if trace_dir:
        click.echo(f"baft: trace of every rank in {trace_dir}; draw it with: baft show {trace_dir} --png timeline.png")


def _say_what_is_kept(configs, run: Path, outcome=None) -> None:
    """After the managers stopped: the step the run goes on from, on disk; or, where a manager could not
    write it, the shared memory it kept instead (never freed unwritten). Where a rank's baft error stopped the launch
    (its ``outcome``: snapshots refused, a bad config), the step kept is said, not that a launch again goes on from
    it: the same launch would stop the same way."""
    from baft.manager import persist
    from baft.manager.nodes import manager_log
    from baft.snapshot import slots

    kept_in_memory = [c for c in configs if slots.rank_ids(c.shm_root)]
    for c in kept_in_memory:
        click.echo(f"baft: node {c.node_id}'s manager could not write its newest snapshot to {c.dir} (see "
                   f"{manager_log(run, c.node_id)}); it kept {c.shm_root} in shared memory: `baft train` "
                   f"again resumes from it, `baft manager clean {c.shm_root}` frees it", err=True)
    newest = [persist.list_steps(c.dir) for c in configs if c.dir is not None]
    damaged = _damaged_step(newest, outcome.error if outcome is not None else None)
    if damaged:
        click.echo(damaged, err=True)
    elif newest and all(newest) and not kept_in_memory:
        kept = f"baft: step {min(steps[0].step for steps in newest)} is kept in {run / PERSISTED}"
        click.echo(kept + (" (the error below stopped this launch)" if outcome is not None and outcome.error else
                           ": `baft train` again with this --run-dir goes on from it (the example: with a larger "
                           "--iters)"))


def _damaged_step(newest: list, error: Optional[str]) -> str:
    """Where the rank's ``error`` that stopped the launch names a file of a node's newest persisted step (of
    ``newest``, each node's steps newest first: its size or checksums wrong), the way on from the newest older step
    every node holds whole: that step's directory moved aside, with the command and the step the run then goes on
    from (probe 21: only a fresh start or another run directory was offered). Never done here: going back steps is
    the user's to choose. "" where the error names no such file."""
    bad = [steps[0] for steps in newest if steps and error and f"{steps[0].path}/" in error]
    if not bad:
        return ""
    moves = " && ".join(f"mv {step.path} {step.path.parent / ('damaged-' + step.path.name)}" for step in bad)
    older = sorted(set.intersection(*({s.step for s in steps if s.step < bad[0].step} for steps in newest)),
                   reverse=True)
    whole = next((step for step in older if _whole_on_every_node(newest, step)), None)
    said = f"baft: the snapshot of step {bad[0].step} on disk is damaged (the error below names its file)"
    if whole is None:
        return f"{said}, and no step persisted before it is whole on every node: start afresh in another --run-dir"
    return (f"{said}: to go on from step {whole}, the newest step persisted before it whose files are whole on every "
            f"node, move its directory aside (`{moves}`) and launch again; or start afresh in another --run-dir")


def _whole_on_every_node(newest: list, step: int) -> bool:
    """Whether every node's persisted ``step`` reads back whole (each rank's file's size and checksums)."""
    from baft.manager import persist

    try:
        for steps in newest:
            persist.read_snapshot(next(s.path for s in steps if s.step == step))
    except BaftError:
        return False
    return True


def _refuse_an_earlier_runs_snapshots(run: Path, top: Path) -> None:
    """A run directory that does not exist, where shared memory keeps the snapshots of an earlier run of the same
    path (its directory deleted after its launch was killed): going on from them, or dropping them, is the user's
    choice to make, never one made without a word."""
    from baft.manager import inventory

    held = [root for root in inventory.scan(top) if root.newest_steps]
    if not held:
        return
    serving = [root for root in held if root.manager_pid is not None]
    raise BaftError(
        f"{run}: no such run directory, but {top} keeps the snapshots an earlier run of it left ("
        f"{'; '.join(root.held() for root in held)}): `mkdir {run}` and launch again to go on from them, or free them "
        f"to start afresh with `baft manager clean {' '.join(str(root.path) for root in held)}`"
        + "".join(f" (after `baft manager stop --shm-root {root.path}`: its manager, pid {root.manager_pid}, serves "
                  "it still)" for root in serving))


def _policy_and_save_dir(command) -> tuple[Optional[str], Optional[str]]:
    """The policy and ``save_dir`` of the ``"baft"`` section a script's arguments name (None where they name no
    config, or one without the section)."""
    from baft.cli.preflight import config_files
    from baft.config import parse_config
    from baft.jsonfile import read_json

    for path in config_files(list(command[1:])):
        cfg = parse_config(read_json(path))
        if cfg.enabled:
            return cfg.policy, cfg.save_dir
    return None, None


def _refuse_another_policys_progress(run: Path, policy: Optional[str], save_dir: Optional[str]) -> None:
    """A launch whose policy keeps its progress where the run's so far is not (the in-memory policies' snapshots in
    ``RUN_DIR/persisted``, the disk policies' checkpoints in their ``save_dir``) would find none and train from step
    0 without a word (probe 18): refused in one line naming where the run's progress is."""
    from baft.config import POLICIES
    from baft.manager import persist

    persisted = max((s.step for node in (run / PERSISTED).glob("node*") for s in persist.list_steps(node)),
                    default=None)
    checkpoints = Path(save_dir) if save_dir else run / "checkpoints"
    written = checkpoints.is_dir() and any(checkpoints.iterdir())
    way_on = "launch with the policy the run trained under, or start afresh in another --run-dir"
    if policy in IN_MEMORY and persisted is None and written:
        raise BaftError(f"{checkpoints}: this run's checkpoints of a disk policy, which policy {policy!r} does not "
                        f"restore (it would train from step 0): {way_on}")
    if policy in POLICIES and policy not in IN_MEMORY + ("none",) and persisted is not None and not written:
        raise BaftError(f"{run / PERSISTED}: this run's snapshots (up to step {persisted}) of an in-memory policy, "
                        f"which policy {policy!r} does not restore (it would train from step 0): {way_on}")


def _warn_unserved_snapshots(shm_root: str, run_id: str) -> None:
    """Say when other runs' snapshots hold shared memory with no manager to serve or free them
    (their ``baft train`` was killed): they take host memory until freed."""
    from baft.manager import inventory

    stale = [r for r in inventory.scan(shm_root) if r.manager_pid is None and r.newest_steps
             and run_id not in r.path.relative_to(shm_root).parts]
    if stale:
        click.echo(f"baft: {shm_root} holds {sum(r.nbytes for r in stale) / 1e6:.1f} MB of snapshots in "
                   f"{len(stale)} node root(s) of other runs that no manager serves; `baft manager ls` lists them, "
                   "`baft manager clean ROOT` frees one", err=True)


def _fresh_trace_dir(trace_dir) -> Path:
    """The trace directory, emptied of an earlier run's traces (a rank writes its own at exit)."""
    from baft.pipeline.merge import trace_paths

    path = Path(trace_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    for old in trace_paths(path):
        old.unlink()
    return path
