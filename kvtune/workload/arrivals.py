"""Arrival processes: gamma-distributed gaps, as `vllm bench serve --burstiness`.

Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean gap is
1/rate whatever the burstiness: 1 is a Poisson process, below 1 burstier,
above 1 more regular, infinity constant gaps. The first request arrives at
t=0, as vLLM sends its first request before the first wait. An infinite rate
sends everything at once.
"""
from __future__ import annotations

import math

import numpy as np


def check_rate(rate: float, burstiness: float) -> None:
    if not (rate > 0):
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not (burstiness > 0):
        raise ValueError(f"burstiness must be > 0, got {burstiness}")


def gamma_arrivals(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """`count` arrival times in seconds, starting at 0."""
    check_rate(rate, burstiness)
    gaps = gamma_gaps(max(count - 1, 0), rate, burstiness, rng)
    return np.concatenate(([0.0], np.cumsum(gaps)))[:count]


def gamma_gaps(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(count)
    if math.isinf(burstiness):
        return np.full(count, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
