"""vLLM V1's scheduling policy (FCFS): continuous batching under a token budget.

One step: RUNNING requests first, in order, each getting the tokens that let
its computed count catch up (chunked prefill or one decode token); when the
pool runs dry the newest running request is preempted (recompute: blocks
freed, back to the front of the waiting queue). Then, only if nothing was
preempted, WAITING requests are admitted in FCFS order while the budget,
`max_num_seqs` and the pool allow; the first that does not fit stops admission
(head-of-line blocking), and admission needs the whole prompt to fit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvengine.config import EngineConfig
from kvengine.core.kv_manager import KVManager
from kvengine.core.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)  # running first, then admitted
    num_new_tokens: list[int] = field(default_factory=list)  # aligned with `scheduled`
    num_new_reqs: int = 0
    preempted: list[Request] = field(default_factory=list)
    total_tokens: int = 0
    # What an executor's block tables need (vLLM's NewRequestData.block_ids and
    # CachedRequestData.new_block_ids), aligned with `scheduled`: a request admitted this
    # step gets its whole table (prefix hits first), a running one the blocks added this step.
    new_block_ids: list[list[int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # ended since the last output: tables to drop


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.chunked_prefill = config.enable_chunked_prefill
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: list[str] = []  # for the next output that runs

    # -- queue management ----------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; frees their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(req)
            self.finished_req_ids.append(rid)
            done.append(req)
        return done

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if out.scheduled:  # the engine executes no empty output: the ids wait for one it does
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # The hot loop of every step: plain comparisons and local names on purpose.
        allocate, running = self.kv.allocate_slots, self.running
        threshold = self.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        limit = self.max_model_len - 1  # room for the sampled token
        scheduled, num_new, block_ids = out.scheduled, out.num_new_tokens, out.new_block_ids
        total = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) - computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > limit - computed:
                n = limit - computed
            if n <= 0:
                i += 1
                continue
            while (new_blocks := allocate(req, n)) is None:
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                req.num_computed_tokens = computed + n
                scheduled.append(req)
                num_new.append(n)
                block_ids.append([b.block_id for b in new_blocks] if new_blocks else new_blocks)
                total += n
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either
        out.total_tokens += total
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv, waiting, running = self.kv, self.waiting, self.running
        threshold = self.long_prefill_token_threshold if len(running) + len(waiting) > 1 else 0
        while budget > 0 and waiting and len(running) < self.max_num_seqs:
            req = waiting[0]
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if not self.chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if kv.allocate_slots(req, n, num_hit, hit_blocks, full_sequence_must_fit=True) is None:
                break  # FCFS: the head does not fit, nobody behind it goes first
            kv.record_prefix_cache_stats(req, num_hit)
            waiting.popleft()
            running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self._commit(out, req, n, kv.get_block_ids(req.request_id))
            out.num_new_reqs += 1
            budget -= n

    def _commit(self, out: SchedulerOutput, req: Request, n: int, block_ids: list[int]) -> None:
        req.num_computed_tokens += n
        out.scheduled.append(req)
        out.num_new_tokens.append(n)
        out.new_block_ids.append(block_ids)
        out.total_tokens += n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the forward pass ----------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Append each sampled token, apply the stop rules, free what finished."""
        finished = []
        max_model_len = self.max_model_len
        for req, token in zip(out.scheduled, sampled):
            if token is None or req.status != RequestStatus.RUNNING:
                continue  # mid-prefill chunk, or preempted later in the same step
            tokens = req.all_token_ids
            tokens.append(token)
            if token == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
            elif token in req.sampling_params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
            elif len(tokens) >= max_model_len or len(tokens) - req.num_prompt_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                continue
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            for req in finished:
                self.kv.free(req)
                del self.requests[req.request_id]
                self.finished_req_ids.append(req.request_id)
        return finished
