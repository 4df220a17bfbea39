"""A Hugging Face config.json -> ModelSpec, for every family whose KV cache vLLM sizes here.

Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and Qwen3-MoE, Mixtral, Gemma 2 and 3, DeepSeek-V2/V3
and Kimi-K2 (MLA), gpt-oss: what decides memory and time (layers, each layer's attention kind,
heads, head sizes, MLA's latent, experts, vocabulary, weight quantization). A family it does not
know, or a field it cannot place, is refused with the file and the field named. No torch: the
planner reads shapes without loading an engine. The presets are such files, shipped in
kvengine/model/configs/ (see `preset_specs`).
"""
from __future__ import annotations

import json
from pathlib import Path

from kvengine.model.spec import DTYPE_BYTES, WEIGHT_QUANT_BYTES, ModelSpec, frozen

PRESET_DIR = Path(__file__).with_name("configs")

# model_type -> family. The families the torch executor runs are TORCH_FAMILIES.
FAMILIES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
    "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "kimi_k2": "deepseek",
    "gpt_oss": "gpt_oss",
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3", "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek", "GptOssForCausalLM": "gpt_oss",
}
TORCH_FAMILIES = ("llama", "mistral", "qwen2")
REQUIRED_KEYS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# transformers' defaults for what a published text_config leaves out (Gemma3TextConfig's).
TEXT_DEFAULTS = {"gemma3": {"vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                            "rope_theta": 1000000.0}}
class CheckpointError(ValueError):
    """The folder is not a checkpoint this engine can load; the message says why."""


def read_json(path, f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: {f.name} is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {f.name} is not a JSON object")
    return data


def first(value):
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


class _Fields:
    """The config's fields, read with the file named in every complaint."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get(self, key, default=None):
        value = self.cfg.get(key)
        return default if value is None else value

    def whole(self, key, default=None) -> int:
        value = self.cfg.get(key)
        value = default if value is None else value
        if value is None:
            raise CheckpointError(f"{self.source}: lacks {key}, which this family needs")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{self.source}: {key} must be a whole number, got {value!r}")
        return value


def family_of(cfg: dict, source: str) -> str:
    family = FAMILIES.get(cfg.get("model_type")) or ARCHITECTURES.get(first(cfg.get("architectures")))
    if family is None:
        raise CheckpointError(
            f"{source}: model_type {cfg.get('model_type')!r} (architectures {cfg.get('architectures')!r}) "
            f"is not a family kvtune models; it knows model_type {', '.join(sorted(FAMILIES))}")
    return family


def _layer_types(f: _Fields, family: str, layers: int) -> tuple[tuple[str, ...] | None, int | None]:
    """(each layer's kind, the window) as vLLM builds the layers of each family."""
    window = f.get("sliding_window")
    if family == "qwen2" or family.startswith("qwen3") or family == "qwen2_moe":
        if not f.get("use_sliding_window", False):
            window = None
    if window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(f"{f.source}: sliding_window must be a whole number of tokens, got {window!r}")
    named = f.get("layer_types")
    if named is not None:
        kinds = tuple(LAYER_TYPES.get(t) for t in named) if isinstance(named, list) else (None,)
        if None in kinds or len(kinds) != layers:
            raise CheckpointError(f"{f.source}: layer_types must list {layers} of "
                                  f"{', '.join(LAYER_TYPES)}, got {named!r}")
    elif family == "gemma2":  # even layers slide (transformers' and vLLM's Gemma2)
        kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    elif family == "gemma3":  # every sliding_window_pattern-th layer is global
        pattern = f.whole("sliding_window_pattern", 6)
        kinds = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    elif family.startswith("qwen"):  # layers from max_window_layers on slide
        start = f.whole("max_window_layers", layers)
        kinds = tuple("sliding" if i >= start else "full" for i in range(layers))
    else:  # Mistral v0.1, Mixtral: every layer
        kinds = ("sliding",) * layers
    if "sliding" not in kinds:
        return None, None
    return (None if len(set(kinds)) == 1 else kinds), window


def _experts(f: _Fields, family: str, layers: int) -> dict:
    if family == "mixtral":
        return dict(num_experts=f.whole("num_local_experts"), num_experts_per_tok=f.whole("num_experts_per_tok"),
                    moe_intermediate_size=f.whole("intermediate_size"))
    if family == "gpt_oss":
        return dict(num_experts=f.whole("num_local_experts"),
                    num_experts_per_tok=f.whole("num_experts_per_tok", f.get("experts_per_token")),
                    moe_intermediate_size=f.whole("intermediate_size"))
    if family in ("qwen2_moe", "qwen3_moe"):
        step, dense_only = f.whole("decoder_sparse_step", 1), f.get("mlp_only_layers", [])
        dense = sum(1 for i in range(layers) if i in dense_only or (step and (i + 1) % step))
        return dict(num_experts=f.whole("num_experts"), num_experts_per_tok=f.whole("num_experts_per_tok"),
                    moe_intermediate_size=f.whole("moe_intermediate_size"), num_dense_layers=dense,
                    shared_expert_intermediate_size=f.whole("shared_expert_intermediate_size", 0))
    if family == "deepseek":
        if not f.get("n_routed_experts"):
            return {}
        moe = f.whole("moe_intermediate_size")
        freq, first_dense = f.whole("moe_layer_freq", 1), f.whole("first_k_dense_replace", 0)
        dense = sum(1 for i in range(layers) if i < first_dense or i % freq)
        return dict(num_experts=f.whole("n_routed_experts"), num_experts_per_tok=f.whole("num_experts_per_tok"),
                    moe_intermediate_size=moe, num_dense_layers=dense,
                    shared_expert_intermediate_size=f.whole("n_shared_experts", 0) * moe)
    return {}


def _mla(f: _Fields) -> dict:
    return dict(kv_lora_rank=f.whole("kv_lora_rank"), qk_rope_head_dim=f.whole("qk_rope_head_dim"),
                qk_nope_head_dim=f.whole("qk_nope_head_dim"), v_head_dim=f.whole("v_head_dim"),
                q_lora_rank=f.whole("q_lora_rank", 0))


def weight_quant(cfg: dict, source: str) -> str | None:
    """The linear layers' stored format ("fp8", "int8", "int4", "mxfp4", "nvfp4", None for the dtype)
    from the config's quantization_config (vLLM's --quantization: kvengine.model.spec.quantized)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in ("fp8", "fbgemm_fp8", "mxfp4"):
        return "fp8" if method != "mxfp4" else "mxfp4"
    if method in ("gptq", "awq"):
        return _bits_format(qc.get("bits"), "int", source, "quantization_config.bits")
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        formats = {_bits_format(w.get("num_bits"), w.get("type", "int"), source,
                                "quantization_config.config_groups.*.weights") for w in weights}
        if len(formats) == 1:
            return formats.pop()
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        found = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_AWQ": "int4", "W4A8_AWQ": "int4"}.get(algo)
        if found:
            return found
    raise CheckpointError(f"{source}: quantization_config (quant_method {method!r}) is not a weight format "
                          f"kvtune sizes ({', '.join(WEIGHT_QUANT_BYTES)})")


def _bits_format(bits, kind, source: str, field: str) -> str:
    found = {(8, "float"): "fp8", (8, "int"): "int8", (4, "int"): "int4", (4, "float"): "nvfp4"}.get((bits, kind))
    if found is None:
        raise CheckpointError(f"{source}: {field} is {bits!r}-bit {kind}; kvtune sizes 8-bit and 4-bit weights")
    return found


def _rope(cfg: dict) -> tuple[float, tuple | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    rope = dict(rope.get("full_attention", rope))  # per layer type (transformers 5): the global layers'
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rope.update(cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type", "default") == "default" and len(rope) <= 1:
        return float(theta), None
    return float(theta), tuple(sorted((k, frozen(v)) for k, v in rope.items()))


def spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """The ModelSpec of one config.json's contents; `source` names the file in every complaint."""
    family = family_of(cfg, source)
    if isinstance(cfg.get("text_config"), dict):  # a multimodal wrapper: the decoder's own config
        cfg = {**cfg, **TEXT_DEFAULTS.get(family, {}), **cfg["text_config"],
               "quantization_config": cfg.get("quantization_config")}
    f = _Fields(cfg, source)
    for key in REQUIRED_KEYS:
        f.whole(key)
    layers, heads = f.whole("num_hidden_layers"), f.whole("num_attention_heads")
    dtype = str(f.get("dtype") or f.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{source}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if dtype == "float32" and family not in TORCH_FAMILIES:
        # vLLM's --dtype auto serves a float32 (or dtype-less: gpt-oss) checkpoint in bfloat16 on GPUs;
        # only kvengine's torch executor runs float32 as float32, and it runs the torch families.
        dtype = "bfloat16"
    mla = _mla(f) if family == "deepseek" else {}
    head_dim = (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla
                else f.whole("head_dim", 0) or f.whole("hidden_size") // heads)
    experts = _experts(f, family, layers)
    intermediate = f.whole("intermediate_size", 0 if family in ("mixtral", "gpt_oss") else None)
    if family in ("mixtral", "gpt_oss"):
        intermediate = 0  # every layer's MLP is its experts
    layer_types, window = _layer_types(f, family, layers)
    theta, rope_scaling = _rope(cfg)
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=f.whole("hidden_size"), num_heads=heads,
        num_kv_heads=f.whole("num_key_value_heads", heads), head_dim=head_dim,
        intermediate_size=intermediate, vocab_size=f.whole("vocab_size"),
        max_position_embeddings=f.whole("max_position_embeddings", 4096), dtype=dtype,
        rope_theta=theta, tie_word_embeddings=bool(f.get("tie_word_embeddings", family.startswith("gemma"))),
        qkv_bias=family in ("qwen2", "qwen2_moe") or bool(f.get("attention_bias", False)),
        rms_norm_eps=f.get("rms_norm_eps", 1e-6), architecture=family, rope_scaling=rope_scaling,
        sliding_window=window, layer_types=layer_types,
        bos_token_id=first(cfg.get("bos_token_id")), eos_token_id=first(cfg.get("eos_token_id")),
        weight_quant=weight_quant(cfg, source), **mla, **experts)


def read_config(path) -> dict:
    return read_json(path, folder(path) / "config.json")


def folder(path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"{path}: not a local folder (kvengine loads config.json + *.safetensors from "
            "disk and never downloads from the Hugging Face hub)")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json")
    return p


def model_spec_from_hf(path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a local checkpoint folder, from its config.json."""
    source = str(Path(path) / "config.json")
    return spec_from_config(read_config(path), name or Path(path).resolve().name, source)


def model_spec_from_config_path(path) -> ModelSpec:
    """A config.json, or a folder holding one, named after its folder (or the file, when it
    is not called config.json): what --hf-config and a --preset path read."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json there")
    name = file.resolve().parent.name if file.name == "config.json" else file.stem
    return spec_from_config(read_json(file, file), name, str(file))


def preset_specs() -> dict[str, ModelSpec]:
    """The shipped presets, kvengine/model/configs/NAME.json, by NAME."""
    return {f.stem: spec_from_config(read_json(f.name, f), f.stem, str(f))
            for f in sorted(PRESET_DIR.glob("*.json"))}
