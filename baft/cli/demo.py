"""``baft demo``: the whole product on the example GPT in one command, about a minute on two cores."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from baft.cli.options import user_errors
from baft.errors import BaftError


# A point of experiments/sweep.py where a snapshot is expensive, as on GPUs: few tokens per micro-batch
# next to a wide model's state, so a synchronous copy costs a good share of every iteration
DEMO_MODEL = {"stages": 2, "micro_batches": 4, "micro_batch_size": 1, "schedule": "1f1b", "seq": 8,
              "d_model": 512, "layers": 8, "heads": 8, "vocab": 4096}


def what_it_means(summary: list[dict]) -> str:
    """One sentence on the comparison: the time each snapshot took from the trainer, and what it cost."""
    rows = {s["policy"]: s for s in summary}
    sync, ours = rows["sync-copy"], rows["baft"]
    per_iteration = ours["stall_s"] / ours["period"]  # a snapshot every P iterations holds the trainer once
    times = f"{sync['stall_s'] / per_iteration:.0f}x" if per_iteration > 0 else "far"
    held = f"{ours['stall_s'] * 1e3:.1f} ms per snapshot" + (
        f" ({per_iteration * 1e3:.1f} ms per iteration)" if ours["period"] > 1 else "")
    how = ("copied it inside the bubbles" if ours["period"] == 1 else
           f"found the bubbles too short for the whole state, so it snapshots every {ours['period']} iterations, "
           "copying inside the bubbles of each,")
    return (f"A synchronous copy of each stage's state held the trainer {sync['stall_s'] * 1e3:.0f} ms every "
            f"iteration ({sync['overhead']:+.1%} here); baft {how} and held it {held}, {times} less "
            f"({ours['overhead']:+.1%}; three rounds are a quick look, experiments/sweep.py the measurement).")


@click.command()
@click.option("--out", "out_dir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@user_errors
def demo(out_dir):
    """Profile the example GPT, plan, compare policies, train under baft (traced), kill a rank, restart,
    draw where baft copied, report."""
    from baft.cli.compare import launch_compare, render
    from baft.cli.figures import draw_timeline
    from baft.cli.launch import launch_env, run_command
    from baft.cli.runlog import LOG_NAME
    from baft.pipeline.bubblemap import BubbleMap
    from baft.snapshot.trace import load_run

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_flags = [f"--{k.replace('_', '-')}={v}" for k, v in DEMO_MODEL.items()]
    me = [sys.executable, "-m", "baft.cli"]
    bmap_path, run_dir, trace_dir = out / "bubbles.json", out / "run", out / "trace"
    pictures = {name: out / f"{name}.png" for name in ("timeline", "copies", "recovery")}

    def step(n, title, cmd=None):
        click.secho(f"\n[{n}/6] {title}", bold=True)
        if cmd is not None and run_command(cmd, launch_env()) != 0:
            raise BaftError(f"demo step {n} ({title}) failed; its output is above")

    step(1, f"profile the example GPT (2 stages, d_model {DEMO_MODEL['d_model']}, {DEMO_MODEL['layers']} blocks, "
            f"{DEMO_MODEL['micro_batches']} micro-batches of {DEMO_MODEL['seq']} tokens) and plan",
         [*me, "profile", "--example", "gpt", *model_flags, "--iters", "10", "--out", str(bmap_path)])
    step(2, "the bubbles as a picture")  # drawn here: `baft show` would print step 1's table again
    click.echo(f"wrote {draw_timeline(BubbleMap.load(bmap_path), pictures['timeline'])}")
    step(3, "overhead of a snapshot every iteration: no snapshots, synchronous copy, baft (interleaved)")
    summary = launch_compare(DEMO_MODEL, 1, "none,sync-copy,baft", 3, 3, str(bmap_path), str(out / "compare.json"))
    click.echo(render(summary) + "\n" + what_it_means(summary))
    shutil.rmtree(run_dir, ignore_errors=True)
    step(4, "train under baft, traced; rank 1 is killed in step 10 and torchrun restarts the job",
         [*me, "train", "--example", "gpt", *model_flags, "--iters", "14", "--bubble-map", str(bmap_path),
          "--run-dir", str(run_dir), "--fault", "rank=1,step=10,phase=backward", "--max-restarts", "1",
          "--trace", str(trace_dir)])
    step(5, "where baft copied: one traced iteration after the restart, its copies inside the bubbles",
         [*me, "show", str(trace_dir), "--png", str(pictures["copies"])])
    step(6, "where the recovery time went", [*me, "report", str(run_dir), "--png", str(pictures["recovery"])])
    bmap = BubbleMap.load(bmap_path)
    click.echo(f"\nbubble map and plan: {bmap_path}, {bmap_path.with_name('bubbles.plan.json')} "
               f"({bmap.schedule}, {bmap.stages} stages)")
    click.echo(f"pictures: {pictures['timeline']} (the bubbles), {pictures['copies']} (baft's copies inside them, "
               f"step {load_run(trace_dir).step}), {pictures['recovery']} (the restart)")
    click.echo(f"losses (with the restart): {run_dir / 'losses.jsonl'}; every rank's output: {run_dir / LOG_NAME}")
