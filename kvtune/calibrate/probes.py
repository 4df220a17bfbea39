"""The designed probe set, and running it against a live server over HTTP.

A live server shows only client-side timings, so each probe isolates a few
terms of the cost model, alone on an idle server:

* prefill:  one request of prompt length L, max_tokens 1. Its TTFT is the
            prefill step(s) of L tokens, plus the client overhead (HTTP,
            parsing, queueing to the engine and back).
* overhead: a tiny prompt decoding a few tokens; TTFT minus the steady ITL of
            the same request pins the client overhead apart from the step's.
* decode:   B requests of a short prompt decoding together (ignore_eos); the
            inter-token gap while all B decode is one decode step of B
            sequences (the weights read, the per-step and per-sequence terms).
* context:  B requests with long prompts decoding: the K/V read (and decode
            attention) term.
* prefix:   a warm-up request fills the prefix cache, then a request sharing
            its first P tokens: the prefill computes only the rest, attending
            over the whole context.
* loaded:   B requests of varied prompt lengths decode while short requests
            arrive one by one, as under real traffic: their TTFT is the rest of
            a decode step, then a mixed step (their prefill with the batch's
            decodes), plus the client overhead of a busy server; the batch's
            typical gap is a decode step over uneven contexts. In two of them
            (one with --quick) the arrivals share a warm prefix (a system prompt
            under traffic).

Where the server exports vLLM's `vllm:request_prefill_time_seconds` (first
scheduled to first token, timed by the engine core), each isolated single-request
TTFT probe also reads it, from /metrics before and after the request: the same
steps without the client overhead, which tells an engine's per-prefill cost apart
from the HTTP path's (in a TTFT alone they only ever add up).

The plan starts and ends with the same decode probe (B=4, or the largest batch
allowed below that), DRIFT_CHECKS times at each end, between the first and the last
few other probes: the median of the closing ones against that of the opening ones
(`speed_drift`) says how much the server's speed moved while it was probed, which a
fit cannot tell from the cost model's own misfit. All of them are fitted, as one
probe (`merge_repeated`).

Every prompt is fresh random token ids (except the shared prefixes), drawn
anew each run, so no probe hits another's cached blocks, nor those an earlier
calibration of the server left; where the server's prefix cache serves one
anyway (over 10% of what a probe looked up, by its hit and query counters), the calibration
stops and says so. Requests look like the load generator's
(streaming /v1/completions, token-id prompts, ignore_eos, default sampling),
so the steps the server runs for probes are those it runs under load.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from ..httpclient import http_get
from ..loadgen import sse_payload
from ..scrape import parse_exposition, reported_config

TOKEN_LOW, TOKEN_HIGH = 1000, 30000  # the workload module's prompt token range
TTFT, ITL = "ttft", "itl"
PREFILL_TIME = "prefill_time"  # the server's own: first scheduled to first token
DECODE_REPEATS = 3  # trials of each decode probe
LOADED_ARRIVALS = 12  # requests arriving one by one during a loaded probe
LOADED_FIRST, LOADED_SPACING = 6, 5  # background tokens before the first arrival, and between arrivals
PROBE_KINDS = ("overhead", "prefill", "decode", "context", "prefix", "loaded")
# The drift check's runs at each end of the plan. One run a side read the same quiet server
# anywhere from -32% to +31% apart: a hiccup of a shared machine (another process's burst, a
# GC pause) lands in one run and moves its whole median. Three runs a side, apart in time (a
# probe between each), are moved only by what lasts over two of them, so the medians' ratio
# is the server's speed, not one run's luck; it costs four more short decode probes.
DRIFT_CHECKS = 3
# Stream lines read within this of the chunk before are one delivery, timed as that chunk: a
# server that falls behind (vLLM's frontend on a busy CPU) writes what it held in one burst,
# whose lines the client reads 20-100 us apart; no engine step is that short.
BURST_S = 0.5e-3
POOL_SHARE = 0.8  # of the KV pool a probe may hold at once: a margin so that no probe is preempted


class CalibrationError(RuntimeError):
    """Calibration could not complete: the server died, refused or answered errors,
    or the probes could not be fitted. Nothing is saved."""


# ---------------------------------------------------------------- the server

@dataclass
class ServerInfo:
    """What the probes need to know about the server, from /v1/models and /metrics."""

    url: str
    model_name: str
    max_model_len: int
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str | None = None
    pool_bytes: int | None = None  # kv_cache_memory_bytes, where the server reports it

    def to_dict(self) -> dict:
        return dict(vars(self))


def server_info(url: str, timeout_s: float = 10.0) -> ServerInfo:
    url = url.rstrip("/")
    try:
        resp = http_get(url + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        entry = resp.json()["data"][0]
    except httpx.HTTPError as err:
        raise CalibrationError(f"cannot reach {url}/v1/models: is a server listening there? ({err})") from None
    except (KeyError, IndexError, ValueError) as err:
        raise CalibrationError(f"{url}/v1/models did not name a model: {err}") from None
    info = ServerInfo(url, entry["id"], int(entry.get("max_model_len") or 4096))
    reported = reported_config(url, timeout_s)  # {} without /metrics: the defaults
    info.block_size = reported.get("block_size")
    info.num_gpu_blocks = reported.get("num_gpu_blocks")
    info.enable_prefix_caching = reported.get("enable_prefix_caching")
    info.kv_cache_dtype = reported.get("kv_cache_dtype") or None
    info.pool_bytes = reported.get("kv_cache_memory_bytes")
    return info


# ---------------------------------------------------------------- the design

@dataclass(frozen=True)
class Probe:
    """One measurement: `batch` concurrent requests of `prompt_len` tokens, `max_tokens`
    each; with `prefix_len`, a warm-up request of the first `prefix_len` tokens plus
    `warm_suffix` of its own goes first. Measured (`measures`): the first request's
    TTFT, and/or the steady inter-token gap while all `batch` requests decode.

    With `background` B: B requests (prompts of `background_len` tokens and shorter)
    decode while `repeats` requests of `prompt_len` arrive one after another (a
    "loaded" probe): their TTFT, and the background's gap. With `prefix_len` as well,
    one warm-up goes first and every arrival shares its prefix (a system prompt's hits
    under traffic)."""

    kind: str
    label: str
    prompt_len: int
    max_tokens: int
    measures: tuple[str, ...]
    batch: int = 1
    prefix_len: int = 0
    warm_suffix: int = 0
    repeats: int = 1
    background: int = 0
    background_len: int = 0

    @property
    def num_requests(self) -> int:
        warmups = (1 if self.background else self.repeats) if self.prefix_len else 0
        return self.repeats * self.batch + warmups + self.background

    def background_tokens(self) -> int:
        """Tokens each background request is asked for: enough to outlast every arrival."""
        return LOADED_FIRST + LOADED_SPACING * self.repeats + 4 * LOADED_SPACING

    def kv_tokens(self, block_size: int = 1) -> int:
        """The most KV the probe holds at once: each batch request's whole context; for a loaded
        probe the background's and two arrivals' (one answered, the next sent). Each request's
        is rounded up to whole blocks of `block_size`: a pool of 8 blocks of 128 tokens holds
        8 decodes of 56 tokens, not 18."""
        def held(tokens: int) -> int:
            return -(-tokens // block_size) * block_size
        if not self.background:
            return self.batch * held(self.prompt_len + self.max_tokens)
        return (sum(held(n + self.background_tokens()) for n in self.background_lens())
                + 2 * held(self.prompt_len + self.max_tokens))

    def background_lens(self) -> list[int]:
        """The background's prompt lengths: spread from 32 to background_len (uneven
        contexts, as real batches have)."""
        if not self.background:
            return []
        lo = min(32, self.background_len)
        return [round(float(x)) for x in np.geomspace(lo, self.background_len, self.background)]


@dataclass
class ProbePlan:
    probes: list[Probe]
    notes: list[str] = field(default_factory=list)  # where the pool kept the plan from its design

    @property
    def num_requests(self) -> int:
        return sum(p.num_requests for p in self.probes)

    def __len__(self) -> int:
        return len(self.probes)


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return [lo]
    return sorted({round(float(x)) for x in np.geomspace(lo, hi, n)})


def design_probes(max_model_len: int, max_batch: int = 64, max_prompt: int | None = None,
                  pool_tokens: int | None = None, batch_tokens: int = 2048, quick: bool = False,
                  block_size: int = 1, kinds: tuple[str, ...] | None = None) -> ProbePlan:
    """The probe set for a server with this context limit.

    max_batch    the largest decode batch (keep it <= the server's max_num_seqs).
    max_prompt   the longest prompt (default: most of max_model_len).
    pool_tokens  the KV pool's size in tokens, when known: every probe's requests fit in it
                 at once (a batch the pool cannot hold runs in waves, and times other steps).
    block_size   the pool's block size: each request holds whole blocks.
    batch_tokens the server's token budget per step (max_num_batched_tokens): a long-context
                 batch decodes long enough to outlast its chunked prefills.
    quick        fewer lengths, batch sizes and repeats (a smoke run).
    kinds        only the probes of these PROBE_KINDS (the drift checks are decodes).
    """
    longest = max(64, min(max_prompt or max_model_len, max_model_len - 64))
    repeats = 3 if quick else 5
    probes: list[Probe] = [Probe("overhead", "overhead L=8", 8, 24, (TTFT, ITL), repeats=repeats)]
    # The short prefills pin the overheads; compute and attention show only in the long
    # ones, so the top octaves get extra lengths (two points there would fit any noise).
    top = max(16, longest // 8)
    lengths = sorted(set(_geometric(16, top, 3 if quick else 5)) | set(_geometric(top, longest, 4 if quick else 5)))
    for length in lengths:
        probes.append(Probe("prefill", f"prefill L={length}", length, 1, (TTFT,), repeats=repeats))
    decode_len = 32
    decode_tokens = 24 if quick else 40
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch]
    if quick:
        batches = batches[::2] + ([batches[-1]] if len(batches) % 2 == 0 else [])
    # Three trials each (their median): a decode probe lasts a fraction of a second, and one
    # hiccup of a shared machine in it moved a whole batch size's ITL by 20%.
    pool = pool_tokens if pool_tokens else max_model_len * max_batch
    room = POOL_SHARE * pool
    notes: list[str] = []
    batches = _held_batches(batches, Probe("decode", "", decode_len, decode_tokens, (ITL,)), pool, block_size,
                            notes)
    for b in batches:
        probes.append(Probe("decode", f"decode B={b}", decode_len, decode_tokens, (ITL,), batch=b,
                            repeats=DECODE_REPEATS))
    check = min(4, max_batch, batches[-1])
    drift_check = Probe("decode", f"decode B={check} (drift check)", decode_len, decode_tokens, (ITL,),
                        batch=check, repeats=DECODE_REPEATS)
    contexts = [longest // 4, longest // 2, longest - decode_tokens] if not quick else [longest // 2, longest - decode_tokens]
    for length in contexts:
        for b in (1, 4, 16):
            context = Probe("context", "", length, decode_tokens, (ITL,), batch=b)
            if b <= max_batch and context.kv_tokens(block_size) <= room:
                prefill_steps = -(-b * length // batch_tokens)
                probes.append(Probe("context", f"context B={b} L={length}", length,
                                    decode_tokens + prefill_steps, (ITL,), batch=b))
    for prefix in ([longest // 2] if quick else [longest // 4, longest // 2]):
        for suffix in (16, 256):
            if prefix + suffix < max_model_len - 8:
                probes.append(Probe("prefix", f"prefix P={prefix} S={suffix}", prefix + suffix, 1, (TTFT,),
                                    prefix_len=prefix, warm_suffix=suffix, repeats=repeats))
    bg_len = max(32, min(1024, longest // 4))
    # Real traffic is mostly this regime, so it gets as many probes as the isolated decodes.
    loaded = [8] if quick else [2, 4, 8, 16, 32]
    for b in sorted({min(b, max_batch - 1) for b in loaded}):
        if b < 1:
            continue
        for length in (64, 512):
            length = min(length, longest)
            probes.append(Probe("loaded", f"loaded B={b} L={length}", length, 1, (TTFT, ITL),
                                repeats=LOADED_ARRIVALS, background=b, background_len=bg_len))
    # Arrivals that hit a warm prefix amid decodes: the mixed steps a shared system prompt
    # gives, whose chunks after context the isolated prefix probes price only alone.
    prefix, suffix = min(1024, longest // 4), min(128, longest // 8)
    for b in sorted({min(b, max_batch - 1) for b in ([8] if quick else [4, 16])}):
        if b >= 1 and prefix + suffix < max_model_len - 8:
            probes.append(Probe("loaded", f"loaded prefix B={b} P={prefix} S={suffix}", prefix + suffix, 1,
                                (TTFT, ITL), prefix_len=prefix, warm_suffix=16, repeats=LOADED_ARRIVALS,
                                background=b, background_len=bg_len))
    if kinds is not None:
        probes = [p for p in probes if p.kind in kinds]
    plan, loaded = [], []
    for probe in _with_drift_checks(probes, drift_check):
        probe = _fit_pool(probe, room, block_size)
        if probe is None or probe in loaded:  # a halved background may repeat another probe
            continue
        if probe.background:
            loaded.append(probe)
        plan.append(probe)
    return ProbePlan(plan, notes)


def _held_batches(batches: list[int], one: Probe, pool_tokens: int, block_size: int, notes: list[str]) -> list[int]:
    """The decode batches whose requests (each like `one`) POOL_SHARE of the pool holds at once; where it holds
    fewer than the largest, the largest it holds takes their place, and `notes` says so: the fit
    then never sees a step of more sequences, and a search running more extrapolates."""
    per_request = one.kv_tokens(block_size)
    most = max(1, int(POOL_SHARE * pool_tokens // per_request))
    held = [b for b in batches if b <= most]
    if len(held) == len(batches):
        return batches
    if not held or held[-1] < most:
        held.append(most)
    blocks = f" in blocks of {block_size} tokens" if block_size > 1 else ""
    notes.append(f"the KV pool ({pool_tokens:,} tokens{blocks}) holds {most} decoding requests of "
                 f"{one.prompt_len + one.max_tokens} tokens at once, so the fit sees decode steps of at most "
                 f"{most} sequences (not {batches[-1]}); a config that runs more at once is priced by "
                 "extrapolation. Step costs do not depend on the pool's size: calibrate on a larger pool "
                 "(--kv-cache-memory-bytes, --gpu-memory-utilization) or a smaller --block-size to see them")
    return held


def _fit_pool(probe: Probe, room: float, block_size: int = 1) -> Probe | None:
    """A loaded probe whose background would outgrow the pool gets a smaller background
    (halved until it fits; None if none does): preempted, the background stalls while the
    others finish, and the probe times recomputation, not the steps it designs."""
    while probe.background and probe.kv_tokens(block_size) > room:
        if probe.background == 1:
            return None
        b = probe.background // 2
        probe = dataclasses.replace(probe, background=b, label=re.sub(r"B=\d+", f"B={b}", probe.label))
    return probe


def _with_drift_checks(probes: list[Probe], check: Probe, n: int = DRIFT_CHECKS) -> list[Probe]:
    """`probes` with `check` n times before, between and after the first n - 1 of them, and
    n times so around the last n - 1: each end's checks apart in time (see DRIFT_CHECKS)."""
    k = min(n - 1, len(probes) // 2)
    head, middle, tail = probes[:k], probes[k:len(probes) - k], probes[len(probes) - k:]
    opening = [p for probe in head for p in (check, probe)] + [check]
    closing = [check] + [p for probe in tail for p in (probe, check)]
    return opening + middle + closing


def speed_drift(runs: list[ProbeRun]) -> dict | None:
    """The plan's closing drift checks against its opening ones, where the plan opens and closes
    with the same probe (design_probes' drift check): the median ITL of each end's runs of it
    (the first and the last half of them) and the relative change; `runs` says how many a side."""
    if len(runs) < 2 or runs[0].probe != runs[-1].probe or ITL not in runs[0].probe.measures:
        return None
    itls = [run.measured(ITL) for run in runs if run.probe == runs[0].probe]
    half = len(itls) // 2
    first, last = _finite_median(itls[:half]), _finite_median(itls[len(itls) - half:])
    if not (math.isfinite(first) and math.isfinite(last) and first > 0):  # checks without a timing
        return None
    return {"probe": runs[0].probe.label, "first_s": first, "last_s": last, "change": last / first - 1.0,
            "runs": half}


def _finite_median(values: list[float]) -> float:
    """The median of the finite values; nan unless they are most of them."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if 2 * len(finite) > len(values) else float("nan")


def merge_repeated(runs: list[ProbeRun]) -> list[ProbeRun]:
    """The runs with each probe's repeats (the drift checks) as one run of all their trials, where
    its first run was: the fit weighs the drift check as one decode probe, timed by the median of
    all its trials."""
    merged: dict[Probe, ProbeRun] = {}
    for run in runs:
        if run.probe in merged:
            merged[run.probe].trials.extend(run.trials)
        else:
            merged[run.probe] = ProbeRun(run.probe, list(run.trials))
    return list(merged.values())


def probe_prompts(probe: Probe, rng: np.random.Generator) -> tuple[list[int] | None, list[list[int]]]:
    """(warm-up prompt or None, the measured prompts) of one repeat: fresh random ids,
    the warm-up and the measured request sharing the first prefix_len tokens."""
    def fresh(n: int) -> list[int]:
        return rng.integers(TOKEN_LOW, TOKEN_HIGH, n).tolist()
    if probe.prefix_len:
        shared = fresh(probe.prefix_len)
        warm = shared + fresh(probe.warm_suffix)
        return warm, [shared + fresh(probe.prompt_len - probe.prefix_len) for _ in range(probe.batch)]
    return None, [fresh(probe.prompt_len) for _ in range(probe.batch)]


# ---------------------------------------------------------------- the runs

@dataclass
class RequestTiming:
    sent: float  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)  # one per output token, receipt time

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


@dataclass
class TrialRun:
    warmup: list[int] | None
    prompts: list[list[int]]
    requests: list[RequestTiming]
    # A loaded probe: the background's prompts and timings, and how many tokens its first
    # request had received when each arriving request was sent.
    background: list[list[int]] = field(default_factory=list)
    background_requests: list[RequestTiming] = field(default_factory=list)
    sent_at_tokens: list[int] = field(default_factory=list)
    # The server's mean vllm:request_prefill_time_seconds over the measured requests
    # (None: not exported, or other requests finished meanwhile).
    prefill_time_s: float | None = None


@dataclass
class ProbeRun:
    probe: Probe
    trials: list[TrialRun]

    def loaded_selection(self) -> list[int]:
        """A loaded probe's arrivals that count: all but the slowest fifth (a hiccup of
        the machine, not the server's way)."""
        ttfts = np.array([r.ttft for r in self.trials[0].requests])
        keep = max(1, int(np.ceil(0.8 * len(ttfts))))
        return sorted(np.argsort(ttfts, kind="stable")[:keep].tolist())

    def loaded_gaps(self) -> list[float]:
        """The background's gaps from the first arrival's send to the last one's answer."""
        trial = self.trials[0]
        start, end = trial.requests[0].sent, trial.requests[-1].token_times[0]
        gaps = []
        for r in trial.background_requests:
            arr = np.asarray(r.token_times)
            gaps.extend(chunk_gaps(arr[(arr >= start) & (arr <= end)]))
        return gaps

    @property
    def measures(self) -> tuple[str, ...]:
        """The probe's measures, and the server's prefill time where every trial read it."""
        timed = not self.probe.background and all(t.prefill_time_s is not None for t in self.trials)
        return (*self.probe.measures, *((PREFILL_TIME,) if timed else ()))

    def _per_trial(self, measure: str) -> list[float]:
        """An isolated probe's TTFT or server prefill time, one per trial (its first request)."""
        if measure == TTFT:
            return [t.requests[0].ttft for t in self.trials]
        return [t.prefill_time_s for t in self.trials]

    def measured(self, measure: str) -> float:
        """An observable in seconds: the median TTFT of the trials' first requests, or
        the median over trials of the steady mean inter-token gap (see `steady_itl`); for a
        loaded probe, the mean TTFT of its selected arrivals and the background's mean
        gap while they arrive (mixed steps included, as a TPOT under traffic has them)."""
        if self.probe.background:
            if measure == TTFT:
                requests = self.trials[0].requests
                return float(np.mean([requests[i].ttft for i in self.loaded_selection()]))
            gaps = self.loaded_gaps()  # none: the window held at most one chunk of each stream
            return float(np.mean(gaps)) if gaps else float("nan")
        if measure in (TTFT, PREFILL_TIME):
            return float(np.median(self._per_trial(measure)))
        # A trial whose streams came in too few chunks to time (nan) is left out, unless most are.
        values = [steady_itl([r.token_times for r in t.requests]) for t in self.trials]
        finite = [v for v in values if np.isfinite(v)]
        return float(np.median(finite)) if 2 * len(finite) > len(values) else float("nan")

    def spread(self, measure: str) -> float:
        """The observable's standard error, from the spread of what it is the median of
        (the trials' TTFTs; the window's gaps for an ITL): MAD * 1.4826 * 1.253 / sqrt(n);
        std / sqrt(n) for a loaded probe's means."""
        if self.probe.background:
            values = ([self.trials[0].requests[i].ttft for i in self.loaded_selection()] if measure == TTFT
                      else self.loaded_gaps())
            return float(np.std(values) / np.sqrt(len(values))) if len(values) > 1 else 0.0  # of a mean
        if measure in (TTFT, PREFILL_TIME):
            values = self._per_trial(measure)
        else:
            values = [g for t in self.trials for g in steady_gaps([r.token_times for r in t.requests])]
        if len(values) < 2:
            return 0.0
        arr = np.asarray(values)
        return float(1.4826 * 1.253 * np.median(np.abs(arr - np.median(arr))) / np.sqrt(len(arr)))


def chunk_gaps(times) -> list[float]:
    """Per token after the first chunk, its share of the gap before the chunk it came in.

    A server may merge several tokens into one streamed chunk, or write several chunks in
    one burst (vLLM does both under load, when its frontend falls behind the engine): they
    arrive with one receipt time (repeated in `RequestTiming.token_times`, one per token, by
    the usage's token count; a burst's lines by BURST_S). Their steps took the time since
    the chunk before, so each of its k tokens gets a k-th of that gap; the first chunk's
    tokens, whose steps began before the window, none. Without merging, np.diff(times).
    The gaps add up to the span: their mean is span / tokens after the first chunk."""
    arr = np.asarray(times, dtype=float)
    if len(arr) < 2:
        return []
    chunks, counts = np.unique(arr, return_counts=True)
    return np.repeat(np.diff(chunks) / counts[1:], counts[1:]).tolist()


def _steady_window(token_times: list[list[float]]) -> list[np.ndarray]:
    """Each request's token times while every request of a batch decodes.

    The window starts at the token (of each request) sent with the batch's last first
    token (every prefill done) and ends one token before the first request's last
    token (none has finished): the same steps for all requests, found by time. Too
    short a window: every token after the first. Tokens merged into one chunk share its
    time: the window starts at the last of the chunk's (those before it were made before
    the window), so its span over its gaps counts the tokens made in it."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    windows = []
    for times in token_times:
        arr = np.asarray(times)
        i0 = int(np.argmin(np.abs(arr - start)))
        i0 = int(np.searchsorted(arr, arr[i0], side="right")) - 1  # the last token of its chunk
        i1 = int(np.argmin(np.abs(arr - end))) - 1
        if i1 - i0 >= 1:
            windows.append(arr[i0:i1 + 1])
    if windows:
        return windows
    for times in token_times:
        i = int(np.searchsorted(times, times[0], side="right")) - 1  # the last token of the first chunk
        if len(times) > 2 and len(times) - i >= 2:
            windows.append(np.asarray(times[i:]))
    return windows


def steady_gaps(token_times: list[list[float]]) -> list[float]:
    """The gaps between tokens in the steady window (`_steady_window`)."""
    return [g for window in _steady_window(token_times) for g in chunk_gaps(window)]


def steady_itl(token_times: list[list[float]]) -> float:
    """The mean gap in the steady window: its span over its gaps, per request, then the
    median over the batch. A client that reads a token late moves one gap up and the next
    down, so the span is immune to it; a step the server stretches (a GC pause, a command
    read mid-loop) is in it, as it is in every TPOT. A median of gaps would drop those."""
    spans = [(w[-1] - w[0]) / (len(w) - 1) for w in _steady_window(token_times) if len(w) > 1]
    return float(np.median(spans)) if spans else float("nan")


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
                await _trial(client, model_name, warmup, None, probe_prompts(warmup, rng)[1], options)
            except (httpx.HTTPError, _BadAnswer) as err:
                raise CalibrationError(_failure(url, warmup, err, check_alive)) from None
        for i, probe in enumerate(plan.probes):
            trials = []
            hits_before = None if probe.prefix_len else await _prefix_hits(client)
            for _ in range(1 if probe.background else probe.repeats):
                if time.monotonic() > deadline:
                    raise CalibrationError(f"probe {probe.label!r} on {url}: the probes ran past their "
                                           f"{options.deadline_s:.0f} s limit; the server is too slow for "
                                           "this probe set (try --quick or a smaller --max-prompt)")
                warm, prompts = probe_prompts(probe, rng)
                try:
                    if probe.background:
                        trials.append(await _loaded_trial(client, model_name, probe, warm, rng, options))
                    else:
                        trials.append(await _trial(client, model_name, probe, warm, prompts, options))
                except (httpx.HTTPError, _BadAnswer) as err:
                    raise CalibrationError(_failure(url, probe, err, check_alive)) from None
            if hits_before is not None:
                _check_no_hits(url, probe, hits_before, await _prefix_hits(client))
            runs.append(ProbeRun(probe, trials))
            if progress is not None:
                progress(i + 1, len(plan.probes), runs[-1])
    return runs


class _BadAnswer(Exception):
    pass


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
    before = await _prefill_times(client) if timed else None
    await asyncio.sleep(options.settle_s)
    timings = await asyncio.gather(*(stream_request(client, model_name, p, probe.max_tokens) for p in prompts))
    await asyncio.sleep(options.settle_s)
    trial = TrialRun(warm, prompts, list(timings))
    if before is not None:
        after = await _prefill_times(client)
        if after is not None and after[1] - before[1] == len(prompts):
            trial.prefill_time_s = (after[0] - before[0]) / len(prompts)
    return trial


async def _scrape(client):
    """The server's /metrics now, parsed; None where it has none (a server without /metrics
    still calibrates on its TTFTs) or serves something else there (a proxy's page, say)."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_exposition(resp.text)
    except ValueError:
        return None


async def _prefill_times(client) -> tuple[float, float] | None:
    """(sum, count) of the server's vllm:request_prefill_time_seconds; None where it has none."""
    snapshot = await _scrape(client)
    hist = None if snapshot is None else snapshot.histograms.get("prefill")
    return (hist.sum, hist.count) if hist is not None else None


async def _prefix_hits(client) -> tuple[float, float, str] | None:
    """The server's prefix-cache hits and queries so far (vllm:prefix_cache_hits and _queries) and
    their unit (tokens, or blocks on older vLLM); None where it exports none."""
    snapshot = await _scrape(client)
    if snapshot is None or snapshot.get("prefix_hits") is None or snapshot.get("prefix_queries") is None:
        return None
    return snapshot.get("prefix_hits"), snapshot.get("prefix_queries"), snapshot.units.get("prefix_hits", "tokens")


def _check_no_hits(url: str, probe: Probe, before: tuple, after: tuple | None) -> None:
    """A probe of fresh prompts must compute them: cached blocks would time lookups, not prefills.
    Chance matches of a few leading tokens (a radix cache's, SGLang) stay under the 10% allowed.
    Hits against queries, both in the server's own unit."""
    if after is None:
        return
    hits, queries = after[0] - before[0], after[1] - before[1]
    if queries > 0 and hits > 0.1 * queries:
        raise CalibrationError(
            f"probe {probe.label!r} on {url}: the server's prefix cache served {hits:.0f} of {queries:.0f} "
            f"prompt {after[2]} that should be new to it, so its timings are not the steps the probe designs "
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
                    raise _BadAnswer("a background request ended before the arrivals were sent")
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
            raise _BadAnswer(f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            payload = sse_payload(line)
            if payload is None:
                continue
            if payload == "DONE":
                done = True
                break
            if "error" in payload:
                raise _BadAnswer(f"error chunk: {payload['error'].get('message', payload['error'])}")
            if not payload.get("choices"):
                continue  # the final usage-only chunk
            usage = payload.get("usage")
            ids = payload["choices"][0].get("token_ids")
            # A chunk may carry several tokens (merged under load): the usage's running count
            # says how many, else its token ids; a text-only chunk counts one.
            count = usage["completion_tokens"] if usage else len(timing.token_times) + (len(ids) if ids else 1)
            read, last_read = now, read
            if timing.token_times and read - last_read < BURST_S:
                now = timing.token_times[-1]  # the same burst as the line before: one chunk (see chunk_gaps)
            timing.token_times.extend([now] * (count - len(timing.token_times)))
    if not done:
        raise _BadAnswer("the stream ended without [DONE]; the server may have died")
    if len(timing.token_times) < max_tokens:
        raise _BadAnswer(f"{len(timing.token_times)} tokens streamed, {max_tokens} asked for (ignore_eos; a "
                         "server that merges tokens into one chunk must report its usage in each chunk, "
                         "stream_options.continuous_usage_stats)")
    return timing
