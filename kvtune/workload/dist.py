"""Distributions of positive integers: token lengths, turns per session.

Written on the command line as:

    512                 fixed
    100-2000            uniform over [100, 2000] (also uniform:100-2000)
    lognormal:1000,0.8  lognormal with mean 1000 and sigma 0.8 (of the log)
    empirical:FILE      resampled from a trace file's input (or output) lengths
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .readers import read_workload


@dataclass(frozen=True)
class IntDist:
    kind: str
    a: float = 0.0
    b: float = 0.0
    values: tuple[int, ...] = ()

    @classmethod
    def fixed(cls, value: int) -> IntDist:
        return cls._checked("fixed", value, value)

    @classmethod
    def uniform(cls, low: int, high: int) -> IntDist:
        return cls._checked("uniform", low, high)

    @classmethod
    def lognormal(cls, mean: float, sigma: float) -> IntDist:
        """Mean in tokens; sigma of the underlying normal (0.5 mild, 1.5 heavy-tailed)."""
        if not (mean >= 1 and sigma >= 0 and math.isfinite(mean * sigma)):
            raise ValueError(f"lognormal needs mean >= 1 and sigma >= 0, got {mean}, {sigma}")
        return cls("lognormal", mean, sigma)

    @classmethod
    def empirical(cls, values) -> IntDist:
        values = tuple(int(v) for v in values)
        if not values or min(values) < 1:
            raise ValueError("an empirical distribution needs at least one value, all >= 1")
        return cls("empirical", values=values)

    @classmethod
    def _checked(cls, kind: str, low: float, high: float) -> IntDist:
        if not (1 <= low <= high and float(low).is_integer() and float(high).is_integer()):
            raise ValueError(f"{kind} needs integers 1 <= low <= high, got {low}, {high}")
        return cls(kind, int(low), int(high))

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` draws, each an integer >= 1."""
        if self.kind == "fixed":
            return np.full(count, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=count)
        if self.kind == "lognormal":
            mu = math.log(self.a) - self.b**2 / 2  # so that the mean is self.a
            return np.maximum(1, np.rint(rng.lognormal(mu, self.b, size=count))).astype(np.int64)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=count)

    def draw(self, rng: np.random.Generator) -> int:
        return int(self.sample(rng, 1)[0])

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        if self.kind == "lognormal":
            return f"lognormal:{self.a:g},{self.b:g}"
        return f"empirical({len(self.values)} values)"


def parse_dist(text: str, column: str = "input") -> IntDist:
    """An IntDist from its command-line spelling; `column` picks the lengths an
    empirical trace contributes ("input" or "output")."""
    kind, _, rest = text.partition(":") if ":" in text else ("", "", text)
    try:
        if kind == "empirical":
            return _empirical(rest, column)
        if kind == "lognormal":
            mean, sigma = rest.split(",")
            return IntDist.lognormal(float(mean), float(sigma))
        if kind in ("", "uniform") and "-" in rest:
            low, high = rest.split("-")
            return IntDist.uniform(int(low), int(high))
        if kind in ("", "fixed"):
            return IntDist.fixed(int(rest))
    except ValueError as err:
        raise ValueError(f"bad distribution {text!r}: {err}") from None
    raise ValueError(f"bad distribution {text!r}: expected N, LOW-HIGH, lognormal:MEAN,SIGMA or empirical:FILE")


def _empirical(path: str, column: str) -> IntDist:
    workload = read_workload(path)
    return IntDist.empirical(getattr(r, f"{column}_length") for r in workload.requests)
