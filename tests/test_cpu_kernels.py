"""kvengine's CPU kernels against the torch paths they replace.

Decode attention reads K/V in place through block tables; the torch path
gathers them into a padded batch and masks the padding. Same numbers to
float32 tolerance on every instantiated shape, ragged lengths, block sizes and
sliding windows. The int8 greedy head gives exactly torch.argmax of the
float32 logits, ties and near-ties included. The engine gives the same greedy
tokens with and without the kernels; without a compiler, or with a source
that does not build, the model keeps the torch paths and says why.
"""
import pytest
import torch
from kvengine.model import cpu_kernels
from kvengine.engine.clock import VirtualClock
from kvengine.config import EngineConfig
from kvengine.model.kv_cache import PagedKVCache
from kvengine.model.llama import Int8GreedyHead, decode_bias
from kvengine.core.request import SamplingParams
from kvengine.engine.torch_engine import build_torch_engine

kernels = cpu_kernels.load()
kernel = kernels.attention if kernels else None
needs_kernel = pytest.mark.skipif(
    kernel is None, reason=f"no CPU kernels here: {cpu_kernels.unavailable_reason()}")
needs_vnni = pytest.mark.skipif(kernels is None or kernels.greedy is None,
                                reason="no AVX-512 VNNI here: the bf16 screen is used")


def torch_decode(q, cache, tables, lens, window, scale):
    """model.Attention._decode's gathering path, restated."""
    D, H, d = q.shape
    hkv = cache.num_kv_heads
    k, v = cache.gather(0, tables.view(-1))
    k, v = k.view(hkv, D, -1, d), v.view(hkv, D, -1, d)
    bias = decode_bias(lens, tables.shape[1] * cache.block_size, window, torch.float32)
    qh = q.view(D, hkv, H // hkv, d).transpose(0, 1)
    probs = torch.softmax(qh @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return (probs @ v).transpose(0, 1).reshape(D, H, d)


def random_batch(lens, hkv, d, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    num_blocks = 1 + len(lens) * width
    cache = PagedKVCache(1, num_blocks, block_size, hkv, d, "auto", torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).view(len(lens), width)
    tables = torch.stack([torch.where(torch.arange(width) < -(-n // block_size), row, 0)
                          for row, n in zip(ids, lens)])  # padded with the null block, as _prepare
    return cache, tables, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_kernel_equals_the_gathering_path(d, heads, kv_heads, block_size):
    lens = [1, 3, 4, 5, 17, 64, 100]  # under, at and past the 4-token tile; ragged
    cache, tables, lens_t = random_batch(lens, kv_heads, d, block_size, seed=d + heads + block_size)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    got = kernel(q, *cache.layer_kv(0), tables, lens_t, None, scale)
    want = torch_decode(q, cache, tables, lens_t, None, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("d,heads,kv_heads", [(16, 4, 4), (32, 8, 2), (64, 16, 2), (128, 8, 1)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_bf16_kernel_is_float32_attention_over_the_bf16_values(d, heads, kv_heads, block_size):
    """bfloat16 K/V are widened exactly: the result is float32 attention over the same values."""
    lens = [1, 3, 5, 17, 100]
    cache, tables, lens_t = random_batch(lens, kv_heads, d, block_size, seed=d + block_size)
    cache.data.copy_(cache.data.to(torch.bfloat16))  # float32 holding bf16 values
    k16, v16 = (t.to(torch.bfloat16).contiguous() for t in cache.layer_kv(0))
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(2))
    got = kernel(q, k16, v16, tables, lens_t, None, d ** -0.5)
    assert got.dtype == torch.float32
    want = torch_decode(q, cache, tables, lens_t, None, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_refuses_mixed_or_other_dtypes():
    cache, tables, lens = random_batch([5], 2, 32, 8, seed=0)
    k, v = cache.layer_kv(0)
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel(q, k.half(), v.half(), tables, lens, None, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel(q, k.to(torch.bfloat16), v, tables, lens, None, 1.0)
    with pytest.raises(ValueError, match="float32 query"):
        kernel(q.to(torch.bfloat16), k, v, tables, lens, None, 1.0)


@needs_kernel
@pytest.mark.parametrize("window", [1, 4, 7, 16, 1000])
def test_kernel_sliding_window(window):
    lens = [2, 9, 16, 33, 50]
    cache, tables, lens_t = random_batch(lens, 2, 32, 8, seed=window)
    q = torch.randn(len(lens), 8, 32)
    got = kernel(q, *cache.layer_kv(0), tables, lens_t, window, 0.2)
    want = torch_decode(q, cache, tables, lens_t, window, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_refuses_shapes_it_was_not_built_for():
    assert not kernel.supports(48, 2) and not kernel.supports(32, 3)
    cache, tables, lens = random_batch([5], 1, 48, 8, seed=0)
    with pytest.raises(ValueError, match="head_dim 48"):
        kernel(torch.randn(1, 2, 48), *cache.layer_kv(0), tables, lens, None, 1.0)


def _greedy_tokens(dtype=None, **config):
    engine = build_torch_engine(EngineConfig(**config), preset="tiny", seed=3, clock=VirtualClock(),
                                dtype=dtype)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", torch.randint(3, 32000, (n,), generator=g).tolist(), sp)
            for i, n in enumerate((5, 40, 77, 130))]
    while engine.has_unfinished():
        engine.step()
    return engine, [r.output_token_ids for r in reqs]


@needs_kernel
def test_engine_tokens_equal_with_and_without_the_kernel(monkeypatch):
    engine, with_kernel = _greedy_tokens(block_size=8)
    assert engine.executor.model.decode_kernel is not None
    assert isinstance(engine.executor.model.greedy_head, Int8GreedyHead) or kernels.greedy is None
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    engine, without = _greedy_tokens(block_size=8)
    assert engine.executor.model.decode_kernel is None
    assert not isinstance(engine.executor.model.greedy_head, Int8GreedyHead)
    assert with_kernel == without


def test_no_compiler_keeps_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("KVENGINE_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.load() is None
    assert "no C++ compiler" in cpu_kernels.unavailable_reason()
    engine, tokens = _greedy_tokens()
    assert engine.executor.model.decode_kernel is None and all(len(t) == 12 for t in tokens)


def test_a_broken_build_keeps_the_torch_path(monkeypatch, tmp_path):
    source = tmp_path / "paged_attention.cpp"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "SOURCES", [source])
    monkeypatch.setenv("KVENGINE_CACHE_DIR", str(tmp_path / "cache"))
    if cpu_kernels.shutil.which("g++") is None:
        pytest.skip("no g++ here")
    assert cpu_kernels.load() is None
    assert "failed" in cpu_kernels.unavailable_reason()
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left to load


# -- the int8 greedy head ---------------------------------------------------------------
def _full(w):
    return lambda x: x @ w.t()


def _normed(rows, k, seed):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


@needs_vnni
@pytest.mark.parametrize("vocab,k", [(32000, 256), (1000, 64), (999, 30), (70, 16)])
def test_int8_head_equals_float32_argmax(vocab, k):
    w = torch.randn(vocab, k, generator=torch.Generator().manual_seed(vocab)) * 0.02
    x = _normed(67, k, seed=k)  # not a multiple of the kernel's 3-row tile
    head = Int8GreedyHead(w, kernels.greedy)
    assert torch.equal(head.argmax(x, _full(w)), (x @ w.t()).argmax(-1))


@needs_vnni
def test_int8_head_ties_near_ties_and_the_last_padded_chunk():
    w = torch.randn(2000, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    x = _normed(3, 64, seed=2)
    best = int((x[0] @ w.t()).argmax())
    w[1500] = w[best]  # an exact tie: the lower id wins, as torch.argmax
    w[700] = w[best] + 1e-4 * x[0] / x[0].norm()  # ahead by ~1e-4 * |x|: invisible in int8
    toward_1 = x[1] / x[1].norm() - x[0] / x[0].norm()  # up for row 1, down for row 0
    w[1999] = 3 * toward_1 / toward_1.norm()  # row 1's winner, in the padded last chunk
    head = Int8GreedyHead(w, kernels.greedy)
    got = head.argmax(x, _full(w))
    assert got[0].item() == 700 and got[1].item() == 1999
    assert torch.equal(got, (x @ w.t()).argmax(-1))


@needs_vnni
def test_int8_head_negative_logits_never_pick_padding():
    w = -torch.rand(100, 32, generator=torch.Generator().manual_seed(3)) - 0.5
    x = torch.rand(4, 32, generator=torch.Generator().manual_seed(4)) + 0.1  # every logit < 0
    head = Int8GreedyHead(w, kernels.greedy)
    assert torch.equal(head.argmax(x, _full(w)), (x @ w.t()).argmax(-1))


@needs_vnni
def test_int8_head_flat_rows_are_computed_in_full():
    w = torch.ones(1000, 16) * 0.01  # every logit equal: all candidates
    calls = []

    def full(rows):
        calls.append(rows.shape[0])
        return rows @ w.t()
    x = torch.randn(4, 16)
    assert Int8GreedyHead(w, kernels.greedy).argmax(x, full).tolist() == [0, 0, 0, 0]
    assert calls == [4]


@needs_kernel
def test_bf16_engine_decodes_through_the_kernel_and_stays_near_the_torch_path(monkeypatch):
    """bf16 decode rows go through the kernel (float32 arithmetic, as vLLM's CPU attention); the
    torch path rounds scores and probabilities to bf16, so tokens may part at near-ties only."""
    engine, with_kernel = _greedy_tokens("bfloat16", block_size=8)
    assert engine.executor.model.decode_kernel is not None
    assert engine.executor.model.decodes_in_place(engine.executor.cache)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    engine, without = _greedy_tokens("bfloat16", block_size=8)
    assert engine.executor.model.decode_kernel is None
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for x, y in zip(with_kernel, without))
    assert [len(x) for x in with_kernel] == [12] * 4
    assert same >= 36  # 44 of 48 here: one request parts at a near-tie
    assert all(x[0] == y[0] for x, y in zip(with_kernel, without))  # prefill is the same code
