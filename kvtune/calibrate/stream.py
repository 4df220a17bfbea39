"""One streamed completion, as a probe sends it, each token's receipt time noted.

Requests look like the load generator's (streaming /v1/completions, token-id prompts,
ignore_eos, default sampling), so the steps the server runs for probes are those it runs
under load.
"""
from __future__ import annotations

import time
from contextlib import aclosing

import httpx

from ..loadgen import sse_payload
from .timings import RequestTiming

# A stream's lines are timed by the network read they arrived in: one read is one delivery,
# whatever the client does between its lines (on a loaded host it may be preempted while it
# parses them). Reads within BURST_S of the one before are one delivery too: a server that
# falls behind (vLLM's frontend on a busy CPU) writes what it held as several HTTP chunks at
# once, which the client may read apart; no engine step is that short.
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
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            raise BadAnswer(f"HTTP {resp.status_code}: {text}")
        async with aclosing(_lines_by_read(resp)) as lines:
            async for read_at, line in lines:
                payload = sse_payload(line)
                if payload is None:
                    continue
                if payload == "DONE":
                    done = True
                    break
                _note_tokens(timing, payload, read_at)
    if not done:
        raise BadAnswer("the stream ended without [DONE]; the server may have died")
    if len(timing.token_times) < max_tokens:
        raise BadAnswer(f"{len(timing.token_times)} tokens streamed, {max_tokens} asked for (ignore_eos; a "
                        "server that merges tokens into one chunk must report its usage in each chunk, "
                        "stream_options.continuous_usage_stats)")
    return timing


async def _lines_by_read(resp: httpx.Response):
    """(when it was read, the line) for each complete line of the stream. A read's lines share its
    time, and a read within BURST_S of the one before takes that one's time."""
    pending, read_at, last = b"", -1.0, -1.0
    async for data in resp.aiter_bytes():
        now = time.perf_counter()
        read_at = read_at if now - last < BURST_S else now
        last = now
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield read_at, line.rstrip(b"\r").decode()
    if pending:
        yield read_at, pending.rstrip(b"\r").decode()


def _note_tokens(timing: RequestTiming, payload: dict, read_at: float) -> None:
    """One chunk's tokens into `timing.token_times`, each at `read_at`."""
    if "error" in payload:
        raise BadAnswer(f"error chunk: {payload['error'].get('message', payload['error'])}")
    if not payload.get("choices"):
        return  # the final usage-only chunk
    usage = payload.get("usage")
    ids = payload["choices"][0].get("token_ids")
    # A chunk may carry several tokens (merged under load): the usage's running count says how
    # many, else its token ids; a text-only chunk counts one.
    count = usage["completion_tokens"] if usage else len(timing.token_times) + (len(ids) if ids else 1)
    timing.token_times.extend([read_at] * (count - len(timing.token_times)))
