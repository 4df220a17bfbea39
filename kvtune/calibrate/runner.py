"""Running a probe plan against a live server over HTTP, one probe at a time, on an idle server.

Every prompt is fresh (design.probe_prompts); where the server's prefix cache serves one
anyway (over 10% of what a probe looked up, by its hit and query counters), the calibration
stops and says so. A server that dies, refuses or answers errors stops it too, the probe
and the URL named.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from .design import LOADED_FIRST, LOADED_SPACING, TOKEN_HIGH, TOKEN_LOW, TTFT, Probe, ProbePlan, probe_prompts
from .errors import CalibrationError
from .server import PrefixCacheCounts, prefill_times, prefix_hits
from .stream import BadAnswer, stream_request
from .timings import ProbeRun, RequestTiming, TrialRun


@dataclass
class ProbeOptions:
    request_timeout_s: float = 120.0  # one request, first byte to last token
    deadline_s: float = 900.0  # the whole probe run
    # None: fresh prompts each run. A fixed seed repeats them, and a second calibration of the
    # same server then hits the blocks the first left in its prefix cache (a 4k prefill in 14 ms).
    seed: int | None = None
    settle_s: float = 0.02  # idle time between requests, so each starts on an idle engine
    warmup_requests: int = 3  # unmeasured batches before the probes


def run_probes(url: str, model_name: str, plan: ProbePlan, options: ProbeOptions | None = None,
               check_alive=None, progress=None) -> list[ProbeRun]:
    """Run the plan's probes one at a time; a server that dies, refuses or answers
    errors raises CalibrationError naming the URL and the probe."""
    options = options or ProbeOptions()
    return asyncio.run(_run_all(url.rstrip("/"), model_name, plan, options, check_alive, progress))


async def _run_all(url, model_name, plan, options, check_alive, progress) -> list[ProbeRun]:
    rng = np.random.default_rng(options.seed)
    deadline = time.monotonic() + options.deadline_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(options.request_timeout_s, connect=10.0)
    runs = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
        warmup = Probe("warmup", "warm-up", 16, 4, (), batch=4)
        for _ in range(options.warmup_requests):  # connections, the server's first-request costs
            try:
                await _trial(client, model_name, warmup, None, probe_prompts(warmup, rng).prompts, options)
            except (httpx.HTTPError, BadAnswer) as err:
                raise CalibrationError(_failure(url, warmup, err, check_alive)) from None
        for i, probe in enumerate(plan.probes):
            trials = []
            hits_before = None if probe.prefix_len else await prefix_hits(client)
            for _ in range(1 if probe.background else probe.repeats):
                if time.monotonic() > deadline:
                    raise CalibrationError(f"probe {probe.label!r} on {url}: the probes ran past their "
                                           f"{options.deadline_s:.0f} s limit; the server is too slow for "
                                           "this probe set (try --quick or a smaller --max-prompt)")
                drawn = probe_prompts(probe, rng)
                try:
                    if probe.background:
                        trials.append(await _loaded_trial(client, model_name, probe, drawn.warmup, rng, options))
                    else:
                        trials.append(await _trial(client, model_name, probe, drawn.warmup, drawn.prompts, options))
                except (httpx.HTTPError, BadAnswer) as err:
                    raise CalibrationError(_failure(url, probe, err, check_alive)) from None
            if hits_before is not None:
                _check_no_hits(url, probe, hits_before, await prefix_hits(client))
            runs.append(ProbeRun(probe, trials))
            if progress is not None:
                progress(i + 1, len(plan.probes), runs[-1])
    return runs


def _failure(url: str, probe: Probe, err: Exception, check_alive) -> str:
    what = str(err) or type(err).__name__
    if isinstance(err, httpx.TimeoutException):
        what = f"no answer within the request timeout ({type(err).__name__})"
    elif isinstance(err, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
        what = f"the connection failed ({what}); the server may have died"
    message = f"probe {probe.label!r} failed against {url}: {what}"
    if check_alive is not None:
        try:
            check_alive()
        except Exception as dead:  # noqa: BLE001 - the target's own report of the death
            message += f"\n{dead}"
    return message


async def _trial(client, model_name, probe: Probe, warm, prompts, options) -> TrialRun:
    if warm is not None:
        await stream_request(client, model_name, warm, 1)
    timed = TTFT in probe.measures and len(prompts) == 1
    before = await prefill_times(client) if timed else None
    await asyncio.sleep(options.settle_s)
    timings = await asyncio.gather(*(stream_request(client, model_name, p, probe.max_tokens) for p in prompts))
    await asyncio.sleep(options.settle_s)
    trial = TrialRun(warm, prompts, list(timings))
    if before is not None:
        after = await prefill_times(client)
        if after is not None and after.count - before.count == len(prompts):
            trial.prefill_time_s = (after.sum_s - before.sum_s) / len(prompts)
    return trial


def _check_no_hits(url: str, probe: Probe, before: PrefixCacheCounts, after: PrefixCacheCounts | None) -> None:
    """A probe of fresh prompts must compute them: cached blocks would time lookups, not prefills.
    Chance matches of a few leading tokens (a radix cache's, SGLang) stay under the 10% allowed.
    Hits against queries, both in the server's own unit."""
    if after is None:
        return
    hits, queries = after.hits - before.hits, after.queries - before.queries
    if queries > 0 and hits > 0.1 * queries:
        raise CalibrationError(
            f"probe {probe.label!r} on {url}: the server's prefix cache served {hits:.0f} of {queries:.0f} "
            f"prompt {after.unit} that should be new to it, so its timings are not the steps the probe designs "
            "(another client sending the same token ids, or a repeated --seed); calibrate an idle server, or "
            "reset its prefix cache (vLLM: POST /reset_prefix_cache)")


async def _loaded_trial(client, model_name, probe: Probe, warm, rng, options) -> TrialRun:
    """Background requests decode; arrivals are sent one at a time, the k-th once the
    background's first request has LOADED_FIRST + k * LOADED_SPACING tokens (and a
    random part of a gap more, so they land at any point of a step). The background
    is cut off (its streams closed, which aborts it) once the last arrival is answered.
    `warm` (probe_prompts'): a prefix probe's warm-up, whose prefix every arrival shares."""
    fresh = lambda n: rng.integers(TOKEN_LOW, TOKEN_HIGH, n).tolist()
    shared = warm[:probe.prefix_len] if warm is not None else []
    if warm is not None:  # alone first, so every arrival finds the prefix cached
        await stream_request(client, model_name, warm, 1)
    background = [fresh(n) for n in probe.background_lens()]
    total = probe.background_tokens()
    timings_bg = [RequestTiming(0.0) for _ in background]
    first = timings_bg[0]
    tasks = [asyncio.create_task(stream_request(client, model_name, p, total, t)) for p, t in zip(background, timings_bg)]
    arrivals, timings, sent_at = [], [], []
    try:
        for k in range(probe.repeats):
            target = LOADED_FIRST + k * LOADED_SPACING
            while len(first.token_times) < target:
                if any(t.done() for t in tasks):
                    for t in tasks:
                        if t.done():
                            t.result()  # raises what went wrong
                    raise BadAnswer("a background request ended before the arrivals were sent")
                await asyncio.sleep(0.0005)
            gaps = np.diff(first.token_times[-4:])
            await asyncio.sleep(float(rng.uniform(0, np.median(gaps))) if len(gaps) else 0.0)
            sent_at.append(len(first.token_times))
            prompt = shared + fresh(probe.prompt_len - probe.prefix_len)
            arrivals.append(prompt)
            timings.append(await stream_request(client, model_name, prompt, 1))
        for t in tasks:
            if t.done():
                t.result()  # a background request that failed meanwhile
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(options.settle_s)
    return TrialRun(warm, arrivals, timings, background, timings_bg, sent_at)
