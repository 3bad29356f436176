"""The simulator's result as text: rich tables (scenario, bubbles per stage, policies) and notes."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from baft.simulate.model import Result
from baft.simulate.units import bandwidth, count, duration, size


def tables(result: Result):
    """The result as rich tables: scenario summary, per-stage bubbles, policies."""
    s = result.scenario
    summary = Table(title=f"{s.name}: {s.description}" if s.description else s.name, show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    model = f"{count(s.params)} parameters" if s.params else "given state size"
    summary.add_row("model", f"{model}, {s.tokens_per_microbatch} tokens per micro-batch")
    summary.add_row("layout", f"p={s.p} m={s.m} v={s.v} {s.schedule}, tp={s.tp}, dp={s.dp}: "
                              f"{s.accelerators} accelerators on {s.nodes} node(s)")
    summary.add_row("per micro-batch", f"forward {duration(result.forward_s)}, backward {duration(result.backward_s)} "
                                       f"(stage 0)")
    summary.add_row("iteration", duration(result.iteration_time))
    summary.add_row("state per rank", f"{size(result.state_per_rank)} (checkpoint {size(result.checkpoint_bytes)})")
    shared = f" (the node's ranks at once; {bandwidth(s.host_bw)} alone)" if s.copy_bw < s.host_bw else ""
    summary.add_row("copy per snapshot", f"{duration(result.copy_time)} at {bandwidth(s.copy_bw)}{shared}")
    summary.add_row("disk flush", f"{duration(result.flush_time)} at {bandwidth(s.disk_write_bw)}")
    summary.add_row("failures", f"{result.failures_per_day:.3g} per day "
                                f"({s.node_failure_fraction:.0%} lose a node)")
    parity = f"{s.parity[0]} of {s.parity[1]} nodes over {bandwidth(s.net_bw)}" if s.parity else "none"
    summary.add_row("parity", parity)

    stages = Table(title="bubbles per stage")
    for col in ("stage", "bubble / iter", "bubble", "closed form", "baft stall", "bubble used"):
        stages.add_column(col, justify="right")
    for x in result.stages:
        stages.add_row(str(x.stage), duration(x.bubble_time), f"{x.bubble_fraction:.1%}", f"{x.closed_form:.1%}",
                       duration(x.stall) if x.stall else "0", f"{x.bubble_used:.0%}")

    policies = Table(title="policies")
    for col in ("policy", "period", "rule", "overhead", "T0", "T1+T2+T4", "T3", "lost / failure", "lost / day"):
        policies.add_column(col, justify="left" if col in ("policy", "rule") else "right")
    for x in result.policies:
        iters = f"{x.period_iterations:.0f} it" if x.period_iterations < 1e4 else f"{x.period_iterations:.3g} it"
        policies.add_row(x.policy, f"{iters} ({duration(x.period_s)})", x.period_rule, f"{x.overhead:.2%}",
                         duration(x.t0), duration(x.t1 + x.t2 + x.t4), duration(x.t3),
                         duration(x.lost_per_failure), duration(x.lost_per_day))
    return summary, stages, policies


def render(result: Result, width: int = 140) -> str:
    """The result as plain text (tables and notes), for ``click.echo``."""
    return plain_text([*tables(result), *(f"note: {note}" for note in result.notes)], width)


def plain_text(items, width: int) -> str:
    """``items`` (rich tables, or strings with rich markup) printed one under the other, without styles."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    for item in items:
        console.print(item, highlight=False)
    return console.export_text().rstrip()
