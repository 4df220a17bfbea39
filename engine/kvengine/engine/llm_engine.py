"""LLMEngine: requests in, one scheduled and executed step at a time, tokens out."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvengine.engine.clock import VirtualClock, WallClock
from kvengine.engine.replay import replay
from kvengine.config import DeviceSpec, EngineConfig, ModelSpec
from kvengine.core.contiguous import ContiguousKVCacheManager
from kvengine.executor.cost import CostCoefficients, StepCost
from kvengine.executor.abstract import Executor, SimExecutor
from kvengine.core.kv_manager import KVManager
from kvengine.core.memory import MemoryPlan, plan_memory, served_shard
from kvengine.core.request import Request, RequestStatus, SamplingParams, check_prompt
from kvengine.core.scheduler import Scheduler


@dataclass
class StepLog:
    """Per-step series, one list per column (cheap to append, easy to export)."""

    time: list[float] = field(default_factory=list)  # step end
    duration: list[float] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    num_preemptions: list[int] = field(default_factory=list)
    prefix_queries: list[int] = field(default_factory=list)  # tokens, new requests only
    prefix_hits: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # computed this step: prefill chunks + decodes
    generation_tokens: list[int] = field(default_factory=list)  # sampled this step
    num_seqs: list[int] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)  # K/V tokens the step read

    def __len__(self) -> int:
        return len(self.time)

    def as_dict(self) -> dict[str, list]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(slots=True)
class StepResult:
    new_tokens: list[tuple[Request, int]]
    finished: list[Request]
    preempted: list[Request]
    num_scheduled: int = 0  # requests the step ran: 0 when none could be scheduled


class LLMEngine:
    def __init__(self, config: EngineConfig, model: ModelSpec, device: DeviceSpec,
                 executor: Executor | None = None, clock: VirtualClock | WallClock | None = None,
                 cost_coefficients: CostCoefficients | None = None, eos_token_id: int | None = None,
                 record_steps: bool = True):
        self.config = config.resolve(model, device)
        self.model = model
        self.device = device
        # One GPU's shard sets a step's time: each rank reads its share of the weights and K/V, then
        # joins the all-reduces StepCost prices.
        self.cost = StepCost.build(served_shard(model, self.config), device,
                                   self.config.kv_cache_dtype, self.config.block_size, cost_coefficients)
        self.executor: Executor = executor or SimExecutor(self.cost)
        # A real executor measures its activation peak (a profiling pass at
        # max_num_batched_tokens, as vLLM does) before the pool is sized, and
        # allocates its KV cache tensors once the block count is known.
        activation = self.executor.profile_activation_bytes(self.config)
        self.memory: MemoryPlan = plan_memory(model, device, self.config, activation)
        self.kv: KVManager = self._make_kv_manager(self.memory.num_gpu_blocks)
        self.scheduler = Scheduler(self.config, self.kv)
        self.executor.initialize_cache(self.memory.num_gpu_blocks, self.kv)
        self.clock = clock or VirtualClock()
        self.eos_token_id = eos_token_id
        self.steps = StepLog()
        self.record_steps = record_steps  # a long-lived server keeps no per-step history
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self._prefix_seen = (0, 0)

    def _make_kv_manager(self, num_blocks: int) -> KVManager:
        cfg = self.config
        groups = self.memory.groups
        # Layers of several kinds, or windowed ones, take vLLM's per-group tables in the simulator; the
        # torch executor reads every block of a request, so it keeps one table (its window is a mask).
        if (cfg.kv_allocator == "paged" and isinstance(self.executor, SimExecutor)
                and groups is not None and groups.kinds != ("full",) and groups.kinds != ("mla",)):
            return HybridKVCacheManager(num_blocks, cfg.block_size, cfg.max_model_len, groups,
                                        cfg.enable_prefix_caching, self.memory.in_flight_tokens)
        cls = ContiguousKVCacheManager if cfg.kv_allocator == "contiguous" else KVCacheManager
        return cls(num_blocks, cfg.block_size, cfg.max_model_len, cfg.enable_prefix_caching)

    # -- requests ------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Queue a request; raises PromptTooLongError (vLLM's 400) if it cannot fit."""
        sp = sampling_params or SamplingParams()
        check_prompt(len(prompt_token_ids), self.config.max_model_len)
        max_len = self.config.max_model_len
        n = len(prompt_token_ids)
        if sp.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {sp.max_tokens}")
        if sp.max_tokens > max_len - n:
            sp = dataclasses.replace(sp, max_tokens=max_len - n)
        arrival = self.clock.now if arrival_time is None else arrival_time
        req = Request(request_id, list(prompt_token_ids), sp, arrival, self.eos_token_id, cache_salt)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """End a request early (a client went away, or a stop string matched)."""
        done = self.scheduler.finish_requests([request_id], status)
        for req in done:
            req.finish_time = self.clock.now
        self.finished.extend(done)
        return bool(done)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ------------------------------------------------------------
    def step(self) -> StepResult:
        sched = self.scheduler
        self.clock.step_started()
        start = self.clock.now
        out = sched.schedule()
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return StepResult([], [], out.preempted)
        for req in out.scheduled[len(out.scheduled) - out.num_new_reqs:]:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
        result = self.executor.execute(out)
        self.clock.advance(result.step_time_s)
        now = self.clock.now
        finished = sched.update_from_output(out, result.sampled)
        new_tokens = []
        for req, token in zip(out.scheduled, result.sampled):
            if token is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                req.token_times.append(now)
                new_tokens.append((req, token))
        for req in finished:
            req.finish_time = now
        self.finished.extend(finished)
        if self.record_steps:
            self._log_step(out, now, now - start, len(new_tokens))
        return StepResult(new_tokens, finished, out.preempted, len(out.scheduled))

    def _log_step(self, out, now: float, duration: float, generated: int) -> None:
        s, sched, stats = self.steps, self.scheduler, self.kv.prefix_stats
        queries, hits = self._prefix_seen
        self._prefix_seen = (stats.queries, stats.hits)
        s.time.append(now)
        s.duration.append(duration)
        s.num_running.append(len(sched.running))
        s.num_waiting.append(len(sched.waiting))
        s.kv_usage.append(self.kv.usage())
        s.num_preemptions.append(len(out.preempted))
        s.prefix_queries.append(stats.queries - queries)
        s.prefix_hits.append(stats.hits - hits)
        s.num_tokens.append(out.total_tokens)
        s.generation_tokens.append(generated)
        s.num_seqs.append(len(out.scheduled))
        s.context_tokens.append(sum([req.num_computed_tokens for req in out.scheduled]))

    # -- virtual-time replay -------------------------------------------------
    def replay(self, arrivals: Iterable[tuple[float, str, list[int], SamplingParams]], on_reject=None,
               max_concurrency: int | None = None, frontend=None) -> dict[str, float]:
        """Run a whole workload in virtual time (kvengine.engine.replay.replay): open loop, or
        closed at `max_concurrency` requests in flight; returns each request's send time."""
        return replay(self, arrivals, on_reject, max_concurrency, frontend)
