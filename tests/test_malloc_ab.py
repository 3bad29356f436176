"""experiments/malloc_ab.py's statistics: the pairs' geometric mean ratio and its interval."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from malloc_ab import geometric_mean  # noqa: E402  (experiments/ is not a package)


def test_the_geometric_mean_of_the_pairs_ratios_with_an_interval_around_it():
    pairs = [{"kept": 2.0, "glibc": 1.0}, {"kept": 8.0, "glibc": 1.0}, {"kept": 4.0, "glibc": 1.0}]
    ratio, (low, high) = geometric_mean(pairs, "kept", "glibc")
    assert math.isclose(ratio, 4.0)
    assert 2.0 <= low < ratio < high <= 8.0


def test_an_a_a_of_identical_runs_has_ratio_one_inside_its_interval():
    pairs = [{"kept": t, "kept again": t} for t in (1.1, 0.9, 1.3)]
    ratio, (low, high) = geometric_mean(pairs, "kept again", "kept")
    assert math.isclose(ratio, 1.0) and math.isclose(low, 1.0) and math.isclose(high, 1.0)
