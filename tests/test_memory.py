"""Memory arithmetic against hand-computed values."""
import math
import re

import pytest

from kvengine.config import GiB, EngineConfig, ConfigError, device_preset, model_preset
from kvengine.core.memory import (KVCacheMemoryError, kv_bytes_per_block, kv_bytes_per_token,
                             max_concurrency, plan_memory)


def test_kv_bytes_per_token_by_hand():
    llama3 = model_preset("llama-3-8b")
    assert kv_bytes_per_token(llama3, "auto") == 2 * 32 * 8 * 128 * 2 == 131_072  # 128 KiB
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert kv_bytes_per_token(llama3, dtype) == 65_536
    assert kv_bytes_per_token(model_preset("llama-2-7b")) == 524_288  # 32 KV heads: 512 KiB
    assert kv_bytes_per_token(model_preset("llama-3-70b")) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(model_preset("tiny")) == 2 * 4 * 2 * 32 * 4  # float32
    assert kv_bytes_per_block(llama3, "auto", 16) == 16 * 131_072


def test_param_counts_match_the_published_sizes():
    expected = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.55e9,
                "mistral-7b": 7.25e9, "qwen2.5-7b": 7.62e9}
    for name, params in expected.items():
        assert model_preset(name).num_params == pytest.approx(params, rel=0.005), name


def test_num_gpu_blocks_follows_the_vllm_formula():
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    cfg = EngineConfig().resolve(model, device)
    plan = plan_memory(model, device, cfg)
    requested = math.ceil(80 * GiB * 0.92)
    available = requested - model.weight_bytes - plan.activation_bytes - device.non_torch_overhead_bytes
    assert plan.kv_cache_bytes == available
    assert plan.num_gpu_blocks == available // (16 * 131_072)
    assert plan.num_tokens == plan.num_gpu_blocks * 16
    # fp8 halves the bytes per block: twice the blocks from the same memory
    fp8 = plan_memory(model, device, EngineConfig(kv_cache_dtype="fp8").resolve(model, device))
    assert fp8.num_gpu_blocks == available // (16 * 65_536)


def test_more_utilisation_more_blocks():
    model, device = model_preset("llama-3-8b"), device_preset("a100-80gb")
    blocks = [plan_memory(model, device, EngineConfig(gpu_memory_utilization=u).resolve(model, device)).num_gpu_blocks
              for u in (0.8, 0.9, 0.95)]
    assert blocks == sorted(blocks) and blocks[0] < blocks[-1]


def test_max_concurrency():
    assert max_concurrency(1000, 16, 1600) == 10.0
    assert max_concurrency(1000, 16, 1601) == pytest.approx(1000 / 101)


def test_start_failure_when_the_pool_cannot_hold_one_max_len_request():
    model, device = model_preset("llama-3-8b"), device_preset("l4-24gb")
    cfg = EngineConfig(gpu_memory_utilization=0.72, max_model_len=8192).resolve(model, device)
    with pytest.raises(KVCacheMemoryError, match="To serve at least one request with the model's max seq len"):
        plan_memory(model, device, cfg)
    with pytest.raises(KVCacheMemoryError, match="do not fit"):
        plan_memory(model_preset("llama-3-70b"), device, EngineConfig().resolve(model, device))


def test_num_gpu_blocks_override():
    model, device = model_preset("tiny"), device_preset("cpu")
    cfg = EngineConfig(num_gpu_blocks_override=300, max_model_len=1024).resolve(model, device)
    assert plan_memory(model, device, cfg).num_gpu_blocks == 300


@pytest.mark.parametrize("kwargs, flag", [
    (dict(block_size=12), "--block-size"),
    (dict(block_size=512), "--block-size"),
    (dict(gpu_memory_utilization=0), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization=1.2), "--gpu-memory-utilization"),
    (dict(kv_cache_dtype="fp4"), "--kv-cache-dtype"),
    (dict(max_num_seqs=512, max_num_batched_tokens=256), "--max-num-batched-tokens"),
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(max_model_len=100_000), "--max-model-len"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=8192), "chunked prefill"),
])
def test_bad_config_names_the_flag(kwargs, flag):
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(**kwargs).resolve(model, device)


def test_vllm_batch_defaults_by_device():
    model = model_preset("llama-3-8b")
    big = EngineConfig().resolve(model, device_preset("h100-80gb"))
    small = EngineConfig().resolve(model, device_preset("a100-80gb"))
    assert (big.max_num_seqs, big.max_num_batched_tokens) == (1024, 8192)
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)
    assert big.max_model_len == 8192


def test_log_lines_say_whether_the_activation_peak_was_measured():
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    cfg = EngineConfig().resolve(model, device)
    estimated = plan_memory(model, device, cfg)
    measured = plan_memory(model, device, cfg, activation_bytes=3 * GiB)
    assert not estimated.activation_measured and "(estimated)" in estimated.log_lines(8192)[0]
    how = re.search(r"activation peak memory takes [\d.]+ GiB \(([^)]+)\)", measured.log_lines(8192)[0]).group(1)
    assert measured.activation_measured and how != "estimated" and "measured" in how
    assert measured.activation_bytes == 3 * GiB
    assert "activation peak memory takes 3.00 GiB" in measured.log_lines(8192)[0]
    # the same formula, the measured peak in it
    assert measured.kv_cache_bytes == estimated.kv_cache_bytes + estimated.activation_bytes - 3 * GiB
