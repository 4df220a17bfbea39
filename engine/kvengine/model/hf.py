"""Local Hugging Face checkpoints: config.json -> ModelSpec, *.safetensors -> weights.

Llama, Mistral and Qwen2 (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`). Only a local folder is read: nothing is ever fetched
from the hub.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvengine.config import DTYPE_BYTES, ModelSpec

ARCHITECTURES = {
    "llama": "llama", "LlamaForCausalLM": "llama",
    "mistral": "mistral", "MistralForCausalLM": "mistral",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
}


REQUIRED_KEYS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")


class CheckpointError(ValueError):
    """The folder is not a checkpoint this engine can load; the message says why."""


def _folder(path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"{path}: not a local folder (kvengine loads config.json + *.safetensors from "
            "disk and never downloads from the Hugging Face hub)")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json")
    return p


def _read_json(path, f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: {f.name} is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {f.name} is not a JSON object")
    return data


def read_config(path) -> dict:
    return _read_json(path, _folder(path) / "config.json")


def _first(value):
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def model_spec_from_hf(path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a local Llama/Mistral/Qwen2 folder, from its config.json."""
    cfg = read_config(path)
    arch = cfg.get("model_type") or _first(cfg.get("architectures"))
    if arch not in ARCHITECTURES:
        arch = _first(cfg.get("architectures"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: model_type {cfg.get('model_type')!r} / architectures "
            f"{cfg.get('architectures')!r} is not a Llama, Mistral or Qwen2 decoder")
    family = ARCHITECTURES[arch]
    missing = [k for k in REQUIRED_KEYS if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if missing:
        raise CheckpointError(f"{path}: config.json lacks whole-number {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    # transformers >= 5 writes rope_parameters (theta inside); older configs
    # rope_theta + rope_scaling ("type" or "rope_type").
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rope.update(cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type", "default") == "default" and len(rope) <= 1:
        rope_scaling = None
    else:
        rope_scaling = tuple(sorted((k, _frozen(v)) for k, v in rope.items()))
    window = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    return ModelSpec(
        name=name or Path(path).resolve().name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        dtype=dtype,
        rope_theta=float(theta),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        architecture=family,
        rope_scaling=rope_scaling,
        sliding_window=window,
        bos_token_id=_first(cfg.get("bos_token_id")),
        eos_token_id=_first(cfg.get("eos_token_id")),
    )


def safetensors_files(path) -> list[Path]:
    """The checkpoint's shards: the index json's files, else every *.safetensors."""
    folder = _folder(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(path, index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: {index.name} has no weight_map object")
        names = sorted(set(map(str, weight_map.values())))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: the index lists shards that are not there: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (pytorch_model.bin is not read)")
    return files


def load_hf_state_dict(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, Hugging Face names, on the CPU in its stored dtype."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        try:
            weights.update(load_file(str(f), device="cpu"))
        except Exception as err:  # SafetensorError (truncated, a bad header), OSError
            raise CheckpointError(f"{path}: {f.name} is not a readable safetensors file ({err})") from None
    # Checkpoints saved from the bare model (no `model.` prefix) load too.
    if "model.embed_tokens.weight" not in weights and "embed_tokens.weight" in weights:
        weights = {(k if k.startswith("lm_head") else "model." + k): v for k, v in weights.items()}
    return weights


def generation_eos_ids(path) -> list[int]:
    """eos ids from generation_config.json (Llama 3 lists several), [] if none."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return []
    eos = json.loads(f.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
