"""vLLM V1 scheduling policy: budget, max_num_seqs, preemption, FCFS admission."""
import random

import pytest

from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.config import EngineConfig
from kvengine.executor.cost import causal_pairs, kernel_pairs
from kvengine.core.request import Request, RequestStatus, SamplingParams
from kvengine.core.scheduler import Scheduler


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, **kw):
    cfg = EngineConfig(max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=max_model_len, **kw)
    kv = KVCacheManager(num_blocks, block_size, max_model_len, cfg.enable_prefix_caching)
    return Scheduler(cfg, kv), kv


def req(rid, n, max_tokens=8, base=0):
    return Request(rid, [base + i + 1 for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched):
    out = sched.schedule()
    sampled = [7 if r.num_computed_tokens >= r.num_tokens else None for r in out.scheduled]
    return out, sched.update_from_output(out, sampled)


def test_budget_and_max_num_seqs_never_exceeded():
    rng = random.Random(1)
    sched, kv = make(num_blocks=40, max_num_seqs=5, budget=24)
    for i in range(40):
        sched.add_request(req(f"r{i}", rng.randint(1, 40), rng.randint(1, 20), base=100 * i))
    finished = 0
    for _ in range(2000):
        out, done = step(sched)
        finished += len(done)
        assert out.total_tokens <= 24
        assert len(sched.running) <= 5
        if not sched.has_unfinished():
            break
    assert finished == 40
    assert kv.num_free_blocks == kv.num_usable_blocks  # everything returned


def test_chunked_prefill_splits_a_long_prompt_at_the_budget():
    sched, _ = make(budget=16, max_model_len=128, num_blocks=64)
    r = req("long", 40)
    sched.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out, _ = step(sched)
        chunks.append(out.num_new_tokens[0])
    assert chunks == [16, 16, 8]  # no token sampled until the whole prompt is computed


def test_newest_running_request_is_preempted_and_goes_to_the_front():
    # 4 usable blocks of 4 tokens; each request's prompt takes one block.
    sched, kv = make(num_blocks=5, max_num_seqs=8, budget=64)
    reqs = [req(f"r{i}", 4, max_tokens=8, base=10 * i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)  # all four prefills fit; each samples a token
    assert [r.request_id for r in out.scheduled] == ["r0", "r1", "r2", "r3"]
    sched.add_request(req("late", 2, base=999))
    out, _ = step(sched)  # every decode needs a 2nd block: the pool runs dry
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "late"]
    assert reqs[3].status == RequestStatus.PREEMPTED and reqs[3].num_computed_tokens == 0
    assert reqs[3].num_preemptions == 1
    assert out.num_new_reqs == 0  # no admission in a step that preempted


def test_head_of_line_blocking():
    sched, _ = make(num_blocks=9, budget=64, max_model_len=64)  # 8 usable blocks
    sched.add_request(req("small0", 12, max_tokens=20))  # 3 blocks, 8 with its output
    step(sched)
    sched.add_request(req("big", 24, base=100))  # needs 6 blocks for its prompt: 5 are free
    sched.add_request(req("small", 4, base=200))  # would fit, but waits behind the head
    out, _ = step(sched)
    assert [r.request_id for r in out.scheduled] == ["small0"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_admission_needs_the_whole_prompt_to_fit():
    # The first chunk (8 tokens) would fit the pool; the whole prompt (40) does not.
    sched, kv = make(num_blocks=9, budget=8, max_model_len=64)
    sched.add_request(req("holder", 8, max_tokens=30))
    step(sched)
    sched.add_request(req("long", 40, base=50))
    out, _ = step(sched)
    assert [r.request_id for r in out.scheduled] == ["holder"]


def test_length_cap_at_max_model_len_and_max_tokens():
    sched, _ = make(max_model_len=16, num_blocks=16)
    a, b = req("a", 10, max_tokens=100), req("b", 4, max_tokens=3, base=50)
    sched.add_request(a)
    sched.add_request(b)
    done = []
    while sched.has_unfinished():
        done += step(sched)[1]
    assert a.num_tokens == 16 and a.finish_reason == "length"
    assert b.num_output_tokens == 3 and b.finish_reason == "length"


def test_eos_and_stop_token_ids_stop_a_request():
    sched, _ = make()
    r = Request("e", [1, 2, 3], SamplingParams(max_tokens=50), eos_token_id=7)
    s = Request("s", [4, 5, 6], SamplingParams(max_tokens=50, stop_token_ids=(7,), ignore_eos=True))
    sched.add_request(r)
    sched.add_request(s)
    _, done = step(sched)
    assert {x.request_id for x in done} == {"e", "s"}
    assert r.finish_reason == "stop" and s.stop_reason == 7


def test_abort_frees_blocks_wherever_the_request_is():
    sched, kv = make()
    a, b = req("a", 9), req("b", 9, base=40)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    done = sched.finish_requests(["a", "b", "nope"])
    assert {r.request_id for r in done} == {"a", "b"}
    assert a.finish_reason == "abort"
    assert kv.num_free_blocks == kv.num_usable_blocks and not sched.has_unfinished()


def test_long_prefill_threshold_caps_a_prefill_when_others_wait():
    sched, _ = make(budget=64, long_prefill_token_threshold=8, max_model_len=64)
    sched.add_request(req("a", 30))
    sched.add_request(req("b", 30, base=100))
    out = sched.schedule()
    assert out.num_new_tokens == [8, 8]


def test_chunked_prefill_off_waits_for_a_budget_that_fits():
    sched, _ = make(budget=64, max_model_len=64, enable_chunked_prefill=False)
    sched.add_request(req("a", 40))
    sched.add_request(req("b", 40, base=100))
    out = sched.schedule()
    assert out.num_new_tokens == [40]  # b would need a chunk: it waits


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_stats_count_new_requests_in_tokens(caching):
    sched, kv = make(enable_prefix_caching=caching)
    for i in range(3):
        sched.add_request(req(f"r{i}", 10))
        step(sched)
    stats = kv.prefix_stats
    if caching:
        assert (stats.requests, stats.queries, stats.hits) == (3, 30, 16)
    else:
        assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_kernel_pairs_count_whole_key_blocks_up_to_each_querys_diagonal():
    assert kernel_pairs(300, 1000, 0) == causal_pairs(300, 1000)  # no blocks: the causal pairs
    assert kernel_pairs(512, 512, 512) == 512 * 512  # one block: every query computes all of it
    # 768 fresh tokens: the first 512 queries compute block one, the last 256 both blocks.
    assert kernel_pairs(768, 768, 512) == 512 * 512 + 256 * 768
    # After 1000 tokens of context: 24 queries end in block one, 232 in block two (of 1256 keys).
    assert kernel_pairs(256, 1256, 512) == 24 * 1024 + 232 * 1256
    assert kernel_pairs(256, 1256, 512, all_keys_after_context=True) == 256 * 1256
    assert kernel_pairs(256, 256, 512, all_keys_after_context=True) == 256 * 256  # no context before it
    for ctx in (1, 511, 512, 513, 4000):  # a decode attends to its context, blocked or not
        assert kernel_pairs(1, ctx, 512) == kernel_pairs(1, ctx, 512, True) == ctx
    rng = random.Random(0)
    for _ in range(200):
        ctx = rng.randint(1, 5000)
        n, block = rng.randint(1, ctx), rng.choice((16, 64, 128, 512))
        assert causal_pairs(n, ctx) <= kernel_pairs(n, ctx, block) <= n * ctx
        assert kernel_pairs(n, ctx, block) == sum(min(ctx, -(-(p + 1) // block) * block)
                                                  for p in range(ctx - n, ctx))


@pytest.mark.parametrize("caching", [False, True])
def test_outputs_carry_the_block_tables_an_executor_keeps(caching):
    """Applying each output's block ids as an executor does (a request admitted or resumed
    brings its whole table, a running one its added blocks; ended ones are dropped) keeps
    the KV manager's tables, through preemptions, prefix hits and an abort."""
    rng = random.Random(2)
    sched, kv = make(num_blocks=24, max_num_seqs=6, budget=20, enable_prefix_caching=caching)
    shared = [9000 + i for i in range(8)]  # a common prefix: prefix hits where caching is on
    for i in range(30):
        own = [100 * i + j + 1 for j in range(rng.randint(1, 24))]
        params = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
        sched.add_request(Request(f"r{i}", shared + own, params))
    tables: dict[str, list[int]] = {}
    preempted = 0
    for k in range(3000):
        if k == 5:
            sched.finish_requests(["r0"])
        out, _ = step(sched)
        assert len(out.new_block_ids) == len(out.scheduled)
        for rid in out.finished_req_ids:
            tables.pop(rid, None)
        for r in out.preempted:
            tables.pop(r.request_id, None)
        preempted += len(out.preempted)
        first_new = len(out.scheduled) - out.num_new_reqs
        for i, (r, ids) in enumerate(zip(out.scheduled, out.new_block_ids)):
            if i >= first_new:
                tables[r.request_id] = list(ids)
            else:
                tables[r.request_id] += ids
        assert {r.request_id: tables[r.request_id] for r in sched.running} == \
            {r.request_id: kv.get_block_ids(r.request_id) for r in sched.running}
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and preempted
    assert kv.prefix_stats.hits > 0 if caching else kv.prefix_stats.hits == 0
    step(sched)  # nothing left: an empty output, which holds the last ones' ids for the next
    assert set(tables) == set(sched.finished_req_ids)
