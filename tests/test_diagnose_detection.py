"""Detection defects of issue #24, each against a run where the fault really happens and a run where it
does not: F3 on healthy bursty traffic, F2's median ITL, F4 on a watched server (no workload profile) and
behind a per-request header, F5 with a large max_num_batched_tokens.

The sim runs replay in virtual time in well under 2 s each; the F4 runs watch a real `kvengine serve`
(sim executor, wall clock) through the same scrape-to-RunResult path as `kvtune diagnose --url`.
"""
from __future__ import annotations

import sys
import threading
import time
from functools import cache

import httpx
import numpy as np
import pytest
from serverproc import ServerProcess
from test_diagnose import evidence, failed_start, fired, load_ramp_on_mha_model, sim

from kvengine.config import EngineConfig
from kvtune.diagnose import diagnose
from kvtune.targets.watch import result_from_scrape
from kvtune.results import RunResult
from kvtune.scrape import Scraper
from kvtune.targets import TargetStartError
from kvtune.targets.process import ManagedServer, free_port
from kvtune.workload import IntDist, SynthSpec, TraceRequest, Workload, synthesize, workload_stats
from kvtune.workload.tokens import unique_tokens


def itl_by_context_quartile(result: RunResult, q: float) -> tuple[float, float]:
    """The clients' ITL percentile `q` in the shortest and the longest quarter of context, from the records."""
    context = np.concatenate([r.prompt_tokens + 1 + np.arange(len(r.itl_s)) for r in result.requests if r.itl_s])
    itl = np.concatenate([r.itl_s for r in result.requests if r.itl_s])
    low, high = np.percentile(context, [25, 75])
    return float(np.percentile(itl[context <= low], q)), float(np.percentile(itl[context >= high], q))


# -- F3: healthy bursty traffic is not memory-bound saturation -----------------------------------------------

BURSTY_SEEDS = range(8)


@cache
def bursty_healthy(seed: int) -> RunResult:
    """Gamma arrivals (burstiness 0.25) of 512-token prompts at 24 req/s on Llama-2-7B: each burst's
    prefill lands in the windows where running peaks, TTFT p95 stays near 0.1-0.2 s."""
    spec = SynthSpec(num_requests=150, rate=24, arrival="gamma", burstiness=0.25, seed=seed,
                     input_len=IntDist.fixed(512), output_len=IntDist.fixed(256))
    return sim(EngineConfig(), synthesize(spec), model="llama-2-7b")


@pytest.mark.parametrize("seed", BURSTY_SEEDS)
def test_f3_does_not_fire_on_healthy_bursty_traffic(seed):
    """Issue #24: windows with up to 4× more prompt than generated tokens counted as decode windows, so
    the prefill of each burst looked like flat tokens/s; nothing waited and TTFT met its SLO."""
    result = bursty_healthy(seed)
    assert result.summary["ttft_p95"] < 0.5 and result.summary["preemptions"] == 0
    assert "F3" not in fired(result)


def test_f3_on_the_load_ramp_shows_decode_dominant_peaks_and_saturation():
    f3 = fired(load_ramp_on_mha_model())["F3"]
    assert evidence(f3, "prompt / generated tokens in the peak windows").value <= 1.0
    growth = evidence(f3, "ITL implied, peak over typical windows")
    assert growth.value >= 1.5 and growth.threshold.startswith(">= 1.5")


# -- F2: the median ITL doubles while prefill stalls make the p95 flat --------------------------------------

def with_prefill_stalls(decoders: list[TraceRequest], horizon_s: float) -> Workload:
    """A 3,000-token prompt every 0.25 s: its prefill step stalls every running decode, so the ITL p95 at
    any context is the stall."""
    stalls = [TraceRequest(0.5 + 0.25 * k, 3000, 1) for k in range(int(horizon_s / 0.25))]
    return Workload(sorted(decoders + stalls, key=lambda r: r.arrival_s), 16)


@cache
def median_itl_doubles() -> RunResult:
    """F2: 28 requests decode 2,500 tokens from 500-token prompts on Llama-2-7B (512 KiB of K/V per token)."""
    decoders = [TraceRequest(i * 0.01, 500, 2500) for i in range(28)]
    return sim(EngineConfig(), with_prefill_stalls(decoders, 75.0), model="llama-2-7b")


@cache
def short_contexts_under_stalls() -> RunResult:
    """The same stalls over short requests arriving steadily: contexts never grow."""
    decoders = [TraceRequest(i * 0.25, 500, 200) for i in range(80)]
    return sim(EngineConfig(), with_prefill_stalls(decoders, 20.0), model="llama-2-7b")


def test_f2_catches_a_median_itl_that_doubles_under_a_noisy_p95():
    result = median_itl_doubles()
    p95_low, p95_high = itl_by_context_quartile(result, 95)
    p50_low, p50_high = itl_by_context_quartile(result, 50)
    assert p95_high / p95_low < 1.5 <= p50_high / p50_low  # the p95 test alone misses it
    assert p50_high / p50_low >= 1.8
    f2 = fired(result)["F2"]
    median = evidence(f2, "ITL p50 (clients) by context quartile")
    assert median.value == f"{p50_low * 1000:.1f} → {p50_high * 1000:.1f} ms"
    assert evidence(f2, "ITL p95 (clients) by context quartile")  # shown beside it, flat
    assert "p50" in f2.symptom and f2.fix.startswith("`--kv-cache-dtype auto → fp8`")


def test_f2_does_not_fire_when_contexts_stay_short_under_the_same_stalls():
    result = short_contexts_under_stalls()
    p50_low, p50_high = itl_by_context_quartile(result, 50)
    assert p50_high / p50_low < 1.5
    assert "F2" not in fired(result)


# -- F4 on a watched server: no workload profile ------------------------------------------------------------

POOL_BLOCKS = 300  # 4,800 tokens: about four of the 1,152-token prompts
SYSTEM_PROMPTS = 12


def prompts(kind: str, count: int) -> list[list[int]]:
    """1,024 tokens of system prompt (one of 12, one of 2, or unique) then 128 unique tokens."""
    systems = [unique_tokens(10_000 + k, 1024) for k in range(SYSTEM_PROMPTS)]
    rng = np.random.default_rng(7)
    out = []
    for i in range(count):
        head = {"thrash": systems[rng.integers(SYSTEM_PROMPTS)], "shared": systems[rng.integers(2)],
                "unique": unique_tokens(20_000 + i, 1024)}[kind]
        out.append(np.concatenate([head, unique_tokens(30_000 + i + 1000 * len(kind), 128)]).tolist())
    return out


def ideal_hit_rate(sent: list[list[int]]) -> float:
    workload = Workload([TraceRequest(0.05 * i, len(p), 4, prompt_token_ids=tuple(p)) for i, p in enumerate(sent)],
                        16)
    return workload_stats(workload, 16)["ideal_prefix_hit_rate"]


def send_all(url: str, sent: list[list[int]], clients: int = 8) -> None:
    todo = iter(sent)
    lock = threading.Lock()

    def loop():
        with httpx.Client(base_url=url, timeout=30) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            while True:
                with lock:
                    prompt = next(todo, None)
                if prompt is None:
                    return
                http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


WATCH_S = 2.5  # at least the 2 s a run needs to be judged (Thresholds.min_duration_s)


def watched_while_serving(url: str, sent: list[list[int]], interval_s: float = 0.2) -> RunResult:
    """What `kvtune diagnose --url --duration 2.5 --interval 0.2` reads (kvtune.targets.watch: the same
    scraper and result_from_scrape), with a bounded load sent meanwhile."""
    start = time.monotonic()
    scraper = Scraper(url, interval_s=interval_s)
    scraper.start()
    send_all(url, sent)
    time.sleep(max(2 * interval_s, WATCH_S - (time.monotonic() - start)))  # a scrape after the last answer
    return result_from_scrape(scraper.stop(), url)


@pytest.fixture(scope="module")
def small_pool_server():
    server = ServerProcess("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb",
                           "--num-gpu-blocks-override", str(POOL_BLOCKS), "--max-model-len", "2048")
    yield server.url
    server.stop()


def evicted_tokens(result: RunResult) -> int:
    return int(sum(result.series["kvengine_evictions"])) * 16


@pytest.mark.slow
def test_f4_without_a_profile_detects_thrash_from_reuse_and_evictions(small_pool_server):
    """Issue #24: 29.8 % hits under heavy evictions of a workload whose ideal is 85 % went undetected: without
    a profile F4 needed hits under 0.2, and evictions only told thrash from a template problem."""
    sent = prompts("thrash", 60)
    result = watched_while_serving(small_pool_server, sent)
    assert result.requests == [] and "ideal_prefix_hit_rate" not in result.workload  # as --url sees it
    hits = sum(result.series["prefix_hits"]) / sum(result.series["prefix_queries"])
    ideal = ideal_hit_rate(sent)
    assert ideal >= 0.7 and hits < 0.5 * ideal  # the fault: the cache loses what the prompts share
    assert evicted_tokens(result) >= POOL_BLOCKS * 16
    f4 = fired(result)["F4"]
    assert "capacity thrash" in f4.cause and f4.severity == "warning"
    assert evidence(f4, "vllm:prefix_cache_hits").value == pytest.approx(hits, abs=1e-3)
    assert evidence(f4, "kvengine:prefix_cache_evictions_total (tokens)").value == evicted_tokens(result)
    assert f4.fix.startswith(f"`--num-gpu-blocks-override {POOL_BLOCKS} → ")


@pytest.mark.slow
def test_f4_without_a_profile_never_calls_prompts_that_share_nothing_thrash(small_pool_server):
    """Issue #24: unique prompts evict as heavily (every full block is cached, none is ever reused)."""
    result = watched_while_serving(small_pool_server, prompts("unique", 60))
    assert evicted_tokens(result) >= POOL_BLOCKS * 16 and sum(result.series["prefix_hits"]) == 0
    f4 = fired(result).get("F4")
    assert f4 is None or ("capacity thrash" not in f4.cause and f4.severity == "info")


@pytest.mark.slow
def test_f4_without_a_profile_is_quiet_when_the_shared_prompts_fit(small_pool_server):
    result = watched_while_serving(small_pool_server, prompts("shared", 60))
    assert sum(result.series["prefix_hits"]) / sum(result.series["prefix_queries"]) > 0.7
    assert "F4" not in fired(result)


# -- F4: a shared body behind a per-request header -------------------------------------------------------------

HEAD, BODY, USER = 16, 2048, 64


def templated(header_first: bool) -> Workload:
    """60 prompts: a 16-token per-request header (a date, an id) and the same 2,048-token system prompt,
    then 64 tokens of user message."""
    body = unique_tokens(1, BODY)
    requests = []
    for i in range(60):
        head, user = unique_tokens(100 + i, HEAD), unique_tokens(500 + i, USER)
        tokens = np.concatenate([head, body, user] if header_first else [body, head, user])
        requests.append(TraceRequest(0.25 * i, len(tokens), 32, prompt_token_ids=tuple(tokens.tolist())))
    return Workload(requests, 16)


@cache
def header_before_body(header_first: bool = True) -> RunResult:
    return sim(EngineConfig(), templated(header_first))


def test_f4_a_varying_header_before_a_shared_body_is_a_warning_with_the_exact_fix():
    """Issue #24: it was `info` and read the same as prompts that share nothing."""
    result = header_before_body()
    profile = result.workload
    assert profile["ideal_prefix_hit_rate"] == 0.0  # as a prefix, nothing is shared
    assert profile["repeated_block_share"] > 0.9  # at any block position, the body is
    assert (profile["repeated_head_tokens"], profile["repeated_body_tokens"]) == (HEAD, BODY)
    f4 = fired(result)["F4"]
    assert f4.severity == "warning"
    assert not f4.changes and f4.fix.index(f"{HEAD}-token") < f4.fix.index(f"{BODY:,}-token")  # head after body
    assert evidence(f4, "varying head before the shared body").value == HEAD
    assert evidence(f4, "shared body behind it").value == BODY


def test_f4_the_fix_applied_serves_the_body_from_the_cache():
    moved = header_before_body(header_first=False)
    assert moved.summary["prefix_hit_rate"] > 0.8
    assert "F4" not in fired(moved)


# -- F5: a large max_num_batched_tokens ---------------------------------------------------------------------------

LARGE_BATCH = EngineConfig(gpu_memory_utilization=0.99, max_num_batched_tokens=65536)
L4 = ("llama-3-8b", "l4-24gb")


def long_requests() -> Workload:
    """Prompts of 1,500-3,000 tokens: longer than the 1,456 the start error says the pool holds."""
    return Workload([TraceRequest(0.2 * i, 1500 + 50 * i, 256) for i in range(31)], 16)


def failed_with_profile() -> tuple[RunResult, str]:
    result, error = failed_start(LARGE_BATCH, *L4)
    result.workload = workload_stats(long_requests(), 16)
    return result, error


def first_change(diagnosis):
    return diagnosis.changes[0]


def test_f5_a_large_batch_budget_is_lowered_first_and_that_starts_and_serves():
    result, error = failed_with_profile()
    [f5] = diagnose(result, error=error)
    cited = evidence(f5, "start error").value
    assert f5.id == "F5" and len(cited) >= 80 and error.startswith(cited)  # the engine's line (long lines cut)
    first = first_change(f5)
    assert first.flag == "--max-num-batched-tokens" and first.old == 65536 and first.new < 65536
    assert "activation peak" in first.effect
    fixed = sim(EngineConfig(gpu_memory_utilization=0.99, max_num_batched_tokens=first.new), long_requests(), *L4)
    assert fixed.summary["rejected"] == 0 and fixed.summary["completed"] == len(long_requests())
    # the length the pool holds (1,456) refuses these requests: never first, and it says so
    max_len = [c for c in f5.changes if c.flag == "--max-model-len"]
    assert all(c is not first and "refuses" in c.effect for c in max_len)
    # fp8 halves 1.00 GiB to 0.50, still over the 0.18 GiB the pool has: not offered
    assert not any(c.flag == "--kv-cache-dtype" for c in f5.changes)


def test_f5_offers_the_length_the_pool_holds_next_where_the_longest_request_fits():
    """The same start with requests of at most 1,000 tokens: the length the pool holds serves them all."""
    result, error = failed_start(LARGE_BATCH, *L4)
    result.workload = workload_stats(Workload([TraceRequest(0.2 * i, 700, 256) for i in range(30)], 16), 16)
    [f5] = diagnose(result, error=error)
    assert first_change(f5).flag == "--max-num-batched-tokens"  # the activations still come first
    assert f5.changes[1].flag == "--max-model-len" and "refuses" not in f5.changes[1].effect


def test_f5_a_default_batch_budget_keeps_the_old_fixes():
    """The pool too small for max_model_len at the default 8,192-token budget: the length is the fix."""
    result, error = failed_start(EngineConfig(gpu_memory_utilization=0.23))
    [f5] = diagnose(result, error=error)
    assert first_change(f5).flag == "--max-model-len"
    assert not any(c.flag == "--max-num-batched-tokens" for c in f5.changes)


def test_f5_is_not_fired_by_the_config_that_starts():
    config = EngineConfig(gpu_memory_utilization=0.99, max_num_batched_tokens=8192)
    assert starts_on_l4(config)
    assert "F5" not in fired(sim(config, long_requests(), *L4))


def starts_on_l4(config: EngineConfig) -> bool:
    try:
        sim(config, Workload([TraceRequest(0.0, 10, 1)], 16), *L4)
    except TargetStartError:
        return False
    return True


@pytest.fixture(scope="module")
def engine_start_error() -> TargetStartError:
    """A real `kvengine serve` with the large budget on the L4 preset (sim executor): it exits at start."""
    port = free_port()
    server = ManagedServer([sys.executable, "-m", "kvengine", "serve", "--port", str(port), "--executor", "sim",
                            "--preset", "llama-3-8b", "--device", "l4-24gb", "--gpu-memory-utilization", "0.99",
                            "--max-num-batched-tokens", "65536"], port, start_timeout_s=60)
    with pytest.raises(TargetStartError) as info, server:
        pass
    return info.value


def engine_run() -> RunResult:
    return RunResult("engine", "llama-3-8b", "l4-24gb", {"gpu_memory_utilization": 0.99,
                                                         "max_num_batched_tokens": 65536}, {}, [], {}, 0.0)


@pytest.mark.slow
def test_f5_on_an_engine_target_cites_the_memory_line_of_its_log(engine_start_error):
    [f5] = diagnose(engine_run(), error=str(engine_start_error))
    cited = evidence(f5, "start error").value
    assert cited and engine_start_error.cause.startswith(cited)  # the log's root-cause line, not the wrapper
    assert first_change(f5).flag == "--max-num-batched-tokens"
    # a record that kept only the wrapper line and the log's path still finds the cause in the log
    wrapper_only = f"the server exited with status 1 before it was healthy\nfull log: {engine_start_error.log_path}"
    [again] = diagnose(engine_run(), error=wrapper_only)
    assert again.id == "F5" and evidence(again, "start error").value == cited
    assert evidence(again, "full log").value == engine_start_error.log_path


def test_the_f5_fix_is_recomputed_from_kvengine_memory():
    """The budget offered is the largest halving of 65,536 that starts; half of it does not have to."""
    result, error = failed_with_profile()
    new = first_change(diagnose(result, error=error)[0]).new
    assert starts_on_l4(EngineConfig(gpu_memory_utilization=0.99, max_num_batched_tokens=new))
    assert not starts_on_l4(EngineConfig(gpu_memory_utilization=0.99, max_num_batched_tokens=new * 2))
