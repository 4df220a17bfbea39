"""The torch executor against Hugging Face transformers on the same weights.

Greedy tokens must be exactly transformers' generate() (float32, CPU) whatever
the engine does on the way: batching requests of different lengths, chunked
prefill in mixed batches, prefix-cache hits, preemption and recompute, the
contiguous allocator. Logits agree to float32 tolerance.
"""
from types import SimpleNamespace

import pytest
import torch
from hfmodels import hf_greedy, hf_logits, random_prompts, save_checkpoint
from kvengine.engine.clock import VirtualClock
from kvengine.config import EngineConfig
from kvengine.model.hf import CheckpointError, model_spec_from_hf
from kvengine.core.request import SamplingParams
from kvengine.engine.torch_engine import build_torch_engine

N = 24  # generated tokens per request
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def engine_for(path, **config):
    return build_torch_engine(EngineConfig(**config), model_path=str(path), clock=VirtualClock())


def generate(engine, prompts, sp=GREEDY):
    reqs = [engine.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = save_checkpoint(path)
    prompts = random_prompts((5, 17, 33, 40))
    return SimpleNamespace(path=path, model=model, prompts=prompts,
                           refs=[hf_greedy(model, p, N) for p in prompts])


def test_batched_requests_of_different_lengths_match_hf(llama):
    e = engine_for(llama.path)
    assert generate(e, llama.prompts) == llama.refs
    assert max(e.steps.num_seqs) == len(llama.prompts)  # all four ran in one batch


def test_chunked_prefill_in_mixed_batches_matches_hf(llama):
    e = engine_for(llama.path, max_num_batched_tokens=16, max_num_seqs=4)
    assert generate(e, llama.prompts) == llama.refs
    assert max(e.steps.num_tokens) <= 16
    mixed = [n for n, s in zip(e.steps.num_tokens, e.steps.num_seqs) if s > 1 and n > s]
    assert mixed, "no step mixed a prefill chunk with decodes"


def test_prefix_cache_hits_match_hf(llama):
    shared = random_prompts((40,), seed=5)[0]
    prompts = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    refs = [hf_greedy(llama.model, p, N) for p in prompts]
    e = engine_for(llama.path, block_size=8)
    first = e.add_request("a", prompts[0], GREEDY)
    e.step()  # the first prompt's full blocks are computed and cached
    second = e.add_request("b", prompts[1], GREEDY)
    while e.has_unfinished():
        e.step()
    assert second.num_cached_tokens == 40  # five full blocks of 8 served from the cache
    assert [first.output_token_ids, second.output_token_ids] == refs


def test_preemption_and_recompute_match_hf(llama):
    e = engine_for(llama.path, block_size=8, num_gpu_blocks_override=10, max_model_len=64,
                   max_num_batched_tokens=32, max_num_seqs=4)
    assert generate(e, llama.prompts) == llama.refs
    assert e.num_preemptions > 0


def test_contiguous_allocator_matches_hf(llama):
    e = engine_for(llama.path, kv_allocator="contiguous", max_model_len=128)
    assert generate(e, llama.prompts) == llama.refs


def test_logits_match_hf_to_float32_tolerance(llama):
    e = engine_for(llama.path, max_num_batched_tokens=16, max_num_seqs=4)
    seen: dict[str, list[torch.Tensor]] = {}
    e.executor.logits_hook = lambda reqs, logits: [
        seen.setdefault(r.request_id, []).append(row.clone()) for r, row in zip(reqs, logits)]
    outs = generate(e, llama.prompts)
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(llama.prompts, outs)):
        ours = torch.stack(seen[f"r{i}"])  # logits of each sampled position
        ref = hf_logits(llama.model, prompt + out[:-1])[len(prompt) - 1:]
        worst = max(worst, (ours - ref).abs().max().item())
    print(f"\nmax |logit - HF logit| over {sum(map(len, outs))} positions: {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("kind,overrides", [
    ("qwen2", {}),  # q/k/v biases
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True}),  # q/k/v and o biases
    ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 128}}),
    ("mistral", {"sliding_window": 12}),
])
def test_architectures_match_hf(tmp_path, kind, overrides):
    model = save_checkpoint(tmp_path, kind, seed=3, **overrides)
    prompts = random_prompts((9, 30), seed=4)
    refs = [hf_greedy(model, p, 16) for p in prompts]
    e = engine_for(tmp_path, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    assert e.model.architecture == kind
    assert generate(e, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) == refs


def test_sliding_window_is_applied(tmp_path):
    """The window changes the tokens (else the test above proves nothing about it)."""
    windowed = save_checkpoint(tmp_path / "w", "mistral", seed=3, sliding_window=12)
    full = save_checkpoint(tmp_path / "f", "mistral", seed=3, sliding_window=None)
    prompt = random_prompts((30,), seed=4)[0]
    assert hf_greedy(windowed, prompt, 16) != hf_greedy(full, prompt, 16)


def test_sharded_checkpoint_loads(tmp_path):
    model = save_checkpoint(tmp_path, seed=1, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompt = random_prompts((12,), seed=2)[0]
    assert generate(engine_for(tmp_path), [prompt]) == [hf_greedy(model, prompt, N)]


def test_model_spec_from_hf_reads_config(tmp_path):
    save_checkpoint(tmp_path, "qwen2", tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-5,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 128})
    spec = model_spec_from_hf(tmp_path)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.vocab_size) == (2, 64, 4, 2, 16, 128, 512)
    assert spec.architecture == "qwen2" and spec.qkv_bias and spec.tie_word_embeddings
    assert spec.rope_theta == 1e6 and spec.rms_norm_eps == 1e-5 and spec.dtype == "float32"
    assert spec.rope_scaling_dict["rope_type"] == "yarn" and spec.rope_scaling_dict["factor"] == 4.0
    assert (spec.bos_token_id, spec.eos_token_id) == (1, 2)
    hash(spec)  # stays a frozen, hashable spec


def test_model_spec_from_older_config_json(tmp_path):
    """transformers 4.x spelling: rope_theta and rope_scaling {"type": ...}, torch_dtype,
    an eos list (Llama 3.1)."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 1, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16", "eos_token_id": [128001, 128009], "bos_token_id": 128000}))
    spec = model_spec_from_hf(tmp_path)
    assert spec.head_dim == 32 and spec.num_kv_heads == 1 and spec.dtype == "bfloat16"
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert spec.eos_token_id == 128001 and not spec.qkv_bias


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="never downloads"):
        model_spec_from_hf(tmp_path / "meta-llama/Llama-3-8B")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'gpt2' .* not a family kvtune models"):
        model_spec_from_hf(tmp_path)
