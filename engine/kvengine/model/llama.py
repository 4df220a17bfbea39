"""A Llama-family decoder in plain torch whose attention reads K/V through block tables.

Llama, Mistral and Qwen2 are one network here: RMSNorm, RoPE (plain, linear,
llama3 or yarn scaling), grouped-query attention, SwiGLU MLP, optional q/k/v
(and o) biases, optional tied embeddings, optional sliding window.

A step runs every scheduled token at once: T tokens flattened into one
[T, hidden] batch with per-token positions (vLLM's and nano-vllm's layout). The
executor orders the rows so the single-token queries (decodes) come first; in
each layer

  1. q, k, v for all T rows; RoPE at each row's position;
  2. k, v go into the paged cache at each row's slot (block_id * block_size + offset);
  3. decode rows: on the CPU (float32 or bfloat16 K/V) the C++ kernel of cpu_kernels.py,
     reading K/V in place through the block tables; elsewhere one batched
     attention over their contexts, gathered from the cache through a padded
     block table, padding masked;
  4. each prefill chunk: attention over its context gathered through its block
     table, causal within the chunk (a first chunk under `auto` uses its fresh
     K/V directly: the same numbers, one gather less).

The same code runs on CPU and CUDA. Weights come as a state dict with Hugging
Face's names (hf.py loads one; `random_state_dict` makes one from a seed).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvengine.model import cpu_kernels
from kvengine.config import ModelSpec
from kvengine.model.kv_cache import PagedKVCache
from kvengine.model.sampling import argmax as _argmax

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this decoder does not implement."""


# -- linear layers -------------------------------------------------------------
try:  # resolved once: every torch.ops attribute access builds a new packet (~40 us)
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):  # a torch built without oneDNN
    _onednn_linear = None


def _onednn_ok(dtype: torch.dtype) -> bool:
    """Can oneDNN pre-pack and run a linear layer of this dtype here?"""
    if _onednn_linear is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype))
        _onednn_linear(torch.ones(2, 4, dtype=dtype), w, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def linear_backend(device: torch.device, dtype: torch.dtype) -> str:
    """`onednn` (pre-packed weights, as vLLM's CPU backend) or `torch` (F.linear).

    oneDNN's pre-packed weights skip the per-call packing MKL's sgemm behind F.linear
    does, which dominates a small model's matmuls on the CPU.
    KVENGINE_LINEAR_BACKEND=torch forces F.linear.
    """
    choice = os.environ.get("KVENGINE_LINEAR_BACKEND", "auto")
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"KVENGINE_LINEAR_BACKEND must be auto, onednn or torch, got {choice!r}")
    if device.type != "cpu" or choice == "torch" or not torch.backends.mkldnn.is_available():
        return "torch"
    return "onednn" if _onednn_ok(dtype) else "torch"


class Linear:
    """y = x W^T + b, W stored [out, in] as in the checkpoint (or packed for oneDNN)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = backend == "onednn"
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return _onednn_linear(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class GreedyHead:
    """Exact greedy tokens from a float32 lm_head at about 2/3 of its cost (CPU, oneDNN bf16).

    With l = x W^T the float32 logits of a row x (K = hidden size):
    1. a = the same product in bf16 (oneDNN: inputs rounded to bf16, float32
       accumulation, output rounded to bf16). Each |a_j - l_j| <= B, where
           B = (3u + 3u^2 + 2 K 2^-24) * 1.02 * ||x|| * max_j ||W_j||,  u = 2^-8:
       2u for the two rounded inputs, u for the rounded output, K 2^-24 for
       each float32 accumulation (a's and l's own), and sum|x_i W_ji| <=
       ||x|| ||W_j|| (Cauchy-Schwarz); 1.02 covers the norms' own rounding.
    2. the argmax j* of l has a_j* >= max(a) - 2B, so only those columns are
       candidates (found through maxima of 256-column chunks: one pass over a);
    3. the candidates' logits again in float32 (x . W_j): the largest wins, the
       lowest id among equals, as torch.argmax.
    Rows with a bound that is not finite, or too many candidates (a very flat
    distribution), take the plain float32 logits. KVENGINE_GREEDY_SCREEN=0
    turns it off. Only greedy rows use it; sampling always sees full logits.
    """

    CHUNK = 256
    MAX_CANDIDATE_CHUNKS = 8  # per row, on average

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, h] float32, dense (the candidates' rows)
        self.vocab = V = weight.shape[0]
        self.padded = -(-V // self.CHUNK) * self.CHUNK  # pad columns read -inf
        pad = weight.new_zeros(self.padded - V, weight.shape[1])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.cat([weight, pad]).to(torch.bfloat16))
        u, k = 2.0 ** -8, weight.shape[1]
        self.bound = (3 * u + 3 * u * u + 2 * k * 2.0 ** -24) * 1.02 * float(weight.norm(dim=1).max())
        self._buffer = torch.empty(0, self.padded)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype, backend: str) -> bool:
        return (device.type == "cpu" and dtype == torch.float32 and backend == "onednn"
                and _onednn_ok(torch.bfloat16))

    def argmax(self, x: torch.Tensor, full_logits) -> torch.Tensor:
        """x: [S, h] float32 normed rows; full_logits(x) is the fallback."""
        S, V, C = x.shape[0], self.vocab, self.CHUNK
        if self._buffer.shape[0] < S:  # reused: a fresh 4 MB tensor per step page-faults
            self._buffer = torch.empty(S, self.padded)
        a = self._buffer[:S].copy_(
            _onednn_linear(x.to(torch.bfloat16), self.packed, None, "none", [], ""))
        if self.padded > V:
            a[:, V:] = float("-inf")
        a = a.view(S, -1, C)
        chunk_max = a.amax(-1)  # [S, chunks]
        thr = chunk_max.amax(-1) - 2 * self.bound * x.norm(dim=1)
        if not bool(torch.isfinite(thr).all()):
            return _argmax(full_logits(x))
        rows, chunks = (chunk_max >= thr[:, None]).nonzero().unbind(1)
        if rows.numel() > self.MAX_CANDIDATE_CHUNKS * S:
            return _argmax(full_logits(x))
        hit, offset = (a[rows, chunks] >= thr[rows, None]).nonzero().unbind(1)
        rows, cols = rows[hit], chunks[hit] * C + offset
        exact = (x[rows] * self.weight[cols]).sum(-1)
        best = torch.full((S,), float("-inf")).scatter_reduce_(0, rows, exact, "amax")
        winner = exact == best[rows]
        return torch.full((S,), V, dtype=torch.long).scatter_reduce_(
            0, rows[winner], cols[winner], "amin")


class Int8GreedyHead:
    """GreedyHead's exact argmax with an int8 screen, in one C++ call (csrc/greedy_head.cpp).

    1. x and each row W_j rounded to int8 with a symmetric scale (s_x = max|x|/127,
       s_j = max|W_j|/127): x = x^ + dx, W_j = W^_j + E_j. A = xq Wq^T in int32 is
       exact, a^_j = s_x s_j A_j, and by Cauchy-Schwarz
           |a^_j - l_j| <= B = 1.01 (|dx| max_j|W_j| + |x^| max_j|E_j|)
                               + 2 K 2^-24 |x| max_j|W_j|   (+ 2^-20 max|a^| in the kernel):
       the two roundings (dx per step, E once at load), the float32 accumulation
       of l, and the float32 products of a^.
    2. and 3. as GreedyHead: candidates a^_j >= max(a^) - 2B, found through
       64-column chunk maxima, rechecked in float32; ties go to the lowest id.
    Rows with more than MAX_CANDIDATES candidates are computed in full.
    It reads half the bytes of the bf16 screen, writes only chunk maxima, and
    rechecks in the same call.
    """

    CHUNK = 64
    MAX_CANDIDATES = 256  # per row

    def __init__(self, weight: torch.Tensor, kernel):
        self.kernel, self.weight = kernel, weight.contiguous()
        V, K = weight.shape
        self.vocab, self.padded, self.k4 = V, -(-V // self.CHUNK) * self.CHUNK, -(-K // 4)
        w = weight.new_zeros(self.padded, self.k4 * 4)
        w[:V, :K] = weight
        self.w_scale = w.abs().amax(1).clamp_(min=torch.finfo(torch.float32).tiny) / 127
        wq = (w / self.w_scale[:, None]).round_().clamp_(-127, 127)
        self.packed = ((wq.to(torch.int16) + 128).to(torch.uint8)
                       .view(self.padded // 16, 16, self.k4, 4).permute(0, 2, 1, 3).contiguous())
        w_norm = float(weight.norm(dim=1).max())
        error_norm = float((w - wq * self.w_scale[:, None]).norm(dim=1).max())
        self.dx_factor, self.xhat_factor = 1.01 * w_norm, 1.01 * error_norm
        self.x_factor = 2 * K * 2.0 ** -24 * w_norm

    def argmax(self, x: torch.Tensor, full_logits) -> torch.Tensor:
        """x: [S, h] float32 normed rows; full_logits(rows) computes rows the screen cannot."""
        S, K = x.shape
        x = x.contiguous()
        sx = x.abs().amax(1).clamp_(min=torch.finfo(torch.float32).tiny) / 127
        xs = x / sx[:, None]
        xq = torch.round(xs)
        bound = sx * (self.dx_factor * (xs - xq).norm(dim=1) + self.xhat_factor * xq.norm(dim=1)
                      + self.x_factor * xs.norm(dim=1))
        if not bool(torch.isfinite(bound).all()):
            return _argmax(full_logits(x))
        xq8 = torch.zeros(S, self.k4 * 4, dtype=torch.int8)
        xq8[:, :K] = xq.to(torch.int8)
        chunk_max = torch.empty(S, self.padded // self.CHUNK)
        out = self.kernel(self.packed, self.weight, self.w_scale, self.vocab, self.k4, x, xq8,
                          sx, xq.sum(1).to(torch.int32), bound, chunk_max,
                          self.MAX_CANDIDATES)
        flat = out < 0
        if bool(flat.any()):
            out[flat] = _argmax(full_logits(x[flat]))
        return out


def greedy_head(weight: torch.Tensor, device: torch.device, dtype: torch.dtype, backend: str):
    """The fastest exact greedy head here: the int8 kernel, the bf16 screen, or None
    (plain float32 logits). KVENGINE_GREEDY_SCREEN=0 turns the screens off."""
    if os.environ.get("KVENGINE_GREEDY_SCREEN", "1") == "0":
        return None
    if device.type == "cpu" and dtype == torch.float32:
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.greedy is not None:
            return Int8GreedyHead(weight, kernels.greedy)
    return GreedyHead(weight) if GreedyHead.available(device, dtype, backend) else None


class RMSNorm:
    """Hugging Face's LlamaRMSNorm, operation for operation (same rounding)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, bit-identical (tests pin it)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# -- rotary position embedding ---------------------------------------------------
def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, as transformers' ROPE_INIT_FUNCTIONS."""
    dim, base = spec.head_dim, spec.rope_theta
    params = spec.rope_scaling_dict or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(spec, params)
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, yarn are)")


def _yarn_inv_freq(spec: ModelSpec, params: dict) -> tuple[torch.Tensor, float]:
    dim, base = spec.head_dim, spec.rope_theta
    orig = params.get("original_max_position_embeddings") or spec.max_position_embeddings
    factor = params.get("factor") or spec.max_position_embeddings / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all
                            else mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, attention_factor


class Rotary:
    def __init__(self, spec: ModelSpec, device: torch.device):
        inv_freq, self.scaling = rope_inv_freq(spec)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """[T, 1, head_dim] cos and sin, computed as transformers computes them."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


# -- what attention needs to know about the step ------------------------------------
@dataclass
class PrefillChunk:
    row: int  # first row of the chunk in the step's [T, hidden] batch
    num_tokens: int
    context_len: int  # tokens of K/V it attends to, its own included
    block_ids: torch.Tensor  # the blocks that hold those tokens
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None = plain causal
    fresh: bool  # no earlier tokens: its K/V are all in this step


@dataclass
class AttentionBatch:
    slots: torch.Tensor  # [T] cache slot of each row's K/V
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks] padded block tables
    decode_lens: torch.Tensor | None  # [num_decode] context lengths
    # [num_decode, 1, max_blocks * block_size]: 0 or -inf, for the gathering path;
    # None when the decode rows go through the CPU kernel (nothing padded to mask)
    decode_bias: torch.Tensor | None
    prefills: list[PrefillChunk]


def prefill_mask(start: int, num_tokens: int, context_len: int, sliding_window: int | None,
                 device) -> torch.Tensor | None:
    """Query i (position start + i) sees key j iff j <= start + i (and, with a
    window W, j > start + i - W, as transformers' sliding-window mask)."""
    if start == 0 and (sliding_window is None or sliding_window >= context_len):
        return None
    q_pos = torch.arange(start, start + num_tokens, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def decode_bias(context_lens: torch.Tensor, width: int, sliding_window: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    k_pos = torch.arange(width, device=context_lens.device)[None, :]
    keep = k_pos < context_lens[:, None]
    if sliding_window is not None:
        keep &= k_pos > context_lens[:, None] - 1 - sliding_window
    bias = torch.zeros(keep.shape, dtype=dtype, device=context_lens.device)
    return bias.masked_fill_(~keep, float("-inf")).unsqueeze(1)


# -- the network ------------------------------------------------------------------
class Attention:
    def __init__(self, spec: ModelSpec, layer: int, w: dict, backend: str, kernel):
        self.layer, self.kernel, self.window = layer, kernel, spec.sliding_window
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.group = spec.num_heads // spec.num_kv_heads
        self.scale = spec.head_dim ** -0.5
        p = f"model.layers.{layer}.self_attn."
        qkv_w = torch.cat([w[p + f"{n}_proj.weight"] for n in "qkv"])
        has_bias = p + "q_proj.bias" in w
        qkv_b = torch.cat([w[p + f"{n}_proj.bias"] for n in "qkv"]) if has_bias else None
        self.qkv_proj = Linear(qkv_w, qkv_b, backend)
        self.o_proj = Linear(w[p + "o_proj.weight"], w.get(p + "o_proj.bias"), backend)

    def __call__(self, x, cos, sin, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x).view(T, -1, self.head_dim)  # [T, heads + 2 kv heads, dim]
        qk = apply_rope(qkv[:, :H + self.num_kv_heads], cos, sin)  # q and k in one go
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + self.num_kv_heads:]
        cache.write(self.layer, k, v, batch.slots)
        D = batch.num_decode
        if D == T:
            out = self._decode(q, batch, cache)
        else:
            out = torch.empty_like(q)
            if D:
                out[:D] = self._decode(q[:D], batch, cache)
            for c in batch.prefills:
                rows = slice(c.row, c.row + c.num_tokens)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], c, cache)
        return self.o_proj(out.view(T, -1))

    def _decode(self, q: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """One query per request, all requests in one padded batch: [D, heads, dim]."""
        if batch.decode_bias is None:
            k, v = cache.layer_kv(self.layer)
            out = self.kernel(q.float().contiguous(), k, v, batch.decode_blocks, batch.decode_lens,
                              self.window, self.scale)
            return out.to(q.dtype)
        D, hkv, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        k, v = cache.gather(self.layer, batch.decode_blocks.view(-1))  # [hkv, D * L, d]
        k, v = k.view(hkv, D, -1, d), v.view(hkv, D, -1, d)
        qh = q.view(D, hkv, g, d).transpose(0, 1)  # [hkv, D, g, d]: heads share their kv head
        scores = torch.matmul(qh, k.transpose(-1, -2)).mul_(self.scale).add_(batch.decode_bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [hkv, D, g, d]
        return out.transpose(0, 1).reshape(D, self.num_heads, d)

    def _prefill(self, q, k, v, chunk: PrefillChunk, cache: PagedKVCache) -> torch.Tensor:
        if chunk.fresh and not cache.quantized:
            kc, vc = k.transpose(0, 1), v.transpose(0, 1)  # [hkv, n, d], as the cache holds them
        else:
            kc, vc = cache.gather(self.layer, chunk.block_ids)
            kc, vc = kc[:, :chunk.context_len], vc[:, :chunk.context_len]
        # [1, heads, n, d] against [1, kv_heads, ctx, d]: sdpa's own GQA (its fused
        # CPU kernel; a broadcast kv-head dim instead drops to the slow math path).
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None], vc[None],
                                             attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)


class MLP:
    def __init__(self, layer: int, w: dict, backend: str):
        p = f"model.layers.{layer}.mlp."
        self.gate_up = Linear(torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]),
                              _cat_bias(w, p + "gate_proj.bias", p + "up_proj.bias"), backend)
        self.down = Linear(w[p + "down_proj.weight"], w.get(p + "down_proj.bias"), backend)
        self.inter = w[p + "down_proj.weight"].shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


def _cat_bias(w: dict, *names: str):
    return torch.cat([w[n] for n in names]) if names[0] in w else None


class DecoderLayer:
    def __init__(self, spec: ModelSpec, layer: int, w: dict, backend: str, kernel):
        p = f"model.layers.{layer}."
        self.input_norm = RMSNorm(w[p + "input_layernorm.weight"], spec.rms_norm_eps)
        self.attn = Attention(spec, layer, w, backend, kernel)
        self.post_norm = RMSNorm(w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        self.mlp = MLP(layer, w, backend)

    def __call__(self, h, cos, sin, batch, cache):
        h = h + self.attn(self.input_norm(h), cos, sin, batch, cache)
        return h + self.mlp(self.post_norm(h))


class LlamaModel:
    """The decoder; `forward` gives the final hidden rows, `compute_logits` the logits."""

    def __init__(self, spec: ModelSpec, state_dict: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.backend = linear_backend(self.device, self.dtype)
        w = {k: t.to(device=self.device, dtype=self.dtype) for k, t in state_dict.items()}
        _check_shapes(spec, w)
        self.embed = w["model.embed_tokens.weight"]
        self.rotary = Rotary(spec, self.device)
        self.decode_kernel = self._decode_kernel()
        self.layers = [DecoderLayer(spec, i, w, self.backend, self.decode_kernel)
                       for i in range(spec.num_layers)]
        self.norm = RMSNorm(w["model.norm.weight"], spec.rms_norm_eps)
        head = w.get("lm_head.weight")
        if head is None or spec.tie_word_embeddings:
            head = self.embed
        self.lm_head = Linear(head, None, self.backend)
        self.greedy_head = greedy_head(head, self.device, self.dtype, self.backend)

    def _decode_kernel(self):
        """The CPU decode-attention kernel where it applies (float32 or bfloat16 on the CPU), else None."""
        if self.device.type != "cpu" or self.dtype not in cpu_kernels.KV_DTYPES:
            return None
        kernels = cpu_kernels.load()
        group = self.spec.num_heads // self.spec.num_kv_heads
        if kernels is None or not kernels.attention.supports(self.spec.head_dim, group):
            return None
        return kernels.attention

    def decodes_in_place(self, cache: PagedKVCache) -> bool:
        """Do the decode rows go through the CPU kernel (no gather, no padding bias)?"""
        return self.decode_kernel is not None and not cache.quantized

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                cache: PagedKVCache) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, cache)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given (final-layer, pre-norm) hidden rows."""
        return self.lm_head(self.norm(hidden)).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of compute_logits(hidden), row by row (GreedyHead's screen where it runs)."""
        x = self.norm(hidden)
        if self.greedy_head is None:
            return _argmax(self.lm_head(x).float())
        return self.greedy_head.argmax(x, lambda rows: self.lm_head(rows))


def _check_shapes(spec: ModelSpec, w: dict) -> None:
    expect = {
        "model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (spec.num_heads * spec.head_dim, spec.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (spec.num_kv_heads * spec.head_dim, spec.hidden_size),
        "model.layers.0.mlp.gate_proj.weight": (spec.intermediate_size, spec.hidden_size),
    }
    for name, shape in expect.items():
        if name not in w:
            raise UnsupportedModelError(f"the weights have no {name!r}")
        if tuple(w[name].shape) != shape:
            raise UnsupportedModelError(
                f"{name} has shape {tuple(w[name].shape)}, the model spec says {shape}")
    missing = [n for i in range(spec.num_layers) for n in _layer_names(i) if n not in w]
    if missing:
        raise UnsupportedModelError(f"the weights lack {len(missing)} tensors, e.g. {missing[:3]}")


def _layer_names(i: int) -> list[str]:
    p = f"model.layers.{i}."
    return [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
            *(p + f"self_attn.{n}_proj.weight" for n in "qkvo"),
            *(p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))]


def random_state_dict(spec: ModelSpec, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face's names and init (normal(0, 0.02), norms at 1),
    float32 on the CPU, deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g) * std

    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    w = {"model.embed_tokens.weight": normal(spec.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(rows, h)
            if spec.qkv_bias:
                w[p + f"self_attn.{name}_proj.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(h, q)
        w[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate_size)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = normal(spec.vocab_size, h)
    return w
