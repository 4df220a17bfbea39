"""`SimTarget` replays the workload through kvengine's engine core with the
simulated executor in virtual time: the same scheduler and KV cache manager as
the live engine, no model, step times from the roofline cost model.
"""
from __future__ import annotations

import time

from kvengine.config import DeviceSpec, EngineConfig, ModelSpec
from kvengine.cost import CostCoefficients
from kvengine.engine import LLMEngine
from kvengine.memory import KVCacheMemoryError
from kvengine.request import Request, SamplingParams
from kvengine.stats import request_timings

from ..results import RequestRecord, RunResult, summarize
from ..workload import Workload, workload_prompt_token_ids, workload_stats
from .base import TargetStartError


class SimTarget:
    name = "sim"

    def __init__(self, model: ModelSpec, device: DeviceSpec,
                 cost_coefficients: CostCoefficients | None = None):
        self.model = model
        self.device = device
        self.cost_coefficients = cost_coefficients

    def run(self, config: EngineConfig, workload: Workload) -> RunResult:
        t0 = time.perf_counter()
        try:
            engine = LLMEngine(config, self.model, self.device,
                               cost_coefficients=self.cost_coefficients)
        except KVCacheMemoryError as err:
            raise TargetStartError(str(err)) from err
        rejected: dict[str, str] = {}
        engine.replay(_arrivals(workload), on_reject=lambda rid, err: rejected.setdefault(rid, str(err)))
        records = [_record(req) for req in engine.finished]
        records += [RequestRecord(rid, workload.requests[int(rid)].arrival_s,
                                  workload.requests[int(rid)].input_length,
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


def _arrivals(workload: Workload):
    prompts = workload_prompt_token_ids(workload)
    for i, (req, prompt) in enumerate(zip(workload.requests, prompts)):
        yield req.arrival_s, str(i), prompt, SamplingParams(max_tokens=req.output_length, ignore_eos=True)


def _record(req: Request) -> RequestRecord:
    if not req.token_times:  # aborted before its first token
        return RequestRecord(req.request_id, req.arrival_time, req.num_prompt_tokens,
                             finish_reason=req.finish_reason)
    t = request_timings(req)
    return RequestRecord(req.request_id, t.arrival, t.prompt_tokens, t.output_tokens, t.cached_tokens,
                         t.ttft, t.tpot, t.e2e, t.queue, list(t.itl), t.num_preemptions, t.finish_reason)


def config_dict(config: EngineConfig) -> dict:
    return {k: v for k, v in vars(config).items() if k != "extra"}
