"""A decoder's shape: everything the memory and cost models need, from a config.json or a preset.

No torch here: the planner reads shapes without loading an engine.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of a quantized linear layer, scales included: fp8/int8 one byte (per-channel or
# 128x128-block scales add < 0.1 %); int4 (GPTQ/AWQ/W4A16, groups of 128 with a bf16 scale);
# mxfp4 (OCP microscaling: 4-bit values, one 8-bit scale per 32).
# nvfp4: 4-bit values, one fp8 scale per 16.
WEIGHT_QUANT_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 128, "mxfp4": 0.5 + 1 / 32,
                      "nvfp4": 0.5 + 1 / 16}

# vLLM's --quantization methods whose weights have one format; the others read the config's.
QUANTIZATION_FLAGS = {"fp8": "fp8", "mxfp4": "mxfp4", "fbgemm_fp8": "fp8", "ptpc_fp8": "fp8",
                      "awq": "int4", "awq_marlin": "int4", "gptq": None, "gptq_marlin": None,
                      "compressed-tensors": None, "modelopt": None, "modelopt_fp4": "nvfp4",
                      "experts_int8": "int8"}


class ConfigError(ValueError):
    """A knob has a value the engine cannot run with; the message names the flag."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder: all the memory and cost models need."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    # Optional, for the torch model (defaults leave every preset above unchanged):
    architecture: str = "llama"  # llama | mistral | qwen2 (all the same decoder here)
    # HF's rope_scaling / rope_parameters minus rope_theta, as sorted (key, value)
    # pairs so the spec stays hashable; None = plain RoPE. See rope_scaling_dict.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    sliding_window: int | None = None  # the window of the "sliding" layers (every layer without layer_types)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Attention per layer, "full" or "sliding" (Gemma 2/3, gpt-oss); None: every layer the
    # same, windowed where sliding_window is set (Mistral v0.1).
    layer_types: tuple[str, ...] | None = None
    # MLA (DeepSeek-V2/V3, Kimi-K2): a layer caches one latent of kv_lora_rank + qk_rope_head_dim
    # per token, shared by every head; kv_lora_rank 0 = ordinary K/V heads.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # Mixture of experts; num_experts 0 = a dense MLP of intermediate_size in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # all shared experts together
    num_dense_layers: int = 0  # layers keeping the dense MLP (DeepSeek's first_k_dense_replace)
    # Weights stored quantized ("fp8", "int8", "int4", "mxfp4", see WEIGHT_QUANT_BYTES); None: dtype.
    weight_quant: str | None = None
    # Tensor-parallel ranks this spec is one shard of (see tp_shard); 1 = the whole model.
    tensor_parallel_size: int = 1

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        """Each layer's KV cache kind: "full", "sliding" or "mla" (vLLM's KV cache specs)."""
        if self.uses_mla:
            return ("mla",) * self.num_layers
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding" if self.sliding_window else "full",) * self.num_layers

    def _attention_params(self) -> int:
        """One layer's attention projections, this shard's heads."""
        h, heads = self.hidden_size, self.num_heads
        if self.uses_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank else h * heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        kv, q = self.num_kv_heads * self.head_dim, heads * self.head_dim
        return h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)

    def _expert_params(self) -> int:
        """Every layer's routed and shared experts (quantized with the linear layers; mxfp4 only these)."""
        if not self.num_experts:
            return 0
        per_layer = self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size \
            + 3 * self.hidden_size * self.shared_expert_intermediate_size
        return (self.num_layers - self.num_dense_layers) * per_layer

    def _other_params(self) -> tuple[int, int]:
        """(attention + dense MLP linear weights, everything kept at the model dtype)."""
        h = self.hidden_size
        dense_layers = self.num_dense_layers if self.num_experts else self.num_layers
        linear = self.num_layers * self._attention_params() + dense_layers * 3 * h * self.intermediate_size
        router = (self.num_layers - dense_layers) * h * self.num_experts
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return linear, router + embed + (2 * self.num_layers + 1) * h

    @property
    def routed_expert_params(self) -> int:
        """The routed experts' weights in every MoE layer: a step reads only the experts its tokens pick."""
        if not self.num_experts:
            return 0
        return (self.num_layers - self.num_dense_layers) * self.num_experts * 3 * self.hidden_size \
            * self.moe_intermediate_size

    @property
    def routed_expert_bytes(self) -> int:
        per = WEIGHT_QUANT_BYTES[self.weight_quant] if self.weight_quant else self.dtype_bytes
        return math.ceil(self.routed_expert_params * per)

    @property
    def num_params(self) -> int:
        linear, kept = self._other_params()
        return linear + self._expert_params() + kept

    @property
    def weight_bytes(self) -> int:
        """The checkpoint's bytes (this shard's): quantized linear layers at their format's bytes."""
        linear, kept = self._other_params()
        experts = self._expert_params()
        if self.weight_quant is None:
            return (linear + experts + kept) * self.dtype_bytes
        quant = WEIGHT_QUANT_BYTES[self.weight_quant]
        if self.weight_quant == "mxfp4":  # gpt-oss: the experts only, attention stays bf16
            return math.ceil(experts * quant) + (linear + kept) * self.dtype_bytes
        return math.ceil((linear + experts) * quant) + kept * self.dtype_bytes

    def tp_shard(self, tp: int) -> "ModelSpec":
        """What one of `tp` tensor-parallel ranks holds, as vLLM shards it: heads, MLP and
        expert widths and the vocabulary split `tp` ways; K/V heads too, replicated once `tp`
        exceeds them; MLA's latent projections and the norms replicated."""
        if tp == 1:
            return self
        check_tensor_parallel(self, tp)
        vocab = -(-self.vocab_size // (64 * tp)) * 64  # VocabParallelEmbedding pads to 64 per rank
        return dataclasses.replace(
            self, num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
            intermediate_size=self.intermediate_size // tp,
            moe_intermediate_size=self.moe_intermediate_size // tp,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size // tp,
            vocab_size=vocab, tensor_parallel_size=tp * self.tensor_parallel_size)


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """vLLM's rules: TP divides the attention heads, and the K/V heads or is divided by them."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be a positive integer, got {tp!r}")
    kv = model.num_kv_heads
    if model.num_heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide {model.name}'s "
                          f"{model.num_heads} attention heads")
    if not model.uses_mla and (kv % tp if kv >= tp else tp % kv):
        raise ConfigError(f"--tensor-parallel-size {tp} and {model.name}'s {kv} K/V heads: one "
                          "must divide the other")


def frozen(value):
    """Lists (JSON's) as tuples, nested too, so a spec holding them hashes."""
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


def spec_from_dict(data: dict) -> ModelSpec:
    """A ModelSpec stored as JSON (dataclasses.asdict): its lists made tuples again, so it hashes."""
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    return ModelSpec(**{k: frozen(v) for k, v in data.items() if k in names})


def quantized(model: ModelSpec, method: str | None) -> ModelSpec:
    """The model served with vLLM's --quantization `method`: a method of one weight format sets it
    (fp8: vLLM quantizes a 16-bit checkpoint as it loads it); one whose format the checkpoint's own
    quantization_config gives (gptq, compressed-tensors, modelopt) needs that config read already."""
    if method is None:
        return model
    if method not in QUANTIZATION_FLAGS:
        raise ConfigError(f"--quantization {method!r}: kvtune sizes {', '.join(QUANTIZATION_FLAGS)}")
    if QUANTIZATION_FLAGS[method] is not None:
        return dataclasses.replace(model, weight_quant=QUANTIZATION_FLAGS[method])
    if model.weight_quant is None:
        raise ConfigError(f"--quantization {method}: {model.name} has no quantization_config saying its "
                          "weights' format (give its config.json with --hf-config)")
    return model
