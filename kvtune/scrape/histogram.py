"""A scraped classic Prometheus histogram: cumulative buckets, their increase, quantiles."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

INF = math.inf


@dataclass
class Histogram:
    bounds: list[float]  # sorted bucket upper bounds; a complete one ends with +Inf
    counts: list[float]  # cumulative count of each bucket
    sum: float = 0.0
    count: float = 0.0

    @classmethod
    def from_buckets(cls, buckets: dict[float, float], total: float = 0.0, count: float | None = None) -> Histogram:
        bounds = sorted(buckets)
        counts = [buckets[b] for b in bounds]
        if count is None:
            count = counts[-1] if counts else 0.0
        return cls(bounds, counts, total, count)

    def cumulative_at(self, bound: float) -> float:
        """Observations <= bound, as far as these buckets can tell (the largest bucket not above it)."""
        i = bisect.bisect_right(self.bounds, bound)
        return self.counts[i - 1] if i else 0.0

    def __add__(self, other: Histogram) -> Histogram:
        """Sum of two replicas (engines); exact where their buckets agree, as vLLM's always do."""
        bounds = sorted(set(self.bounds) | set(other.bounds))
        counts = [self.cumulative_at(b) + other.cumulative_at(b) for b in bounds]
        return Histogram(bounds, counts, self.sum + other.sum, self.count + other.count)

    def is_reset_from(self, earlier: Histogram) -> bool:
        """True when the server restarted in between: a count went down or the buckets changed."""
        if self.bounds != earlier.bounds or self.count < earlier.count:
            return True
        return any(now < before for now, before in zip(self.counts, earlier.counts))

    def increase_since(self, earlier: Histogram | None) -> Histogram:
        """What was observed after `earlier`; after a reset, everything now counted is new."""
        if earlier is None or self.is_reset_from(earlier):
            return Histogram(list(self.bounds), list(self.counts), self.sum, self.count)
        counts = [now - before for now, before in zip(self.counts, earlier.counts)]
        return Histogram(list(self.bounds), counts, self.sum - earlier.sum, self.count - earlier.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        return bucket_quantile(q, self.bounds, self.counts)

    def quantile_bound(self, q: float) -> Quantile:
        """The quantile as these buckets can tell it: a value, or only "< first bound" / "> last bound"."""
        return bounded_quantile(q, self.bounds, self.counts)

    def nonzero(self) -> tuple[int, int] | None:
        """Of a histogram of non-negative whole numbers (preemptions per request): how many observations
        are above 0, as (fewest, most) the buckets and the sum allow; None without a +Inf bucket.

        With a bucket at le="0" that is its count subtracted from the total. vLLM's and kvengine's
        request_num_preemptions buckets start at 1, so the first bucket holds both 0 and 1; then the
        sum tells them apart: the sum minus what the higher buckets hold is the first bucket's
        preemptions, exact when those buckets are one wide (2, 3, 4, 5) and a range when the coarse
        ones (5, 10], (10, 20] or +Inf hold any.
        """
        if len(self.bounds) < 2 or self.bounds[-1] != INF:
            return None
        counts = _monotonic(self.counts)
        total = round(counts[-1])
        first_bound = math.floor(self.bounds[0])
        if total <= 0:
            return 0, 0
        if first_bound <= 0:  # the first bucket holds only zeros
            n = total - round(counts[0])
            return n, n
        rest, rest_low, rest_high = 0, 0, 0.0
        for i in range(1, len(self.bounds)):
            n = round(counts[i] - counts[i - 1])
            rest += n
            rest_low += n * (math.floor(self.bounds[i - 1]) + 1)
            rest_high += n * (math.floor(self.bounds[i]) if self.bounds[i] != INF else INF) if n else 0
        first = round(counts[0])
        whole = round(self.sum)
        in_first_low = max(whole - rest_high, 0) if rest_high != INF else 0
        in_first_high = max(min(whole - rest_low, first * first_bound), 0)
        fewest = min(math.ceil(in_first_low / first_bound), first)
        most = max(min(first, in_first_high), fewest)
        return rest + int(fewest), rest + int(most)


def bucket_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus' histogram_quantile (promql/quantile.go, bucketQuantile), None where it gives NaN.

    Linear interpolation inside the bucket that holds the rank, from 0 for the
    lowest bucket (or its bound when that is <= 0); a rank in the +Inf bucket
    returns the highest finite bound.
    """
    if math.isnan(q):
        return None
    if q < 0:
        return -INF
    if q > 1:
        return INF
    if len(bounds) < 2 or bounds[-1] != INF:
        return None
    counts = _monotonic(counts)
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, in_bucket = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        in_bucket -= counts[b - 1]
        rank -= counts[b - 1]
    if in_bucket <= 0:  # q == 0 over an empty lowest bucket: Prometheus divides 0 by 0
        return start
    return start + (end - start) * (rank / in_bucket)


@dataclass(frozen=True)
class Quantile:
    """A histogram quantile: `value` where the buckets place it between two finite bounds; where the
    rank falls in the first bucket (0, b] only `below` = b is known ("< b"), and in the +Inf bucket
    only `above` = the highest finite bound ("> bound"). All None: no observations."""

    value: float | None = None
    below: float | None = None
    above: float | None = None

    @property
    def known(self) -> bool:
        return self.value is not None or self.below is not None or self.above is not None


def bounded_quantile(q: float, bounds: list[float], counts: list[float]) -> Quantile:
    """bucket_quantile, except that a rank inside the first bucket (0, b] or the +Inf bucket is not
    interpolated: Prometheus' linear guess there (from 0, or the last bound itself) is no measurement.
    A first bucket with a bound <= 0 is exact (nothing observed below it) and stays a value."""
    value = bucket_quantile(q, bounds, counts)
    if value is None or not 0 <= q <= 1:
        return Quantile(value)
    counts = _monotonic(counts)
    rank = q * counts[-1]
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return Quantile(above=bounds[-2])
    if b == 0 and bounds[0] > 0:
        return Quantile(below=bounds[0])
    return Quantile(value)


def _monotonic(counts: list[float]) -> list[float]:
    """Scrapes of buckets are not atomic: a later bucket can read lower. Prometheus keeps the max."""
    out, high = [], -INF
    for c in counts:
        high = max(high, c)
        out.append(high)
    return out
