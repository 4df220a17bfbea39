"""Roofline step time of a ModelSpec on a DeviceSpec.

A step reads the weights once (all but an untied input embedding, of which it
gathers only its tokens' rows) and the K/V of every scheduled request's context
at the KV dtype's bytes per element, writes the new tokens' K/V, and does
2 * (non-embedding params) FLOPs per token, plus the lm_head's 2 * vocab *
hidden per sampled token (logits are computed only where a token is sampled:
a prefill chunk's last row, each decode), plus the attention FLOPs (a decode's at
their own share of peak where the coefficients give one). Its time is
max(memory time, compute time) + a fixed per-step overhead (and a floor per
decoder layer: its small kernels' fixed time on a GPU) + a per-sequence overhead (+ a quantized cache's dequantization: per step, and per K/V element
gathered). Small blocks read K/V less efficiently (more block-table lookups
and partial tiles per byte), which is how block_size enters.

All coefficients live in CostCoefficients so a profile fitted to a live
server (`kvtune calibrate`) can replace them.
"""
from __future__ import annotations

import csv
import functools
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvengine.config import DeviceSpec, ModelSpec
from kvengine.core.memory import kv_bytes_per_token, kv_elements_per_token

if TYPE_CHECKING:
    from kvengine.core.scheduler import SchedulerOutput


# The coefficients that may be None: then they take the value of the one named here.
TIED_TO = {"kv_memory_efficiency": "memory_efficiency", "decode_attention_efficiency": "attention_efficiency",
           "context_attention_efficiency": "attention_efficiency"}


@dataclass(frozen=True)
class CostCoefficients:
    memory_efficiency: float = 0.80  # achieved share of HBM bandwidth
    compute_efficiency: float = 0.55  # achieved share of dense FLOP/s (MFU of the GEMMs)
    attention_efficiency: float = 0.35  # attention kernels reach less of peak than GEMMs
    step_overhead_s: float = 1.5e-3  # scheduling, input prep, launch, sampling per step
    # per decoder layer per step: the floor of its small kernels (norms, rotary, activation,
    # residual adds), which take a few microseconds each on a GPU however few the tokens
    layer_overhead_s: float = 0.0
    per_seq_overhead_s: float = 1.0e-5  # per scheduled request per step
    # per request with a prefill chunk in the step: attention launched per sequence (a CPU's
    # sdpa per chunk and layer); 0 for varlen kernels that take every chunk in one launch
    per_prefill_overhead_s: float = 0.0
    # per request admitted into a step that runs others too: the frontend taking it in
    # (HTTP, parsing, tokenizing) competes with a busy engine for the CPU (and the GIL where
    # they share a process); on an idle engine it is the client's wait instead. ~0 where the
    # frontend has cores of its own (vLLM's API server process beside a GPU's engine core).
    busy_arrival_overhead_s: float = 0.0
    block_overhead_tokens: float = 2.0  # K/V read efficiency = bs / (bs + this)
    # Share of HBM bandwidth the paged K/V reads reach, when it differs from the weights'
    # (gathers through block tables, padded batches); None: memory_efficiency.
    kv_memory_efficiency: float | None = None
    # Share of peak the decode attention (one query per sequence against its paged context)
    # reaches, when it differs from the prefill's: another kernel (a paged decode kernel
    # beside a flash-attention prefill); None: attention_efficiency.
    decode_attention_efficiency: float | None = None
    # Share of peak the attention of a prefill chunk after earlier context (a prefix hit's, a
    # long prompt's later chunks) reaches, when it differs from a fresh prefill's: the torch
    # executor gathers that context from the paged cache and hands sdpa an explicit mask, whose
    # values its CPU kernel adds to every score; None: attention_efficiency.
    context_attention_efficiency: float | None = None
    # How the prefill's attention kernel counts its (query, key) pairs (kernel_pairs).
    # Keys per block: a flash-attention kernel computes whole blocks, so each query attends up
    # to the end of the key block holding its diagonal, the rest of that block computed, then
    # masked. 0: only the causal pairs. torch's CPU flash attention takes keys 512 at a time,
    # which nearly doubles a 512-token prefill's attention; a GPU's 64-128-key blocks waste little.
    attention_key_block: int = 0
    # Whether a chunk after earlier context attends to all its keys: the torch executor hands
    # sdpa such a chunk's causal mask as an explicit mask, which turns its block skipping off
    # (vLLM's varlen kernels skip there as well).
    context_chunk_all_keys: bool = False
    # Seconds per K/V element a step gathers from a quantized cache (fp8, int8; StepShape's
    # gathered_tokens), on top of its bytes: the torch executor dequantizes each element in
    # software and runs its decodes as one padded batch (its in-place CPU kernel reads only
    # float caches); a GPU's fp8 kernels convert in registers (~0). Fitted from probes of a
    # server running that dtype (kvtune calibrate --quantized-kv).
    kv_dequant_per_element_s: float = 0.0
    # Per step with a quantized cache: that path's own kernels, launched per layer whatever the
    # batch (quantizing the new K/V, converting and scaling what is gathered, the padded softmax).
    quantized_step_overhead_s: float = 0.0

    def __post_init__(self):
        """Efficiencies are shares > 0, the rest non-negative: a profile file or a
        stored fit with anything else would make the sim's clock run backwards."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in TIED_TO:
                continue
            if f.name == "context_chunk_all_keys":
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be true or false, got {value!r}")
                continue
            if f.name == "attention_key_block" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be a whole number of keys, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            if f.name.endswith("efficiency") and value <= 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")

    def to_dict(self) -> dict:
        return asdict(self)

    def resolved(self, name: str) -> float:
        """The coefficient's value, or the one it is tied to (TIED_TO) where it is None."""
        value = getattr(self, name)
        return getattr(self, TIED_TO[name]) if value is None else value


# What a cost profile may hold (wider than kvtune's fit bounds): outside these the sim's steps
# take ages or overflow the clock (an efficiency of 1e-300 makes a step 1e290 s long).
RANGES = {"efficiency": (1e-6, 1e4), "_s": (0.0, 60.0), "block_overhead_tokens": (0.0, 1e6),
          "attention_key_block": (0, 1 << 20)}


def check_ranges(c: CostCoefficients) -> None:
    """ValueError naming the first coefficient outside RANGES."""
    for f in fields(c):
        value = getattr(c, f.name)
        bounds = next((b for suffix, b in RANGES.items() if f.name.endswith(suffix)), None)
        if value is None or bounds is None:
            continue
        low, high = bounds
        if not low <= value <= high:
            show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
            raise ValueError(f"{f.name} must be in [{show(low)}, {show(high)}], got {show(value)}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, as the roofline prices it; step_shape counts it from a SchedulerOutput."""

    num_tokens: int  # computed this step: prefill chunks + decodes
    num_seqs: int  # requests scheduled
    context_tokens: int  # K/V tokens read: each request's context after the step, summed
    attention_token_pairs: int  # (query, key) pairs the attention kernels compute (kernel_pairs)
    num_samples: int | None = None  # requests that sample a token; None: all of them
    num_prefills: int = 0  # requests computing a prefill chunk (more than one token)
    num_busy_arrivals: int = 0  # requests admitted for the first time into a step beside running ones
    decode_token_pairs: int = 0  # the part of the pairs decodes compute: each its context
    context_chunk_pairs: int = 0  # the part prefill chunks after earlier context compute
    # K/V tokens a gathering attention path reads: every decode padded to the longest decode's
    # blocks (one padded batch), each prefill chunk's context in whole blocks
    gathered_tokens: int = 0
    # what a sliding-window layer reads of the same contexts: each request's last `window` tokens
    windowed_context_tokens: int = 0

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The shape as one row of StepCost.step_times' input (np.array of a list of shapes)."""
        samples = self.num_seqs if self.num_samples is None else self.num_samples
        return np.array((self.num_tokens, self.num_seqs, self.context_tokens, self.attention_token_pairs, samples,
                         self.num_prefills, self.num_busy_arrivals, self.decode_token_pairs,
                         self.context_chunk_pairs, self.gathered_tokens, self.windowed_context_tokens), dtype=dtype)


# The columns of StepCost.step_times' input, in order.
STEP_SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))
SHAPE_FIELDS = len(STEP_SHAPE_FIELDS)


def causal_pairs(new_tokens: int, context: int) -> int:
    """(query, key) pairs of `new_tokens` queries ending a `context`-token sequence under a
    causal mask: each attends to the earlier context and to its chunk up to itself. A decode
    (1 token) attends to the whole context; a fresh prefill of n tokens to n(n+1)/2 pairs."""
    return new_tokens * (context - new_tokens) + new_tokens * (new_tokens + 1) // 2


def kernel_pairs(new_tokens: int, context: int, key_block: int, all_keys_after_context: bool = False) -> int:
    """(query, key) pairs an attention kernel computes for `new_tokens` queries ending a
    `context`-token sequence, where it takes keys `key_block` at a time: each query attends
    up to the end of the block holding its own position (the block's later keys computed,
    then masked), at most the whole context. key_block 0: the causal pairs.
    `all_keys_after_context`: a chunk after earlier context attends to every key (a kernel
    handed an explicit mask skips no block)."""
    start = context - new_tokens
    if all_keys_after_context and start > 0:
        return new_tokens * context
    if key_block <= 0:
        return causal_pairs(new_tokens, context)
    pairs = 0
    for block in range(start // key_block, (context - 1) // key_block + 1):
        end = min(context, (block + 1) * key_block)
        pairs += (end - max(start, block * key_block)) * end
    return pairs


def step_shape(out: SchedulerOutput, sampled: list[int | None], key_block: int = 0,
               all_keys_after_context: bool = False, block_size: int = 1, window: int | None = None) -> StepShape:
    """The shape of a scheduled step (the scheduler has advanced each request's
    num_computed_tokens to its context after the step), its prefill pairs counted as a
    kernel taking keys `key_block` at a time does (kernel_pairs), its gathered tokens in
    blocks of `block_size`, its contexts as a sliding-window layer of `window` reads them;
    `sampled` the executor's tokens, None where a prefill chunk samples none."""
    windowed = sum(min(req.num_computed_tokens, window) for req in out.scheduled) if window else 0
    context = decode_pairs = prefill_pairs = chunk_pairs = prefills = gathered = decodes = longest = 0
    for req, n in zip(out.scheduled, out.num_new_tokens):
        ctx = req.num_computed_tokens
        context += ctx
        if n > 1:
            gathered += -(-ctx // block_size) * block_size
            prefills += 1
            pairs = kernel_pairs(n, ctx, key_block, all_keys_after_context)
            prefill_pairs += pairs
            if ctx > n:  # after earlier context: a prefix hit's chunk, a long prompt's later ones
                chunk_pairs += pairs
        elif n == 1:
            decode_pairs += ctx  # one query attends to its whole context, in any kernel
            decodes, longest = decodes + 1, max(longest, ctx)
    gathered += decodes * -(-longest // block_size) * block_size
    scheduled = out.scheduled
    busy = 0
    if len(scheduled) > out.num_new_reqs:  # beside running ones; a resumed request is no arrival
        busy = sum(1 for req in scheduled[len(scheduled) - out.num_new_reqs:] if req.num_preemptions == 0)
    return StepShape(out.total_tokens, len(scheduled), context, decode_pairs + prefill_pairs,
                     len(sampled) - sampled.count(None), prefills, busy, decode_pairs, chunk_pairs, gathered, windowed)


# How the torch executor's prefill attention (model.Attention._prefill: sdpa) counts its pairs,
# by device kind. On a CPU, torch's flash attention takes keys 512 at a time (its kv split);
# on CUDA, FlashAttention-2 takes 64-128 by head size. A chunk after earlier context goes with
# an explicit mask (model.prefill_mask), under which neither skips a block.
TORCH_ATTENTION_KERNELS = {"cpu": {"attention_key_block": 512, "context_chunk_all_keys": True},
                           "cuda": {"attention_key_block": 128, "context_chunk_all_keys": True}}


def torch_attention_kernel(device: str) -> dict:
    """TORCH_ATTENTION_KERNELS' entry for a torch device name ("cpu", "cuda", "cuda:1")."""
    return TORCH_ATTENTION_KERNELS["cpu" if device == "cpu" else "cuda"]


@dataclass(frozen=True)
class StepCost:
    """The per-configuration constants of the roofline, computed once."""

    weight_bytes: float  # read per step
    kv_read_bytes_per_token: float  # the full-attention layers', divided by the block-size (and K/V bandwidth) efficiency
    kv_write_bytes_per_token: float
    flops_per_token: float  # the transformer layers
    flops_per_sample: float  # the lm_head, per sampled token
    attention_flops_per_pair: float  # per (query token, context token) pair
    bytes_per_s: float
    flops_per_s: float
    attention_flops_per_s: float
    decode_attention_flops_per_s: float
    context_attention_flops_per_s: float
    step_overhead_s: float  # with the layers' kernel floor
    per_seq_overhead_s: float
    per_prefill_overhead_s: float
    busy_arrival_overhead_s: float
    kv_dequant_s_per_token: float  # per token gathered from a quantized cache (0 for "auto")
    quantized_step_overhead_s: float  # per step with a quantized cache (0 for "auto")
    attention_key_block: int  # these two as in CostCoefficients: step_shape counts the pairs with them
    context_chunk_all_keys: bool
    block_size: int  # step_shape counts the gathered tokens in whole blocks
    # Mixture of experts: the routed experts' bytes, of which a step reads the share its tokens pick,
    # 1 - expert_miss ** tokens (each token picks k of E experts, uniformly: the expected distinct ones).
    routed_expert_bytes: float = 0.0
    expert_miss: float = 1.0  # 1 - k / E
    # Tensor parallelism: two all-reduces of the hidden states a layer, not overlapped with the
    # compute; each a fixed latency plus a ring's 2 (T - 1) / T of the bytes over the interconnect,
    # or, where the interconnect's NCCL timings were measured, those at the message's size.
    allreduce_s: float = 0.0
    allreduce_s_per_token: float = 0.0
    allreduce_curve: tuple = ()  # (log bytes, log seconds) of one all-reduce, measured; () if none
    allreduce_bytes_per_token: float = 0.0
    allreduces: int = 0
    # Sliding-window layers (Gemma 2/3, gpt-oss, Mistral v0.1): their K/V bytes per token of the
    # windowed contexts (StepShape.windowed_context_tokens), and the window step_shape caps them at.
    kv_windowed_read_bytes_per_token: float = 0.0
    window: int | None = None

    @classmethod
    def build(cls, model: ModelSpec, device: DeviceSpec, kv_cache_dtype: str, block_size: int,
              coeffs: CostCoefficients | None = None) -> "StepCost":
        c = coeffs or device_coefficients(device)
        kv_token = kv_bytes_per_token(model, kv_cache_dtype)
        kinds = model.attention_kinds
        sliding = kinds.count("sliding") / len(kinds)  # each layer's cache is the same size
        block_eff = block_size / (block_size + c.block_overhead_tokens)
        # slower (or faster) K/V reads than the weights': more (fewer) bytes at the same rate
        block_eff *= c.resolved("kv_memory_efficiency") / c.memory_efficiency
        # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add, per query head and layer.
        attn_pair = 4.0 * model.num_heads * model.head_dim * model.num_layers
        vocab_matrix = model.vocab_size * model.hidden_size
        gathered_embedding = 0 if model.tie_word_embeddings else vocab_matrix
        vocab_matrices = 1 if model.tie_word_embeddings else 2
        experts, routed = model.num_experts, model.routed_expert_params
        active = model.num_params - routed * (1 - model.num_experts_per_tok / experts) if experts else model.num_params
        tp, ring = model.tensor_parallel_size, 2 * (model.tensor_parallel_size - 1) / model.tensor_parallel_size
        reductions = 2 * model.num_layers if tp > 1 else 0
        curve = allreduce_curve(device.allreduce_table, tp) if reductions else ()
        # fp8 checkpoints run W8A8 GEMMs at the FP8 tensor rate where the device has one
        gemm_flops = device.fp8_flops if model.weight_quant == "fp8" and device.fp8_flops else device.bf16_flops
        return cls(
            weight_bytes=float(model.weight_bytes - gathered_embedding * model.dtype_bytes - model.routed_expert_bytes),
            kv_read_bytes_per_token=kv_token * (1 - sliding) / block_eff,
            kv_write_bytes_per_token=float(kv_token),
            flops_per_token=2.0 * (active - vocab_matrices * vocab_matrix),
            flops_per_sample=2.0 * vocab_matrix,
            attention_flops_per_pair=attn_pair,
            bytes_per_s=device.hbm_bandwidth * c.memory_efficiency,
            flops_per_s=gemm_flops * c.compute_efficiency,
            attention_flops_per_s=device.bf16_flops * c.attention_efficiency,
            decode_attention_flops_per_s=device.bf16_flops * c.resolved("decode_attention_efficiency"),
            context_attention_flops_per_s=device.bf16_flops * c.resolved("context_attention_efficiency"),
            step_overhead_s=c.step_overhead_s + c.layer_overhead_s * model.num_layers,
            per_seq_overhead_s=c.per_seq_overhead_s,
            per_prefill_overhead_s=c.per_prefill_overhead_s,
            busy_arrival_overhead_s=c.busy_arrival_overhead_s,
            kv_dequant_s_per_token=(c.kv_dequant_per_element_s * kv_elements_per_token(model)
                                    if kv_cache_dtype != "auto" else 0.0),
            quantized_step_overhead_s=c.quantized_step_overhead_s if kv_cache_dtype != "auto" else 0.0,
            attention_key_block=c.attention_key_block,
            context_chunk_all_keys=c.context_chunk_all_keys,
            block_size=block_size,
            routed_expert_bytes=float(model.routed_expert_bytes),
            expert_miss=1 - model.num_experts_per_tok / experts if experts else 1.0,
            allreduce_s=0.0 if curve else reductions * device.allreduce_latency_s,
            allreduce_s_per_token=0.0 if curve else (
                reductions * ring * model.hidden_size * model.dtype_bytes / device.interconnect_bandwidth),
            allreduce_curve=curve,
            allreduce_bytes_per_token=float(model.hidden_size * model.dtype_bytes),
            allreduces=reductions,
            kv_windowed_read_bytes_per_token=kv_token * sliding / block_eff,
            window=model.sliding_window if sliding else None,
        )

    def step_time(self, shape: StepShape) -> float:
        """Seconds for one step of `shape` (0 for one that computes nothing)."""
        if shape.num_tokens == 0:
            return 0.0
        samples = shape.num_seqs if shape.num_samples is None else shape.num_samples
        return self._seconds(max, shape.num_tokens, shape.num_seqs, shape.context_tokens,
                             shape.attention_token_pairs, samples, shape.num_prefills, shape.num_busy_arrivals,
                             shape.decode_token_pairs, shape.context_chunk_pairs, shape.gathered_tokens,
                             shape.windowed_context_tokens)

    def step_times(self, shapes: np.ndarray) -> np.ndarray:
        """step_time of each row of `shapes` ([N, SHAPE_FIELDS], StepShape's fields in order, all given),
        as one array computation: a calibration fit prices every probe step thousands of times."""
        columns = np.asarray(shapes, dtype=np.float64).T
        seconds = self._seconds(np.maximum, *columns)
        return np.where(columns[0] == 0, 0.0, seconds)

    def _measured_allreduces(self, num_tokens):
        """The step's all-reduces at the measured NCCL time of their size (log-log interpolation)."""
        if not self.allreduce_curve:
            return 0.0
        log_bytes, log_s = self.allreduce_curve
        size = np.log(np.maximum(num_tokens, 1) * self.allreduce_bytes_per_token)
        return self.allreduces * np.exp(np.interp(size, log_bytes, log_s))

    def _seconds(self, maximum, num_tokens, num_seqs, context_tokens, attention_token_pairs, samples,
                 num_prefills, num_busy_arrivals, decode_token_pairs, context_chunk_pairs, gathered_tokens,
                 windowed_context_tokens):
        """The roofline of one step (or of arrays of them: `maximum` is max or np.maximum)."""
        mem = (self.weight_bytes + self.routed_expert_bytes * (1 - self.expert_miss ** num_tokens)
               + context_tokens * self.kv_read_bytes_per_token
               + windowed_context_tokens * self.kv_windowed_read_bytes_per_token + num_tokens * self.kv_write_bytes_per_token) / self.bytes_per_s
        compute = ((num_tokens * self.flops_per_token + samples * self.flops_per_sample) / self.flops_per_s
                   + ((attention_token_pairs - decode_token_pairs - context_chunk_pairs) / self.attention_flops_per_s
                      + decode_token_pairs / self.decode_attention_flops_per_s
                      + context_chunk_pairs / self.context_attention_flops_per_s) * self.attention_flops_per_pair)
        return (maximum(mem, compute) + self.allreduce_s + num_tokens * self.allreduce_s_per_token
                + self._measured_allreduces(num_tokens)
                + self.step_overhead_s + num_seqs * self.per_seq_overhead_s
                + gathered_tokens * self.kv_dequant_s_per_token + self.quantized_step_overhead_s
                + num_prefills * self.per_prefill_overhead_s + num_busy_arrivals * self.busy_arrival_overhead_s)


DATA = Path(__file__).with_name("data")


@functools.cache
def allreduce_curve(table: str, ranks: int) -> tuple:
    """(log bytes, log seconds) of one all-reduce over `ranks` GPUs on `table`'s interconnect, from
    data/allreduce.csv (NCCL timings measured on DGX nodes; see benchmarks/data/vidur/SOURCES.md),
    made non-decreasing in size (a smaller message never costs more: the dips are the timer's noise);
    () where the table has no such rows. Beyond its largest size it grows with the bytes."""
    if not table:
        return ()
    with open(DATA / "allreduce.csv") as f:
        rows = sorted((int(r["bytes"]), float(r["median_ms"]) / 1e3) for r in csv.DictReader(f)
                      if r["interconnect"] == table and int(r["ranks"]) == ranks)
    if not rows:
        return ()
    sizes = np.array([b for b, _ in rows], dtype=float)
    seconds = np.minimum.accumulate(np.array([t for _, t in rows])[::-1])[::-1]
    # past the last measured size, bandwidth-bound: time in proportion to the bytes
    sizes, seconds = np.append(sizes, sizes[-1] * 1e6), np.append(seconds, seconds[-1] * 1e6)
    return tuple(np.log(sizes)), tuple(np.log(seconds))


@functools.cache
def device_coefficients(device: DeviceSpec) -> CostCoefficients:
    """The cost coefficients of a device preset's kernels: fitted to public GPU measurements
    (data/gpu_efficiency.json, written by benchmarks/gpu_fidelity.py --fit) where its `kernels`
    name a fit, CostCoefficients' defaults otherwise."""
    if not device.kernels:
        return CostCoefficients()
    fitted = json.loads((DATA / "gpu_efficiency.json").read_text())["kernels"][device.kernels]
    return CostCoefficients(**fitted["coefficients"])
