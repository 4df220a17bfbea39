"""Transforms every workload accepts; each returns a new Workload.

time_scale and rate_scale stretch or squeeze arrival times; length_scale
shrinks or grows prompts and outputs (to fit a small engine), and their hash
blocks with them so that the prefix sharing stays the trace's; head and sample
select requests; retime replaces the arrival times with a fresh gamma process.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import replace

import numpy as np

from .arrivals import gamma_arrivals
from .model import TraceRequest, Workload, blocks_for
from .tokens import count_tokens, utf8


def time_scale(workload: Workload, factor: float) -> Workload:
    """Arrival times multiplied by `factor` (2 replays at half speed)."""
    _check_factor(factor, "time scale")
    return _with_arrivals(workload, [r.arrival_s * factor for r in workload.requests])


def rate_scale(workload: Workload, factor: float) -> Workload:
    """Arrival times divided by `factor` (2 doubles the request rate)."""
    _check_factor(factor, "rate scale")
    return _with_arrivals(workload, [r.arrival_s / factor for r in workload.requests])


def retime(workload: Workload, rate: float, burstiness: float = 1.0, seed: int = 0) -> Workload:
    """New arrivals at `rate` requests/s from a gamma process (see `arrivals`), in the same order."""
    arrivals = gamma_arrivals(len(workload), rate, burstiness, np.random.default_rng(seed))
    return _with_arrivals(workload, arrivals.tolist())


def head(workload: Workload, n: int) -> Workload:
    """The first `n` requests by arrival."""
    if n < 0:
        raise ValueError(f"head needs n >= 0, got {n}")
    return workload.with_requests(workload.requests[:n])


def sample(workload: Workload, n: int | float, seed: int = 0) -> Workload:
    """A random subset, in arrival order, with the original arrival times.

    `n`: an int is a count (capped at the workload's size); a float in (0, 1]
    is a fraction. Thinning this way lowers the rate proportionally.
    """
    total = len(workload)
    if isinstance(n, float):
        if not 0 < n <= 1:
            raise ValueError(f"sample fraction must be in (0, 1], got {n}")
        count = round(total * n)
    elif isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        count = min(n, total)
    else:
        raise ValueError(f"sample needs a count >= 0 or a fraction in (0, 1], got {n!r}")
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=count, replace=False))
    return workload.with_requests([workload.requests[i] for i in chosen])


def length_scale(workload: Workload, factor: float, max_input: int | None = None,
                 max_output: int | None = None) -> Workload:
    """Input and output lengths times `factor` (rounded, at least 1), then capped.

    Prefix structure: the hash block size is scaled too (rounded, at least 1),
    so each hash id still covers the same share of its prompt and requests
    share the same share of their tokens as before. Keeping the blocks would
    make it up: every prompt shrunk into its first block would share all of it
    with every other prompt that starts with that block. A prompt keeps its
    leading ids, as many as cover its new length; where the rounding of the
    block size leaves it a few tokens past its last id, they get an id of their
    own, the same for every prompt that ends with that id (what they stand for
    is the rest of that block). Prompt text and explicit token ids are cut
    with the prompt (text only where the bundled tokenizer counted it) and
    dropped where the prompt grows.
    """
    _check_factor(factor, "length scale")
    for cap, name in ((max_input, "max_input"), (max_output, "max_output")):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1, got {cap}")
    block_size = _scaled(workload.hash_block_size, factor, None)
    tail_ids = defaultdict(itertools.count(_max_hash_id(workload) + 1).__next__)
    requests = [
        _scale_request(r, _scaled(r.input_length, factor, max_input),
                       _scaled(r.output_length, factor, max_output), block_size, tail_ids)
        for r in workload.requests
    ]
    return replace(workload, requests=requests, hash_block_size=block_size)


def _scale_request(req: TraceRequest, input_length: int, output_length: int, hash_block_size: int,
                   tail_ids: defaultdict[tuple[int, int], int]) -> TraceRequest:
    prompt, input_length = _cut_prompt(req, input_length)
    hash_ids = None if req.hash_ids is None else _rebuilt_hash_ids(
        req.hash_ids, input_length, hash_block_size, tail_ids)
    token_ids = req.prompt_token_ids
    if token_ids is not None:
        token_ids = token_ids[:input_length] if input_length <= len(token_ids) else None
    return replace(req, input_length=input_length, output_length=output_length, hash_ids=hash_ids,
                   prompt=prompt, prompt_token_ids=token_ids)


def _cut_prompt(req: TraceRequest, input_length: int) -> tuple[str | None, int]:
    """The prompt text for the new length, and the length it really has."""
    prompt = req.prompt
    if prompt is None or input_length == req.input_length:
        return prompt, input_length
    if input_length > req.input_length or count_tokens(prompt) != req.input_length:
        return None, input_length
    cut = utf8(prompt)[:input_length].decode("utf-8", errors="ignore")
    # A cut through a multi-byte character loses its bytes: report the true length.
    return (cut, count_tokens(cut)) if cut else (None, input_length)


def _rebuilt_hash_ids(ids: tuple[int, ...], input_length: int, hash_block_size: int,
                      tail_ids: defaultdict[tuple[int, int], int]) -> tuple[int, ...]:
    """The ids covering `input_length` tokens in blocks of the scaled size; past the last one, the
    ids `tail_ids` keeps for that id's k-th extra block."""
    count = blocks_for(input_length, hash_block_size)
    extra = tuple(tail_ids[ids[-1], k] for k in range(count - len(ids)))
    return ids[:count] + extra


def _scaled(length: int, factor: float, cap: int | None) -> int:
    scaled = max(1, math.floor(length * factor + 0.5))
    return scaled if cap is None else min(scaled, cap)


def _max_hash_id(workload: Workload) -> int:
    return max((max(r.hash_ids) for r in workload.requests if r.hash_ids), default=-1)


def _with_arrivals(workload: Workload, arrivals: list[float]) -> Workload:
    requests = [replace(r, arrival_s=t) for r, t in zip(workload.requests, arrivals)]
    return workload.with_requests(requests)


def _check_factor(factor: float, name: str) -> None:
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"{name} factor must be a finite number > 0, got {factor}")
