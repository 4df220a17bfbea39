"""The contiguous worst-case baseline behind the KV manager interface."""
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.core.contiguous import ContiguousKVCacheManager
from kvengine.engine.llm_engine import LLMEngine
from kvengine.core.request import Request, SamplingParams


def test_each_request_reserves_max_model_len_first_fit():
    kv = ContiguousKVCacheManager(num_blocks=33, block_size=16, max_model_len=128)  # 32 usable: 4 x 8
    reqs = [Request(f"r{i}", [1] * 10) for i in range(5)]
    got = [kv.allocate_slots(r, 10) for r in reqs]
    assert [g[0] if g else None for g in got] == [1, 9, 17, 25, None]
    assert kv.usage() == 1.0 and kv.get_computed_blocks(reqs[0]) == ([], 0)
    kv.free(reqs[1])
    kv.free(reqs[2])  # merges with the run freed before it
    assert kv.free_runs == [(9, 16)]
    assert kv.allocate_slots(reqs[4], 10)[0] == 9
    assert kv.allocate_slots(reqs[4], 1) == []  # already covered
    for r in (reqs[0], reqs[3], reqs[4]):
        kv.free(r)
    assert kv.free_runs == [(1, 32)] and kv.num_free_blocks == 32


def test_engine_runs_on_the_contiguous_allocator_with_fewer_running():
    model, device = model_preset("llama-3-8b"), device_preset("a10-24gb")

    def peak_running(allocator):
        e = LLMEngine(EngineConfig(kv_allocator=allocator, max_model_len=4096, gpu_memory_utilization=0.95),
                      model, device)
        sp = SamplingParams(max_tokens=64, ignore_eos=True)
        e.replay([(0.0, f"r{i}", [i + 1000 + j for j in range(300)], sp) for i in range(64)])
        assert len(e.finished) == 64 and e.kv.usage() == 0
        return max(e.steps.num_running)

    paged, contiguous = peak_running("paged"), peak_running("contiguous")
    assert contiguous < paged
