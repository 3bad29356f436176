"""Rich tables as plain text, for screens and log files alike."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def to_text(table: Table, width: int = 200) -> str:
    """A rich table as plain text (no colour, no terminal needed)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
