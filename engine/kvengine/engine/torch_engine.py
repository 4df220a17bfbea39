"""build_torch_engine: an LLMEngine wired to a TorchExecutor running a real model.

    engine = build_torch_engine(EngineConfig(block_size=16), preset="tiny")
    engine.add_request("a", engine.executor.tokenizer.encode("Hello"), SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        engine.step()

Apart from torch_executor because the engine drives its executor, not the other way round.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from kvengine.engine.clock import WallClock
from kvengine.config import ConfigError, DeviceSpec, EngineConfig, GiB, model_preset
from kvengine.engine.llm_engine import LLMEngine
from kvengine.model.llama import TORCH_DTYPES, LlamaModel, random_state_dict
from kvengine.executor.torch_executor import (
    TorchExecutor,
    resident_bytes,
    resolve_device,
    set_num_threads,
    torch_device_spec,
    tune_cpu_allocators,
)


def build_torch_engine(config: EngineConfig, preset: str | None = None, model_path: str | None = None,
                       device: str = "cpu", device_memory: int | None = None, seed: int = 0,
                       dtype: str | None = None, num_threads: int | None = None,
                       clock=None, own_process: bool = False) -> LLMEngine:
    """An LLMEngine running a real model with the TorchExecutor.

    config        the engine knobs (EngineConfig; unset ones take vLLM's defaults).
    preset        a ModelSpec preset name with random weights from `seed`
                  (default "tiny" when no model_path).
    model_path    a local Hugging Face folder (config.json + *.safetensors, maybe
                  sharded) of a Llama, Mistral or Qwen2 model; never downloaded.
                  Its tokenizer.json is used when present. Wins over preset.
    device        "cpu", "cuda", "cuda:N" or "auto" (cuda when available); a GPU
                  preset name means "cuda". Raises ConfigError with a plain
                  message when CUDA is asked for and absent.
    device_memory bytes playing the device's total memory on the CPU (default
                  2 GiB); on CUDA an optional cap below the real total.
    seed          random weights (presets) and the sampler's unseeded draws.
    dtype         override the model dtype: float32, bfloat16 or float16.
    num_threads   torch intra-op threads (default $KVENGINE_NUM_THREADS or 1).
    clock         default WallClock() (serving); pass a VirtualClock for replay.
    own_process   the process serves this engine alone (the server's engine core):
                  on the CPU, what it holds beside the weights counts against the budget.

    The engine's executor (engine.executor) carries the tokenizer
    (engine.executor.tokenizer) and the loaded model (engine.executor.model);
    engine.eos_token_id is the model's (or the byte tokenizer's) eos id.
    """
    from kvengine.model.hf import generation_eos_ids, load_hf_state_dict, torch_model_spec
    from kvengine.model.tokenizer import load_tokenizer

    if config.tensor_parallel_size != 1:  # one process, one device: the sim executor splits ranks
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: the torch executor runs "
                          "one device; use --executor sim to model tensor parallelism")
    set_num_threads(num_threads)
    torch_device = resolve_device(device)
    if own_process and torch_device == "cpu":
        tune_cpu_allocators()
    if model_path is not None:
        spec = torch_model_spec(model_path)
    else:
        spec = model_preset(preset or "tiny")
    if dtype is not None:
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
        spec = dataclasses.replace(spec, dtype=dtype)
    device_spec = torch_device_spec(torch_device, device_memory)
    if torch_device.startswith("cuda"):
        _check_free_gpu_memory(torch_device, device_spec, config)
    weights = load_hf_state_dict(model_path) if model_path else random_state_dict(spec, seed)
    model = LlamaModel(spec, weights, torch_device)
    del weights
    eos = spec.eos_token_id
    if model_path is not None and eos is None:
        eos = next(iter(generation_eos_ids(model_path)), None)
    tokenizer = load_tokenizer(model_path, spec.vocab_size, spec.bos_token_id, eos)
    if eos is None:
        eos = tokenizer.eos_token_id
    if own_process and torch_device == "cpu":  # all it holds beside the weights, loaders' leftovers too
        device_spec = torch_device_spec(torch_device, device_memory, resident_bytes() - spec.weight_bytes)
    executor = TorchExecutor(model, tokenizer, seed, profile_rss=own_process and torch_device == "cpu")
    config = dataclasses.replace(config, seed=seed) if config.seed != seed else config
    return LLMEngine(config, spec, device_spec, executor=executor,
                     clock=clock or WallClock(), eos_token_id=eos)


def _check_free_gpu_memory(device: str, spec: DeviceSpec, config: EngineConfig) -> None:
    """vLLM refuses to start when other processes hold what utilization asks for."""
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    requested = math.ceil(spec.memory_bytes * config.gpu_memory_utilization)
    if config.num_gpu_blocks_override is None and free < requested:
        raise ConfigError(
            f"Free memory on device {device} ({free / GiB:.2f}/{spec.memory_bytes / GiB:.2f} GiB) "
            f"on startup is less than desired GPU memory utilization "
            f"({config.gpu_memory_utilization}, {requested / GiB:.2f} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.")
