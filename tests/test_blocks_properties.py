"""The KV cache manager under random allocate / append / free / lookup.

After every operation: used + free = usable; the free queue holds exactly the
blocks with ref count 0, once each; each block's ref count equals the number
of block tables holding it; a cached hash maps to a block whose writer wrote
exactly those tokens; and after every request finishes all blocks are free.
"""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.core.request import Request

BLOCK = 4
NUM_BLOCKS = 24
MAX_LEN = 64

# A tiny alphabet makes shared prefixes (and so prefix hits) frequent.
prompts = st.lists(st.integers(1, 3), min_size=1, max_size=24)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, MAX_LEN, enable_caching=True)
        self.live: list[Request] = []
        self.writer: dict[int, tuple[Request, int]] = {}  # block id -> (request, index) that wrote it
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _record_writes(self, req: Request, first_new_index: int, new_blocks) -> None:
        for k, blk in enumerate(new_blocks):
            self.writer[blk.block_id] = (req, first_new_index + k)

    @rule(prompt=prompts)
    def admit(self, prompt):
        req = Request(self._new_id(), list(prompt))
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit % BLOCK == 0 and num_hit <= len(prompt) - 1
        new = self.kv.allocate_slots(req, len(prompt) - num_hit, num_hit, hits,
                                     full_sequence_must_fit=True)
        if new is None:
            return
        self.kv.record_prefix_cache_stats(req, num_hit)
        self._record_writes(req, len(hits), new)
        req.num_computed_tokens = len(prompt)
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data, token):
        req = data.draw(st.sampled_from(self.live))
        if req.num_tokens + 1 >= MAX_LEN:
            return self._finish(req)
        req.all_token_ids.append(token)  # the sampled token, computed in the next step
        if self.kv.allocate_slots(req, 1) is None:
            return self._finish(req)  # what the scheduler would do: preempt it
        # The token lands in the block at this index (a fresh or still-partial
        # block): whoever writes last owns the block's content.
        idx = req.num_computed_tokens // BLOCK
        self.writer[self.kv.req_to_blocks[req.request_id][idx].block_id] = (req, idx)
        req.num_computed_tokens += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self._finish(data.draw(st.sampled_from(self.live)))

    def _finish(self, req):
        self.live.remove(req)
        self.kv.free(req)
        self.kv.free(req)  # a second free of the same request must be a no-op

    @rule(prompt=prompts)
    def lookup(self, prompt):
        req = Request("probe", list(prompt))
        hits, num_hit = self.kv.get_computed_blocks(req)
        for i, blk in enumerate(hits):
            w_req, w_idx = self.writer[blk.block_id]
            assert w_idx == i
            assert w_req.all_token_ids[i * BLOCK:(i + 1) * BLOCK] == prompt[i * BLOCK:(i + 1) * BLOCK]

    @invariant()
    def pool_accounting(self):
        pool = self.kv.pool
        in_queue = [b.block_id for b in pool.free_queue]
        assert len(in_queue) == len(set(in_queue)) == pool.num_free_blocks
        assert all(pool.blocks[i].ref_cnt == 0 for i in in_queue)
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert used + pool.num_free_blocks == pool.num_usable_blocks
        assert 0 not in in_queue

    @invariant()
    def ref_counts_match_tables(self):
        holders = {}
        for blocks in self.kv.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.kv.pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), b

    @invariant()
    def cached_hashes_hold_their_tokens(self):
        for h, blk in self.kv.pool.cached.items():
            assert blk.block_hash == h
            w_req, w_idx = self.writer[blk.block_id]
            assert w_req.block_hashes[w_idx] == h

    @invariant()
    def computed_prefix_matches_writers(self):
        for req in self.live:
            table = self.kv.req_to_blocks[req.request_id]
            for i in range(req.num_computed_tokens // BLOCK):
                w_req, w_idx = self.writer[table[i].block_id]
                assert w_idx == i
                assert w_req.all_token_ids[i * BLOCK:(i + 1) * BLOCK] == req.all_token_ids[i * BLOCK:(i + 1) * BLOCK]

    def teardown(self):
        for req in list(self.live):
            self._finish(req)
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1
        assert not self.kv.req_to_blocks


TestKVCacheManager = KVCacheMachine.TestCase
TestKVCacheManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
