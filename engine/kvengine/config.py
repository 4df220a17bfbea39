"""The engine's knobs (vLLM's flag names and defaults), model and device specs."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from kvengine.model.hf_config import preset_specs
from kvengine.model.spec import (  # noqa: F401  (the engine's names for them)
    DTYPE_BYTES, QUANTIZATION_FLAGS, WEIGHT_QUANT_BYTES, ConfigError, ModelSpec, check_tensor_parallel, quantized)

GiB = 1 << 30

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
KV_ALLOCATORS = ("paged", "contiguous")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: what bounds a step's time and the KV pool's size."""

    name: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s, no sparsity
    # Memory the framework holds outside torch's allocator (CUDA context,
    # cuBLAS workspaces, NCCL): vLLM's `non_torch_increase` plus its
    # CUDA-graph estimate, typical values from vLLM start-up logs.
    non_torch_overhead_bytes: int = int(1.5 * GiB)
    large_memory: bool = False  # vLLM's >= 70 GiB, non-A100 batch defaults
    # vLLM's platform whose defaults apply (see platform_defaults). "cpu" only where the
    # torch executor really runs on the CPU, as vLLM's CPU build does; every preset,
    # the `cpu` one included, keeps the GPU defaults the sim was calibrated with.
    platform: str = "cuda"
    # Between the GPUs of one tensor-parallel group: each direction's bandwidth (bytes/s) and one
    # all-reduce's fixed latency, what a step pays twice a layer (vLLM's row-parallel reductions).
    interconnect_bandwidth: float = 32e9  # PCIe Gen4 x16
    allreduce_latency_s: float = 20e-6
    # The measured NCCL all-reduce table of this interconnect (executor/data/allreduce.csv), which
    # prices a step's all-reduces by message size and ranks; "": the bandwidth and latency above.
    allreduce_table: str = ""
    # Dense FP8 tensor FLOP/s, what an fp8 checkpoint's GEMMs run at (W8A8); 0: no FP8 tensor cores
    # (Ampere: vLLM runs fp8 weights as W8A16, dequantized into bf16 GEMMs).
    fp8_flops: float = 0.0
    # Which fitted GPU efficiencies (executor/data/gpu_efficiency.json) time this device's kernels;
    # "": CostCoefficients' defaults.
    kernels: str = ""


@dataclass(frozen=True)
class PlatformDefaults:
    """What vLLM's API server picks when a knob is not given (`vllm/engine/arg_utils.py`)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


def platform_defaults(device: DeviceSpec) -> PlatformDefaults:
    """vLLM's defaults on this device: the CPU build's (block 128, 128 seqs, 2048
    tokens), or a GPU's (block 16; 1024 seqs / 8192 tokens on large GPUs, else 256 / 2048)."""
    if device.platform == "cpu":
        return PlatformDefaults(128, 128, 2048)
    if device.large_memory:
        return PlatformDefaults(16, 1024, 8192)
    return PlatformDefaults(16, 256, 2048)


def platform_block_size(model: ModelSpec, device: DeviceSpec, asked: int) -> int:
    """The block size the platform runs: vLLM's CPU build overrides any block size of an MLA
    model with 16, the only one its MLA decode kernel has (`vllm/platforms/cpu.py`)."""
    return 16 if model.uses_mla and device.platform == "cpu" else asked


# Model shapes: each model's published config.json, shipped in kvengine/model/configs/.
MODEL_PRESETS: dict[str, ModelSpec] = preset_specs()

# Memory, HBM bandwidth and dense BF16 / FP8 tensor FLOP/s from the vendors' datasheets
# (dense: the datasheets' sparsity figures halved):
#   H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (80 GB HBM3, 3.35 TB/s, 989 / 1,979 TFLOPS)
#   H200 SXM 141GB: NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 / 1,979 TFLOPS)
#   B200 (HGX B200, 180 GB): NVIDIA HGX B200 datasheet (180 GB HBM3e, 7.7 TB/s, 2.25 / 4.5 PFLOPS)
#   A100 SXM 80GB / 40GB: NVIDIA A100 datasheet (2,039 GB/s / 1,555 GB/s, 312 TFLOPS BF16, no FP8)
#   L40S 48GB: NVIDIA L40S datasheet (864 GB/s GDDR6, 362 / 733 TFLOPS)
#   A10 24GB: NVIDIA A10 datasheet (600 GB/s GDDR6, 125 TFLOPS BF16, no FP8)
#   L4 24GB: NVIDIA L4 datasheet (300 GB/s GDDR6, 121 / 242.5 TFLOPS)
# NVLink per direction: 900 GB/s on B200 (NVLink 5), 450 GB/s on H100/H200 SXM (NVLink 4), 300 GB/s
# on A100 SXM (NVLink 3); L40S, A10 and L4 talk over PCIe Gen4 x16 (DeviceSpec's default).
# All-reduces on NVLink 3 and 4 are priced from NCCL timings measured on DGX A100 and DGX H100 nodes
# (Vidur's profiles, executor/data/allreduce.csv); B200 and the PCIe cards from bandwidth and a
# typical small-message latency. Kernel efficiencies (`kernels`) are fitted to Vidur's per-operation
# timings on A100 and H100 (executor/data/gpu_efficiency.json); H200 and B200 take Hopper's, the Ada
# and Ampere PCIe cards A100's: unmeasured, and labelled so in gpu_efficiency.json's notes.
# `cpu` is a rough 2-core x86 server (DDR bandwidth share, AVX2 FP32), an estimate,
# meant only to be replaced by a calibrated profile.
NVLINK5 = {"interconnect_bandwidth": 900e9, "allreduce_latency_s": 8e-6}
NVLINK4 = {"interconnect_bandwidth": 450e9, "allreduce_latency_s": 8e-6, "allreduce_table": "nvlink4"}
NVLINK3 = {"interconnect_bandwidth": 300e9, "allreduce_latency_s": 10e-6, "allreduce_table": "nvlink3"}
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100-80gb", 80 * GiB, 3.35e12, 989e12, large_memory=True, fp8_flops=1979e12, kernels="hopper",
                   **NVLINK4),
        DeviceSpec("h200-141gb", 141 * GiB, 4.8e12, 989e12, large_memory=True, fp8_flops=1979e12, kernels="hopper",
                   **NVLINK4),
        DeviceSpec("b200-180gb", 180 * GiB, 7.7e12, 2250e12, large_memory=True, fp8_flops=4500e12,
                   kernels="hopper", **NVLINK5),
        DeviceSpec("a100-80gb", 80 * GiB, 2.039e12, 312e12, kernels="ampere", **NVLINK3),
        DeviceSpec("a100-40gb", 40 * GiB, 1.555e12, 312e12, kernels="ampere", **NVLINK3),
        DeviceSpec("l40s-48gb", 48 * GiB, 864e9, 362e12, fp8_flops=733e12, kernels="ampere"),
        DeviceSpec("a10-24gb", 24 * GiB, 600e9, 125e12, kernels="ampere"),
        DeviceSpec("l4-24gb", 24 * GiB, 300e9, 121e12, fp8_flops=242.5e12, kernels="ampere"),
        DeviceSpec("cpu", 16 * GiB, 20e9, 100e9, non_torch_overhead_bytes=256 << 20),
    )
}


def _lookup(table: dict, name: str, flag: str):
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"{flag}: unknown preset {name!r}; choose one of {', '.join(table)}"
            + (" (or give a config.json or its folder)" if table is MODEL_PRESETS else "")
        ) from None


def model_preset(name: str) -> ModelSpec:
    """A shipped preset by name, or the model of a config.json (or a folder holding one)."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if not os.path.exists(name):
        if os.sep in name or name.endswith(".json"):
            raise ConfigError(f"--preset/--hf-config {name}: no such file or folder")
        return _lookup(MODEL_PRESETS, name, "--preset")
    from kvengine.model.hf_config import CheckpointError, model_spec_from_config_path

    try:
        return model_spec_from_config_path(name)
    except CheckpointError as err:
        raise ConfigError(f"--preset/--hf-config {err}") from None


def device_preset(name: str) -> DeviceSpec:
    return _lookup(DEVICE_PRESETS, name, "--device")


@dataclass(frozen=True)
class EngineConfig:
    """vLLM's KV-cache and scheduler knobs, same names and defaults as `vllm serve`.

    `block_size`, `max_num_seqs`, `max_num_batched_tokens` and `max_model_len` left
    as None take vLLM's defaults for the device and model (see `resolve`); resolved,
    they are ints. block_size defaults to 16 (vLLM's on GPUs) so an unresolved
    config has one; `kvengine serve` passes None to get the platform's.
    """

    # Each field with a "help" is a `vllm serve` flag of the same name (flags.add_engine_flags
    # derives the command line from these fields, as vLLM's EngineArgs does); launch commands
    # list them in this order, the searched knobs first.
    block_size: int | None = field(default=16, metadata={"help": "tokens per KV block", "always": True})
    gpu_memory_utilization: float = field(default=0.92, metadata={
        "help": "share of device memory the engine may use, in (0, 1]", "always": True})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV storage: auto = the model dtype", "choices": KV_CACHE_DTYPES, "always": True})
    max_num_seqs: int | None = field(default=None, metadata={
        "help": "most requests running at once (default: vLLM's for the device, 1024 or 256 on GPUs, 128 on "
                "the CPU)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget per step (default: vLLM's for the device, 8192 or 2048)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context limit per request (default: the model's)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "GPUs one replica's weights, heads and KV cache are split over (sizes one GPU's pool)"})
    quantization: str | None = field(default=None, metadata={
        "help": "the weights' quantization method (fp8 quantizes a 16-bit checkpoint as it loads; default: "
                "the checkpoint's quantization_config)", "choices": tuple(QUANTIZATION_FLAGS)})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "use this many KV blocks instead of sizing the pool from memory"})
    # vLLM's --kv-cache-memory-bytes: the KV pool's size in bytes, whatever the utilisation
    # (CPU vLLM's VLLM_CPU_KVCACHE_SPACE sets the same thing).
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "the KV pool's size (e.g. 4GiB or 4294967296), instead of sizing it from "
                "--gpu-memory-utilization", "size": True})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "cap on one request's prefill tokens per step, 0 = off"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse K/V of shared prompt prefixes", "always": True})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prefills across steps"})
    # Not a vLLM flag: the baseline allocator that PagedAttention replaced.
    kv_allocator: str = "paged"
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def resolve(self, model: ModelSpec, device: DeviceSpec) -> "EngineConfig":
        """Fill in vLLM's defaults for this device and model, then validate."""
        platform = platform_defaults(device)

        def default(value, fallback):
            return fallback if value is None else value

        cfg = dataclasses.replace(
            self,
            block_size=platform_block_size(model, device, default(self.block_size, platform.block_size)),
            max_model_len=default(self.max_model_len, model.max_position_embeddings),
            max_num_seqs=default(self.max_num_seqs, platform.max_num_seqs),
            max_num_batched_tokens=default(self.max_num_batched_tokens, platform.max_num_batched_tokens),
        )
        if not cfg.enable_chunked_prefill and self.max_num_batched_tokens is None:
            cfg = dataclasses.replace(
                cfg, max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len))
        cfg.validate(model)
        return cfg

    def validate(self, model: ModelSpec | None = None) -> None:
        bs = self.block_size
        if bs is not None and (not isinstance(bs, int) or bs not in BLOCK_SIZES):  # None: not resolved yet
            raise ConfigError(
                f"--block-size must be a power of two from 8 to 256 "
                f"({', '.join(map(str, BLOCK_SIZES))}), got {bs!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {util!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}")
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ConfigError(
                f"kv_allocator must be one of {', '.join(KV_ALLOCATORS)}, got {self.kv_allocator!r}")
        for flag, value in (("--max-num-seqs", self.max_num_seqs),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--max-model-len", self.max_model_len),
                            ("--tensor-parallel-size", self.tensor_parallel_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be >= 0")
        if (self.max_num_seqs and self.max_num_batched_tokens
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be greater "
                f"than or equal to --max-num-seqs ({self.max_num_seqs})")
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens
                and self.max_model_len and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({self.max_model_len}) with chunked prefill disabled: "
                "a long prompt could never be scheduled; raise it or enable chunked prefill")
        if self.quantization is not None and self.quantization not in QUANTIZATION_FLAGS:
            raise ConfigError(f"--quantization {self.quantization!r}: kvtune sizes {', '.join(QUANTIZATION_FLAGS)}")
        if model is not None:
            check_tensor_parallel(model, self.tensor_parallel_size)
            quantized(model, self.quantization)  # a method whose format the checkpoint must give
        if model is not None and self.max_model_len and self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len ({self.max_model_len}) is larger than {model.name}'s "
                f"max_position_embeddings ({model.max_position_embeddings})")
        if self.kv_cache_memory_bytes is not None and (
                not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes < 1):
            raise ConfigError(f"--kv-cache-memory-bytes must be a positive number of bytes, "
                              f"got {self.kv_cache_memory_bytes!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("--num-gpu-blocks-override must be at least 2 (one is the null block)")
