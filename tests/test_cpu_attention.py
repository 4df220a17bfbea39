"""The CPU decode-attention kernel against the torch path it replaces.

The kernel reads K/V in place through block tables; the torch path gathers
them into a padded batch and masks the padding. Same numbers to float32
tolerance on every instantiated shape, ragged lengths, block sizes and sliding
windows; the engine gives the same greedy tokens either way; without a
compiler the model keeps the torch path and says why.
"""
import pytest
import torch
from kvengine import cpu_attention
from kvengine.clock import VirtualClock
from kvengine.config import EngineConfig
from kvengine.kv_cache import PagedKVCache
from kvengine.model import decode_bias
from kvengine.request import SamplingParams
from kvengine.torch_executor import build_torch_engine

kernel = cpu_attention.load()
needs_kernel = pytest.mark.skipif(
    kernel is None, reason=f"no CPU kernel here: {cpu_attention.unavailable_reason()}")


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


def _greedy_tokens(**config):
    engine = build_torch_engine(EngineConfig(**config), preset="tiny", seed=3, clock=VirtualClock())
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
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "0")
    engine, without = _greedy_tokens(block_size=8)
    assert engine.executor.model.decode_kernel is None
    assert with_kernel == without


def test_no_compiler_keeps_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("KVENGINE_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_attention.load() is None
    assert "no C++ compiler" in cpu_attention.unavailable_reason()
    engine, tokens = _greedy_tokens()
    assert engine.executor.model.decode_kernel is None and all(len(t) == 12 for t in tokens)


def test_a_broken_build_keeps_the_torch_path(monkeypatch, tmp_path):
    source = tmp_path / "paged_attention.cpp"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(cpu_attention, "SOURCE", source)
    monkeypatch.setenv("KVENGINE_CACHE_DIR", str(tmp_path / "cache"))
    if cpu_attention.shutil.which("g++") is None:
        pytest.skip("no g++ here")
    assert cpu_attention.load() is None
    assert "failed" in cpu_attention.unavailable_reason()
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left to load
