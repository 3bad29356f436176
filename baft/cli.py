"""The ``baft`` command: profile, show, plan, train, manager, inspect, report, simulate, demo."""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from baft.errors import BaftError

EXAMPLE_OPTIONS = [
    click.option("--stages", default=2, show_default=True, help="Pipeline stages (processes per data-parallel replica)."),
    click.option("--data-parallel", "dp", default=1, show_default=True, help="Data-parallel replicas of every stage."),
    click.option("--micro-batches", default=8, show_default=True, help="Micro-batches per iteration."),
    click.option("--micro-batch-size", default=2, show_default=True, help="Sequences per micro-batch."),
    click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["1f1b", "gpipe"])),
    click.option("--seq", default=128, show_default=True, help="Tokens per sequence."),
    click.option("--d-model", default=384, show_default=True),
    click.option("--layers", default=8, show_default=True),
    click.option("--heads", default=6, show_default=True),
    click.option("--vocab", default=4096, show_default=True),
]

_MODEL_KEYS = ("stages", "micro_batches", "micro_batch_size", "schedule", "seq", "d_model", "layers", "heads", "vocab")


def example_options(fn):
    for option in reversed(EXAMPLE_OPTIONS):
        fn = option(fn)
    return fn


def user_errors(fn):
    """Print a BaftError as one line and exit 2, instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaftError as err:
            click.echo(f"baft: error: {err}", err=True)
            sys.exit(2)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="baft")
def main():
    """Bubble-aware fault tolerance for pipeline-parallel DeepSpeed training."""


def _run(cmd: list[str], env: dict) -> int:
    return subprocess.run(cmd, env=env).returncode


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
    from baft.launch import example_args, launch_env, torchrun
    from baft.plugin import PROFILE_DIR_ENV, PROFILE_ITERS_ENV
    from baft.profiler import merge_traces, trace_paths

    if bool(example) == bool(command):
        raise BaftError("give either --example gpt or a launch command after --, not both or neither")
    with tempfile.TemporaryDirectory(prefix="baft-profile-") as traces:
        env = launch_env({PROFILE_DIR_ENV: traces, PROFILE_ITERS_ENV: str(iters)})
        cmd = list(command) if command else torchrun(model["stages"] * dp, example_args(
            {**model, "iters": iters + 1, "policy": "none"}))
        code = _run(cmd, env)
        paths = trace_paths(traces)
        if code != 0 and not paths:
            raise BaftError(f"the profiled run failed (exit code {code}) before writing its traces")
        bmap = merge_traces(paths)
    out = Path(out)
    bmap.save(out)
    plan_path = _write_plan(bmap, out)
    _print_bubble_map(bmap)
    click.echo(f"wrote {out} and {plan_path}")


def _write_plan(bmap, out: Path) -> Path:
    from baft.planner import plan

    path = out.with_name(out.stem + ".plan.json")
    plan(bmap, source=str(out)).save(path)
    return path


def _print_bubble_map(bmap) -> None:
    from baft.show import render_text

    click.echo(render_text(bmap))


def _load_any(path):
    """A bubble map or a plan, by its 'schema' field."""
    from baft.bubblemap import BubbleMap
    from baft.jsonfile import read_json
    from baft.planner import Plan

    kind = read_json(path).get("schema")
    if kind == "baft.plan":
        return Plan.load(path)
    return BubbleMap.load(path)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw the per-stage timeline to this PNG.")
@click.option("--stages", type=int, help="Refuse a map made for another stage count.")
@user_errors
def show(file, png, stages):
    """Print a bubble map's or plan's summary; draw the timeline with --png."""
    from baft.bubblemap import BubbleMap
    from baft.planner import Plan
    from baft.show import draw_timeline, render_plan_text, render_text

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
        draw_timeline(obj, png, title=f"{Path(file).name}: {obj.schedule}, {obj.stages} stages, "
                                      f"{obj.micro_batches} micro-batches")
        click.echo(f"wrote {png}")


@main.command(name="plan")
@click.argument("bubble_map", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), help="Plan file (default: beside the map).")
@click.option("--budget", default=0.01, show_default=True, help="Overhead budget as a fraction of iteration time.")
@user_errors
def plan_cmd(bubble_map, out, budget):
    """Plan which chunks to copy in which bubble, and the snapshot period."""
    from baft.bubblemap import BubbleMap
    from baft.planner import plan
    from baft.show import render_plan_text

    bmap = BubbleMap.load(bubble_map)
    result = plan(bmap, budget=budget, source=bubble_map)
    path = Path(out) if out else Path(bubble_map).with_name(Path(bubble_map).stem + ".plan.json")
    result.save(path)
    click.echo(render_plan_text(result))
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
