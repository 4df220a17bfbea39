"""Local Hugging Face checkpoints the torch executor runs: *.safetensors -> weights.

Llama, Mistral and Qwen2 (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`);
config.json is read by kvengine/model/hf_config.py. Only a local folder is read: nothing is
ever fetched from the hub.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvengine.model.hf_config import (  # noqa: F401  (the loader's names for them)
    TORCH_FAMILIES, CheckpointError, folder, model_spec_from_hf, read_json)


def torch_model_spec(path, name: str | None = None):
    """The spec of a checkpoint the torch executor runs: a Llama, Mistral or Qwen2 decoder."""
    spec = model_spec_from_hf(path, name)
    if spec.architecture not in TORCH_FAMILIES or spec.uses_mla or spec.num_experts or spec.layer_types:
        raise CheckpointError(
            f"{path}: a {spec.architecture} model; the torch executor runs Llama, Mistral and Qwen2 "
            "decoders only (--executor sim models this one's memory and time)")
    return spec


def safetensors_files(path) -> list[Path]:
    """The checkpoint's shards: the index json's files, else every *.safetensors."""
    root = folder(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(path, index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: {index.name} has no weight_map object")
        names = sorted(set(map(str, weight_map.values())))
        files = [root / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: the index lists shards that are not there: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
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
