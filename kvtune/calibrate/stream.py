"""One streamed completion, as a probe sends it, each token's receipt time noted.

Requests look like the load generator's (streaming /v1/completions, token-id prompts,
ignore_eos, default sampling), so the steps the server runs for probes are those it runs
under load.
"""
from __future__ import annotations

import time

import httpx

from ..loadgen import sse_payload
from .timings import RequestTiming

# Stream lines read within this of the chunk before are one delivery, timed as that chunk: a
# server that falls behind (vLLM's frontend on a busy CPU) writes what it held in one burst,
# whose lines the client reads 20-100 us apart; no engine step is that short.
BURST_S = 0.5e-3


class BadAnswer(Exception):
    """The server answered, but not with a full stream of the tokens asked for."""


async def stream_request(client: httpx.AsyncClient, model_name: str, prompt: list[int], max_tokens: int,
                         timing: RequestTiming | None = None) -> RequestTiming:
    """One streamed completion of exactly `max_tokens` tokens, each token's receipt time noted."""
    body = {**({"model": model_name} if model_name else {}), "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    timing = timing or RequestTiming(0.0)
    timing.sent = time.perf_counter()
    done = False
    read = -1.0  # when the last line came in
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            raise BadAnswer(f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            payload = sse_payload(line)
            if payload is None:
                continue
            if payload == "DONE":
                done = True
                break
            if "error" in payload:
                raise BadAnswer(f"error chunk: {payload['error'].get('message', payload['error'])}")
            if not payload.get("choices"):
                continue  # the final usage-only chunk
            usage = payload.get("usage")
            ids = payload["choices"][0].get("token_ids")
            # A chunk may carry several tokens (merged under load): the usage's running count
            # says how many, else its token ids; a text-only chunk counts one.
            count = usage["completion_tokens"] if usage else len(timing.token_times) + (len(ids) if ids else 1)
            read, last_read = now, read
            if timing.token_times and read - last_read < BURST_S:
                now = timing.token_times[-1]  # the same burst as the line before: one chunk (see timings.chunk_gaps)
            timing.token_times.extend([now] * (count - len(timing.token_times)))
    if not done:
        raise BadAnswer("the stream ended without [DONE]; the server may have died")
    if len(timing.token_times) < max_tokens:
        raise BadAnswer(f"{len(timing.token_times)} tokens streamed, {max_tokens} asked for (ignore_eos; a "
                        "server that merges tokens into one chunk must report its usage in each chunk, "
                        "stream_options.continuous_usage_stats)")
    return timing
