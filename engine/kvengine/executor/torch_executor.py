"""TorchExecutor: real forward passes over a paged KV cache, behind SimExecutor's interface.

torch_engine.build_torch_engine wires one into an LLMEngine, which drives it in three calls:
  1. `profile_activation_bytes(config)` before the pool is sized. On CUDA a
     profiling forward pass at `max_num_batched_tokens` (split over
     `max_num_seqs` sequences, with their logits), measured as vLLM measures it:
     the rise of torch.cuda.max_memory_allocated over the weights. On the CPU
     the same pass (and a sampling pass over its logits), measured as the rise
     of the process's peak resident memory (Linux VmHWM, reset first): what
     torch, oneDNN and malloc hold at the peak, not only live tensors. Only in
     a process that serves this engine alone (`profile_rss`: the server's
     engine core), where RSS is the engine's; elsewhere, or where /proc cannot
     say, memory.activation_peak_bytes estimates it.
  2. `initialize_cache(num_gpu_blocks, kv_manager)`: allocates the KV tensors
     (exactly num_gpu_blocks * memory.kv_bytes_per_block bytes of payload,
     plus the quantized types' scales, reported apart as `kv_scale_bytes`).
  3. `execute(out)` every step: the scheduler has already advanced each
     request's num_computed_tokens by its num_new_tokens, so request i
     computes tokens [c - n, c) of all_token_ids; it samples when c reaches
     the end of its tokens, else (a prefill chunk) its entry is None. Its
     block tables come from the outputs' block ids, not from the KV manager.
"""
from __future__ import annotations

import ctypes
import os
import time
from types import SimpleNamespace

import torch

from kvengine.core.kv_cache_manager import cdiv
from kvengine.config import (
    DEVICE_PRESETS,
    ConfigError,
    DeviceSpec,
    EngineConfig,
    GiB,
    ModelSpec,
)
from kvengine.executor.abstract import ExecutorOutput
from kvengine.model.kv_cache import PagedKVCache
from kvengine.core.kv_manager import KVManager
from kvengine.core.memory import KVCacheMemoryError, activation_peak_bytes, kv_bytes_per_block
from kvengine.model.llama import (
    AttentionBatch,
    LlamaModel,
    PrefillChunk,
    decode_bias,
    prefill_mask,
)
from kvengine.core.request import SamplingParams
from kvengine.model.sampling import Sampler, is_greedy
from kvengine.core.scheduler import SchedulerOutput

DEFAULT_CPU_MEMORY = 2 * GiB
THREADS_ENV = "KVENGINE_NUM_THREADS"
M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
ONEDNN_CACHE_CAPACITY = 16  # primitives kept by tune_cpu_allocators


# -- devices -------------------------------------------------------------------------
def resolve_device(device: str | None = "cpu") -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'. 'cpu', 'cuda' and 'cuda:N'
    pass through (checked); a GPU preset name (h100-80gb, ...) means 'cuda'."""
    device = (device or "cpu").strip()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in DEVICE_PRESETS and device != "cpu":
        device = "cuda"
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = (f"torch {torch.__version__} is a CPU-only build" if build is None
                   else f"torch {torch.__version__} (CUDA {build}) sees no GPU")
            raise ConfigError(f"--device {device}: CUDA is not available here ({why}); "
                              "use --device cpu (or auto)")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
        return device
    raise ConfigError(f"--device {device!r}: the torch executor runs on cpu, cuda, cuda:N or auto")


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def reset_peak_resident() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) at the current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """This process's peak resident memory since start or the last reset (VmHWM), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, StopIteration):
        return 0


def tune_cpu_allocators() -> None:
    """For a process that serves one CPU engine: keep memory that is freed returnable.

    Every step's token count is a new shape, and oneDNN caches a primitive per
    shape (1024 by default) for the life of the process; glibc gives each thread
    its own heap (the pipe's reader thread one more), where freed pages stay
    resident. Both grow the RSS under load past what the profile run saw. (A
    fixed mmap threshold would return more, but page-faults every step's large
    tensors: measured slower.) Must run before oneDNN's first primitive and
    before threads start; an operator's own settings win.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc
        pass


def torch_device_spec(device: str, device_memory: int | None = None, runtime_bytes: int = 0) -> DeviceSpec:
    """The DeviceSpec the pool is sized from.

    cuda: the real GPU's total memory (so gpu_memory_utilization applies to it),
    its name, and bandwidth/FLOP/s of the matching preset (H100's if none match).
    cpu: a budget of `device_memory` bytes (default 2 GiB) plays the device's
    total memory; bandwidth, FLOP/s and overhead of the `cpu` preset, and vLLM's
    CPU-build defaults (block_size 128, max_num_seqs 128) for knobs left unset.
    `runtime_bytes`, the memory a process serving only this engine holds beside its
    weights (interpreter, torch, libraries, what loading left), is its non-torch overhead
    where it is more than the preset's: on a CPU it takes the same memory as the pool,
    as a CUDA context takes a GPU's.
    """
    device = resolve_device(device)
    if device == "cpu":
        base = DEVICE_PRESETS["cpu"]
        memory = DEFAULT_CPU_MEMORY if device_memory is None else int(device_memory)
        return DeviceSpec("cpu", memory, base.hbm_bandwidth, base.bf16_flops,
                          non_torch_overhead_bytes=max(base.non_torch_overhead_bytes, runtime_bytes),
                          platform="cpu")
    props = torch.cuda.get_device_properties(torch.device(device))
    total = full = torch.cuda.mem_get_info(torch.device(device))[1]
    if device_memory is not None:
        total = min(total, int(device_memory))
    name = props.name
    base = DEVICE_PRESETS[gpu_preset_name(name, full)]
    large = total >= 70 * GiB and "a100" not in name.lower()  # vLLM's default-batch rule
    return DeviceSpec(name, total, base.hbm_bandwidth, base.bf16_flops, large_memory=large)


def gpu_preset_name(gpu_name: str, total_memory: int) -> str:
    """The device preset for a GPU torch names ('NVIDIA H200', 141 GiB -> 'h200-141gb'):
    the same chip's preset nearest in memory, h100-80gb where no chip matches."""
    key = gpu_name.lower()
    same_chip = [n for n in DEVICE_PRESETS if n != "cpu" and n.split("-")[0] in key]
    return min(same_chip, key=lambda n: abs(DEVICE_PRESETS[n].memory_bytes - total_memory),
               default="h100-80gb")


def set_num_threads(num_threads: int | None = None) -> int:
    """torch's intra-op threads: the argument, else $KVENGINE_NUM_THREADS, else 1
    (on a small CPU box one thread is several times faster than two)."""
    n = num_threads or int(os.environ.get(THREADS_ENV, "1") or 1)
    torch.set_num_threads(max(1, n))
    return n


# -- the executor -------------------------------------------------------------------
class TorchExecutor:
    def __init__(self, model: LlamaModel, tokenizer=None, seed: int = 0,
                 kv_cache_dtype: str | None = None, profile_rss: bool = False):
        self.model = model
        self.profile_rss = profile_rss
        self.spec: ModelSpec = model.spec
        self.device = model.device
        self.tokenizer = tokenizer
        self.sampler = Sampler(seed, self.device)
        self.kv_cache_dtype = kv_cache_dtype
        self.config: EngineConfig | None = None
        self.cache: PagedKVCache | None = None
        self.block_size = 0
        self.block_tables: dict[str, list[int]] = {}  # request id -> block ids, from the scheduler's outputs
        # Called as hook(requests, logits [S, vocab] float32) on every step that
        # samples (forces the full-logits path): for tests and accuracy studies.
        self.logits_hook = None

    # -- start-up hooks (LLMEngine calls them) ----------------------------------
    def profile_activation_bytes(self, config: EngineConfig) -> int:
        self.config = config
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = config.kv_cache_dtype
        if self.device.type == "cuda":
            return self._profile_cuda(config)
        measured = self._profile_cpu(config) if self.profile_rss else None
        if measured is None:
            return activation_peak_bytes(self.spec, config.max_num_batched_tokens, config.max_num_seqs)
        return measured

    def _profile_cpu(self, config: EngineConfig) -> int | None:
        """The rise of peak RSS over a profile run and a sampling pass; None where unknown."""
        cache = self._profile_cache(config)
        cache.data.zero_()  # its pages resident before the baseline: cache, not activation
        if not reset_peak_resident():
            return None
        before = resident_bytes()
        logits = self.profile_run(config, cache)
        stub = SimpleNamespace(sampling_params=SamplingParams(temperature=1.0, top_p=0.95, top_k=50))
        Sampler(0, self.device).sample(logits, [stub] * logits.shape[0])  # its own generator
        peak = peak_resident_bytes()
        del cache, logits
        return max(0, peak - before) if peak else None

    def _profile_cuda(self, config: EngineConfig) -> int:
        cache = self._profile_cache(config)  # allocated before the baseline: not activation
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_run(config, cache)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del cache
        torch.cuda.empty_cache()
        return int(peak)

    @staticmethod
    def _profile_sequences(config: EngineConfig) -> list[int]:
        """vLLM's dummy batch: max_num_batched_tokens tokens over min(max_num_seqs,
        tokens) sequences, as even as they split."""
        tokens = config.max_num_batched_tokens
        seqs = min(config.max_num_seqs, tokens)
        return [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]

    def _profile_cache(self, config: EngineConfig) -> PagedKVCache:
        bs = config.block_size
        blocks = sum(cdiv(n, bs) for n in self._profile_sequences(config)) + 1
        return PagedKVCache(self.spec.num_layers, blocks, bs, self.spec.num_kv_heads,
                            self.spec.head_dim, self.kv_cache_dtype or config.kv_cache_dtype,
                            self.model.dtype, self.device)

    def profile_run(self, config: EngineConfig, cache: PagedKVCache) -> torch.Tensor:
        """One forward pass over the dummy batch into `cache`, and each sequence's
        last-token logits (returned), as vLLM's profile run."""
        bs, dev = config.block_size, self.device
        ids, positions, slots, chunks, next_block = [], [], [], [], 1
        for n in self._profile_sequences(config):
            block_ids = list(range(next_block, next_block + cdiv(n, bs)))
            next_block += len(block_ids)
            chunks.append(PrefillChunk(len(ids), n, n, torch.tensor(block_ids, device=dev),
                                       None, True))
            ids += [0] * n
            positions += range(n)
            slots += [block_ids[p // bs] * bs + p % bs for p in range(n)]
        batch = AttentionBatch(torch.tensor(slots, device=dev), 0, None, None, None, chunks)
        cache.zero_fresh_blocks(batch.slots)
        hidden = self.model.forward(torch.tensor(ids, device=dev),
                                    torch.tensor(positions, device=dev), batch, cache)
        last = torch.tensor([c.row + c.num_tokens - 1 for c in chunks], device=dev)
        return self.model.compute_logits(hidden[last])

    def initialize_cache(self, num_gpu_blocks: int, kv_manager: KVManager) -> None:
        self.block_size = kv_manager.block_size
        dtype = self.kv_cache_dtype or (self.config.kv_cache_dtype if self.config else "auto")
        self.kv_cache_dtype = dtype
        if self.device.type == "cuda":
            self._check_cache_fits(num_gpu_blocks, dtype)
        self.cache = PagedKVCache(self.spec.num_layers, num_gpu_blocks, self.block_size,
                                  self.spec.num_kv_heads, self.spec.head_dim, dtype,
                                  self.model.dtype, self.device)

    def _check_cache_fits(self, num_blocks: int, dtype: str) -> None:
        """A clear error instead of a CUDA OOM from inside torch: the payload the
        plan sized, plus the quantized types' scales, which the plan leaves to
        the overhead margin (4 bytes per head_dim payload bytes)."""
        payload = num_blocks * kv_bytes_per_block(self.spec, dtype, self.block_size)
        scales = 0 if dtype == "auto" else payload * 4 // self.spec.head_dim
        free = torch.cuda.mem_get_info(self.device)[0]
        if payload + scales > free:
            raise KVCacheMemoryError(
                f"The KV cache ({num_blocks} blocks: {payload / GiB:.2f} GiB of K/V"
                + (f" + {scales / GiB:.2f} GiB of {dtype} scales" if scales else "")
                + f") does not fit in the {free / GiB:.2f} GiB free on {self.device}. "
                "Decrease `gpu_memory_utilization` or set `num_gpu_blocks_override`.")

    @property
    def kv_cache_bytes(self) -> int:
        """K+V payload allocated: num_gpu_blocks * memory.kv_bytes_per_block(...)."""
        return self.cache.payload_bytes if self.cache else 0

    @property
    def kv_scale_bytes(self) -> int:
        return self.cache.scale_bytes if self.cache else 0

    # -- one step -----------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        start = time.perf_counter()
        if self.cache is None:
            raise RuntimeError("TorchExecutor.execute before initialize_cache")
        self._update_block_tables(out)
        ids, positions, batch, sample_rows, sample_reqs, sample_at = self._prepare(out)
        sampled: list[int | None] = [None] * len(out.scheduled)
        if ids is not None:
            if not self.model.decodes_in_place(self.cache):  # the kernel reads no padding
                self.cache.zero_fresh_blocks(batch.slots)
            hidden = self.model.forward(ids, positions, batch, self.cache)
            if sample_rows:
                last = hidden[torch.tensor(sample_rows, device=self.device)]
                if self.logits_hook is None and all(is_greedy(r.sampling_params)
                                                    for r in sample_reqs):
                    tokens = self.model.greedy_tokens(last).tolist()
                else:
                    logits = self.model.compute_logits(last)
                    if self.logits_hook is not None:
                        self.logits_hook(sample_reqs, logits)
                    tokens = self.sampler.sample(logits, sample_reqs)
                for i, token in zip(sample_at, tokens):
                    sampled[i] = token
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ExecutorOutput(sampled, time.perf_counter() - start)

    def _update_block_tables(self, out: SchedulerOutput) -> None:
        """Apply the output's block ids: a request admitted (or resumed) this step brings
        its whole table, a running one the blocks it was given."""
        tables = self.block_tables
        for rid in out.finished_req_ids:
            tables.pop(rid, None)
        for req in out.preempted:
            tables.pop(req.request_id, None)
        first_new = len(out.scheduled) - out.num_new_reqs
        for i, (req, block_ids) in enumerate(zip(out.scheduled, out.new_block_ids)):
            if i >= first_new:
                tables[req.request_id] = list(block_ids)
            elif block_ids:
                tables[req.request_id].extend(block_ids)

    def _prepare(self, out: SchedulerOutput):
        """Flatten the step: decode rows first, then each prefill chunk's rows."""
        bs, block_tables, dev = self.block_size, self.block_tables, self.device
        window = self.spec.sliding_window
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        prefill = []
        sample_rows, sample_reqs, sample_at = [], [], []
        for i, (req, n) in enumerate(zip(out.scheduled, out.num_new_tokens)):
            c = req.num_computed_tokens
            if n <= 0 or req.is_finished:
                continue
            if n > 1:
                prefill.append((i, req, n, c))
                continue
            blocks = block_tables[req.request_id][:cdiv(c, bs)]
            p = c - 1
            ids.append(req.all_token_ids[p])
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            tables.append(blocks)
            context_lens.append(c)
            if c >= len(req.all_token_ids):
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
                sample_at.append(i)
        num_decode = len(ids)
        decode_blocks = lens = bias = None
        if num_decode:
            width = max(len(t) for t in tables)
            decode_blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
            lens = torch.tensor(context_lens, device=dev)
            if not self.model.decodes_in_place(self.cache):
                bias = decode_bias(lens, width * bs, window, self.model.dtype)
        chunks = []
        slot_parts = [torch.tensor(slots, dtype=torch.long, device=dev)]
        for i, req, n, c in prefill:
            start = c - n
            blocks = torch.tensor(block_tables[req.request_id][:cdiv(c, bs)], device=dev)
            pos = torch.arange(start, c, device=dev)
            slot_parts.append(blocks[pos // bs] * bs + pos % bs)
            chunks.append(PrefillChunk(len(ids), n, c, blocks,
                                       prefill_mask(start, n, c, window, dev), start == 0))
            ids.extend(req.all_token_ids[start:c])
            positions.extend(range(start, c))
            if c >= len(req.all_token_ids):
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
                sample_at.append(i)
        if not ids:
            return None, None, None, [], [], []
        batch = AttentionBatch(torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0],
                               num_decode, decode_blocks, lens, bias, chunks)
        return (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), batch,
                sample_rows, sample_reqs, sample_at)
