"""The paged KV cache tensors, and the one place K/V enter and leave them.

One payload tensor holds every layer's K and V:

    data[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]

head-major inside each layer, so gathering a batch's blocks by one index gives
[kv_heads, seqs, tokens, head_dim] in one copy, ready for a batched matmul.
A token's slot is `block_id * block_size + offset`, as in vLLM's slot mapping.
Its bytes are exactly `num_blocks * memory.kv_bytes_per_block(...)`.

`kv_cache_dtype` (vLLM's flag, plus int8):
    auto               the model's dtype, stored as is
    fp8, fp8_e4m3      torch.float8_e4m3fn (max 448)
    fp8_e5m2           torch.float8_e5m2 (max 57344)
    int8               torch.int8, symmetric, round to nearest (max 127)
The quantized types keep one float32 scale per (token slot, kv head), K and V
apart: scale = amax over head_dim / max of the type (vLLM's
`*_per_token_head` layout). A scale is fixed when its token is written, so a
block never needs re-quantizing as it fills. The scales are a side tensor,
reported apart (`scale_bytes`): 4 bytes per head_dim payload bytes, i.e. 12.5%
on top at head_dim 32, 3% at 128. memory.plan_memory does not count them (as
vLLM counts only the payload); they come out of the overhead margin.
"""
from __future__ import annotations

import torch

STORAGE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return STORAGE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}") from None


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.model_dtype = model_dtype
        self.dtype = storage_dtype(kv_cache_dtype, model_dtype)
        self.quantized = kv_cache_dtype != "auto"
        self.qmax = QUANT_MAX.get(self.dtype)
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        # Empty, not zeros: a block is zeroed when its first slot is written
        # (zero_fresh_blocks), so no stale NaN bytes are ever read, and a multi-GiB
        # pool starts at once instead of touching every page.
        self.data = torch.empty(shape, dtype=self.dtype, device=device)
        # Byte view for indexing: index_copy_/index_select have no float8 kernels.
        self.raw = self.data.view(torch.uint8) if self.dtype.is_floating_point and self.quantized \
            else self.data
        self.scales = (torch.empty(shape[:-1], dtype=torch.float32, device=device)
                       if self.quantized else None)
        self.zero_blocks(torch.tensor([0], device=device))  # the null block pads block tables

    # -- sizes ----------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        """K+V bytes, all layers: what memory.kv_bytes_per_block predicts, times blocks."""
        return self.data.numel() * self.data.element_size()

    @property
    def scale_bytes(self) -> int:
        return 0 if self.scales is None else self.scales.numel() * self.scales.element_size()

    # -- block maintenance --------------------------------------------------
    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero whole blocks (every layer, K and V)."""
        self.raw.index_fill_(3, block_ids, 0)
        if self.scales is not None:
            self.scales.index_fill_(3, block_ids, 0)

    def zero_fresh_blocks(self, slots: torch.Tensor) -> None:
        """Zero the blocks whose first slot this step writes: a block fills from
        offset 0 (prefix hits arrive full), so a padded read past a request's
        last token only ever sees zeros or old, finite K/V.
        Needed by the gathering decode path (0 * NaN under the mask is NaN); the
        CPU kernel reads only written slots, and the executor skips it then."""
        fresh = slots[slots % self.block_size == 0]
        if fresh.numel():
            self.zero_blocks(fresh // self.block_size)

    # -- the write and the read of one layer ------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the step's new K and V ([T, kv_heads, head_dim]) at their slots."""
        for i, x in enumerate((k, v)):
            dst = self.raw[layer, i].view(self.num_kv_heads, -1, self.head_dim)
            if not self.quantized:
                dst.index_copy_(1, slots, x.transpose(0, 1))
                continue
            q, scale = self._quantize(x)
            dst.index_copy_(1, slots, q.transpose(0, 1))
            self.scales[layer, i].view(self.num_kv_heads, -1).index_copy_(1, slots, scale.t())

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        scale = x.abs().amax(-1).clamp_(min=1e-12) / self.qmax  # [T, kv_heads]
        y = x / scale.unsqueeze(-1)
        if self.dtype == torch.int8:
            q = y.round_().clamp_(-127, 127).to(torch.int8)
        else:
            q = y.clamp_(-self.qmax, self.qmax).to(self.dtype).view(torch.uint8)
        return q, scale

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V pools as stored: [kv_heads, num_blocks, block_size, head_dim]."""
        return self.data[layer, 0], self.data[layer, 1]

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks, in order, in the model's dtype:
        two [kv_heads, len(block_ids) * block_size, head_dim] tensors."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_dim
        both = self.raw[layer].view(2 * h, self.num_blocks, bs * d).index_select(1, block_ids)
        both = both.view(2 * h, -1, d)
        if self.quantized:
            scale = self.scales[layer].view(2 * h, self.num_blocks, bs).index_select(1, block_ids)
            values, factor = self._to_float(both)
            both = (values * (scale.view(2 * h, -1, 1) * factor)).to(self.model_dtype)
        return both[:h], both[h:]

    def _to_float(self, raw: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Stored bytes -> float32 values / factor. On the CPU, fp8 goes through
        float16 bit patterns: torch's own float8_e4m3fn -> float32 conversion there
        is a slow scalar path."""
        if self.dtype == torch.int8:
            return raw.to(torch.float32), 1.0
        if raw.device.type != "cpu":
            return raw.view(self.dtype).to(torch.float32), 1.0
        wide = raw.view(torch.int8).to(torch.int16)  # sign-extended byte
        if self.dtype == torch.float8_e5m2:  # e5m2 is the high byte of a float16
            return (wide << 8).view(torch.float16).to(torch.float32), 1.0
        # e4m3fn: s eeee mmm -> float16 s 0eeee mmm0000000 (bias 15 instead of 7,
        # subnormals included), so the value is the float16 times 2^8. No NaN is
        # ever stored (writes clamp to +-448).
        bits = torch.bitwise_and(wide << 7, -16385)  # clear bit 14, keep the sign
        return bits.view(torch.float16).to(torch.float32), 256.0
