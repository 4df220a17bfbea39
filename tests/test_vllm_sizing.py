"""kvtune's KV pool against vLLM's own, family by family (issue #40, point 4).

The reference is vLLM itself: a real start of the CPU build on a shrunk config.json with dummy
weights (tests/vllm_sizing.py start_and_read: its vllm:cache_config_info and its logged
"Maximum concurrency"), or, where a start is not needed or not possible (tensor parallelism on
one CPU), vLLM's own sizing code run on the same config (vllm_sizing: its ModelConfig, its layers'
KV cache specs, get_kv_cache_configs and get_max_concurrency_for_kv_cache_config). kvtune's side
is kvengine.core.memory.plan_memory on the spec kvengine.model.hf_config reads. Every family's
start and probe at TP 1, 2 and 4 are recorded in tests/data/sizing/vllm_reference.json (compared
without vLLM); benchmarks/vllm_sizing.py runs them again (`--starts`: the real starts too); the suite
also probes three families live (a hybrid, MLA at TP 2, GQA at TP 4) with the pinned vLLM.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from kvengine.config import DeviceSpec, EngineConfig, GiB
from kvengine.core.memory import plan_memory
from kvengine.model.hf_config import spec_from_config

from vllm_sizing import family_dir, vllm_sizings

MAX_MODEL_LEN = 2048
REFERENCE = json.loads((family_dir("llama3").parent / "vllm_reference.json").read_text())
# The CPU build's platform (one batch in flight, its default batch budget); its memory is unused
# here: the pool is given (VLLM_CPU_KVCACHE_SPACE, or the probe's available bytes).
CPU = DeviceSpec("cpu", 64 * GiB, 20e9, 100e9, platform="cpu")


def kvtune_sizing(family: str, *, tp: int = 1, block_size: int, pool_bytes: int = GiB,
                  max_num_batched_tokens: int | None = None) -> tuple[int, float]:
    """(num_gpu_blocks, max concurrency at MAX_MODEL_LEN) as kvtune plans one GPU of the family."""
    path = family_dir(family) / "config.json"
    spec = spec_from_config(json.loads(path.read_text()), family, str(path))
    spec = dataclasses.replace(spec, dtype="bfloat16")  # the tests serve --dtype bfloat16
    config = EngineConfig(block_size=block_size, kv_cache_memory_bytes=pool_bytes, max_model_len=MAX_MODEL_LEN,
                          tensor_parallel_size=tp, max_num_batched_tokens=max_num_batched_tokens)
    plan = plan_memory(spec, CPU, config.resolve(spec, CPU))
    return plan.num_gpu_blocks, plan.max_concurrency(MAX_MODEL_LEN)


RECORDED = [(family, key, entry) for family, runs in REFERENCE.items() if family != "_about"
            for key, entry in runs.items()]


@pytest.mark.parametrize("family, key, entry", RECORDED, ids=[f"{f}-{k}" for f, k, _ in RECORDED])
def test_the_pool_equals_vllms_recorded_one(family, key, entry):
    """Every family as the CPU build sized it when started (real) and as vLLM's sizing code sized it at
    TP 1, 2 and 4 (probe_tpN), recorded in tests/data/sizing/vllm_reference.json by
    `python tests/vllm_sizing.py --json`: kvtune's plan gives the same blocks and concurrency."""
    tp = int(key.removeprefix("probe_tp")) if key.startswith("probe_tp") else 1
    blocks, concurrency = kvtune_sizing(family, tp=tp, block_size=entry["block_size"],
                                        max_num_batched_tokens=entry.get("max_num_batched_tokens"))
    assert blocks == entry.get("num_blocks", entry.get("num_gpu_blocks"))
    assert concurrency == pytest.approx(entry["max_concurrency"], abs=0.01)


# Live, in one probe process (vLLM's import paid once): Gemma 2 (sliding window on alternate layers),
# DeepSeek-V3's MLA latent (whole on every rank) and Qwen3's K/V heads split (and replicated past their
# count) over TP ranks, as vLLM's own code sizes them for one rank's memory.
LIVE = [("gemma2", 1), ("deepseek_v3", 2), ("qwen3", 4)]


@pytest.fixture(scope="module")
def live_sizing():
    return dict(zip(LIVE, vllm_sizings([dict(config_dir=family_dir(f), tp=tp, block_size=128,
                                             max_model_len=MAX_MODEL_LEN) for f, tp in LIVE])))


@pytest.mark.slow
@pytest.mark.parametrize("family, tp", LIVE)
def test_hybrid_mla_and_tensor_parallel_pools_equal_vllms_own_sizing(live_sizing, family, tp):
    """vLLM groups Gemma 2's layers by kind and keeps a window's blocks per sliding group, so its pool and
    concurrency are not a dense model's; MLA and TP as the comment above says."""
    theirs = live_sizing[family, tp]
    assert "error" not in theirs, theirs.get("error")
    blocks, concurrency = kvtune_sizing(family, tp=tp, block_size=128)
    assert blocks == theirs["num_blocks"]
    assert concurrency == pytest.approx(theirs["max_concurrency"], rel=1e-6)
