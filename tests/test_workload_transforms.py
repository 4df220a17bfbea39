"""Transforms: pure functions from a Workload to a new one."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtune.workload import (
    TraceRequest,
    Workload,
    count_tokens,
    head,
    length_scale,
    prompt_token_ids,
    rate_scale,
    retime,
    sample,
    time_scale,
)


def timed(*arrivals: float) -> Workload:
    return Workload([TraceRequest(t, 10, 2) for t in arrivals], source="t")


def arrivals(w: Workload) -> list[float]:
    return [r.arrival_s for r in w]


def test_time_and_rate_scale():
    w = timed(0.0, 1.0, 3.0)
    assert arrivals(time_scale(w, 2.0)) == [0.0, 2.0, 6.0]
    assert arrivals(rate_scale(w, 2.0)) == [0.0, 0.5, 1.5]
    assert rate_scale(w, 2.0).rate_rps == pytest.approx(2 * w.rate_rps)
    assert arrivals(w) == [0.0, 1.0, 3.0]  # the input is untouched
    assert time_scale(w, 2.0).source == "t"
    with pytest.raises(ValueError):
        time_scale(w, 0)
    with pytest.raises(ValueError):
        rate_scale(w, -1)


def test_head_and_sample():
    w = timed(*range(100))
    assert arrivals(head(w, 3)) == [0, 1, 2]
    picked = sample(w, 10, seed=1)
    assert len(picked) == 10 and arrivals(picked) == sorted(arrivals(picked))
    assert arrivals(picked) == arrivals(sample(w, 10, seed=1))
    assert arrivals(picked) != arrivals(sample(w, 10, seed=2))
    assert len(sample(w, 0.25)) == 25
    assert len(sample(w, 1000)) == 100
    with pytest.raises(ValueError):
        sample(w, 1.5)


def test_length_scale_lengths_and_caps():
    w = Workload([TraceRequest(0.0, 1000, 100), TraceRequest(1.0, 1, 1)])
    scaled = length_scale(w, 0.25, max_input=200, max_output=20)
    assert [(r.input_length, r.output_length) for r in scaled] == [(200, 20), (1, 1)]
    assert [(r.input_length, r.output_length) for r in length_scale(w, 3)] == [(3000, 300), (3, 3)]


def test_shrinking_keeps_the_leading_ids():
    w = Workload([TraceRequest(0.0, 2000, 5, (1, 2, 3, 4)), TraceRequest(0.0, 1100, 5, (1, 2, 9))])
    small = length_scale(w, 0.5)
    assert [r.hash_ids for r in small] == [(1, 2), (1, 2)]
    assert [r.input_length for r in small] == [1000, 550]
    # the shared tokens are still the original ones
    assert prompt_token_ids(small.requests[1], 512) == prompt_token_ids(w.requests[1], 512)[:550]


def test_growing_gives_fresh_ids_to_grown_blocks():
    w = Workload([TraceRequest(0.0, 700, 5, (1, 2)), TraceRequest(0.0, 1024, 5, (1, 2))])
    big = length_scale(w, 2.0)
    first, second = (r.hash_ids for r in big)
    assert len(first) == math.ceil(1400 / 512) and len(second) == 4
    assert first[0] == 1 and first[1] not in (1, 2)       # the partial block 2 grew: fresh
    assert second[:2] == (1, 2) and set(second[2:]).isdisjoint({1, 2} | set(first))
    assert len(set(first) | set(second)) == len(first) + len(second) - 1


def test_length_scale_cuts_byte_counted_prompts():
    prompt = "abcdé"  # 6 bytes
    w = Workload([TraceRequest(0.0, 6, 3, prompt=prompt)])
    cut = length_scale(w, 0.5).requests[0]
    assert (cut.prompt, cut.input_length) == ("abc", 3)
    through_e = length_scale(w, 5 / 6).requests[0]  # 5 bytes would split the é
    assert (through_e.prompt, through_e.input_length) == ("abcd", 4)
    assert through_e.input_length == count_tokens(through_e.prompt)
    assert length_scale(w, 2).requests[0].prompt is None
    foreign = Workload([TraceRequest(0.0, 2, 3, prompt=prompt)])  # counted by another tokenizer
    assert length_scale(foreign, 0.5).requests[0].prompt is None


def test_retime_mean_rate_and_regular_gaps():
    w = timed(*([0.0] * 20000))
    poisson = retime(w, rate=10.0, seed=3)
    gaps = np.diff(arrivals(poisson))
    assert arrivals(poisson)[0] == 0.0
    assert poisson.rate_rps == pytest.approx(10.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential gaps
    bursty = retime(w, rate=10.0, burstiness=0.25, seed=3)
    assert bursty.rate_rps == pytest.approx(10.0, rel=0.05)
    assert np.std(np.diff(arrivals(bursty))) / 0.1 == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    constant = retime(timed(*range(5)), rate=4.0, burstiness=float("inf"))
    assert arrivals(constant) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert arrivals(retime(w, 10.0, seed=3)) == arrivals(poisson)
    with pytest.raises(ValueError):
        retime(w, rate=0)


def test_retime_keeps_everything_but_the_times():
    w = Workload([TraceRequest(5.0, 10, 2, (1,), "p", "s")], hash_block_size=16)
    r = retime(w, 1.0).requests[0]
    assert (r.arrival_s, r.hash_ids, r.prompt, r.session_id) == (0.0, (1,), "p", "s")
    assert retime(w, 1.0).hash_block_size == 16
