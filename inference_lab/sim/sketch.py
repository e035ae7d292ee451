"""A mergeable quantile sketch with a relative-error bound: how a sharded simulation's
shards report their latencies without keeping one number per request.

Log-bucketed, after DDSketch (Masson, Rim and Lee, VLDB 2019), written here: each value
is counted in a bucket whose bounds grow by a constant factor, so a bucket's middle is
within a fixed fraction of every value in it, whatever the values' scale.

Rule 1: with relative accuracy ``alpha`` (:data:`RELATIVE_ACCURACY` by default) and
        ``gamma = (1 + alpha) / (1 - alpha)``, a value ``x > 0`` is counted in bucket
        ``i = ceil(log(x) / log(gamma))``, which holds ``(gamma**(i-1), gamma**i]`` and
        stands for ``2 * gamma**i / (gamma + 1)``: within ``alpha * x`` of ``x``. A
        negative value is counted the same way by its magnitude in a store of its own;
        zero in a count of its own (exactly).
Rule 2: merging adds bucket counts, which are integers: sketches merged in any order or
        grouping are the sketch of all their values, bucket for bucket.
Rule 3: the count, the minimum and the maximum are exact; the sum is the sum of the
        batches' sums (numpy's, then Python's), so the mean is exact up to floating-point
        rounding (a relative 1e-15 or so), not bit for bit numpy's mean of all values.
Rule 4: :meth:`QuantileSketch.percentile` follows numpy's ``linear`` method -- the
        order statistics at ``floor(q / 100 * (n - 1))`` and the next, interpolated --
        with each order statistic replaced by its bucket's value (the first and the last
        by the exact minimum and maximum) and the result kept within them. For values of one sign it is within
        ``alpha`` (relative) of ``numpy.percentile`` of all the values: each order
        statistic is, and the interpolation is a convex combination of two of them.
        (Up to the floating-point rounding of the bucket index at a bucket's edge.)
Rule 5: memory is one count per bucket in use: about ``log(max / min) / (2 * alpha)``
        buckets (at the default accuracy, ~ 23,000 for values spanning ten decades),
        independent of how many values were added.

Pure numpy; who uses it: :mod:`inference_lab.sim.shard` (a shard's latencies) and
:mod:`inference_lab.sim.fleet` (merging them).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from inference_lab.sim.summary import PERCENTILES, LatencyStats

__all__ = ["RELATIVE_ACCURACY", "QuantileSketch"]

#: The relative error of a sharded run's percentiles (Rule 4): 0.05 %.
RELATIVE_ACCURACY = 5e-4

_EMPTY_I = np.zeros(0, dtype=np.int64)


def _merge_store(
    idx: npt.NDArray[np.int64],
    cnt: npt.NDArray[np.int64],
    more_idx: npt.NDArray[np.int64],
    more_cnt: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Two sparse stores (sorted bucket indices, their counts) as one."""
    if not len(more_idx):
        return idx, cnt
    if not len(idx):
        return more_idx, more_cnt
    both = np.concatenate((idx, more_idx))
    keys, inverse = np.unique(both, return_inverse=True)
    counts = np.zeros(len(keys), dtype=np.int64)
    np.add.at(counts, inverse, np.concatenate((cnt, more_cnt)))
    return keys, counts


class QuantileSketch:
    """Counts of values in log-spaced buckets, with their exact count, sum, min and max
    (module rules). Add batches with :meth:`add`, combine with :meth:`merge`."""

    __slots__ = (
        "alpha", "_log_gamma", "_pos", "_pos_n", "_neg", "_neg_n", "zeros", "count", "total",
        "min", "max",
    )  # fmt: skip

    def __init__(self, alpha: float = RELATIVE_ACCURACY) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self._log_gamma = math.log((1 + alpha) / (1 - alpha))
        self._pos, self._pos_n = _EMPTY_I, _EMPTY_I
        self._neg, self._neg_n = _EMPTY_I, _EMPTY_I
        #: values equal to zero
        self.zeros = 0
        self.count = 0
        #: the sum of the values (Rule 3)
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def _index(self, magnitudes: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        return np.ceil(np.log(magnitudes) / self._log_gamma).astype(np.int64)

    def _counted(
        self, magnitudes: npt.NDArray[np.float64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        keys, counts = np.unique(self._index(magnitudes), return_counts=True)
        return keys.astype(np.int64), counts.astype(np.int64)

    def add(self, values: npt.ArrayLike) -> None:
        """Count every value of ``values`` (any shape; finite numbers)."""
        x = np.asarray(values, dtype=np.float64).ravel()
        if not x.size:
            return
        if not np.isfinite(x).all():
            raise ValueError("a quantile sketch counts finite values only")
        self.count += int(x.size)
        self.total += float(x.sum())
        self.min = min(self.min, float(x.min()))
        self.max = max(self.max, float(x.max()))
        pos = x[x > 0]
        neg = x[x < 0]
        self.zeros += int(x.size - pos.size - neg.size)
        if pos.size:
            self._pos, self._pos_n = _merge_store(self._pos, self._pos_n, *self._counted(pos))
        if neg.size:
            self._neg, self._neg_n = _merge_store(self._neg, self._neg_n, *self._counted(-neg))

    def merge(self, other: QuantileSketch) -> None:
        """Add ``other``'s values (Rule 2); both must have the same accuracy."""
        if other.alpha != self.alpha:
            raise ValueError(f"cannot merge sketches of accuracy {self.alpha} and {other.alpha}")
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.zeros += other.zeros
        self._pos, self._pos_n = _merge_store(self._pos, self._pos_n, other._pos, other._pos_n)
        self._neg, self._neg_n = _merge_store(self._neg, self._neg_n, other._neg, other._neg_n)

    def buckets(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """The stores as they are: positive bucket indices and counts, then the negative
        store's as one array of signed indices (``-i`` for magnitude bucket ``i``), and
        the zeros. Two sketches of the same values give equal buckets (tests)."""
        idx = np.concatenate((-self._neg[::-1], self._pos))
        cnt = np.concatenate((self._neg_n[::-1], self._pos_n))
        return idx, cnt, self.zeros

    def _order_values(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """The cumulative counts and representative values of every bucket in value
        order (negative buckets, zero, positive buckets)."""
        gamma = math.exp(self._log_gamma)
        scale = 2.0 / (gamma + 1.0)
        neg = -scale * np.exp(self._neg[::-1].astype(np.float64) * self._log_gamma)
        pos = scale * np.exp(self._pos.astype(np.float64) * self._log_gamma)
        values = np.concatenate((neg, [0.0], pos))
        counts = np.concatenate((self._neg_n[::-1], [self.zeros], self._pos_n))
        return np.cumsum(counts), values

    def percentile(self, q: float | npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The percentiles ``q`` (0..100) of the values counted (Rule 4). Raises
        ValueError when the sketch is empty."""
        if not self.count:
            raise ValueError("no values counted")
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if ((qs < 0) | (qs > 100)).any():
            raise ValueError("percentiles must be in 0..100")
        cum, values = self._order_values()
        rank = qs / 100.0 * (self.count - 1)
        low = np.floor(rank)
        frac = rank - low
        high = np.minimum(low + 1, self.count - 1)
        a = self._order_statistic(cum, values, low)
        b = self._order_statistic(cum, values, high)
        out = a + (b - a) * frac
        return np.clip(out, self.min, self.max)

    def _order_statistic(
        self,
        cum: npt.NDArray[np.int64],
        values: npt.NDArray[np.float64],
        j: npt.NDArray[np.float64],
    ) -> npt.NDArray[np.float64]:
        """The ``j``-th smallest values (0-based) as their buckets give them; the first
        and the last are the exact minimum and maximum."""
        out = values[np.searchsorted(cum, j, side="right")]
        out = np.where(j == 0, self.min, out)
        return np.where(j == self.count - 1, self.max, out)

    def stats(self) -> LatencyStats:
        """The summary's statistics of the values (already in milliseconds): count, min,
        mean, the summary's percentiles and max; None each when empty."""
        if not self.count:
            return LatencyStats.from_seconds(())
        p50, p90, p95, p99 = self.percentile(PERCENTILES).tolist()
        return LatencyStats(
            count=self.count,
            min=self.min,
            mean=self.total / self.count,
            p50=p50,
            p90=p90,
            p95=p95,
            p99=p99,
            max=self.max,
        )
