"""Seconds, bytes, counts and bandwidths as the simulator's notes and tables write them."""

from __future__ import annotations

import math


def duration(seconds: float) -> str:
    """``"750 ms"``, ``"33.4 s"``, ``"47.0 min"``, ``"2.5 h"``; ``"-"`` for NaN or infinity."""
    if math.isnan(seconds) or math.isinf(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def count(n: float) -> str:
    """``"175B"``, ``"1.5M"``: three significant digits and a k/M/B/T suffix."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def size(nbytes: float) -> str:
    """``"2.7 GB"``, ``"200.0 MB"``: decimal units, one decimal."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def bandwidth(bytes_per_s: float | None) -> str:
    """``"25.0 GB/s"``; ``"-"`` when not given."""
    return "-" if bytes_per_s is None else f"{bytes_per_s / 1e9:.1f} GB/s"
