"""Synthetic workloads: determinism, arrivals, shared system prompts, sessions."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from kvtune.workload import (
    IntDist,
    SynthSpec,
    parse_dist,
    prefix_reuse,
    read_workload,
    synthesize,
    write_workload,
)
from kvtune.workload.model import blocks_for


def test_same_seed_same_workload():
    spec = SynthSpec(num_requests=200, input_len=IntDist.lognormal(300, 0.8), turns=IntDist.uniform(1, 4),
                     think_time_s=5, system_prompts=2, system_prompt_len=100, seed=7)
    assert synthesize(spec).requests == synthesize(spec).requests
    spec.seed = 8
    assert synthesize(spec).requests != synthesize(SynthSpec(**{**spec.__dict__, "seed": 7})).requests


def test_count_lengths_and_consistent_hash_ids():
    spec = SynthSpec(num_requests=300, input_len=IntDist.uniform(50, 150), output_len=IntDist.fixed(7),
                     hash_block_size=32)
    w = synthesize(spec)
    assert len(w) == 300 and w.hash_block_size == 32
    assert all(50 <= r.input_length <= 150 and r.output_length == 7 for r in w)
    assert all(len(r.hash_ids) == blocks_for(r.input_length, 32) for r in w)
    assert len({i for r in w for i in r.hash_ids}) == sum(len(r.hash_ids) for r in w)  # nothing shared


def test_constant_and_poisson_arrivals():
    constant = synthesize(SynthSpec(num_requests=5, rate=2.0, arrival="constant"))
    assert [r.arrival_s for r in constant] == [0.0, 0.5, 1.0, 1.5, 2.0]
    poisson = synthesize(SynthSpec(num_requests=5000, rate=20.0, input_len=IntDist.fixed(8)))
    assert poisson.rate_rps == pytest.approx(20.0, rel=0.05)


def test_duration_bounds_the_arrivals():
    w = synthesize(SynthSpec(num_requests=None, duration_s=100.0, rate=5.0, input_len=IntDist.fixed(8)))
    assert max(r.arrival_s for r in w) < 100.0
    assert len(w) == pytest.approx(500, rel=0.15)


def test_shared_system_prompts():
    spec = SynthSpec(num_requests=2000, system_prompts=2, system_prompt_len=100,
                     system_prompt_shares=(0.5, 0.25), input_len=IntDist.fixed(40), hash_block_size=16)
    w = synthesize(spec)
    openings = Counter(r.hash_ids[:6] for r in w)  # 100 // 16 = 6 full shared blocks
    common = openings.most_common(2)
    assert common[0][1] == pytest.approx(1000, rel=0.1) and common[1][1] == pytest.approx(500, rel=0.15)
    with_system = sum(r.input_length == 140 for r in w)
    assert with_system == common[0][1] + common[1][1]  # the other quarter has only its 40 tokens
    assert all(r.input_length in (40, 140) for r in w)
    # per system prompt, every request after the first serves the 96 shared tokens
    expected = (common[0][1] - 1 + common[1][1] - 1) * 96
    assert prefix_reuse(w, 16).cached_tokens == expected


def test_multi_turn_sessions_extend_the_previous_turn():
    spec = SynthSpec(num_requests=400, rate=2.0, turns=IntDist.uniform(2, 5), think_time_s=30,
                     input_len=IntDist.uniform(10, 200), output_len=IntDist.uniform(5, 100), hash_block_size=16)
    w = synthesize(spec)
    sessions = defaultdict(list)
    for r in w:
        sessions[r.session_id].append(r)
    assert None not in sessions and len(sessions) < 400
    partial_checked = 0
    for turns in sessions.values():
        for prev, this in zip(turns, turns[1:]):
            assert this.arrival_s >= prev.arrival_s
            assert this.input_length > prev.input_length + prev.output_length
            full = prev.input_length // 16
            assert this.hash_ids[:full] == prev.hash_ids[:full]
            if prev.input_length % 16:  # the partial block grew with the answer: fresh id
                assert prev.hash_ids[full] not in this.hash_ids
                partial_checked += 1
    assert partial_checked > 50


def test_multi_turn_ideal_hit_rate_is_honest():
    spec = SynthSpec(num_requests=3, rate=1.0, turns=IntDist.fixed(3), think_time_s=1,
                     input_len=IntDist.fixed(40), output_len=IntDist.fixed(10), hash_block_size=16)
    w = synthesize(spec)
    assert [r.input_length for r in w] == [40, 90, 140]
    # turn 2 reuses turn 1's 2 full blocks (32 tokens); turn 3 reuses turn 2's 5 (80 tokens)
    assert prefix_reuse(w, 16).cached_tokens == 32 + 80
    assert prefix_reuse(w, 8).cached_tokens == 32 + 80


def test_max_input_ends_sessions_that_no_longer_fit():
    spec = SynthSpec(num_requests=200, turns=IntDist.fixed(10), input_len=IntDist.fixed(100),
                     output_len=IntDist.fixed(100), max_input=500)
    w = synthesize(spec)
    assert len(w) == 200 and max(r.input_length for r in w) <= 500
    assert max(Counter(r.session_id for r in w).values()) == 3  # 100, 300, 500


def test_synthetic_trace_round_trips(tmp_path):
    w = synthesize(SynthSpec(num_requests=50, turns=IntDist.fixed(2), system_prompts=1,
                             system_prompt_len=64, think_time_s=3))
    path = tmp_path / "s.jsonl"
    write_workload(w, path)
    again = read_workload(path)
    assert again.hash_block_size == 16
    assert [(r.input_length, r.hash_ids, r.session_id) for r in again] == \
        [(r.input_length, r.hash_ids, r.session_id) for r in w]
    assert prefix_reuse(again).cached_tokens == prefix_reuse(w).cached_tokens > 0


@pytest.mark.parametrize("spec", [
    SynthSpec(num_requests=None, duration_s=None),
    SynthSpec(num_requests=5, duration_s=5.0),
    SynthSpec(rate=0),
    SynthSpec(arrival="weibull"),
    SynthSpec(system_prompts=2, system_prompt_len=10, system_prompt_shares=(0.8, 0.8)),
    SynthSpec(system_prompts=2, system_prompt_len=0),
])
def test_inconsistent_specs_are_refused(spec):
    with pytest.raises(ValueError):
        synthesize(spec)


def test_distributions(tmp_path):
    rng = np.random.default_rng(0)
    assert parse_dist("512") == IntDist.fixed(512)
    assert parse_dist("10-20") == parse_dist("uniform:10-20") == IntDist.uniform(10, 20)
    lognormal = parse_dist("lognormal:1000,0.5").sample(rng, 20000)
    assert lognormal.mean() == pytest.approx(1000, rel=0.03) and lognormal.min() >= 1
    uniform = IntDist.uniform(10, 20).sample(rng, 1000)
    assert uniform.min() == 10 and uniform.max() == 20
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 7, "output_length": 3}\n'
                     '{"timestamp": 1, "input_length": 9, "output_length": 4}\n')
    assert set(parse_dist(f"empirical:{trace}", "output").sample(rng, 100)) == {3, 4}
    for bad in ("x", "20-10", "lognormal:5", "0"):
        with pytest.raises(ValueError):
            parse_dist(bad)
