"""What the clients saw: latency percentiles, ITL against context, the contexts to plan for."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..results import RequestRecord


def completed(requests: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in requests if r.ok]


def percentile(values, q: float) -> float | None:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def itl_by_context(requests: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(context, itl) for every inter-token gap: the gap before output token k+2 follows a
    context of prompt + k + 1 tokens (the first token came from the prefill)."""
    contexts, gaps = [], []
    for r in requests:
        if r.itl_s:
            contexts.append(r.prompt_tokens + 1 + np.arange(len(r.itl_s)))
            gaps.append(np.asarray(r.itl_s, dtype=float))
    if not gaps:
        return np.empty(0), np.empty(0)
    return np.concatenate(contexts), np.concatenate(gaps)


@dataclass
class Contexts:
    """Per-request context (prompt + output tokens) percentiles, and where they came from."""

    p50: float
    p95: float
    p99: float
    mean: float
    source: str
    longest: float = 0.0  # the longest request's context: a max_model_len below it refuses that request


def contexts_from_requests(requests: list[RequestRecord], min_requests: int) -> Contexts | None:
    lengths = [r.prompt_tokens + r.output_tokens for r in requests if r.ok]
    if len(lengths) < min_requests:
        return None
    p50, p95, p99 = np.percentile(lengths, [50, 95, 99])
    return Contexts(float(p50), float(p95), float(p99), float(np.mean(lengths)),
                    "completed requests' prompt + output tokens", float(max(lengths)))


def contexts_from_profile(workload: dict) -> Contexts | None:
    """From the workload profile: input pXX + output pXX, an upper bound on the pXX of their sum."""
    inputs, outputs = workload.get("input_len") or {}, workload.get("output_len") or {}
    if not inputs.get("p99"):
        return None
    total = {q: (inputs.get(q) or 0) + (outputs.get(q) or 0) for q in ("p50", "p95", "p99", "mean", "max")}
    return Contexts(total["p50"], total["p95"], total["p99"], total["mean"] or total["p50"],
                    "workload profile: input pXX + output pXX", total["max"] or total["p99"])
