"""The evaluation's statistics: fits, percentiles, the leak detector, workloads."""

from __future__ import annotations

import math
import random

import pytest

from cothink.eval.common import detect_growth, linear_fit, numbers_in, percentile
from cothink.eval.workload import Problem, problems


def test_linear_fit_exact_line():
    xs = [256, 512, 1024, 2048, 4096]
    fit = linear_fit(xs, [3.0 * x + 2.0 for x in xs])
    assert fit.slope == pytest.approx(3.0)
    assert fit.intercept == pytest.approx(2.0)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.at(100) == pytest.approx(302.0)


def test_linear_fit_flat_and_noisy():
    rng = random.Random(0)
    xs = list(range(0, 2000, 50))
    flat = linear_fit(xs, [16.0] * len(xs))
    assert flat.slope == 0 and flat.intercept == 16.0
    noisy = linear_fit(xs, [0.5 * x + 10 + rng.gauss(0, 1) for x in xs])
    assert noisy.slope == pytest.approx(0.5, abs=0.01)
    assert noisy.r2 > 0.99


def test_linear_fit_degenerate():
    assert linear_fit([], []).n == 0
    one = linear_fit([5], [7])
    assert one.slope == 0 and one.intercept == 7
    with pytest.raises(ValueError):
        linear_fit([1, 2], [1])


def test_percentile():
    xs = [5, 1, 4, 2, 3]
    assert percentile(xs, 50) == 3
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 5
    assert percentile(xs, 25) == pytest.approx(2)
    assert percentile([2.0], 99) == 2.0
    assert math.isnan(percentile([], 50))


def _series(f, n=200, duration=60.0):
    ts = [duration * i / (n - 1) for i in range(n)]
    return ts, [f(t) for t in ts]


def test_growth_detector_catches_steady_growth():
    ts, vs = _series(lambda t: 1000 + 2.0 * t)  # +2 per second: 60 over the second half
    trend = detect_growth("rss", ts, vs, abs_tol=32)
    assert trend.leaking
    assert trend.slope_per_s == pytest.approx(2.0)
    assert trend.growth == pytest.approx(60.0, rel=0.05)


def test_growth_detector_passes_bounded_series():
    rng = random.Random(1)
    ts, flat = _series(lambda t: 1000 + rng.gauss(0, 3))
    assert not detect_growth("flat", ts, flat, abs_tol=32).leaking
    ts, saw = _series(lambda t: 10 + (int(t * 4) % 7))  # saw-tooth: churn, no trend
    assert not detect_growth("saw", ts, saw, abs_tol=4).leaking
    ts, plateau = _series(lambda t: 1000 + min(t, 25.0) * 10)  # warm-up growth, then flat
    assert not detect_growth("plateau", ts, plateau, abs_tol=32).leaking


def test_growth_detector_relative_tolerance():
    ts, vs = _series(lambda t: 1000 + 0.5 * t)  # 15 over the second half, 1.5% of the mean
    assert detect_growth("x", ts, vs, abs_tol=1, rel_tol=0.0).leaking
    assert not detect_growth("x", ts, vs, abs_tol=1, rel_tol=0.02).leaking


def test_growth_detector_short_series_is_inconclusive():
    assert not detect_growth("x", [0, 1, 2], [1, 2, 3], abs_tol=0).leaking


def test_numbers_in():
    assert numbers_in("14 + 15 = 29, then 29*2 = 58 and -3; 1,250") == [14, 15, 29, 29, 2, 58, -3, 1250]
    assert numbers_in("no digits") == []


def test_problems_are_deterministic_and_correct():
    a, b = problems(3, 5), problems(3, 5)
    assert a == b and len(set(a)) == 5
    p = Problem(14, 15, 2, 9)
    assert p.expression == "((14+15)*2)-9"
    assert p.steps == (29, 58, 49) and p.answer == 49
    assert p.expression in p.prompt
