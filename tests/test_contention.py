"""experiments/contention.py's analysis: the slowdown of a pass per copier phase, on hand-made passes."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import contention  # noqa: E402  (experiments/ is not a package)


def cycles(n: int, slowdown: dict, jitter: float = 0.02, seed: int = 0) -> list:
    """Passes of ``n`` copier cycles: each phase's pass time is 0.1 s x (1 + slowdown) x noise; a straddling
    pass (phase None) between phases, as the compute process records one when the phase changes under it."""
    rng = random.Random(seed)
    passes = [(-1, 0.5)]  # before the copier's first phase
    for _ in range(n):
        for k, name in enumerate(contention.PHASES):
            passes += [(k, 0.1 * (1 + slowdown.get(name, 0.0)) * rng.uniform(1 - jitter, 1 + jitter))
                       for _ in range(8)]
            passes.append((None, 5.0))
    return passes


def test_a_copy_phase_is_compared_with_the_idle_phase_before_it():
    """The straddling passes (5 s each) would swamp every ratio if they counted."""
    result = contention.analyse(cycles(40, {"copy+checksum": 0.15, "copy": 0.10}))
    assert result["cycles"] == 40 and result["pass_s"] == pytest.approx(0.1, rel=0.03)
    phases = result["phases"]
    assert phases["copy+checksum"]["against"] == "idle" and phases["copy"]["against"] == "idle again"
    for name, truth in [("copy+checksum", 0.15), ("copy", 0.10), ("idle again", 0.0)]:
        low, high = phases[name]["ci95"]
        assert low < truth < high and high - low < 0.02, (name, phases[name])
