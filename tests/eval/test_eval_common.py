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


def test_min_samples_leave_two_beyond_the_percentile():
    from cothink.eval.common import min_samples, sampled_percentile

    assert (min_samples(50), min_samples(95), min_samples(99)) == (4, 40, 200)
    xs = [float(i) for i in range(199)]
    short = sampled_percentile(xs, 99)
    assert not short.enough and math.isnan(short.value) and short.n == 199
    assert "insufficient" in str(short) and "199" in str(short)
    full = sampled_percentile([*xs, 199.0], 99)
    assert full.enough and full.value == pytest.approx(percentile([*xs, 199.0], 99)) and "n=200" in str(full)
    with pytest.raises(ValueError):
        min_samples(100)


def _ramp(points):
    from cothink.eval.common import RampPoint

    return [RampPoint(c, t, lat) for c, t, lat in points]


def test_knee_where_throughput_stops_growing_while_latency_grows():
    from cothink.eval.common import knee

    # doubling concurrency: +90%, +80%, +5% (latency up) -> the knee is 4, the last point worth going to
    found = knee(_ramp([(1, 100, 1.0), (2, 190, 1.1), (4, 342, 1.3), (8, 359.1, 2.4)]), 0.10)
    assert found.concurrency == 4
    assert found.gains == pytest.approx((0.9, 0.8, 0.05))
    # the order of the points does not matter
    assert knee(_ramp([(8, 359.1, 2.4), (1, 100, 1.0), (4, 342, 1.3), (2, 190, 1.1)])).concurrency == 4


def test_knee_needs_growing_latency_and_judges_gains_per_doubling():
    from cothink.eval.common import knee

    # small gain but latency flat: free concurrency, no knee
    assert knee(_ramp([(1, 100, 1.0), (2, 101, 1.0)])).concurrency is None
    # always gaining well: the knee lies beyond the measured range
    unreached = knee(_ramp([(1, 100, 1.0), (3, 300, 1.2), (9, 900, 1.5)]))
    assert unreached.concurrency is None and "not reached up to 9" in unreached.detail
    # 1 -> 9 with +20% in all is under 10% per doubling (log2 9 = 3.17 doublings: 5.9% each)
    wide = knee(_ramp([(1, 100, 1.0), (9, 120, 2.0)]))
    assert wide.concurrency == 1 and wide.gains[0] == pytest.approx(1.2 ** (1 / math.log2(9)) - 1)
    # the same per-doubling gain spaced 1,2,4 or 1,4 gives the same verdict
    g = 0.08
    close = knee(_ramp([(1, 100, 1.0), (2, 100 * (1 + g), 1.1), (4, 100 * (1 + g) ** 2, 1.2)]))
    far = knee(_ramp([(1, 100, 1.0), (4, 100 * (1 + g) ** 2, 1.2)]))
    assert close.concurrency == far.concurrency == 1
    assert knee([]).concurrency is None
    with pytest.raises(ValueError):
        knee(_ramp([(2, 1, 1.0), (2, 2, 1.0)]))
