"""Interval estimates used by the benchmarks' accuracy tables (``hf_kvreuse.cli``)."""

import random

import pytest

from hf_kvreuse.cli import paired_difference, wilson


def test_wilson_known_value():
    """Wilson's interval of 0.5 at n = 10 is [0.237, 0.763] (textbook value); a Wald interval would fail."""
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)


def test_paired_difference_pairing_narrows():
    """Identical outcomes differ by exactly 0 and the interval is narrow (phi = 1); unpaired marginal intervals
    would span about +-13 points here. Planted bugs that fail it (checked): dropping the ``2 * phi`` term
    (independent samples) or flipping its sign."""
    x = [i % 10 < 3 for i in range(100)]
    d, lo, hi = paired_difference(x, x)
    assert d == 0 and lo <= 0 <= hi and hi - lo < 0.05


def test_paired_difference_antisymmetric_and_errors():
    x = [True] * 30 + [False] * 70
    y = [True] * 20 + [False] * 10 + [True] * 5 + [False] * 65
    d, lo, hi = paired_difference(x, y)
    d2, lo2, hi2 = paired_difference(y, x)
    assert d == pytest.approx(0.05) and (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))
    assert lo < d < hi
    with pytest.raises(ValueError, match="same items"):
        paired_difference(x, y[:-1])


def test_paired_difference_coverage():
    """Simulated coverage of the 95% interval on correlated pairs (n = 50, true difference 0.1) is near 95%.
    Planted bugs that fail it (checked): the sign of ``phi`` flipped (coverage 100%: intervals far too wide), or
    the ``phi`` term dropped (99.7%: pairing ignored)."""
    rng = random.Random(0)
    # joint law of (x, y): P(1,1) = .25, P(1,0) = .15, P(0,1) = .05, P(0,0) = .55 -> p_x = .4, p_y = .3
    cells = [(True, True)] * 25 + [(True, False)] * 15 + [(False, True)] * 5 + [(False, False)] * 55
    hits, sims = 0, 2000
    for _ in range(sims):
        pairs = [rng.choice(cells) for _ in range(50)]
        _, lo, hi = paired_difference([p[0] for p in pairs], [p[1] for p in pairs])
        hits += lo <= 0.1 <= hi
    assert 0.925 <= hits / sims <= 0.985
