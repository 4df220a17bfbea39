"""prompt_token_ids: deterministic, in range, sharing exactly what hash_ids share."""
from __future__ import annotations


import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.workload import (
    TOKEN_ID_MAX,
    TOKEN_ID_MIN,
    TraceRequest,
    Workload,
    count_tokens,
    prompt_token_ids,
    read_workload,
    workload_prompt_token_ids,
)

from tracepaths import AZURE_CONV


def test_count_tokens_is_utf8_bytes():
    assert count_tokens("") == 0
    assert count_tokens("hello") == 5
    assert count_tokens("héllo") == 6
    assert count_tokens("😀") == 4


def test_deterministic_and_in_range():
    req = TraceRequest(0.0, 1300, 5, (7, 8, 9))
    tokens = prompt_token_ids(req, 512)
    assert tokens == prompt_token_ids(TraceRequest(9.0, 1300, 1, (7, 8, 9)), 512)
    assert len(tokens) == 1300 and all(isinstance(t, int) for t in tokens)
    assert TOKEN_ID_MIN <= min(tokens) and max(tokens) < TOKEN_ID_MAX
    assert len(set(tokens)) > 1000  # pseudo-random, not a constant fill


def test_equal_leading_ids_give_equal_leading_tokens():
    a = prompt_token_ids(TraceRequest(0.0, 1024, 1, (1, 2)), 512)
    b = prompt_token_ids(TraceRequest(0.0, 1100, 1, (1, 3, 4)), 512)
    assert a[:512] == b[:512]
    assert a[512:] != b[512:1024]


def test_a_partial_last_block_is_a_prefix_of_the_full_block():
    partial = prompt_token_ids(TraceRequest(0.0, 600, 1, (1, 2)), 512)
    full = prompt_token_ids(TraceRequest(0.0, 1024, 1, (1, 2)), 512)
    assert partial == full[:600]


def test_blocks_follow_the_hash_block_size():
    tokens = prompt_token_ids(TraceRequest(0.0, 48, 1, (5, 6, 5)), 16)
    assert tokens[:16] == tokens[32:] != tokens[16:32]


def test_explicit_token_ids_win():
    req = TraceRequest(0.0, 3, 1, (1,), prompt_token_ids=(11, 12, 13))
    assert prompt_token_ids(req, 512) == [11, 12, 13]


def test_prompt_text_gives_byte_tokens_when_it_matches_the_length():
    req = TraceRequest(0.0, 3, 1, prompt="abc")
    assert prompt_token_ids(req) == [TOKEN_ID_MIN + 97, TOKEN_ID_MIN + 98, TOKEN_ID_MIN + 99]
    other_tokenizer = TraceRequest(0.0, 2, 1, prompt="abc")
    assert len(prompt_token_ids(other_tokenizer)) == 2


def test_requests_without_hash_ids_share_nothing():
    same = TraceRequest(0.0, 64, 4)
    w = Workload([same, same, same])
    streams = list(workload_prompt_token_ids(w))
    assert len({tuple(s[:16]) for s in streams}) == 3
    assert streams == list(workload_prompt_token_ids(w))  # still deterministic
    assert prompt_token_ids(same, unique_key=1) == streams[1]
    assert prompt_token_ids(same) == prompt_token_ids(same)  # keyed by its fields


def test_unique_streams_never_equal_a_hash_block():
    assert prompt_token_ids(TraceRequest(0.0, 16, 1), 16, unique_key=3) != \
        prompt_token_ids(TraceRequest(0.0, 16, 1, (3,)), 16)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**63), min_size=1, max_size=6), st.integers(1, 64), st.data())
def test_sharing_matches_the_ids(ids, block, data):
    length = data.draw(st.integers((len(ids) - 1) * block + 1, len(ids) * block))
    other = ids[:data.draw(st.integers(0, len(ids)))]
    other += [i + 1 for i in ids[len(other):]]
    a = prompt_token_ids(TraceRequest(0.0, length, 1, tuple(ids)), block)
    b = prompt_token_ids(TraceRequest(0.0, length, 1, tuple(other)), block)
    common = 0
    while common < len(ids) and ids[common] == other[common]:
        common += 1
    shared = min(common * block, length)
    assert a[:shared] == b[:shared]
    assert all(TOKEN_ID_MIN <= t < TOKEN_ID_MAX for t in a)
    if shared < length:
        assert a[shared:] != b[shared:]


def test_a_real_trace_tokenises_to_its_lengths():
    """(How fast: benchmarks/replay_speed.py's tokenise figure.)"""
    w = read_workload(AZURE_CONV)
    assert sum(len(t) for t in workload_prompt_token_ids(w)) == sum(r.input_length for r in w)


def test_mooncake_style_trace_shares_its_prefix_blocks():
    rng = np.random.default_rng(0)
    requests = []
    for i in range(400):  # a shared prefix of 1-39 blocks, then a block of its own
        ids = tuple(range(int(rng.integers(1, 40)))) + (1000 + i,)
        requests.append(TraceRequest(float(i), len(ids) * 512, 1, ids))
    tokens = list(workload_prompt_token_ids(Workload(requests)))
    assert tokens[0][:512] == tokens[1][:512]
