"""A workload's clients in virtual time: who sends what when, and when it reaches the engine.

Open loop: each request is sent at its arrival time, however busy the engine is.
Closed loop (`max_concurrency` N, vLLM's `vllm bench serve --max-concurrency`): at most N
requests are in flight (sent and not finished); a request due while N are in flight waits, in
trace order, and is sent when one finishes. A trace whose requests all arrive at t=0 with N is
`vllm bench serve --max-concurrency N --request-rate inf`.

A `frontend(sent_s, in_flight)` gives when a request sent at `sent_s` reaches the engine core
(an API server taking requests in one at a time); by default at once.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

from kvengine.core.request import SamplingParams

if TYPE_CHECKING:
    from kvengine.engine.llm_engine import LLMEngine

Arrival = tuple[float, str, list[int], SamplingParams]  # (arrival_s, id, prompt, params)


def replay(engine: LLMEngine, arrivals: Iterable[Arrival], on_reject=None, max_concurrency: int | None = None,
           frontend: Callable[[float, int], float] | None = None) -> dict[str, float]:
    """Run a whole workload on `engine` in virtual time; return each request's send time by id.

    `arrivals` are sorted by arrival. Idle gaps are skipped; a rejected prompt (the engine's 400)
    goes to `on_reject(id, error)` and frees its slot at once."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    cap = max_concurrency or float("inf")
    clock, pending = engine.clock, iter(arrivals)
    nxt = next(pending, None)
    inbound: deque[Arrival] = deque()  # sent, on its way to the engine: (reaches_s, id, prompt, params)
    sent: dict[str, float] = {}
    in_flight = 0
    slot_free_since = float("-inf")  # when the in-flight count last fell below the cap
    while nxt is not None or inbound or engine.has_unfinished():
        while nxt is not None and nxt[0] <= clock.now and in_flight < cap:
            at = max(nxt[0], slot_free_since)
            sent[nxt[1]] = at
            inbound.append((frontend(at, in_flight) if frontend else at, *nxt[1:]))
            in_flight += 1
            nxt = next(pending, None)
        while inbound and inbound[0][0] <= clock.now:
            reaches, rid, prompt, params = inbound.popleft()
            try:
                engine.add_request(rid, prompt, params, arrival_time=reaches)
            except ValueError as err:
                if on_reject is None:
                    raise
                on_reject(rid, err)
                in_flight -= 1
        if engine.has_unfinished():
            full, step = in_flight >= cap, engine.step()
            in_flight -= len(step.finished)
            if full and in_flight < cap:
                slot_free_since = clock.now
            if step.num_scheduled:
                continue
        elif nxt is None and not inbound:
            break
        # idle, or nothing schedulable until more arrives: jump to the next send or arrival
        due = [t for t in (inbound[0][0] if inbound else None,
                           nxt[0] if nxt is not None and in_flight < cap else None) if t is not None]
        if not due:
            raise RuntimeError("engine stalled: requests remain but none can be scheduled")
        clock.advance_to(min(due))
    return sent
