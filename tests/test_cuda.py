"""The torch executor on a real GPU: the same tokens as on the CPU, and the pool the
memory plan sized. Skipped where torch sees no GPU (CI); run on a GPU machine with
`python -m pytest tests/test_cuda.py`."""
import pytest
import torch
from kvengine.engine.clock import VirtualClock
from kvengine.config import KV_CACHE_DTYPES, EngineConfig, GiB
from kvengine.core.memory import kv_bytes_per_block
from kvengine.core.request import SamplingParams
from kvengine.engine.torch_engine import build_torch_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU that torch can see")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SHARED = list(range(100, 164))  # four 16-token blocks: the later prompts hit the prefix cache
PROMPTS = [SHARED + [7, 8, 9], SHARED + list(range(300, 420)), [5] * 3, SHARED + [11] * 40]


def generate(device: str, kv_cache_dtype: str = "auto") -> tuple[list[list[int]], object]:
    # A 48-token budget chunks the 184-token prompt; prompts arrive one step apart so the
    # later ones find the first one's blocks cached.
    config = EngineConfig(num_gpu_blocks_override=128, max_model_len=512, max_num_batched_tokens=48,
                          max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    engine = build_torch_engine(config, preset="tiny", device=device, seed=1, clock=VirtualClock())
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(engine.add_request(f"r{i}", prompt, GREEDY))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests], engine


def test_greedy_tokens_on_cuda_are_the_cpus():
    """Paged attention, chunked prefill, prefix hits and the greedy head agree across
    devices (float32 weights: an argmax flips only on a near-tie)."""
    cpu, cpu_engine = generate("cpu")
    cuda, engine = generate("cuda")
    assert cuda == cpu
    assert engine.executor.cache.data.device.type == "cuda"
    assert engine.kv.prefix_stats.hits == cpu_engine.kv.prefix_stats.hits > 0


@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
def test_every_kv_cache_dtype_runs_on_cuda_with_the_planned_bytes(dtype):
    outputs, engine = generate("cuda", dtype)
    assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(PROMPTS)
    spec, blocks = engine.model, engine.memory.num_gpu_blocks
    assert engine.executor.kv_cache_bytes == blocks * kv_bytes_per_block(spec, dtype, engine.config.block_size)


def test_the_pool_fills_the_budget_after_the_measured_activation_peak():
    """On CUDA the activation peak is measured by a profile run over the token budget
    (vLLM's way), and the pool takes what utilization leaves of the budget."""
    config = EngineConfig(gpu_memory_utilization=0.5, max_num_batched_tokens=2048, max_num_seqs=64)
    engine = build_torch_engine(config, preset="tiny", device="cuda", device_memory=4 * GiB, seed=1,
                                clock=VirtualClock())
    memory = engine.memory
    assert memory.total_bytes == 4 * GiB and memory.activation_bytes > 0
    assert engine.executor.kv_cache_bytes == memory.num_gpu_blocks * memory.block_bytes
    used = memory.weights_bytes + memory.activation_bytes + memory.overhead_bytes + engine.executor.kv_cache_bytes
    assert memory.requested_bytes - memory.block_bytes < used <= memory.requested_bytes == 2 * GiB
