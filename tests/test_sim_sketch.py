"""The quantile sketch of a sharded run's latencies (``inference_lab.sim.sketch``): its
percentiles within the stated relative error of numpy's over all the values, merges that
are exact bucket for bucket, and the exact count, minimum, maximum and (up to rounding)
sum."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from inference_lab.sim.sketch import RELATIVE_ACCURACY, QuantileSketch
from inference_lab.sim.summary import LatencyStats

GRID = np.linspace(0.0, 100.0, 201)


def _data(kind: str, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    if kind == "lognormal":  # latencies: four decades
        return rng.lognormal(3.0, 1.5, 20_000)
    if kind == "zeros":  # queue times: many exactly 0
        return np.where(rng.random(5_000) < 0.4, 0.0, rng.exponential(2.0, 5_000))
    if kind == "ties":  # a few distinct values, repeated
        return rng.choice([0.5, 1.25, 7.0, 1e4], 3_001)
    if kind == "tiny":  # rounding residues next to ordinary values
        return np.concatenate((rng.uniform(1e-15, 1e-13, 50), rng.uniform(1, 2, 500)))
    if kind == "signed":  # both signs: each side within the bound of its own magnitude
        return -rng.lognormal(0.0, 1.0, 2_000)
    return np.array([3.25])  # one value


def _relative_error(sketch: QuantileSketch, values: npt.NDArray[np.float64]) -> float:
    exact = np.percentile(values, GRID, method="linear")
    got = sketch.percentile(GRID)
    scale = np.maximum(np.abs(exact), np.finfo(np.float64).tiny)
    return float((np.abs(got - exact) / scale).max())


@pytest.mark.parametrize("kind", ["lognormal", "zeros", "ties", "tiny", "signed", "one"])
@pytest.mark.parametrize("alpha", [RELATIVE_ACCURACY, 0.01])
def test_percentiles_are_within_the_relative_bound(kind: str, alpha: float) -> None:
    """Every percentile on a 0.5 grid is within ``alpha`` (relative, plus float rounding)
    of numpy's linear percentile of all the values; 0 and 100 are the exact extremes."""
    values = _data(kind, np.random.default_rng(7))
    sketch = QuantileSketch(alpha)
    for part in np.array_split(values, 7):
        sketch.add(part)
    assert _relative_error(sketch, values) <= alpha * (1 + 1e-9)
    assert sketch.percentile([0, 100]).tolist() == [values.min(), values.max()]


def test_the_bound_is_not_met_by_accident() -> None:
    """The sketch is not exact: at 1 % accuracy some percentile of spread-out values is
    off by more than a tenth of the bound (so the test above measures something)."""
    values = _data("lognormal", np.random.default_rng(3))
    sketch = QuantileSketch(0.01)
    sketch.add(values)
    assert _relative_error(sketch, values) > 0.001


def test_merged_sketches_are_the_sketch_of_all_values() -> None:
    """Sketches of parts merged in any order give the buckets, count, min and max of the
    sketch of the whole, and its sum up to rounding."""
    rng = np.random.default_rng(11)
    values = np.concatenate((rng.lognormal(1.0, 2.0, 9_000), np.zeros(100), -rng.random(50)))
    rng.shuffle(values)
    whole = QuantileSketch()
    whole.add(values)
    parts = []
    for chunk in np.array_split(values, 5):
        part = QuantileSketch()
        part.add(chunk)
        parts.append(part)
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        merged = QuantileSketch()
        for i in order:
            merged.merge(parts[i])
        for a, b in zip(merged.buckets(), whole.buckets(), strict=True):
            assert np.array_equal(a, b)
        assert (merged.count, merged.min, merged.max) == (whole.count, whole.min, whole.max)
        assert merged.total == pytest.approx(float(values.sum()), rel=1e-12)
        assert np.array_equal(merged.percentile(GRID), whole.percentile(GRID))


def test_stats_have_the_summary_shape() -> None:
    """``stats()`` is a LatencyStats whose count, min and max are exact, mean within
    rounding, percentiles within the bound; empty, every statistic is None."""
    values = np.random.default_rng(5).gamma(2.0, 30.0, 4_000)
    sketch = QuantileSketch()
    sketch.add(values)
    got = sketch.stats()
    exact = LatencyStats.from_seconds(values / 1e3)  # from_seconds reports ms
    assert (got.count, got.min, got.max) == (exact.count, exact.min, exact.max)
    assert got.mean == pytest.approx(exact.mean, rel=1e-12)
    for name in ("p50", "p90", "p95", "p99"):
        assert getattr(got, name) == pytest.approx(getattr(exact, name), rel=RELATIVE_ACCURACY)
    empty = QuantileSketch().stats()
    assert empty.count == 0 and empty.p50 is None and empty.mean is None


def test_bad_input_is_refused() -> None:
    sketch = QuantileSketch()
    with pytest.raises(ValueError, match="no values"):
        sketch.percentile(50)
    with pytest.raises(ValueError, match="finite"):
        sketch.add([1.0, np.nan])
    sketch.add([1.0])
    with pytest.raises(ValueError, match="0..100"):
        sketch.percentile(101)
    with pytest.raises(ValueError, match="merge"):
        sketch.merge(QuantileSketch(0.01))
    with pytest.raises(ValueError, match="alpha"):
        QuantileSketch(0.0)
