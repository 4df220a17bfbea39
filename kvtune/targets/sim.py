"""`SimTarget` replays the workload through kvengine's engine core with the
simulated executor in virtual time: the same scheduler and KV cache manager as
the live engine, no model, step times from the roofline cost model.

With a calibrated profile's client overhead it also models the server's frontend
(HTTP, parsing, tokenizing): one event loop takes requests in one at a time, each
reaching the engine core once taken in, so a burst enters the engine staggered,
as it does on a live server, not in one step. The overhead is the profile's idle
value for a request that finds nothing in flight, its busy value otherwise; latencies count
from when the client sent the request (kvengine.engine.replay).
"""
from __future__ import annotations

import dataclasses
import time

from kvengine.config import DeviceSpec, EngineConfig, ModelSpec
from kvengine.core.memory import KVCacheMemoryError
from kvengine.core.request import Request, SamplingParams
from kvengine.engine.llm_engine import LLMEngine
from kvengine.executor.cost import CostCoefficients
from kvengine.metrics.stats import request_timings

from ..results import RequestRecord, RunResult, config_dict, summarize
from ..workload import Workload, workload_prompt_token_ids, workload_stats
from .base import TargetStartError


class SimTarget:
    name = "sim"

    def __init__(self, model: ModelSpec, device: DeviceSpec,
                 cost_coefficients: CostCoefficients | None = None,
                 client_overhead_s: float = 0.0, client_overhead_busy_s: float | None = None):
        self.model = model
        self.device = device
        self.cost_coefficients = cost_coefficients
        self.client_overhead_s = client_overhead_s
        self.client_overhead_busy_s = client_overhead_s if client_overhead_busy_s is None else client_overhead_busy_s

    def with_model(self, model: ModelSpec) -> SimTarget:
        """The same simulator (device, cost coefficients, client overheads) of another model."""
        return SimTarget(model, self.device, self.cost_coefficients, self.client_overhead_s,
                         self.client_overhead_busy_s)

    def run(self, config: EngineConfig, workload: Workload) -> RunResult:
        t0 = time.perf_counter()
        try:
            engine = LLMEngine(config, self.model, self.device, cost_coefficients=self.cost_coefficients)
        except KVCacheMemoryError as err:
            raise TargetStartError(str(err)) from err
        rejected: dict[str, str] = {}
        frontend = self._frontend() if self.client_overhead_s or self.client_overhead_busy_s else None
        sent = engine.replay(_arrivals(workload), on_reject=lambda rid, err: rejected.setdefault(rid, str(err)),
                             max_concurrency=workload.max_concurrency, frontend=frontend)
        records = [_from_frontend(_record(req), req.arrival_time - sent[req.request_id]) for req in engine.finished]
        records += [RequestRecord(rid, sent[rid], workload.requests[int(rid)].input_length,
                                  finish_reason="rejected", error=msg)
                    for rid, msg in rejected.items()]
        records.sort(key=lambda r: int(r.request_id))
        first = workload.requests[0].arrival_s if workload.requests else 0.0
        stats = workload_stats(workload, block_size=engine.config.block_size)
        result = RunResult(
            target=self.name, model=self.model.name, device=self.device.name,
            config=config_dict(engine.config), workload=stats, requests=records,
            series=engine.steps.as_dict(), duration_s=max(engine.clock.now - first, 0.0),
            wall_s=time.perf_counter() - t0)
        result.summary = summarize(result)
        return result

    def _frontend(self):
        """When a request sent at `sent_s` reaches the engine: a frontend takes requests in one at
        a time in the order sent, each costing the busy overhead when others are in flight."""
        free = float("-inf")

        def reaches(sent_s: float, in_flight: int) -> float:
            nonlocal free
            free = max(sent_s, free) + (self.client_overhead_busy_s if in_flight > 0 else self.client_overhead_s)
            return free

        return reaches


def _arrivals(workload: Workload):
    prompts = workload_prompt_token_ids(workload)
    for i, (req, prompt) in enumerate(zip(workload.requests, prompts)):
        yield req.arrival_s, str(i), prompt, SamplingParams(max_tokens=req.output_length, ignore_eos=True)


def _from_frontend(record: RequestRecord, delay_s: float) -> RequestRecord:
    """A record timed from the engine's arrival, timed from the frontend's instead."""
    if not delay_s or record.ttft_s is None:
        return record
    return dataclasses.replace(record, arrival_s=record.arrival_s - delay_s, ttft_s=record.ttft_s + delay_s,
                               e2e_s=record.e2e_s + delay_s)


def _record(req: Request) -> RequestRecord:
    if not req.token_times:  # aborted before its first token
        return RequestRecord(req.request_id, req.arrival_time, req.num_prompt_tokens,
                             finish_reason=req.finish_reason)
    t = request_timings(req)
    return RequestRecord(req.request_id, t.arrival, t.prompt_tokens, t.output_tokens, t.cached_tokens,
                         t.ttft, t.tpot, t.e2e, t.queue, list(t.itl), t.num_preemptions, t.finish_reason)
