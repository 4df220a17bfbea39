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

from .config import EngineConfig
from .kv_manager import KVManager
from .request import Request, RequestStatus


def causal_pairs(new_tokens: int, context: int) -> int:
    """(query, key) pairs of `new_tokens` queries ending a `context`-token sequence under a
    causal mask: each attends to the earlier context and to its chunk up to itself. A decode
    (1 token) attends to the whole context; a fresh prefill of n tokens to n(n+1)/2 pairs."""
    return new_tokens * (context - new_tokens) + new_tokens * (new_tokens + 1) // 2


def kernel_pairs(new_tokens: int, context: int, key_block: int, all_keys_after_context: bool = False) -> int:
    """(query, key) pairs an attention kernel computes for `new_tokens` queries ending a
    `context`-token sequence, where it takes keys `key_block` at a time: each query attends
    up to the end of the block holding its own position (the block's later keys computed,
    then masked), at most the whole context. key_block 0: the causal pairs.
    `all_keys_after_context`: a chunk after earlier context attends to every key (a kernel
    handed an explicit mask skips no block)."""
    start = context - new_tokens
    if all_keys_after_context and start > 0:
        return new_tokens * context
    if key_block <= 0:
        return causal_pairs(new_tokens, context)
    pairs = 0
    for block in range(start // key_block, (context - 1) // key_block + 1):
        end = min(context, (block + 1) * key_block)
        pairs += (end - max(start, block * key_block)) * end
    return pairs


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)  # running first, then admitted
    num_new_tokens: list[int] = field(default_factory=list)  # aligned with `scheduled`
    num_new_reqs: int = 0
    preempted: list[Request] = field(default_factory=list)
    total_tokens: int = 0
    # Cost-model inputs, summed over the batch while scheduling (context = after the step).
    context_tokens: int = 0
    attention_token_pairs: int = 0  # (query, key) pairs a causal kernel computes; see causal_pairs
    decode_token_pairs: int = 0  # the part of them one-token queries (decodes) compute: their contexts
    context_chunk_pairs: int = 0  # the part of them prefill chunks after earlier context compute


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
            done.append(req)
        return done

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # The hot loop of every step: plain comparisons and local names on purpose.
        allocate, running = self.kv.allocate_slots, self.running
        threshold = self.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        limit = self.max_model_len - 1  # room for the sampled token
        scheduled, num_new = out.scheduled, out.num_new_tokens
        total = context = pairs = decode_pairs = chunk_pairs = 0
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
            while allocate(req, n) is None:
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                ctx = req.num_computed_tokens = computed + n
                scheduled.append(req)
                num_new.append(n)
                total += n
                context += ctx
                p = causal_pairs(n, ctx)
                pairs += p
                if n == 1:
                    decode_pairs += ctx
                elif ctx > n:
                    chunk_pairs += p
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either
        out.total_tokens += total
        out.context_tokens += context
        out.attention_token_pairs += pairs
        out.decode_token_pairs += decode_pairs
        out.context_chunk_pairs += chunk_pairs
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
            self._commit(out, req, n)
            out.num_new_reqs += 1
            budget -= n

    def _commit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        req.num_computed_tokens += n
        ctx = req.num_computed_tokens
        out.scheduled.append(req)
        out.num_new_tokens.append(n)
        out.total_tokens += n
        out.context_tokens += ctx
        pairs = causal_pairs(n, ctx)
        out.attention_token_pairs += pairs
        if n == 1:
            out.decode_token_pairs += ctx
        elif ctx > n:  # a prefix hit's chunk
            out.context_chunk_pairs += pairs

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
        return finished
