"""The statistics a verdict rests on: a mean's Student-t interval, Welch's test of two means, and
Holm's step-down correction over several comparisons (`ranking.choose` uses all three).

Student t, not a bootstrap: with the 3-5 runs a live stage affords, a percentile bootstrap
covers the mean far less often than it says (about 75 % for a "95 %" interval of 3 normal
values). Welch, not Student's pooled test: configs differ in their run-to-run noise (an
overloaded default varies far more than a config with room).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
# The t distribution's quantile and tail as scipy.special's functions: scipy.stats is the same numbers
# at over twice the import (every `kvtune search` pays it).
from scipy.special import stdtr, stdtrit

LEVEL = 0.95  # the intervals' confidence


@dataclass(frozen=True)
class Interval:
    """A mean over repeats and its Student-t interval at LEVEL (lo == hi == mean for one value);
    `sd` the runs' sample standard deviation (0 for one value)."""
    mean: float
    lo: float
    hi: float
    n: int
    sd: float = 0.0

    def overlaps(self, other: Interval) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi


def interval(values: list[float]) -> Interval | None:
    """The mean of the finite values and its two-sided Student-t interval at LEVEL: with 3-5 runs a
    percentile bootstrap covers the mean far less often than it says (about 75 % for a '95 %' one
    of 3 normal values)."""
    xs = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if xs.size == 0:
        return None
    mean = float(xs.mean())
    if xs.size == 1:
        return Interval(mean, mean, mean, 1)
    sd = float(xs.std(ddof=1))
    half = float(stdtrit(xs.size - 1, (1 + LEVEL) / 2)) * sd / math.sqrt(xs.size)
    # every figure ranked (goodput, latencies) is >= 0: an interval reaching below 0 says only that
    lo = max(mean - half, 0.0) if xs.min() >= 0 else mean - half
    return Interval(mean, lo, mean + half, int(xs.size), sd)


@dataclass(frozen=True)
class Difference:
    """One test of `a` beating `b` on one figure: a's mean minus b's, its Welch interval at LEVEL,
    and the one-sided p-value of `a` being better (higher for the objective, lower for an SLO)."""
    diff: float
    lo: float
    hi: float
    p: float


def welch(a: Interval, b: Interval, higher_is_better: bool = True) -> Difference | None:
    """Welch's t-test of a's mean against b's (unequal variances); None with fewer than 2 runs of either."""
    if a.n < 2 or b.n < 2:
        return None
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    diff, se = a.mean - b.mean, math.sqrt(va + vb)
    if se == 0:  # runs identical to the bit (a simulated executor): any difference is certain
        return Difference(diff, diff, diff, 0.0 if (diff > 0) == higher_is_better and diff else 1.0)
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    t = diff / se if higher_is_better else -diff / se
    half = float(stdtrit(df, (1 + LEVEL) / 2)) * se
    return Difference(diff, diff - half, diff + half, float(stdtr(df, -t)))


def holm(tests: dict, alpha: float) -> set:
    """The keys of `tests` ({key: p}) that Holm's step-down procedure rejects at family-wise `alpha`."""
    rejected = set()
    for i, (key, p) in enumerate(sorted(tests.items(), key=lambda kv: kv[1])):
        if p >= alpha / (len(tests) - i):
            break
        rejected.add(key)
    return rejected
