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
    rate_scale,
    retime,
    sample,
    time_scale,
    workload_prompt_token_ids,
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


def test_length_scale_scales_the_hash_blocks_with_the_lengths():
    w = Workload([TraceRequest(0.0, 2000, 5, (1, 2, 3, 4)), TraceRequest(0.0, 1100, 5, (1, 2, 9))])
    small = length_scale(w, 0.5)
    assert small.hash_block_size == 256
    assert [r.input_length for r in small] == [1000, 550]
    # each id still covers the same share of its prompt, so the ids stay as they were
    assert [r.hash_ids for r in small] == [(1, 2, 3, 4), (1, 2, 9)]
    big = length_scale(w, 2.0)
    assert big.hash_block_size == 1024 and [r.hash_ids for r in big] == [r.hash_ids for r in w]
    assert length_scale(w, 1.0, max_input=600).hash_block_size == 512
    assert length_scale(w, 0.0001).hash_block_size == 1


def shared_tokens(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shared_ids(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return shared_tokens(list(a), list(b))


@pytest.mark.parametrize("factor", [0.05, 0.1, 0.25, 3.0])
def test_scaled_prompts_share_exactly_the_blocks_their_ids_share(factor):
    w = Workload([TraceRequest(0.0, 5000, 5, tuple(range(10))),
                  TraceRequest(1.0, 3000, 5, (0, 1, 2, 3, 20, 21)),
                  TraceRequest(2.0, 5120, 5, tuple(range(10))),      # ten full blocks
                  TraceRequest(3.0, 5120, 5, tuple(range(10))),
                  TraceRequest(4.0, 700, 5, (0, 30))])
    scaled = length_scale(w, factor)
    size = scaled.hash_block_size
    prompts = list(workload_prompt_token_ids(scaled))
    for i, a in enumerate(scaled.requests):
        assert len(a.hash_ids) == math.ceil(a.input_length / size)
        for j, b in enumerate(scaled.requests[:i]):
            common = shared_ids(a.hash_ids, b.hash_ids)
            expected = min(common * size, a.input_length, b.input_length)
            assert shared_tokens(prompts[i], prompts[j]) == expected, (factor, i, j)


def test_tokens_past_the_last_id_share_what_that_id_shares():
    # 51-token blocks (512 * 0.1 rounded down) hold 510 of the 512 tokens ten full blocks scale to
    w = Workload([TraceRequest(0.0, 5120, 5, tuple(range(10))), TraceRequest(1.0, 5120, 5, tuple(range(10))),
                  TraceRequest(2.0, 5120, 5, tuple(range(9)) + (99,))])
    first, again, other = (r.hash_ids for r in length_scale(w, 0.1))
    assert len(first) == 11 and first[:10] == tuple(range(10)) and first[10] > 99
    assert again == first and other[10] not in first


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
