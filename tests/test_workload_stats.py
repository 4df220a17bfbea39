"""workload_stats, and the ideal prefix hit rate checked by hand."""
from __future__ import annotations


import pytest

from kvtune.workload import TraceRequest, Workload, prefix_reuse, read_workload, workload_stats

from tracepaths import AZURE_CONV


def test_hand_made_trace_with_block_equal_to_hash_block():
    w = Workload([
        TraceRequest(0.0, 8, 1, (1, 2)),      # cold: 0 of 8
        TraceRequest(1.0, 12, 1, (1, 2, 3)),  # blocks 1,2 cached: 8 of 12
        TraceRequest(2.0, 8, 1, (1, 2)),      # both cached, but the last token is never served: 4 of 8
        TraceRequest(3.0, 10, 1, (2, 1, 3)),  # block (2) at the start is a different chain: 0 of 10
        TraceRequest(4.0, 7, 1, (1, 2)),      # partial second block: at most 6 tokens -> 1 block: 4 of 7
    ], hash_block_size=4)
    reuse = prefix_reuse(w, block_size=4)
    assert (reuse.cached_tokens, reuse.prompt_tokens) == (16, 45)
    # distinct chains: [1] [1,2] [1,2,3] [2] [2,1]; the partial blocks never enter the cache
    assert reuse.distinct_blocks == 5
    assert workload_stats(w, 4)["ideal_prefix_hit_rate"] == pytest.approx(16 / 45)


def test_block_size_finer_than_the_hash_blocks():
    w = Workload([TraceRequest(0.0, 32, 1, (1, 2)), TraceRequest(1.0, 32, 1, (1, 3))], hash_block_size=16)
    # second request: the first hash block (16 tokens = two 8-token blocks) is shared
    assert prefix_reuse(w, 8).cached_tokens == 16
    # a 12-token cache block: one whole block inside the shared 16 tokens
    assert prefix_reuse(w, 12).cached_tokens == 12
    # a 32-token block spans the differing second hash block: nothing to share
    assert prefix_reuse(w, 32).cached_tokens == 0


def test_requests_without_prefix_info_share_nothing():
    w = Workload([TraceRequest(float(i), 100, 3) for i in range(5)])
    assert prefix_reuse(w, 16).cached_tokens == 0
    assert prefix_reuse(w, 16).distinct_blocks == 5 * 6


def test_identical_prompt_text_is_shared():
    w = Workload([TraceRequest(0.0, 40, 1, prompt="x" * 40), TraceRequest(1.0, 40, 1, prompt="x" * 40)])
    assert prefix_reuse(w, 16).cached_tokens == 32


def test_stats_fields():
    w = Workload([TraceRequest(float(i), 10 * (i + 1), i + 1, session_id="s" if i else None)
                  for i in range(100)], source="t")
    stats = workload_stats(w)
    assert stats["requests"] == 100
    assert stats["duration_s"] == 99.0 and stats["rate_rps"] == pytest.approx(1.0)
    assert stats["input_len"]["max"] == 1000 and stats["input_len"]["mean"] == pytest.approx(505)
    assert stats["input_len"]["p50"] == pytest.approx(505)
    assert stats["output_len"]["p99"] == pytest.approx(99.01)
    assert stats["sessions"] == 1 and stats["prompt_tokens"] == 50500 and stats["output_tokens"] == 5050
    assert stats["ideal_prefix_hit_rate"] == 0.0


def test_empty_workload_stats():
    stats = workload_stats(Workload([]))
    assert stats["requests"] == 0 and stats["ideal_prefix_hit_rate"] == 0.0
    assert stats["rate_rps"] == 0.0 and stats["input_len"]["max"] == 0


def test_real_trace_stats():
    # No wall-clock limit here (the rules: none in a test); replay_speed.py measures speed.
    w = read_workload(AZURE_CONV)
    stats = workload_stats(w, 16)
    assert stats["requests"] == 19366 and stats["ideal_prefix_hit_rate"] == 0.0
    assert stats["distinct_prefix_blocks"] == sum(r.input_length // 16 for r in w)
    assert 4 < stats["rate_rps"] < 7
