"""Bugs that small vLLM clones shipped, pinned down."""
import pytest

from kvengine.core.block_pool import BlockHashToBlockMap, BlockPool
from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.core.kv_cache_utils import KVCacheBlock, hash_block_tokens
from kvengine.config import EngineConfig
from kvengine.core.request import Request, SamplingParams
from kvengine.core.scheduler import Scheduler


def admit(kv, rid, prompt):
    req = Request(rid, list(prompt))
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return req, num_hit


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, 4, 64)
    prompt = list(range(100, 108))  # exactly two full blocks
    admit(kv, "a", prompt)
    _, hit = admit(kv, "b", prompt)
    assert hit == 4  # not 8: the last block is recomputed to get the last token's logits
    _, hit = admit(kv, "c", prompt + [5])
    assert hit == 8  # one more token: both blocks hit, only that token is computed


def test_block_reused_after_eviction_loses_its_old_hash():
    kv = KVCacheManager(4, 4, 64)  # 3 usable blocks
    old, _ = admit(kv, "old", [1, 2, 3, 4, 5])
    old_hash = old.block_hashes[0]
    kv.free(old)
    assert kv.pool.cached.get_one_block(old_hash) is not None  # freed but still cached
    admit(kv, "new", list(range(50, 61)))  # needs all 3 blocks: evicts the cached one
    assert kv.pool.cached.get_one_block(old_hash) is None
    assert all(b.block_hash != old_hash for b in kv.pool.blocks)
    probe = Request("probe", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(probe) == ([], 0)
    assert kv.num_evictions == 1


def test_hit_blocks_are_really_used():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)
    kv = KVCacheManager(64, 16, 128)
    sched = Scheduler(cfg, kv)
    shared = list(range(1000, 1048))  # three full blocks
    first = Request("first", shared + [1, 2, 3], SamplingParams(max_tokens=4))
    sched.add_request(first)
    sched.update_from_output(sched.schedule(), [7])
    second = Request("second", shared + [9, 9], SamplingParams(max_tokens=4))
    sched.add_request(second)
    out = sched.schedule()
    assert out.scheduled == [first, second]
    assert out.num_new_tokens == [1, 2]  # only the two unshared tokens are computed
    assert second.num_computed_tokens == 50 and second.num_cached_tokens == 48
    assert kv.get_block_ids("second")[:3] == kv.get_block_ids("first")[:3]
    assert kv.prefix_stats.hits == 48 and kv.prefix_stats.queries == 51 + 50


def test_freed_blocks_go_to_the_tail_tail_block_first():
    kv = KVCacheManager(8, 4, 64)
    req, _ = admit(kv, "a", list(range(12)))
    ids = kv.get_block_ids("a")
    kv.free(req)
    queue = [b.block_id for b in kv.pool.free_queue]
    assert queue[-3:] == ids[::-1]  # evicted last-block-first


def test_double_free_is_refused():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(16, 4, 64)
    admit(kv, "a", list(range(9)))
    salted = Request("b", list(range(9)), cache_salt="tenant-2")
    assert kv.get_computed_blocks(salted)[1] == 0
    assert kv.get_computed_blocks(Request("c", list(range(9))))[1] == 8


def test_block_hash_is_deterministic_and_chained():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != a


def test_usage_counts_only_referenced_blocks():
    kv = KVCacheManager(11, 4, 64)  # 10 usable
    req, _ = admit(kv, "a", list(range(8)))
    assert kv.usage() == pytest.approx(0.2)
    kv.free(req)
    assert kv.usage() == 0.0  # cached but free: not "used"
    assert kv.reset_prefix_cache()
    assert not kv.pool.cached


def test_a_hash_two_requests_computed_at_once_keeps_both_blocks():
    cached, a, b = BlockHashToBlockMap(), KVCacheBlock(1), KVCacheBlock(2)
    cached.insert(b"h", a)
    cached.insert(b"h", b)
    assert len(cached) == 1 and sorted(blk.block_id for _, blk in cached.items()) == [1, 2]
    assert cached.get_one_block(b"h") is a
    assert cached.pop(b"h", 1) is a and cached.get_one_block(b"h") is b
    assert cached.pop(b"h", 1) is None and cached.get_one_block(b"h") is b
    assert cached.pop(b"h", 2) is b and cached.get_one_block(b"h") is None and len(cached) == 0


def test_a_huge_pool_makes_its_blocks_only_as_they_are_first_used_in_vllms_order():
    """vLLM's initial free queue holds every block in id order; a freed block that no prefix can hit
    (no hash) goes to its head, reused before the never-used ones, and a cached one to its tail,
    evicted last. Made lazily, in that order."""
    pool = BlockPool(10**7)
    assert len(pool.blocks) == 1 and pool.num_free_blocks == 10**7 - 1  # the null block only
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [1, 2, 3] and len(pool.blocks) == 4
    pool.free_blocks(reversed(first))  # freed last-first, as vLLM frees a request's blocks
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]  # uncached blocks reused first
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 4] and len(pool.blocks) == 5
    small = BlockPool(6)
    taken = small.get_new_blocks(3)
    taken[0].block_hash = b"cached"  # a full block a later prompt could hit
    small.free_blocks(reversed(taken))
    assert [b.block_id for b in small.free_queue] == [3, 2, 4, 5, 1]
    assert [b.block_id for b in small.get_new_blocks(5)] == [3, 2, 4, 5, 1]
