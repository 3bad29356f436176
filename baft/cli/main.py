"""The ``baft`` command: profile, show, plan, train, manager, inspect, report, simulate, compare, demo."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import click

from baft.accelerator import quiet_detection
from baft.cli.demo import demo
from baft.cli.launch import SHM_ROOT
from baft.cli.options import example_options, executor_options, user_errors
from baft.config import IN_MEMORY, POLICIES
from baft.errors import BaftError

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="baft")
def main():
    """Bubble-aware fault tolerance for pipeline-parallel DeepSpeed training."""
    quiet_detection()


@main.command()
@click.option("--example", type=click.Choice(["gpt"]), help="Profile the bundled example instead of a script.")
@example_options
@click.option("--iters", default=10, show_default=True, help="Iterations to profile (after one warm-up).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Bubble map to write (JSON).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@user_errors
def profile(example, out, iters, command, dp, **model):
    """Measure each stage's bubbles on a real DeepSpeed run and write the bubble map.

    Either ``--example gpt`` or, after ``--``, the launch command of a script that calls
    ``baft.initialize`` (the script is stopped after the profiled iterations). A plan is
    written beside the map (``NAME.plan.json``).
    """
    from baft.cli.launch import example_args, launch_env, run_command
    from baft.cli.runlog import Outcome, run_example_logged
    from baft.pipeline.merge import merge_traces, trace_paths
    from baft.config import PROFILE_DIR_ENV, PROFILE_ITERS_ENV

    if bool(example) == bool(command):
        raise BaftError("give either --example gpt or a launch command after --, not both or neither")
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="baft-profile-") as traces:
        env = launch_env({PROFILE_DIR_ENV: traces, PROFILE_ITERS_ENV: str(iters)})
        if command:  # the user's own launch: its output is theirs, on the terminal
            outcome = Outcome(run_command(list(command), env))
        else:
            outcome = run_example_logged(model["stages"] * dp, example_args(
                {**model, "iters": iters + 1, "policy": "none"}), env, out.with_suffix(".log"))
        paths = trace_paths(traces)
        if outcome.code != 0 and not paths:
            raise BaftError(f"the profiled run failed ({outcome.reason()}) before writing its traces")
        bmap = merge_traces(paths)
    bmap.save(out)
    plan_path = _write_plan(bmap, out)
    _print_bubble_map(bmap)
    click.echo(f"wrote {out} and {plan_path}")


def _write_plan(bmap, out: Path) -> Path:
    from baft.snapshot.planner import plan

    path = out.with_name(out.stem + ".plan.json")
    plan(bmap, source=str(out)).save(path)
    return path


def _print_bubble_map(bmap) -> None:
    from baft.cli.show import render_text

    click.echo(render_text(bmap))


def _load_any(path):
    """A bubble map or a plan, by its 'schema' field."""
    from baft.jsonfile import read_json
    from baft.pipeline.bubblemap import BubbleMap
    from baft.snapshot.planner import Plan

    kind = read_json(path).get("schema")
    if kind == "baft.plan":
        return Plan.load(path)
    return BubbleMap.load(path)


@main.command()
@click.argument("file", type=click.Path())
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw the per-stage timeline to this PNG.")
@click.option("--stages", type=int, help="Refuse a map made for another stage count.")
@user_errors
def show(file, png, stages):
    """Print a bubble map's or plan's summary; draw the timeline with --png.

    FILE may also be the trace directory of a run (``baft train --trace DIR``): one typical
    iteration of it, with baft's copies inside the bubbles and the flush before the optimizer step.
    """
    from baft.cli.show import render_plan_text, render_text
    from baft.pipeline.bubblemap import BubbleMap
    from baft.snapshot.planner import Plan

    if Path(file).is_dir():
        _show_run(file, png, stages)
        return
    obj = _load_any(file)
    if stages is not None and obj.stages != stages:
        raise BaftError(f"{file}: made for {obj.stages} pipeline stages, not {stages}")
    if isinstance(obj, Plan):
        click.echo(render_plan_text(obj))
        if png:
            raise BaftError("--png draws bubble maps; give the bubble map the plan was made from")
        return
    assert isinstance(obj, BubbleMap)
    click.echo(render_text(obj))
    if png:
        from baft.cli.figures import draw_timeline  # matplotlib: only to draw

        draw_timeline(obj, png, title=f"{Path(file).name}: {obj.schedule}, {obj.stages} stages, "
                                      f"{obj.micro_batches} micro-batches")
        click.echo(f"wrote {png}")


def _show_run(directory, png, stages) -> None:
    """``baft show`` of a run's trace directory."""
    from baft.cli.figures import draw_run
    from baft.cli.show import render_run_text, render_text
    from baft.snapshot.trace import load_run

    run = load_run(directory)
    if stages is not None and run.bubble_map.stages != stages:
        raise BaftError(f"{directory}: traced {run.bubble_map.stages} pipeline stages, not {stages}")
    click.echo(render_text(run.bubble_map))
    click.echo(render_run_text(run))
    if png:
        draw_run(run, png)
        click.echo(f"wrote {png}")


@main.command(name="plan")
@click.argument("bubble_map", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), help="Plan file (default: beside the map).")
@click.option("--budget", default=0.01, show_default=True, help="Overhead budget as a fraction of iteration time.")
@user_errors
def plan_cmd(bubble_map, out, budget):
    """Plan which chunks to copy in which bubble, and the snapshot period."""
    from baft.cli.show import render_plan_text
    from baft.pipeline.bubblemap import BubbleMap
    from baft.snapshot.planner import plan

    bmap = BubbleMap.load(bubble_map)
    result = plan(bmap, budget=budget, source=bubble_map)
    path = Path(out) if out else Path(bubble_map).with_name(Path(bubble_map).stem + ".plan.json")
    result.save(path)
    click.echo(render_plan_text(result))
    click.echo(f"wrote {path}")


@main.command()
@click.option("--example", type=click.Choice(["gpt"]), help="Train the bundled example instead of a script.")
@example_options
@click.option("--iters", default=20, show_default=True, help="Train until this optimizer step.")
@click.option("--policy", default="baft", show_default=True,
              type=click.Choice(POLICIES))
@click.option("--period", default="auto", show_default=True, help="Snapshot every K steps, or 'auto' (planner).")
@executor_options
@click.option("--bubble-map", type=click.Path(dir_okay=False), help="Measured bubble map to plan from.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), help="Plan file to follow.")
@click.option("--run-dir", default="runs/latest", show_default=True, type=click.Path(file_okay=False),
              help="Where losses.jsonl, recovery.jsonl and checkpoints go.")
@click.option("--max-restarts", default=3, show_default=True, help="Elastic restarts after a failure.")
@click.option("--nprocs", type=int, help="Processes for a script (default: stages x data-parallel).")
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
              help="Simulated nodes: one manager each, in one parity group over loopback.")
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
    from baft.cli.preflight import check_script_launch, unprotected_initialize

    if bool(example) == bool(command):
        raise BaftError("give either --example gpt or a training script after --, not both or neither")
    if in_place and not warm:
        raise BaftError("--in-place: a killed rank is replaced by the node's warm server, which --cold turns off")
    given = click.get_current_context().get_parameter_source("spares") is not click.core.ParameterSource.DEFAULT
    if given and not in_place:
        raise BaftError("--spares: spares replace a killed rank in place; give --in-place too")
    if command:
        check_script_launch(list(command))
        said = unprotected_initialize(command[0]) if not command[0].startswith("-") else None
        if said:
            click.echo(f"baft: warning: {said}", err=True)
        if hang_timeout is not None:
            raise BaftError("--hang-timeout is the example's: a script sets baft.hang_timeout in its DeepSpeed config")
    from baft.cli.launch import example_args, exclusive_run, launch_env, torchrun
    from baft.cli.launch import run_id as launch_run_id
    from baft.cli.runlog import LOG_NAME, Terminated, run_logged, sigterm_stops, torchrun_options, trim_run_logs
    from baft.config import TRACE_DIR_ENV
    from baft.manager.nodes import node_configs, retire_all, start_all, stop_all
    from baft.config import REPLACE_ENV, SPARES_ENV
    from baft.recovery import chaos
    from baft.warm import WarmServer, warmable

    asked = [chaos.parse_fault(fault) for fault in faults]
    run = Path(run_dir).resolve()
    run_id, shm = launch_run_id(run), SHM_ROOT
    if not run.exists():
        _refuse_an_earlier_runs_snapshots(run, Path(shm) / run_id)
    run.mkdir(parents=True, exist_ok=True)
    procs = nprocs or model["stages"] * dp
    if procs % nodes:
        raise BaftError(f"--nodes {nodes}: {procs} processes cannot be split evenly over {nodes} nodes")
    env = launch_env({"BAFT_RUN_ID": run_id, "BAFT_SHM_ROOT": shm, "BAFT_RUN_DIR": str(run),
                      **({chaos.ENV: ";".join(faults)} if faults else {}),
                      **({TRACE_DIR_ENV: str(_fresh_trace_dir(trace_dir))} if trace_dir else {})})
    server = WarmServer.running(env) or WarmServer()
    configs, program = [], list(command)
    if example:
        args = {**model, "iters": iters, "policy": policy, "period": period, "executor": executor,
                "leftovers": leftovers, "run_dir": str(run), "bubble_map": bubble_map, "plan": plan_file,
                "run_id": run_id, "shm_root": shm, "ranks_per_node": procs // nodes, "hang_timeout": hang_timeout}
        if nodes > 1 or persist_every:
            configs = node_configs(shm, run_id, nodes, run / "persisted", persist_every)
            args.update(parity_group=",".join(str(m) for m in configs[0].group) or None,
                        parity_k=configs[0].parity_k, persist_every=persist_every, persist_dir=str(run / "persisted"))
        program = ["-m", *example_args(args)]
    warm = warm and warmable(program)
    if warm:
        program = server.program(program)
        env.update(server.env())
        if in_place:  # each killed rank is replaced in place while torchrun's restarts are left
            env.update({REPLACE_ENV: str(max_restarts), SPARES_ENV: str(spares)})
    cmd = torchrun(procs, program, max_restarts=max_restarts, module=False, options=torchrun_options(run))
    if warm:  # torchrun itself forked too: its import of torch, and its exit's freeing of it, come off every launch
        cmd = server.command(cmd)
    if not (manager and policy in IN_MEMORY):
        configs = []
    elif not configs:
        configs = node_configs(shm, run_id, nodes, run / "persisted", persist_every)
    log = run / LOG_NAME
    try:
        with sigterm_stops(), exclusive_run(run), server:
            for pid in retire_all(configs):
                click.echo(f"baft: stopped the manager an earlier launch of {run} left running (pid {pid}); "
                           "this launch's managers adopt its snapshots")
            _warn_unserved_snapshots(shm, run_id)
            trim_run_logs(run)
            if warm:
                server.start(env, eager=in_place)
            start_all(configs, log_dir=run)
            try:
                outcome = run_logged(cmd, env, log)
            finally:
                stop_all(configs)
                _say_what_is_kept(configs, run)
    except Terminated:
        click.echo(f"baft: stopped by SIGTERM; every rank's output is in {log}", err=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    if (run / "recovery.jsonl").exists():
        from baft.cli.report import render_recovery_text
        from baft.recovery.record import load_recoveries

        click.echo(render_recovery_text(load_recoveries(run)))
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


def _say_what_is_kept(configs, run: Path) -> None:
    """After the managers stopped: the step the run goes on from, on disk; or, where a manager could not
    write it, the shared memory it kept instead (never freed unwritten)."""
    from baft.manager import persist
    from baft.manager.nodes import manager_log
    from baft.snapshot import slots

    kept_in_memory = [c for c in configs if slots.rank_ids(c.shm_root)]
    for c in kept_in_memory:
        click.echo(f"baft: node {c.node_id}'s manager could not write its newest snapshot to {c.dir} (see "
                   f"{manager_log(run, c.node_id)}); it kept {c.shm_root} in shared memory: `baft train` "
                   f"again resumes from it, `baft manager clean {c.shm_root}` frees it", err=True)
    newest = [persist.list_steps(c.dir) for c in configs if c.dir is not None]
    if newest and all(newest) and not kept_in_memory:
        click.echo(f"baft: step {min(steps[0].step for steps in newest)} is kept in {run / 'persisted'}: `baft train` "
                   f"again with this --run-dir goes on from it (the example: with a larger --iters)")


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


@main.group()
def manager():
    """Start, stop or query this node's snapshot manager."""


@manager.command(name="start")
@click.option("--node-id", default=0, show_default=True)
@click.option("--shm-root", required=True, help="This node's shared-memory root, e.g. /dev/shm/baft/RUN/node0.")
@click.option("--dir", "directory", type=click.Path(file_okay=False),
              help="Where to persist snapshots: the newest at a clean stop, and on the schedule below.")
@click.option("--group", help="host:port of every manager of the parity group, e.g. 0@127.0.0.1:7100,1@...")
@click.option("--parity-k", type=int, help="Shares needed to rebuild a node (default: group size - 1).")
@click.option("--persist-every", type=int)
@click.option("--persist-seconds", type=float)
@click.option("--keep", default=3, show_default=True)
@click.option("--memory-limit", help="Refuse ranks whose snapshots need more host memory, e.g. 8G.")
@user_errors
def manager_start(node_id, shm_root, directory, group, parity_k, persist_every, persist_seconds, keep, memory_limit):
    """Start the manager in the background; it outlives the trainers."""
    from baft.manager.config import ManagerConfig, parse_bytes, parse_group
    from baft.manager.control import start

    pid = start(ManagerConfig(node_id=node_id, shm_root=Path(shm_root), dir=directory,
                              group=parse_group(group) if group else (), parity_k=parity_k,
                              persist_every=persist_every, persist_seconds=persist_seconds, keep=keep,
                              memory_limit=parse_bytes(memory_limit) if memory_limit else None).validate())
    click.echo(f"manager of node {node_id} running (pid {pid}) at {shm_root}")


@manager.command(name="stop")
@click.option("--shm-root", required=True)
@user_errors
def manager_stop(shm_root):
    """Persist what is due, stop the manager and free its shared memory."""
    from baft.manager.control import stop

    stop(shm_root)
    click.echo("manager stopped")


@manager.command(name="status")
@click.option("--shm-root", required=True)
@user_errors
def manager_status(shm_root):
    """Steps held, sizes, checksums verified, parity status, last persisted step."""
    from baft.manager.control import format_status, status

    click.echo(format_status(status(shm_root)))


@manager.command(name="ls")
@click.argument("directory", default=SHM_ROOT, required=False, type=click.Path(file_okay=False))
@user_errors
def manager_ls(directory):
    """The node roots under DIRECTORY (default /dev/shm/baft) holding snapshots: size, steps, manager."""
    from baft.manager import inventory

    roots = inventory.scan(directory)
    holding = [r for r in roots if r.newest_steps or r.manager_pid is not None]
    for root in holding:
        click.echo(root.line())
    unserved = [r for r in holding if r.manager_pid is None]
    click.echo(f"{len(holding)} node root(s) with snapshots or a manager under {directory}, "
               f"{sum(r.nbytes for r in holding) / 1e6:.1f} MB; {len(unserved)} with no manager"
               + ("; free one with `baft manager clean ROOT`" if unserved else ""))
    if len(roots) > len(holding):
        click.echo(f"{len(roots) - len(holding)} more hold nothing committed; `baft manager clean --empty` removes them")


@manager.command(name="clean")
@click.argument("roots", nargs=-1, type=click.Path(file_okay=False))
@click.option("--empty", "empty_under", is_flag=False, flag_value=SHM_ROOT, default=None, metavar="[DIRECTORY]",
              help="Also remove every node root under DIRECTORY (default /dev/shm/baft) with nothing committed "
                   "and no manager.")
@user_errors
def manager_clean(roots, empty_under):
    """Delete the snapshots of node roots ROOTS no manager serves (`baft manager ls` lists them)."""
    from baft.manager import inventory

    if not roots and not empty_under:
        raise BaftError("name the node roots to remove (`baft manager ls` lists them), or give --empty")
    for path in roots:
        root = inventory.remove(path)
        click.echo(f"removed {root.path} ({root.nbytes / 1e6:.1f} MB; {root.held()})")
    if empty_under:
        empty = [r for r in inventory.scan(empty_under) if not r.newest_steps and r.manager_pid is None]
        for root in empty:
            inventory.remove(root.path)
        click.echo(f"removed {len(empty)} node root(s) under {empty_under} with nothing committed")


@main.command(name="inspect")
@click.argument("path", type=click.Path())
@click.option("--no-verify", is_flag=True, help="Print the manifest without checking checksums.")
@user_errors
def inspect_cmd(path, no_verify):
    """Print a persisted or in-memory snapshot's manifest and verify its checksums."""
    from baft.recovery.inspect import SnapshotCorrupt, inspect

    try:
        click.echo(inspect(path, verify=not no_verify))
    except SnapshotCorrupt as err:
        click.echo(err.report)  # the manifest and every chunk's verdict; the error line follows
        raise


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw the phases per fault to this PNG.")
@user_errors
def report(run_dir, png):
    """The recovery-time breakdown (T0..T4) of every fault of a run."""
    from baft.cli.report import draw_recovery, render_recovery_text
    from baft.recovery.record import load_recoveries

    recs = load_recoveries(run_dir)
    click.echo(render_recovery_text(recs))
    if png:
        draw_recovery(recs, png)
        click.echo(f"wrote {png}")


@main.command()
@click.option("--preset", help="A bundled scenario (gpt3-175b-1024, gpt3-3b-8, gpt3-15b-8, this-machine).")
@click.option("--scenario", type=click.Path(dir_okay=False), help="A scenario JSON file.")
@click.option("--set", "overrides", multiple=True, help="Override a scenario key: key=value.")
@click.option("--measured", type=click.Path(dir_okay=False),
              help="Instead: check the model against a measured bubble map, side by side.")
@click.option("--measured-overhead", type=float, help="With --measured: the overhead measured for baft (fraction).")
@user_errors
def simulate(preset, scenario, overrides, measured, measured_overhead):
    """Bubbles, snapshot period, overhead and time lost per day at cluster scale."""
    from baft.simulate.measured import compare_to_measured
    from baft.simulate.model import run
    from baft.simulate.tables import render

    if measured:
        from baft.pipeline.bubblemap import BubbleMap

        click.echo(compare_to_measured(BubbleMap.load(measured), measured_overhead).render())
        return

    values = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise BaftError(f"--set {item!r}: expected key=value")
        values[key] = value
    click.echo(render(run(preset=preset, scenario_file=scenario, overrides=values)))


@main.command()
@click.option("--example", type=click.Choice(["gpt"]), default="gpt", show_default=True)
@example_options
@click.option("--policies", default="none,sync-copy,baft", show_default=True,
              help="Comma-separated: none, sync-copy, thread-copy, baft, torch-save, deepspeed, dcp-async; "
                   "KIND/N snapshots every N steps (deepspeed/10). baft's period is its planner's unless given.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Rounds of A B C ... blocks.")
@click.option("--block", default=3, show_default=True, type=click.IntRange(1),
              help="Iterations per policy per round (the first is dropped from the summary).")
@click.option("--none-between", is_flag=True,
              help="Run none between every two policies' blocks (none A none B ...): a baseline beside each block.")
@click.option("--shuffle", is_flag=True, help="Draw the policies' order anew every round (no policy keeps one place).")
@click.option("--bubble-map", type=click.Path(dir_okay=False), help="Measured bubble map for baft's planner.")
@executor_options
@click.option("--out", type=click.Path(dir_okay=False),
              help="Write the run here (JSON): every iteration's figures per rank, periods, bytes, baft's plans.")
@user_errors
def compare(example, policies, rounds, block, none_between, shuffle, bubble_map, out, dp, **model):
    """Compare snapshot policies on one run, interleaved, and print the overhead table."""
    from baft.cli.compare import launch_compare, render

    click.echo(render(launch_compare(model, dp, policies, rounds, block, bubble_map, out, none_between, shuffle)))


main.add_command(demo)
