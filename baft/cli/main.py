"""The ``baft`` command: profile, show, plan, train, manager, inspect, report, simulate, compare, demo."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from baft.accelerator import quiet_detection
from baft.cli.demo import demo
from baft.cli.launch import SHM_ROOT
from baft.cli.options import example_options, executor_options, user_errors
from baft.cli.train import train
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
def compare(policies, rounds, block, none_between, shuffle, bubble_map, out, dp, **model):
    """Compare snapshot policies on one run, interleaved, and print the overhead table."""
    from baft.cli.compare import launch_compare, render

    click.echo(render(launch_compare(model, dp, policies, rounds, block, bubble_map, out, none_between, shuffle)))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED)
def torchrun(torchrun_args):
    """torchrun with warm ranks: ``baft torchrun ARGS`` runs ``torchrun ARGS`` (every option of torchrun's), each
    rank and each restarted rank forked from a process of this node that has imported torch and DeepSpeed once.

    The launch of a job on each node of a cluster (README: More than one node): a restart then forks every rank
    again instead of starting a new interpreter, and torchrun's restarts skip the waits a restart does not need.
    """
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from baft.cli.torchrun import main as run

    try:
        run(list(torchrun_args), warm=True)
    except ChildFailedError as err:  # torchrun's summary of the failed ranks, without the launcher's traceback
        click.echo(str(err), err=True)
        sys.exit(1)


main.add_command(demo)
main.add_command(train)
