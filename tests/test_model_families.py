"""The model families a config.json describes, against their publishers' own figures.

Each shipped preset (kvengine/model/configs/NAME.json, the model's published config.json) is
read by kvengine.model.hf_config and its counted parameters compared with the count its model
card states; the KV cache per token with the layer kinds and MLA's latent. vLLM's own sizing of
the pool is compared in tests/test_vllm_sizing.py.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from kvengine.config import MODEL_PRESETS, ConfigError, EngineConfig, device_preset
from kvengine.core.memory import kv_bytes_per_token, kv_groups, plan_memory
from kvengine.model.hf_config import CheckpointError, spec_from_config

GiB = 1 << 30

# Total parameters as each model card states them (billions; the decoder vLLM loads: DeepSeek-V3
# without its 14B multi-token-prediction layer, Gemma 3 without its 0.4B vision tower).
PUBLISHED_PARAMS_B = {
    "llama-3.1-70b": 70.6, "llama-3.1-8b": 8.03, "mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235.0, "qwen3-8b": 8.2, "qwen3-32b": 32.8, "qwen2.5-72b": 72.7,
    "deepseek-v3": 671.0, "kimi-k2": 1030.0, "gpt-oss-120b": 116.8, "gpt-oss-20b": 20.9,
    "gemma-2-9b": 9.24, "gemma-2-27b": 27.2, "gemma-3-27b": 27.0,
}
# (layer kinds, bytes per token of every layer held in full, at the checkpoint dtype)
KV_SHAPES = {
    "llama-3.1-70b": ({"full"}, 80 * 2 * 8 * 128 * 2),
    "mixtral-8x7b": ({"full"}, 32 * 2 * 8 * 128 * 2),
    "qwen3-30b-a3b": ({"full"}, 48 * 2 * 4 * 128 * 2),
    "deepseek-v3": ({"mla"}, 61 * (512 + 64) * 2),
    "kimi-k2": ({"mla"}, 61 * (512 + 64) * 2),
    "gemma-2-9b": ({"full", "sliding"}, 42 * 2 * 8 * 256 * 2),
    "gemma-3-27b": ({"full", "sliding"}, 62 * 2 * 16 * 128 * 2),
    "gpt-oss-120b": ({"full", "sliding"}, 36 * 2 * 8 * 64 * 2),
}


def preset(name: str):
    if name not in MODEL_PRESETS:
        pytest.fail(f"no shipped preset {name!r}: kvengine/model/configs/{name}.json")
    return MODEL_PRESETS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_counted_parameters_match_the_model_card(name):
    counted = preset(name).num_params / 1e9
    assert counted == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.015), counted


@pytest.mark.parametrize("name", sorted(KV_SHAPES))
def test_layer_kinds_and_cache_per_token(name):
    spec = preset(name)
    kinds, per_token = KV_SHAPES[name]
    assert set(spec.attention_kinds) == kinds and len(spec.attention_kinds) == spec.num_layers
    assert kv_bytes_per_token(spec) == per_token


def test_quantized_checkpoints_are_sized_in_their_format():
    """fp8 weights a byte each, gpt-oss's mxfp4 experts about half a byte: the pool is what is left."""
    dense, fp8 = preset("llama-3.1-70b"), preset("llama-3.1-70b-fp8")
    assert dense.weight_quant is None and fp8.weight_quant == "fp8"
    assert fp8.weight_bytes == pytest.approx(dense.weight_bytes / 2, rel=0.03)
    assert preset("deepseek-v3").weight_quant == "fp8"
    oss = preset("gpt-oss-120b")
    assert oss.weight_quant == "mxfp4"
    # The published checkpoint is about 65 GB: experts in mxfp4, attention and embeddings in bf16.
    assert 58 < oss.weight_bytes / GiB < 64


def test_hybrid_layers_group_as_vllm_groups_them():
    """Gemma 2: 21 sliding + 21 full layers, two groups of 21; Gemma 3 (5:1): groups of the 10
    full layers' size; a sliding group holds the window and the tokens in flight, plus a block."""
    gemma2 = kv_groups(preset("gemma-2-9b"))
    assert (gemma2.layers_per_group, sorted(gemma2.kinds), gemma2.window) == (21, ["full", "sliding"], 4096)
    assert gemma2.blocks_per_request(8192, 16, 0) == 512 + 256 + 1
    assert gemma2.blocks_per_request(1000, 16, 8192) == 63 + 64  # the window capped at the context, plus one
    gemma3 = kv_groups(preset("gemma-3-27b"))
    full = preset("gemma-3-27b").attention_kinds.count("full")
    assert gemma3.layers_per_group == full and gemma3.kinds.count("full") == 1
    assert gemma3.kinds.count("sliding") == -(-(62 - full) // full)


def test_tensor_parallel_shards_heads_and_weights_as_vllm_does():
    model, device = preset("llama-3.1-70b"), device_preset("h100-80gb")
    whole = plan_memory(model, device, EngineConfig(kv_cache_memory_bytes=8 * GiB, max_model_len=8192))
    tp4 = plan_memory(model, device, EngineConfig(tensor_parallel_size=4))
    assert tp4.weights_bytes == pytest.approx(whole.weights_bytes / 4, rel=0.01)
    assert tp4.block_bytes == whole.block_bytes // 4  # 8 K/V heads, 2 a GPU
    tp16 = model.tp_shard(16)  # more ranks than K/V heads: each holds one, replicated
    assert tp16.num_kv_heads == 1 and tp16.num_heads == 4
    mla = preset("deepseek-v3").tp_shard(8)  # MLA's latent is on every rank, whole
    assert kv_bytes_per_token(mla) == kv_bytes_per_token(preset("deepseek-v3"))
    with pytest.raises(ConfigError, match="does not divide .* 64 attention heads"):
        plan_memory(model, device, EngineConfig(tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="8 K/V heads: one must divide the other"):
        dataclasses.replace(model, num_heads=96).tp_shard(12)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}, r"model_type 'falcon' .* not a family"),
    ({"num_hidden_layers": None}, "lacks num_hidden_layers"),
    ({"kv_lora_rank": None}, "lacks kv_lora_rank, which this family needs"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    ({"layer_types": ["full_attention"] * 3, "sliding_window": 128, "model_type": "gpt_oss", "num_local_experts": 8},
     "layer_types must list 61"),
])
def test_a_config_it_cannot_place_names_the_file_and_the_field(change, message):
    cfg = json.loads(json.dumps(_deepseek_config()))
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(CheckpointError, match=message) as err:
        spec_from_config(cfg, "x", "/models/x/config.json")
    assert str(err.value).startswith("/models/x/config.json: ")


def _deepseek_config() -> dict:
    from kvengine.model.hf_config import PRESET_DIR
    return json.loads((PRESET_DIR / "deepseek-v3.json").read_text())


def test_plan_takes_any_family_tp_quantization_and_a_fixed_pool(capsys):
    """The issue's command: --hf-config DIR --tensor-parallel-size T --quantization Q
    --kv-cache-memory-bytes B --block-size S --context L --json gives fits and max_concurrency[L]."""
    from kvengine.model.hf_config import PRESET_DIR
    from test_plan import plan_json

    out = plan_json(capsys, "--hf-config", str(PRESET_DIR / "llama-3.1-70b.json"), "--device", "h100-80gb",
                    "--tensor-parallel-size", "4", "--quantization", "fp8", "--kv-cache-memory-bytes", "20GiB",
                    "--block-size", "16", "--context", "8192", "--max-model-len", "8192")
    assert out["fits"] is True and out["config"]["tensor_parallel_size"] == 4
    per_token = 80 * 2 * 2 * 128 * 2  # two of the 8 K/V heads on each GPU
    assert out["kv_bytes_per_token"] == per_token
    assert out["num_gpu_blocks"] == 20 * GiB // (16 * per_token)
    assert out["max_concurrency"]["8192"] == out["num_gpu_blocks"] / 512
    embeddings = 2 * 128256 * 8192  # embed_tokens and lm_head stay bf16; the linear layers are fp8
    assert out["memory"]["weights_bytes"] == pytest.approx((70.55e9 - embeddings + 2 * embeddings) / 4, rel=0.01)


def test_run_simulates_a_70b_model_split_over_four_gpus(tmp_path, capsys):
    import importlib.resources

    from kvengine.entrypoints.flags import launch_flags
    from kvtune.cli import main

    trace = importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl"
    common = ["run", "--target", "sim", "--workload", str(trace), "--head", "20", "--preset", "llama-3.1-70b",
              "--device", "h100-80gb", "--max-model-len", "8192", "--db", f"sqlite:///{tmp_path}/k.db"]
    assert main(common) != 0  # 131 GiB of weights on one 80 GB GPU
    assert "--tensor-parallel-size" in capsys.readouterr().err
    assert main([*common, "--tensor-parallel-size", "4"]) == 0
    assert "4 × h100-80gb (tensor parallel)" in capsys.readouterr().out
    flags = launch_flags(EngineConfig(tensor_parallel_size=4))  # the report's launch commands
    assert flags[flags.index("--tensor-parallel-size") + 1] == "4"


def test_the_simulator_runs_the_model_a_live_target_serves(tmp_path, capsys):
    """A local --model's config.json is the stage-1 model; a --preset describing another model is
    refused with both shapes named, before anything starts or is stored."""
    import argparse
    import importlib.resources
    import shutil

    from kvtune.cli import main
    from kvtune.cli.target import simulated_model
    from vllm_sizing import family_dir

    served = tmp_path / "qwen3-tiny"
    shutil.copytree(family_dir("qwen3"), served)

    def args(target, preset=None, model=str(served)):
        return argparse.Namespace(target=target, preset=preset, model=model)

    assert simulated_model(args("vllm"), "llama-3-8b") == str(served)
    assert simulated_model(args("http://127.0.0.1:9/", model=None), "llama-3-8b") == "llama-3-8b"
    assert simulated_model(args("vllm", preset=str(served / "config.json")), "x") == str(served / "config.json")
    db = tmp_path / "k.db"
    trace = importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl"
    for command in (["search", "--trials", "2"], ["calibrate", "--quick"]):
        extra = ["--workload", str(trace)] if command[0] == "search" else []
        code = main([*command, *extra, "--target", "vllm", "--model", str(served), "--preset", "llama-3-8b",
                     "--db", f"sqlite:///{db}"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "32 layers, 32 heads, 8 K/V heads of 128 (llama-3-8b)" in err
        assert "4 layers, 8 heads, 4 K/V heads of 64 (qwen3-tiny)" in err
        assert not db.exists()


def test_search_tunes_a_70b_model_at_tp_4_in_fp8_and_its_launch_line_says_so(tmp_path, capsys):
    import importlib.resources

    from kvtune.cli import main

    trace = tmp_path / "t.jsonl"
    lines = (importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl").read_text().splitlines()
    trace.write_text("\n".join(lines[:60]) + "\n")
    code = main(["search", "--workload", str(trace), "--target", "none", "--preset", "llama-3.1-70b", "--device",
                 "h100-80gb", "--tensor-parallel-size", "4", "--quantization", "fp8", "--max-model-len", "8192",
                 "--trials", "3", "--json",
                 "--db", f"sqlite:///{tmp_path}/k.db", "--report-dir", str(tmp_path / "report")])
    out = capsys.readouterr().out
    assert code == 0, out
    from kvtune.search.report_data import load_report_data
    info = load_report_data(f"sqlite:///{tmp_path}/k.db", json.loads(out.strip().splitlines()[-1])["study"]).info
    assert (info.model, info.device, info.tensor_parallel_size) == ("llama-3.1-70b", "h100-80gb", 4)
    assert "llama-3.1-70b on 4 × h100-80gb" in out  # the search says what it tunes on as it starts
    report = (tmp_path / "report" / "report.md").read_text()
    assert "tuned the KV cache of `llama-3.1-70b` on `4 × h100-80gb (tensor parallel)`" in report
    assert "--tensor-parallel-size 4" in report and "--quantization fp8" in report


def test_the_simulator_holds_a_window_of_a_sliding_groups_blocks():
    """Gemma 2 in the simulator: per-group tables over one pool, as vLLM keeps them (its step-by-step
    agreement with vLLM's hybrid coordinator is tests/test_vllm_differential.py's): a long prompt
    holds every block in the full group and about the window in the sliding one."""
    from kvengine.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from kvengine.engine.llm_engine import LLMEngine
    from kvengine.core.request import SamplingParams

    engine = LLMEngine(EngineConfig(max_model_len=8192, max_num_batched_tokens=8192), preset("gemma-2-9b"),
                       device_preset("h100-80gb"))
    assert isinstance(engine.kv, HybridKVCacheManager)
    engine.add_request("long", list(range(100, 8100)), SamplingParams(max_tokens=4))

    def held() -> dict:
        null = engine.kv.pool.null_block
        return {kind: sum(b is not null for b in table["long"]) for kind, table in zip(engine.kv.kinds, engine.kv.tables)}

    engine.step()  # the whole prompt in one chunk: the window's group holds it all while in flight
    assert held() == {"full": 500, "sliding": 500}
    engine.step()  # the first decode: blocks wholly before the window (8,000 - 4,096 + 1 tokens) are freed
    assert held() == {"full": 501, "sliding": 501 - (8000 - 4096 + 1) // 16}


def test_search_chooses_tensor_parallelism_and_replicas_for_the_gpus_given(tmp_path, capsys):
    """--gpus 8: TP among 8's divisors, 8 / TP replicas sharing the traffic; TP 1 cannot hold a 70B model
    on one H100, and the report says what the replicas assume."""
    import importlib.resources

    from kvtune.cli import main

    trace = tmp_path / "t.jsonl"
    lines = (importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl").read_text().splitlines()
    trace.write_text("\n".join(lines[:60]) + "\n")
    common = ["search", "--workload", str(trace), "--preset", "llama-3.1-70b", "--device", "h100-80gb",
              "--gpus", "8", "--max-model-len", "8192", "--db", f"sqlite:///{tmp_path}/k.db"]
    code = main([*common, "--target", "none", "--trials", "8", "--seed", "3", "--space", "tensor_parallel_size=1,2,8",
                 "--report-dir", str(tmp_path / "report"), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert rows and all(r[5] in ("2", "8") for r in rows)  # TP 1 never fits: its trials failed
    from kvtune.search.report_data import load_report_data
    study = json.loads(out.strip().splitlines()[-1])["study"]
    assert load_report_data(f"sqlite:///{tmp_path}/k.db", study).info.gpus == 8  # the replicas the figures assume
    report = (tmp_path / "report" / "report.md").read_text()
    assert "8 GPUs" in report and "8 / TP" in report  # and the report says so
    assert main([*common, "--target", "engine", "--trials", "2"]) == 2  # a live run cannot serve the layouts
    assert "--gpus compares replica layouts on the simulator only" in capsys.readouterr().err


def test_a_profile_carries_the_served_model_and_server_into_the_simulator(tmp_path, capsys):
    """A profile fitted on a checkpoint no preset describes keeps its shape; `run --target sim --profile`
    then simulates that server's block size, max_num_seqs, max_model_len and pool, not the presets'."""
    from kvengine.executor.cost import CostCoefficients
    from kvengine.model.hf_config import model_spec_from_config_path
    from kvtune.calibrate import CalibrationProfile, save_profile
    from kvtune.cli import main
    from kvtune.workload import TraceRequest, Workload, write_workload
    from vllm_sizing import family_dir

    model = model_spec_from_config_path(family_dir("qwen3"))
    db = f"sqlite:///{tmp_path}/p.db"
    save_profile(db, CalibrationProfile(
        name="cpu-qwen3", model=model.name, model_spec=dataclasses.asdict(model), device="cpu",
        coefficients=CostCoefficients(), target="vllm",
        server={"block_size": 128, "num_gpu_blocks": 40, "max_model_len": 2048, "config": {"max_num_seqs": 64}}))
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(i * 0.1, 300, 20) for i in range(10)]), str(trace))
    assert main(["run", "--target", "sim", "--profile", "cpu-qwen3", "--workload", str(trace), "--db", db,
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert "sim: qwen3 on cpu, block_size 128" in out and "max_num_seqs 64" in out
    from kvtune.store import Store
    [run] = Store(db).list_runs()
    stored = Store(db).load_run(run.id).config
    assert (stored["num_gpu_blocks_override"], stored["max_model_len"]) == (40, 2048)


def test_a_running_servers_model_is_read_from_its_v1_models_id(tmp_path, capsys):
    """A URL target whose /v1/models id is a folder on this host (vLLM serving a local checkpoint):
    its config.json is the simulated model; an id kvtune cannot read leaves a note, not a silent default."""
    import argparse
    import shutil

    from kvtune.cli.target import simulated_model
    from serverproc import ServerProcess
    from vllm_sizing import family_dir

    served = tmp_path / "qwen3-served"
    shutil.copytree(family_dir("qwen3"), served)
    server = ServerProcess("--executor", "sim", "--hf-config", str(served), "--device", "cpu",
                           "--served-model-name", str(served))
    try:
        args = argparse.Namespace(target=server.url, preset=None, model=None)
        assert simulated_model(args, "llama-3-8b") == str(served)
    finally:
        server.stop()
    other = ServerProcess("--executor", "sim", "--preset", "tiny", "--device", "cpu", "--served-model-name", "tiny")
    try:
        assert simulated_model(argparse.Namespace(target=other.url, preset=None, model=None), "llama-3-8b") == \
            "llama-3-8b"
        err = capsys.readouterr().err
        assert "note:" in err and "llama-3-8b" in err  # the default model, named in a note
    finally:
        other.stop()


def test_tensor_parallelism_on_the_torch_executor_is_refused_before_anything_starts(tmp_path, capsys):
    import importlib.resources

    from kvtune.cli import main

    trace = importlib.resources.files("kvtune") / "data" / "demo_traces.jsonl"
    db = tmp_path / "k.db"
    assert main(["run", "--target", "engine", "--workload", str(trace), "--head", "3", "--tensor-parallel-size", "2",
                 "--db", f"sqlite:///{db}"]) == 2
    assert "torch executor) runs one device: --tensor-parallel-size 2" in capsys.readouterr().err
    assert not db.exists()
