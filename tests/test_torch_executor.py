"""TorchExecutor: KV bytes as memory.py predicts them, sampling, devices,
the greedy head, and build_torch_engine's wiring."""
import dataclasses
import json

import pytest
import torch
from kvengine.engine.clock import VirtualClock
from kvengine.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, GiB, ModelSpec
from kvengine.engine.llm_engine import LLMEngine
from kvengine.model.kv_cache import PagedKVCache
from kvengine.core.memory import activation_peak_bytes, kv_bytes_per_block
from kvengine.model.llama import GreedyHead, LlamaModel, random_state_dict
from kvengine.core.request import SamplingParams
from kvengine.model.sampling import Sampler, apply_top_k_top_p
from kvengine.model.tokenizer import ByteTokenizer, HFTokenizer
from kvengine.engine.torch_engine import build_torch_engine
from kvengine.executor.torch_executor import (
    TorchExecutor,
    resolve_device,
    set_num_threads,
    torch_device_spec,
)

SMALL = ModelSpec("small", 2, 64, 4, 2, 16, 128, 512, 512, dtype="float32")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def small_engine(spec=SMALL, seed=0, device_memory=320 << 20, **config) -> LLMEngine:
    model = LlamaModel(spec, random_state_dict(spec, seed))
    return LLMEngine(EngineConfig(**config), spec, torch_device_spec("cpu", device_memory),
                     executor=TorchExecutor(model, ByteTokenizer(spec.vocab_size), seed=seed),
                     clock=VirtualClock())


def run(engine, prompts, sp):
    reqs = [engine.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 50)), [300] * 11]


# -- memory: predicted bytes == allocated bytes ----------------------------------------
@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_kv_bytes_per_block_is_what_the_executor_allocates(dtype, block_size):
    e = small_engine(kv_cache_dtype=dtype, block_size=block_size, max_model_len=256)
    ex, blocks = e.executor, e.memory.num_gpu_blocks
    assert e.memory.block_bytes == kv_bytes_per_block(SMALL, dtype, block_size)
    assert ex.kv_cache_bytes == blocks * kv_bytes_per_block(SMALL, dtype, block_size)
    per_token_scales = 0 if dtype == "auto" else 2 * SMALL.num_layers * SMALL.num_kv_heads * 4
    assert ex.kv_scale_bytes == blocks * block_size * per_token_scales
    assert ex.cache.data.element_size() == (4 if dtype == "auto" else 1)
    assert ex.cache.num_blocks == blocks == e.kv.pool.num_blocks


def test_bf16_model_auto_cache_is_two_bytes(monkeypatch):
    spec = dataclasses.replace(SMALL, dtype="bfloat16")
    e = small_engine(spec, num_gpu_blocks_override=20, max_model_len=128)
    assert e.executor.cache.data.dtype == torch.bfloat16
    assert e.executor.kv_cache_bytes == 20 * kv_bytes_per_block(spec, "auto", 16)
    out = run(e, PROMPTS[:1], GREEDY)
    assert len(out[0]) == 12


def test_device_memory_budget_sizes_the_pool_on_cpu():
    small, big = small_engine(device_memory=400 << 20), small_engine(device_memory=600 << 20)
    assert big.memory.num_gpu_blocks > small.memory.num_gpu_blocks
    assert small.memory.total_bytes == 400 << 20
    assert small.executor.kv_cache_bytes == small.memory.num_gpu_blocks * small.memory.block_bytes
    assert torch_device_spec("cpu").memory_bytes == 2 * GiB


def test_cpu_activation_profile_is_the_memory_estimate():
    e = small_engine(max_num_batched_tokens=512, max_num_seqs=8)
    assert e.memory.activation_bytes == activation_peak_bytes(SMALL, 512, 8)


# -- devices -----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_auto_selects_cpu_without_cuda():
    assert resolve_device("auto") == "cpu"
    assert resolve_device(None) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "h100-80gb"])
def test_cuda_without_a_gpu_is_a_clear_config_error(device):
    with pytest.raises(ConfigError) as err:
        build_torch_engine(EngineConfig(), preset="tiny", device=device)
    msg = str(err.value)
    assert "CUDA is not available" in msg and "--device cpu" in msg
    assert err.traceback[-1].path.name == "torch_executor.py"  # kvengine's check, not torch's


def test_unknown_device_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu, cuda, cuda:N or auto"):
        resolve_device("tpu")


def test_num_threads_default_is_one(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("KVENGINE_NUM_THREADS", raising=False)
        assert set_num_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("KVENGINE_NUM_THREADS", "2")
        assert set_num_threads() == 2 and torch.get_num_threads() == 2
        assert set_num_threads(1) == 1
    finally:
        torch.set_num_threads(before)


# -- the execute contract -----------------------------------------------------------------
def test_chunked_prefill_samples_only_at_the_end_of_the_prompt():
    e = small_engine(max_num_batched_tokens=8, max_num_seqs=2)
    req = e.add_request("a", list(range(10, 30)), GREEDY)  # 20 tokens: chunks of 8, 8, 4
    e.step()
    e.step()
    assert req.num_output_tokens == 0 and req.num_computed_tokens == 16
    e.step()
    assert req.num_output_tokens == 1 and e.steps.duration[-1] > 0


def test_block_tables_come_from_the_scheduler_outputs_and_match_the_kv_managers():
    """Preempted, resumed, prefix hits, finished: the executor's tables (built from the outputs'
    block ids alone) are the KV manager's, and finished requests' go."""
    e = small_engine(block_size=8, num_gpu_blocks_override=9, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
                     enable_prefix_caching=True)
    prompts = [[7] * 16 + list(range(40 + 9 * i, 49 + 9 * i)) for i in range(4)]  # 16 shared tokens
    reqs = [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    while e.has_unfinished():
        e.step()
        for r in e.scheduler.running:
            assert e.executor.block_tables[r.request_id] == e.kv.get_block_ids(r.request_id)
    assert e.num_preemptions and e.kv.prefix_stats.hits
    assert all(len(r.output_token_ids) == 12 for r in reqs)
    e.add_request("last", [5, 6, 7], dataclasses.replace(GREEDY, max_tokens=1))
    e.step()
    assert set(e.executor.block_tables) == {"last"}  # the others' ended with the step before


@pytest.mark.parametrize("dtype", ["auto", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_cache_write_then_gather_round_trips(dtype):
    cache = PagedKVCache(2, 6, 4, 2, 8, dtype, torch.float32)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([4, 5, 6, 7, 12])  # block 1 whole, block 3 slot 0
    cache.zero_fresh_blocks(slots)
    cache.write(1, k, v, slots)
    gk, gv = cache.gather(1, torch.tensor([1, 3]))
    got_k = torch.cat([gk[:, :4], gk[:, 4:5]], dim=1).transpose(0, 1)
    got_v = torch.cat([gv[:, :4], gv[:, 4:5]], dim=1).transpose(0, 1)
    tol = {"auto": 0, "int8": 1 / 127, "fp8_e4m3": 1 / 16, "fp8_e5m2": 1 / 8}[dtype]
    for got, ref in ((got_k, k), (got_v, v)):
        err = (got - ref).abs() / ref.abs().amax(-1, keepdim=True)  # relative to the head's amax
        assert err.max() <= tol + 1e-7
    assert torch.equal(gk[:, 5:], torch.zeros_like(gk[:, 5:]))  # rest of a fresh block: zeros


# -- sampling --------------------------------------------------------------------------------
def test_seeded_sampling_is_deterministic_and_independent_of_the_batch():
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run(small_engine(), [PROMPTS[1]], sp)[0]
    crowd = small_engine()
    others = [crowd.add_request(f"o{i}", p, SamplingParams(max_tokens=6, temperature=0.9))
              for i, p in enumerate(PROMPTS)]
    assert run(crowd, [PROMPTS[1]], sp)[0] == alone
    assert all(o.num_output_tokens == 6 for o in others)


def test_top_k_one_and_tiny_top_p_are_greedy():
    greedy = run(small_engine(), PROMPTS, GREEDY)
    top_k = run(small_engine(), PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, top_k=1,
                                                        ignore_eos=True))
    top_p = run(small_engine(), PROMPTS, SamplingParams(max_tokens=12, temperature=1.5,
                                                        top_p=1e-6, ignore_eos=True))
    assert top_k == greedy and top_p == greedy


def test_temperature_varies_across_seeds():
    outs = {tuple(run(small_engine(), [PROMPTS[0]],
                      SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True))[0])
            for s in range(4)}
    assert len(outs) == 4


def test_unseeded_sampling_follows_the_engine_seed():
    sp = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    assert run(small_engine(seed=5), PROMPTS, sp) == run(small_engine(seed=5), PROMPTS, sp)
    assert run(small_engine(seed=5), PROMPTS, sp) != run(small_engine(seed=6), PROMPTS, sp)


def test_sampled_frequencies_follow_the_distribution():
    from kvengine.core.request import Request

    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)

    def draw(**kw):
        reqs = [Request(f"r{i}", [1], SamplingParams(**kw)) for i in range(len(logits))]
        return torch.bincount(torch.tensor(Sampler(seed=0).sample(logits.clone(), reqs)),
                              minlength=3) / len(logits)

    assert torch.allclose(draw(temperature=1.0), torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    hot = draw(temperature=2.0)  # flatter: p ~ sqrt(p)
    flat = torch.tensor([0.6, 0.3, 0.1]).sqrt()
    assert torch.allclose(hot, flat / flat.sum(), atol=0.03)
    assert draw(temperature=1.0, top_k=2)[2] == 0
    assert draw(temperature=1.0, top_p=0.5).tolist() == [1.0, 0.0, 0.0]
    top_p = draw(temperature=1.0, top_p=0.8)
    assert top_p[2] == 0 and abs(top_p[0] - 2 / 3) < 0.03


def test_top_k_top_p_masks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 0]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1e-9, 0.5]))
    assert (~torch.isinf(out)).sum(1).tolist() == [1, 1]


# -- the greedy head: exact argmax through a bf16 screen ---------------------------------------
needs_screen = pytest.mark.skipif(
    not GreedyHead.available(torch.device("cpu"), torch.float32, "onednn"),
    reason="no oneDNN bf16 on this CPU: the screen is off and plain float32 logits are used")


def _full(w):
    return lambda x: x @ w.t()


@needs_screen
@pytest.mark.parametrize("vocab", [32000, 1000])
def test_greedy_head_equals_float32_argmax(vocab):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, 64, generator=g) * 0.02
    x = torch.randn(200, 64, generator=g)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    head = GreedyHead(w)
    assert torch.equal(head.argmax(x, _full(w)), (x @ w.t()).argmax(-1))


@needs_screen
def test_greedy_head_ties_and_near_ties():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2000, 64, generator=g) * 0.02
    x = torch.randn(3, 64, generator=g)
    best = int((x[0] @ w.t()).argmax())
    w[1500] = w[best]  # an exact tie: the lower id wins, as torch.argmax
    w[700] = w[best] + 1e-4 * x[0] / x[0].norm()  # ahead by ~1e-4 * |x|: invisible in bf16
    head = GreedyHead(w)
    got = head.argmax(x, _full(w))
    assert got[0].item() == 700 == int((x[0] @ w.t()).argmax())
    assert torch.equal(got, (x @ w.t()).argmax(-1))


@needs_screen
def test_greedy_head_flat_logits_fall_back():
    w = torch.ones(1000, 16) * 0.01  # every logit equal: all candidates
    x = torch.randn(4, 16)
    assert GreedyHead(w).argmax(x, _full(w)).tolist() == [0, 0, 0, 0]


def test_greedy_screen_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KVENGINE_GREEDY_SCREEN", "0")
    assert LlamaModel(SMALL, random_state_dict(SMALL)).greedy_head is None


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_greedy_tokens_equal_argmax_of_logits(monkeypatch, backend):
    monkeypatch.setenv("KVENGINE_LINEAR_BACKEND", backend)
    spec = dataclasses.replace(SMALL, vocab_size=32000)
    model = LlamaModel(spec, random_state_dict(spec, 3))
    hidden = torch.randn(64, 64) * 3
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(-1))


# -- build_torch_engine ------------------------------------------------------------------------
def test_build_torch_engine_tiny_preset_runs_text():
    e = build_torch_engine(EngineConfig(num_gpu_blocks_override=64, max_model_len=256),
                           preset="tiny", seed=1, clock=VirtualClock())
    tok = e.executor.tokenizer
    assert isinstance(tok, ByteTokenizer) and e.eos_token_id == tok.eos_token_id == 2
    assert e.model.name == "tiny" and e.executor.model.dtype == torch.float32
    req = e.add_request("a", tok.encode("Hello, paged world"), GREEDY)
    while e.has_unfinished():
        e.step()
    assert req.num_output_tokens == 12 and isinstance(tok.decode(req.output_token_ids), str)
    assert torch.get_num_threads() == 1


def test_build_torch_engine_uses_the_folders_tokenizer(tmp_path):
    from hfmodels import save_checkpoint
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_checkpoint(tmp_path, eos_token_id=3)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<eos>", "hello", "world"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    e = build_torch_engine(EngineConfig(), model_path=str(tmp_path), dtype="bfloat16",
                           device_memory=512 << 20, clock=VirtualClock())
    tok = e.executor.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 5]) == "hello world"
    assert e.eos_token_id == 3 and e.model.dtype == "bfloat16"
    assert e.executor.cache.data.dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 3


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decoding_is_exact_for_every_byte(dtype):
    cache = PagedKVCache(1, 2, 64, 1, 4, dtype, torch.float32)
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(cache.dtype).float()
    values, factor = cache._to_float(codes)
    finite = torch.isfinite(ref)
    if dtype == "fp8_e4m3":
        finite &= ref.abs() <= 448  # 0x7f/0xff are NaN: never written
    assert torch.equal((values * factor)[finite], ref[finite])


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_profile_run_covers_the_token_budget(dtype):
    """The dummy batch the CUDA profile measures, run here on the CPU."""
    e = small_engine(kv_cache_dtype=dtype, max_num_batched_tokens=100, max_num_seqs=8,
                     max_model_len=128)
    ex = e.executor
    assert sum(ex._profile_sequences(e.config)) == 100 and len(ex._profile_sequences(e.config)) == 8
    logits = ex.profile_run(e.config, ex._profile_cache(e.config))
    assert logits.shape == (8, SMALL.vocab_size) and torch.isfinite(logits).all()


def test_cuda_device_spec_takes_the_real_gpu_memory(monkeypatch):
    """What torch reports about the GPU becomes the DeviceSpec the pool is sized from
    (torch's CUDA queries stubbed: this machine has none)."""
    from types import SimpleNamespace

    from kvengine.config import DEVICE_PRESETS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(name="NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (120 * GiB, 141 * GiB))
    spec = torch_device_spec("cuda")
    assert (spec.name, spec.memory_bytes, spec.large_memory) == ("NVIDIA H200", 141 * GiB, True)
    assert spec.hbm_bandwidth == DEVICE_PRESETS["h200-141gb"].hbm_bandwidth
    assert torch_device_spec("cuda", device_memory=40 * GiB).memory_bytes == 40 * GiB
    with pytest.raises(ConfigError, match="only 1 GPU"):
        resolve_device("cuda:1")
