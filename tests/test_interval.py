"""stasis.interval: Young/Daly's interval, its limits and the bounds a site sets."""

from __future__ import annotations

import math

import pytest

from stasis.interval import choose, daly, mtbi_s, young


def test_daly_matches_the_published_formula() -> None:
    # C = 60 s, M = 24 h: sqrt(2*60*86400) = 3219.938; C/2M = 1/2880;
    # factor 1 + sqrt(1/2880)/3 + 1/(9*2880) = 1.0062498; tau = 3240.06 - 60.
    assert daly(60, 86400) == pytest.approx(3180.06, abs=0.01)
    # C = 5 min, M = 1 h: sqrt(2*300*3600) = 1469.69; C/2M = 1/24;
    # factor 1 + 0.068041 + 0.0046296 = 1.0726707; tau = 1576.50 - 300.
    assert daly(300, 3600) == pytest.approx(1276.50, abs=0.01)
    # Young's first order is its leading term; for C << M the two meet (less C).
    assert young(1, 1e6) == pytest.approx(math.sqrt(2e6))
    assert daly(1, 1e6) == pytest.approx(young(1, 1e6) - 1, rel=1e-3)


def test_a_cost_of_twice_the_mtbi_or_more_gives_the_mtbi() -> None:
    assert daly(7200, 3600) == 3600
    assert daly(1e9, 3600) == 3600
    # Just under: still the series, positive.
    assert 0 < daly(7199, 3600) < 7200


def test_zero_cost_and_zero_rate() -> None:
    assert daly(0, 3600) == 0
    assert mtbi_s(0) is None
    assert mtbi_s(1.0) == 3600
    assert mtbi_s(1.0, nodes=4) == 900  # any of its nodes' failures interrupts the job
    with pytest.raises(ValueError):
        daly(1, 0)
    with pytest.raises(ValueError):
        daly(-1, 10)


def test_choose_bounds_and_says_why() -> None:
    c = choose(60, 86400, floor_s=300, ceiling_s=86400)
    assert c.bound == "" and c.interval_s == pytest.approx(3180.06, abs=0.01)
    assert "checkpoint cost 60 s" in c.why() and "Young/Daly 53 min" in c.why()

    low = choose(0.2, 40, floor_s=300, ceiling_s=86400)
    assert low.bound == "floor" and low.interval_s == 300
    assert low.raw_s == pytest.approx(daly(0.2, 40))
    assert "raised to the floor" in low.why()

    high = choose(600, 1e9, floor_s=300, ceiling_s=3600)
    assert high.bound == "ceiling" and high.interval_s == 3600 and high.raw_s is not None
    assert high.raw_s > 3600 and "lowered to the ceiling" in high.why()

    # No interruption seen: the ceiling, not "never".
    none = choose(5, None, floor_s=300, ceiling_s=3600)
    assert none.interval_s == 3600 and none.raw_s is None and none.bound == "ceiling"
    assert "no interruption seen" in none.why()
    assert choose(5, math.inf, 300, 3600).interval_s == 3600

    # A huge cost: Daly's M, then the bounds.
    assert choose(1e6, 3600, 300, 86400).interval_s == 3600
    # A floor above the ceiling wins.
    assert choose(1, 100, floor_s=600, ceiling_s=300).interval_s == 600
    # The answer travels as JSON with its reason.
    assert choose(60, 86400, 300, 86400).as_dict()["why"] == c.why()


def test_more_interruptions_never_mean_rarer_checkpoints() -> None:
    values = [daly(30, m) for m in (60, 600, 3600, 86400, 864000)]
    assert values == sorted(values)
