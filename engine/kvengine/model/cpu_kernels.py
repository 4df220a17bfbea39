"""kvengine's CPU kernels (csrc/*.cpp), built on first use.

- paged_attention.cpp: decode attention reading K/V in place through block tables;
- greedy_head.cpp: exact greedy tokens through an int8 lm_head screen (AVX-512 VNNI).

Decode attention through torch on the CPU has to gather every sequence's K/V
out of the block pool into one padded tensor before two batched matmuls: on
the tiny benchmark model the gather moves three times the bytes the attention
needs and costs more than the attention itself. The kernel reads K/V in place
through the block tables (as vLLM's CPU backend does), with no padding to
mask, prefetching each next block (blocks sit anywhere in the pool, so the
hardware prefetcher cannot foresee them): about 0.33 ms -> 0.16 ms per layer at 32
sequences x 256 tokens inside a decode step of the tiny model.

The lm_head of a step is the other large cost: model.GreedyHead's bf16
screen streams a bf16 copy of the matrix through oneDNN and then scans the
logits in several torch passes; greedy_head.cpp reads int8 weights (half the
bytes), keeps only chunk maxima, and rechecks the few candidates in float32
in the same call: 2.0 ms -> 1.4 ms per step at 32 rows x 32000 x 256.

They are plain C++ with a C ABI, compiled with the system's g++ (no torch
headers, under a second) into $KVENGINE_CACHE_DIR (default
~/.cache/kvengine), one library per set of sources, compiler and CPU, loaded with
ctypes (which releases the GIL while it runs, so the HTTP frontend keeps
serving). `-march=native` because the library is built on the machine that
runs it; `-ffast-math` for vectorized exp (glibc's libmvec) and reductions,
at compile time only: linking with it would pull in crtfastmath, which turns
on flush-to-zero for the whole process and would change torch's numbers.

No compiler, a failed build, or KVENGINE_CPU_KERNEL=0: `load()` gives None
(the reason in `unavailable_reason()`) and the model keeps the torch paths;
so does a shape the attention kernel was not instantiated for (head_dim
16/32/64/128, 1/2/4/8 query heads per kv head), and a CPU without AVX-512
VNNI keeps the bf16 greedy screen. The kernels run on one thread.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17"]
ENV_SWITCH = "KVENGINE_CPU_KERNEL"
log = logging.getLogger(__name__)

_state: dict = {}  # "kernel" (the CpuKernels or None) and "reason", once load() has run


class CpuKernels:
    """The loaded library: `attention` always, `greedy` where the CPU has VNNI."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self.attention = DecodeAttentionKernel(lib)
        self.greedy = GreedyInt8Kernel(lib) if lib.kvengine_greedy_supported() else None


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the decode kernel reads


class DecodeAttentionKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.kvengine_paged_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64]
        self._supports = lib.kvengine_supports
        self._supports.restype = ctypes.c_int
        self._supports.argtypes = [ctypes.c_int64, ctypes.c_int64]

    def supports(self, head_dim: int, group: int) -> bool:
        return bool(self._supports(head_dim, group))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, window: int | None,
                 scale: float) -> torch.Tensor:
        """q [seqs, heads, dim] float32; k/v_cache [kv_heads, blocks, block_size, dim] (one
        layer), float32 or bfloat16; tables [seqs, max_blocks] and lens [seqs] int64.
        Returns [seqs, heads, dim] float32."""
        S, H, d = q.shape
        hkv, num_blocks, bs, _ = k_cache.shape
        if (q.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES
                or v_cache.dtype != k_cache.dtype):
            raise ValueError("the CPU kernel takes a float32 query and float32 or bfloat16 K/V, "
                             f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
        for t in (q, k_cache, v_cache):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("the CPU kernel takes contiguous CPU tensors")
        if tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("block tables and lengths must be int64")
        # per call, not kept: engines in several threads share this object, and
        # ctypes lets them run at once
        scratch = torch.empty((H // hkv) * tables.shape[1] * bs)
        out = torch.empty_like(q)
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      tables.contiguous().data_ptr(), lens.contiguous().data_ptr(),
                      out.data_ptr(), scratch.data_ptr(), S, H, hkv, d, num_blocks, bs,
                      tables.shape[1], window or 0, scale, k_cache.dtype == torch.bfloat16)
        if rc != 0:
            raise ValueError(f"the CPU kernel has no instance for head_dim {d}, "
                             f"{H // hkv} query heads per kv head")
        return out


class GreedyInt8Kernel:
    """kvengine_greedy_int8 (csrc/greedy_head.cpp); model.Int8GreedyHead prepares its inputs."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.kvengine_greedy_int8
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5
                             + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])

    def __call__(self, packed, weight, w_scale, vocab, k4, x, xq, x_scale, x_sum, bound,
                 chunk_max, max_candidates) -> torch.Tensor:
        S, K = x.shape
        out = torch.empty(S, dtype=torch.int64)
        rc = self._fn(packed.data_ptr(), weight.data_ptr(), w_scale.data_ptr(), vocab, K, k4,
                      x.data_ptr(), xq.data_ptr(), x_scale.data_ptr(), x_sum.data_ptr(),
                      bound.data_ptr(), S, chunk_max.data_ptr(),
                      max_candidates, out.data_ptr())
        if rc != 0:
            raise RuntimeError("kvengine_greedy_int8 is not supported on this CPU")
        return out


def load() -> CpuKernels | None:
    """The kernel, built and loaded once per process; None when switched off or it cannot be."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if "kernel" not in _state:
        try:
            _state["kernel"], _state["reason"] = _load(), None
        except KernelUnavailable as e:
            _state["kernel"], _state["reason"] = None, str(e)
            log.warning("CPU kernels unavailable, using the slower torch paths: %s", e)
    return _state["kernel"]


def unavailable_reason() -> str | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    load()
    return _state["reason"]


class KernelUnavailable(RuntimeError):
    pass


def _load() -> CpuKernels:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler or not shutil.which(compiler):
        raise KernelUnavailable(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{compiler} --version failed: {e}") from None
    sources = [p.read_bytes() for p in SOURCES]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(COMPILE_FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("KVENGINE_CACHE_DIR") or Path.home() / ".cache" / "kvengine")
    path = cache / f"kvengine_cpu-{key}.so"
    if not path.exists():
        _build(compiler, cache, path)
    try:
        return CpuKernels(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None


def _build(compiler: str, cache: Path, path: Path) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create {cache}: {e}") from None
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        lib = Path(tmp) / "kvengine_cpu.so"
        steps = [[compiler, *COMPILE_FLAGS, "-c", str(src), "-o", obj]
                 for src, obj in zip(SOURCES, objs)]
        steps.append([compiler, "-shared", *objs, "-o", str(lib), "-lmvec", "-lm"])
        for cmd in steps:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
            if done.returncode != 0 and "-lmvec" in cmd:  # no libmvec: scalar exp
                cmd = [c for c in cmd if c != "-lmvec"]
                done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, path)  # atomic: a concurrent build of the same key is harmless


def _cpu_flags() -> str:
    """What -march=native depends on: a library built for another CPU must not be reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform
        return platform.processor()
