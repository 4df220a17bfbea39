"""The fault rules, each against a sim run built to cause its fault (and a healthy run that causes none).

Every run replays in virtual time on the bundled engine core.
The expected fixes are recomputed here from the run and kvengine.core.memory, never
copied from the rule's output.
"""
import dataclasses
import math
from functools import cache

import numpy as np
import pytest
from kvengine.executor.cost import CostCoefficients

from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.core.memory import max_concurrency, plan_memory
from kvtune.diagnose import INSUFFICIENT_DATA, Thresholds, diagnose
from kvtune.diagnose.prefix import TEMPLATE_FIX
from kvtune.diagnose.render import format_diagnoses
from kvtune.results import RunResult
from kvtune.targets import SimTarget, TargetStartError
from kvtune.results import config_dict
from kvtune.workload import IntDist, SynthSpec, TraceRequest, Workload, synthesize


def sim(config: EngineConfig, workload: Workload, model="llama-3-8b", device="h100-80gb") -> RunResult:
    # the scenarios' timing is the generic roofline's, not a GPU's fitted kernels: what they test is
    # the diagnosis of a pool and a load, which a refit of the kernels must not move
    return SimTarget(model_preset(model), device_preset(device), CostCoefficients()).run(config, workload)


def fired(result: RunResult, **thresholds) -> dict:
    return {d.id: d for d in diagnose(result, Thresholds(**thresholds))}


def evidence(diagnosis, metric_start: str):
    return next(e for e in diagnosis.evidence if e.metric.startswith(metric_start))


def served(result: RunResult) -> RunResult:
    """The run as a server sized in bytes reports it: the same pool as its num_gpu_blocks, no
    override. fp8 K/V then doubles the blocks; under --num-gpu-blocks-override it could not."""
    config = dict(result.config)
    config["num_gpu_blocks"] = config.pop("num_gpu_blocks_override")
    return dataclasses.replace(result, config=config)


def p99_context(result: RunResult) -> float:
    return float(np.percentile([r.prompt_tokens + r.output_tokens for r in result.requests if r.ok], 99))


# -- the runs ------------------------------------------------------------------

@cache
def healthy_run() -> RunResult:
    """Two shared system prompts, light load, a big pool: nothing to find."""
    spec = SynthSpec(num_requests=80, rate=4, system_prompts=2, system_prompt_len=1024,
                     input_len=IntDist.fixed(256), output_len=IntDist.fixed(64))
    return sim(EngineConfig(), synthesize(spec))


@cache
def long_prompts_into_full_pool() -> RunResult:
    """F1: a stream of 600-token requests keeps an 8,000-token pool near full; 3,000-token prompts
    arriving into it wait at the head of the queue while the queue grows behind them."""
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(0.04, 200))
    requests = [TraceRequest(float(t), 600, 50) for t in arrivals]
    requests += [TraceRequest(1.0 + k, 3000, 20) for k in range(6)]
    requests.sort(key=lambda r: r.arrival_s)
    config = EngineConfig(num_gpu_blocks_override=500, max_model_len=4096, max_num_seqs=64)
    return sim(config, Workload(requests, 16))


@cache
def growing_contexts() -> RunResult:
    """F2: 96 requests decode 3,000 tokens each from 1,000-token prompts: every step reads more K/V."""
    requests = [TraceRequest(i * 0.01, 1000, 3000) for i in range(96)]
    return sim(EngineConfig(), Workload(requests, 16))


@cache
def load_ramp_on_mha_model() -> RunResult:
    """F3: arrivals speed up 8× on Llama-2-7B (32 K/V heads: 512 KiB per token): running requests
    grow but tokens/s does not follow, each step reads their K/V."""
    gaps = 2.0 - 1.75 * np.arange(60) / 60
    requests = [TraceRequest(float(t), 1500, 1500) for t in np.cumsum(gaps)]
    return sim(EngineConfig(), Workload(requests, 16), model="llama-2-7b")


@cache
def unique_prompts() -> RunResult:
    """F4 as a template problem: no two prompts share a prefix."""
    spec = SynthSpec(num_requests=80, rate=4, input_len=IntDist.fixed(1024), output_len=IntDist.fixed(64))
    return sim(EngineConfig(), synthesize(spec))


@cache
def shared_prefixes_tiny_pool() -> RunResult:
    """F4 as thrash: 12 shared 1,024-token system prompts, a pool of 4,800 tokens."""
    spec = SynthSpec(num_requests=120, rate=8, system_prompts=12, system_prompt_len=1024,
                     input_len=IntDist.fixed(128), output_len=IntDist.fixed(64))
    return sim(EngineConfig(num_gpu_blocks_override=300, max_model_len=2048), synthesize(spec))


def preemption_config(max_num_seqs=256) -> EngineConfig:
    return EngineConfig(num_gpu_blocks_override=400, max_num_seqs=max_num_seqs, max_model_len=2048)


def preemption_workload() -> Workload:
    spec = SynthSpec(num_requests=100, rate=20, system_prompts=1, system_prompt_len=64,
                     input_len=IntDist.fixed(448), output_len=IntDist.fixed(256))
    return synthesize(spec)


@cache
def preemption_run() -> RunResult:
    """F6: max_num_seqs 256 over a 400-block pool that holds 8 requests at their full context."""
    return sim(preemption_config(), preemption_workload())


@cache
def agent_sessions(prefix_caching: bool) -> RunResult:
    """F7: 10 agent sessions of 8 calls, each resending a 2,048-token shared context and its history."""
    spec = SynthSpec(num_requests=80, rate=1, turns=IntDist.fixed(8), think_time_s=1.0, system_prompts=1,
                     system_prompt_len=2048, input_len=IntDist.fixed(256), output_len=IntDist.fixed(64))
    return sim(EngineConfig(enable_prefix_caching=prefix_caching), synthesize(spec))


@cache
def long_tail_contexts() -> RunResult:
    """F8: one request in ten has a 14,000-token prompt; 100 arrive in 5 s onto a 96,000-token pool."""
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.exponential(0.05, 100))
    requests = [TraceRequest(float(t), 14000 if rng.random() < 0.1 else 1500, 300) for t in arrivals]
    config = EngineConfig(max_model_len=16384, num_gpu_blocks_override=6000)
    return sim(config, Workload(requests, 16), model="qwen2.5-7b")


# -- healthy and insufficient --------------------------------------------------

def test_a_healthy_run_fires_no_rule():
    assert diagnose(healthy_run()) == []


def test_too_few_requests_is_insufficient_data_not_a_guess():
    result = sim(EngineConfig(), Workload([TraceRequest(i * 0.1, 500, 20) for i in range(3)], 16))
    [only] = diagnose(result)
    assert only.id == INSUFFICIENT_DATA and only.severity == "info"
    gap = evidence(only, "completed requests")
    assert gap.value == 3 and gap.threshold == ">= 20"


def test_a_run_without_series_is_insufficient_data():
    result = RunResult("url", "m", "unknown", {}, {}, [], {"time": [], "duration": []}, 0.0)
    [only] = diagnose(result)
    assert only.id == INSUFFICIENT_DATA and only.evidence[0].metric == "server series"


# -- F1 ------------------------------------------------------------------------

def test_f1_long_prompts_into_a_nearly_full_pool():
    result = long_prompts_into_full_pool()
    f1 = fired(result)["F1"]
    blocked = evidence(f1, "vllm:kv_cache_usage_perc with num_requests_waiting")
    assert blocked.value >= 0.1
    start, peak = map(float, evidence(f1, "vllm:num_requests_waiting").value.split(" → "))
    assert peak - start >= 2
    ttft = evidence(f1, "TTFT p95")
    assert ttft.value == pytest.approx(result.summary["ttft_p95"], rel=1e-3)
    assert f1.severity == ("critical" if ttft.value > 1.0 else "warning")
    # The pool was fixed at 500 blocks of 16 tokens: only that knob grows it; fp8 K/V would
    # halve the bytes of the same 500 blocks and hold not one token more.
    assert "`--num-gpu-blocks-override 500 → 750` (pool 8,000 → 12,000 tokens" in f1.fix
    assert "--kv-cache-dtype" not in f1.fix


# -- F2 ------------------------------------------------------------------------

def test_f2_itl_grows_with_context():
    result = growing_contexts()
    found = fired(result)
    f2 = found["F2"]
    trend = evidence(f2, "ITL p95 (clients) by context quartile")
    low, high = (float(v.removesuffix(" ms")) for v in trend.value.split(" → "))
    assert high / low >= 1.5
    assert evidence(f2, "vllm:kv_cache_usage_perc, p95 over time").value >= 0.5
    assert f2.fix.startswith("`--kv-cache-dtype auto → fp8`")
    assert "F3" not in found  # running stays at 96: it is context, not load, that slows the decode


def test_f2_does_not_fire_when_the_threshold_asks_for_more_growth():
    assert "F2" not in fired(growing_contexts(), itl_growth=10.0)


# -- F3 ------------------------------------------------------------------------

def test_f3_running_grows_but_tokens_per_second_does_not():
    result = load_ramp_on_mha_model()
    found = fired(result)
    f3 = found["F3"]
    run_low, run_high = map(float, evidence(f3, "vllm:num_requests_running").value.split(" → "))
    tps_low, tps_high = (float(v.replace(",", "")) for v in evidence(f3, "generation tokens/s").value.split(" → "))
    assert run_high / run_low >= 1.5
    assert math.log(tps_high / tps_low) / math.log(run_high / run_low) <= 0.5
    assert "--max-num-seqs 1024 → " in f3.fix
    knee = int(f3.fix.split("--max-num-seqs 1024 → ")[1].split("`")[0])
    assert 1 <= knee <= max(result.series["num_running"])
    assert "F2" not in found and "F6" not in found


def test_f3_shows_nvml_utilisation_where_a_gpu_was_sampled():
    result = load_ramp_on_mha_model()
    steps = len(result.series["time"])
    with_gpu = dataclasses.replace(result, series=result.series | {"gpu_utilization": [95.0] * steps})
    f3 = fired(with_gpu)["F3"]
    busy = evidence(f3, "NVML GPU utilisation")
    assert 0 < busy.value <= 95.0 and busy.threshold == ">= 80 looks busy"


# -- F4 ------------------------------------------------------------------------

def test_f4_unique_prompts_are_a_template_problem():
    f4 = fired(unique_prompts())["F4"]
    assert f4.severity == "info" and not f4.changes  # no flag fixes a template: the prompts must change
    assert evidence(f4, "ideal hit rate").value == 0.0
    assert evidence(f4, "vllm:prefix_cache_hits").value == 0.0
    assert f4.fix == TEMPLATE_FIX


def test_f4_shared_prefixes_in_a_tiny_pool_are_thrash():
    result = served(shared_prefixes_tiny_pool())
    f4 = fired(result)["F4"]
    observed, ideal = evidence(f4, "vllm:prefix_cache_hits").value, evidence(f4, "ideal hit rate").value
    assert ideal == pytest.approx(result.workload["ideal_prefix_hit_rate"], abs=1e-3) and ideal >= 0.3
    assert observed < 0.5 * ideal
    assert "capacity thrash" in f4.cause and f4.severity == "warning"
    assert evidence(f4, "distinct prompt blocks").value > 300 * 16
    assert "`--kv-cache-dtype auto → fp8` (pool 4,800 → 9,600 tokens)" in f4.fix


# -- F5 ------------------------------------------------------------------------

def failed_start(config: EngineConfig, model="llama-3-8b", device="h100-80gb") -> tuple[RunResult, str]:
    with pytest.raises(TargetStartError) as info:
        sim(config, Workload([TraceRequest(0.0, 10, 1)], 16), model, device)
    return RunResult("sim", model, device, config_dict(config), {}, [], {}, 0.0), str(info.value)


def starts(config: EngineConfig) -> bool:
    try:
        sim(config, Workload([TraceRequest(0.0, 10, 1)], 16))
    except TargetStartError:
        return False
    return True


def test_f5_weights_that_do_not_fit_get_the_smallest_utilisation_that_starts():
    result, error = failed_start(EngineConfig(gpu_memory_utilization=0.15))
    [f5] = diagnose(result, error=error)
    assert f5.id == "F5" and f5.severity == "critical"
    assert evidence(f5, "start error").value == error.splitlines()[0]  # the engine's own line, cited
    assert evidence(f5, "gpu_memory_utilization").value == 0.15
    target = float(f5.fix.split("--gpu-memory-utilization 0.15 → ")[1].split("`")[0])
    assert starts(EngineConfig(gpu_memory_utilization=target))
    assert not starts(EngineConfig(gpu_memory_utilization=round(target - 0.01, 2)))


def test_f5_a_pool_too_small_for_max_model_len_gets_the_length_it_holds():
    result, error = failed_start(EngineConfig(gpu_memory_utilization=0.23))
    [f5] = diagnose(result, error=error)
    cited = evidence(f5, "start error").value
    assert len(cited) >= 80 and error.startswith(cited)  # the engine's own line, cited (long lines cut)
    target = int(f5.fix.split("--max-model-len 8192 → ")[1].split("`")[0])
    assert target % 16 == 0
    assert starts(EngineConfig(gpu_memory_utilization=0.23, max_model_len=target))
    assert not starts(EngineConfig(gpu_memory_utilization=0.23, max_model_len=target + 16 * 64))


def test_f5_a_cuda_oom_lowers_utilisation_and_the_batch_budget():
    result = RunResult("vllm", "some/model", "unknown",
                       {"gpu_memory_utilization": 0.97, "max_num_batched_tokens": 16384}, {}, [], {}, 0.0)
    [f5] = diagnose(result, error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert evidence(f5, "gpu_memory_utilization").value == 0.97
    assert "`--gpu-memory-utilization 0.97 → 0.9`" in f5.fix
    assert "`--max-num-batched-tokens 16384 → 8192`" in f5.fix


def test_a_failed_run_for_another_reason_is_not_f5():
    result = RunResult("vllm", "m", "unknown", {}, {}, [], {}, 0.0)
    [only] = diagnose(result, error="error: unrecognized arguments: --frobnicate")
    assert only.id == INSUFFICIENT_DATA


# -- F6 ------------------------------------------------------------------------

def test_f6_max_num_seqs_far_above_what_the_pool_holds():
    result = served(preemption_run())
    f6 = fired(result)["F6"]
    assert f6.severity == "critical"
    assert evidence(f6, "vllm:num_preemptions_total").value == result.summary["preemptions"] >= 5
    assert evidence(f6, "windows with preemptions").value >= 0.25
    assert evidence(f6, "vllm:kv_cache_usage_perc, p95 over time").value >= 0.9
    # The pool holds 8 at the p99 context, the arrivals need ~46 in service (Little's law): a cap
    # at 8 would starve the queue, so it is not offered (it was the first fix before issue #24).
    fit = int(max_concurrency(400, 16, math.ceil(p99_context(result))))
    assert fit < needed_concurrency(result)
    assert f"--max-num-seqs 256 → {fit}`" not in f6.fix
    assert f6.fix.startswith("`--kv-cache-dtype auto → fp8`")


def needed_concurrency(result: RunResult) -> int:
    """L = lambda × W, recomputed from the records: arrivals per second × mean seconds in service."""
    arrivals = sorted(r.arrival_s for r in result.requests)
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    service = np.mean([r.e2e_s - r.queue_s for r in result.requests if r.ok])
    return math.ceil(rate * service)


def max_num_seqs_offered(fix: str) -> list[int]:
    return [int(part.split(" → ")[1].split("`")[0]) for part in fix.split("; or ") if "--max-num-seqs" in part]


TIGHT_UTILIZATION = 0.235  # llama-3-8b on an h100: an 8,000-token pool, sized by utilisation so fp8 doubles it


@cache
def tight_pool_run() -> RunResult:
    """F1/F6 on a pool sized by utilisation: 20 req/s of 768-token contexts need ~46 in service,
    the pool holds 10 of them."""
    return sim(EngineConfig(gpu_memory_utilization=TIGHT_UTILIZATION, max_model_len=2048), preemption_workload())


def apply(fix: str, config: EngineConfig) -> EngineConfig:
    """The first flag change of a fix line, applied to the config."""
    first = fix.split("; or ")[0]
    flag, change = first.strip("`").split("`")[0].split(" ", 1)
    value = change.split(" → ")[1]
    field = flag.removeprefix("--").replace("-", "_")
    kind = type(getattr(config, field))
    return dataclasses.replace(config, **{field: value if kind is str else kind(value)})


@pytest.mark.parametrize("fault", ["F1", "F6"])
def test_the_first_fix_for_a_tight_pool_does_not_starve_the_arrivals(fault):
    """Issue #24: the max_num_seqs cap at what the pool holds (10) starved a queue that needs ~46
    running: TTFT and e2e p95 grew while preemptions vanished. No cap below L is offered, and the
    first fix, applied and re-run, cuts preemptions without making TTFT or e2e p95 worse."""
    result = tight_pool_run()
    need = needed_concurrency(result)
    found = fired(result)[fault]
    assert all(cap >= need for cap in max_num_seqs_offered(found.fix)), found.fix
    config = EngineConfig(gpu_memory_utilization=TIGHT_UTILIZATION, max_model_len=2048)
    rerun = sim(apply(found.fix, config), preemption_workload())
    before, after = result.summary, rerun.summary
    assert after["preemptions"] < before["preemptions"]
    assert after["ttft_p95"] <= 1.1 * before["ttft_p95"]
    assert after["e2e_p95"] <= 1.1 * before["e2e_p95"]


def test_f1_on_a_pool_sized_by_cpu_vllms_environment_grows_that_instead_of_utilisation():
    """CPU vLLM ignores --gpu-memory-utilization while VLLM_CPU_KVCACHE_SPACE is set: a fix that
    raised utilisation would change nothing, so the fix raises the variable the run was sized by."""
    rng = np.random.default_rng(0)
    requests = sorted([TraceRequest(float(t), 600, 50) for t in np.cumsum(rng.exponential(0.04, 200))]
                      + [TraceRequest(1.0 + k, 3000, 20) for k in range(6)], key=lambda r: r.arrival_s)
    # a pool of ~8,600 tokens sized by utilisation (no block override)
    result = sim(EngineConfig(gpu_memory_utilization=0.74, max_model_len=4096, max_num_seqs=64),
                 Workload(requests, 16), device="l4-24gb")
    sized = dataclasses.replace(result, config=dict(result.config, launch_env={"VLLM_CPU_KVCACHE_SPACE": "2"},
                                                    server_block_sizes=[32, 64, 128, 256]))
    text = " ".join(d.fix for d in fired(sized).values())
    assert "`VLLM_CPU_KVCACHE_SPACE 2 → 3`" in text and "--gpu-memory-utilization" not in text
    plain = " ".join(d.fix for d in fired(result).values())
    assert "--gpu-memory-utilization" in plain  # the same run on a GPU: utilisation is the knob


def test_f6_respects_its_thresholds():
    assert "F6" not in fired(preemption_run(), min_preemptions=10_000)
    assert "F6" not in fired(preemption_run(), preempting_fraction=1.01, preempted_share_critical=1.01)


def test_f6_does_not_need_a_scrape_to_catch_the_pool_exactly_full():
    """Each preemption frees its victim's blocks at once, so on a small pool the scrapes
    between preemptions read below full (a live 100-block pool peaked at 92.9% in 6 scrapes
    while it preempted 17 times); the sustained preemptions themselves show it ran out."""
    assert "F6" in fired(preemption_run(), usage_saturated=1.01)


def critical_evidence(diagnosis) -> list[bool]:
    """For each evidence line with a 'critical' threshold, whether its value crosses it."""
    out = []
    for e in diagnosis.evidence:
        words = e.threshold.split()
        if words[:1] != ["critical"]:
            continue
        op, bound = (words[2], words[3]) if words[1] == "at" else (words[1], words[2])
        out.append(e.value >= float(bound) if op == ">=" else e.value > float(bound))
    return out


@pytest.mark.parametrize("run", [lambda: served(preemption_run()), long_tail_contexts,
                                 lambda: mild_overcommit(), lambda: chats_and_long_documents(0.30)])
def test_pressure_severity_is_the_one_its_evidence_shows(run):
    """Issue #39: a CRITICAL F6 listed 'requests preempted at least once 0.017, critical at >= 0.1'.
    Critical where, and only where, a line it prints crosses its critical threshold."""
    found = [d for d in diagnose(run()) if d.id in ("F6", "F8")]
    assert found
    for d in found:
        crossed = critical_evidence(d)
        assert crossed, d.evidence
        assert (d.severity == "critical") == any(crossed), (d.id, d.severity, d.evidence)


# -- F7 ------------------------------------------------------------------------

def test_f7_agent_sessions_re_prefill_their_context_on_every_call():
    result = agent_sessions(prefix_caching=False)
    f7 = fired(result)["F7"]
    assert evidence(f7, "calls per session").value == 8.0
    assert evidence(f7, "prompt tokens per request").value >= 1024
    assert evidence(f7, "cached prompt tokens per request").value == 0
    assert f7.fix.startswith("`--enable-prefix-caching off → on`")
    # With caching on, each call is served its shared context from the cache: no F7.
    again = agent_sessions(prefix_caching=True)
    assert "F7" not in fired(again)
    assert again.summary["ttft_mean"] < result.summary["ttft_mean"] / 2


# -- F8 ------------------------------------------------------------------------

def in_service_sum(result: RunResult, at: float) -> int:
    """The full contexts of the requests in service (scheduled to finished) at `at`, counted by hand."""
    return sum(r.prompt_tokens + r.output_tokens for r in result.requests
               if r.ok and r.arrival_s + r.queue_s <= at < r.arrival_s + r.e2e_s)


def test_f8_concurrent_contexts_exceed_the_pool():
    result = served(long_tail_contexts())
    f8 = fired(result)["F8"]
    demand = evidence(f8, "KV demand: p99 over time of the full contexts of the requests in service")
    # Never the p99 context times the peak running (a 14,300-token tail counted once per running
    # request): what the requests in service held at once, which no moment of the run exceeds.
    starts = [r.arrival_s + r.queue_s for r in result.requests if r.ok]
    most = max(in_service_sum(result, t) for t in starts)
    assert 96_000 < demand.value <= most
    assert "pool 96,000 tokens" in demand.threshold
    assert evidence(f8, "vllm:num_preemptions_total").value >= 5
    assert f8.fix.startswith("`--kv-cache-dtype auto → fp8` (pool 96,000 → 192,000 tokens)")


def chats_and_long_documents(utilization: float) -> RunResult:
    """Issue #39: llama-3-8b on an H100 at a 30 % pool (50,608 tokens), 5 req/s for 90 s: 95 % chats
    behind one 1,024-token system prompt, 5 % documents of 5-6.5k prompt and 1.2-1.6k output. At the
    mean context × the running requests the pool fits; the documents, which also stay the longest,
    do not."""
    rng = np.random.default_rng(1)
    system, requests, t = tuple(range(8)), [], 0.0
    while (t := t + rng.exponential(0.2)) < 90:
        n = len(requests)
        if rng.random() < 0.05:
            prompt, output, shared = int(rng.integers(5000, 6500)), int(rng.integers(1200, 1600)), ()
        else:
            prompt, output, shared = 1024 + int(rng.integers(50, 400)), int(rng.integers(50, 300)), system
        own = tuple(10**7 + 100 * n + k for k in range(math.ceil((prompt - 128 * len(shared)) / 128)))
        requests.append(TraceRequest(t, prompt, output, hash_ids=shared + own))
    return sim(EngineConfig(gpu_memory_utilization=utilization, max_model_len=8192), Workload(requests, 128))


def test_f8_fires_on_a_preempting_pool_that_fits_the_mean_but_not_the_tail():
    """The regression of issue #39: Little's law with one mean service time drew the contexts per
    arrival, so the documents (5 % of arrivals, most of the K/V in service) counted 5 %."""
    result = chats_and_long_documents(0.30)
    f8 = fired(result)["F8"]
    pool = 50_608
    assert evidence(f8, "KV demand").value > pool
    assert evidence(f8, "mean context ×").value <= pool  # the mean hides it
    assert result.summary["preemptions"] >= 5


def test_f8_is_silent_just_under_the_fault():
    """Two points more of the GPU: the same traffic preempts no request, and nothing is overcommitted."""
    result = chats_and_long_documents(0.32)
    assert result.summary["preemptions"] == 0
    assert "F8" not in fired(result)


def test_f8_proposes_fp8_and_no_tensor_parallelism_where_fp8_suffices():
    """Where fp8's doubling of the pool covers the demand, fp8 comes first and no GPUs are added:
    the same run, its pool seen just over half the demand."""
    result = long_tail_contexts()
    demand = evidence(fired(result)["F8"], "KV demand").value
    blocks = math.ceil(demand / 16 / 2) + 1
    half = served(dataclasses.replace(result, config=dict(result.config, num_gpu_blocks_override=blocks)))
    f8 = fired(half)["F8"]
    assert f8.fix.startswith("`--kv-cache-dtype auto → fp8`")
    assert "--tensor-parallel-size" not in f8.fix


def test_f8_never_proposes_tensor_parallelism_on_a_cpu_server():
    result = long_tail_contexts()
    assert "--tensor-parallel-size" in fired(result)["F8"].fix  # on the GPU it is offered
    on_cpu = dataclasses.replace(result, config=dict(result.config, launch_env={"VLLM_CPU_KVCACHE_SPACE": "2"}))
    assert "--tensor-parallel-size" not in fired(on_cpu)["F8"].fix
    cpu_device = dataclasses.replace(result, device="cpu")
    assert "--tensor-parallel-size" not in fired(cpu_device)["F8"].fix


def test_f8_with_few_preemptions_and_ttft_within_its_slo_is_not_critical():
    """Issue #24: F8 was critical with 5 preemptions and a TTFT p95 of 0.17 s."""
    result = mild_overcommit()
    f8 = fired(result)["F8"]
    assert result.summary["ttft_p95"] < 1.0
    assert result.summary["preemptions"] < 0.1 * len(result.requests)
    assert f8.severity != "critical"


@cache
def mild_overcommit() -> RunResult:
    """A few bursts of long requests fill an 8,000-token pool now and then: some preemptions, TTFT fine."""
    rng = np.random.default_rng(2)
    arrivals = np.cumsum(rng.exponential(0.1, 150))
    requests = [TraceRequest(float(t), 2500 if rng.random() < 0.15 else 300, 100) for t in arrivals]
    return sim(EngineConfig(max_model_len=4096, num_gpu_blocks_override=500), Workload(requests, 16))


def test_f8_pool_from_presets_matches_kvengine_memory_plan():
    """Without an override, the pool the rules use is the one kvengine sized for the run."""
    result = growing_contexts()
    cfg = EngineConfig(**{k: v for k, v in result.config.items() if k != "extra"})
    plan = plan_memory(model_preset("llama-3-8b"), device_preset("h100-80gb"), cfg)
    from kvtune.diagnose.pool import pool_of
    assert pool_of(result).tokens == plan.num_tokens


# -- live-shaped series --------------------------------------------------------

def as_scrapes(result: RunResult, interval_s: float = 1.0) -> RunResult:
    """The sim run as a scraper would have seen it: gauges sampled, counters summed per interval."""
    s = {k: np.asarray(v, dtype=float) for k, v in result.series.items()}
    edges = np.arange(0.0, s["time"][-1] + interval_s, interval_s)
    index = np.searchsorted(s["time"], edges, side="right") - 1
    series = {"time": list(edges), "duration": [0.0] + [interval_s] * (len(edges) - 1)}
    for gauge in ("num_running", "num_waiting", "kv_usage"):
        series[gauge] = [float(s[gauge][i]) if i >= 0 else 0.0 for i in index]
    cumulative = {c: np.concatenate([[0.0], np.cumsum(s[c])]) for c in
                  ("num_preemptions", "prefix_queries", "prefix_hits", "generation_tokens")}
    for name, totals in cumulative.items():
        series[name] = list(np.diff(totals[index + 1], prepend=0.0))
    ends = [r.arrival_s + r.e2e_s for r in result.requests if r.ok]
    series["requests_finished"] = list(np.diff(np.searchsorted(np.sort(ends), edges, side="right"), prepend=0))
    return dataclasses.replace(result, series=series, requests=[])


@pytest.mark.parametrize("run, faults", [
    (preemption_run, {"F1", "F6"}), (growing_contexts, {"F2"}), (load_ramp_on_mha_model, {"F3"}),
    (shared_prefixes_tiny_pool, {"F4", "F6"}), (long_tail_contexts, {"F8"}),
])
def test_rules_read_per_scrape_series_like_per_step_ones(run, faults):
    """Without client samples (as when watching a server), from series sampled once a second."""
    assert faults <= set(fired(as_scrapes(run())))


def test_the_busy_part_of_a_watch_keeps_every_count_and_drops_the_idle_scrapes():
    """A watch reads idle scrapes around the traffic; a request that came and went between two scrapes
    shows only in the counters of the scrape after it, which must stay (issue #39)."""
    from kvtune.diagnose.signals import Series
    series = {"time": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], "duration": [0.0] + [1.0] * 6,
              "num_running": [0, 0, 0, 2, 0, 0, 0], "num_waiting": [0] * 7,
              "prefix_queries": [0, 0, 64, 128, 32, 0, 0], "prefix_hits": [0, 0, 16, 64, 0, 0, 0]}
    busy = Series(series).busy()
    assert list(busy.time) == [3.0, 4.0, 5.0] and busy.span_s == 3.0
    assert busy.total("prefix_queries") == 224 and busy.total("prefix_hits") == 80


def test_a_healthy_run_seen_as_scrapes_fires_no_rule():
    assert fired(as_scrapes(healthy_run())) == {}


def test_the_table_lists_critical_first_with_evidence_and_fix():
    text = format_diagnoses(diagnose(served(preemption_run())))
    assert text.index("CRITICAL") < text.index("INFO")
    assert "metric" in text and "threshold" in text and "fix:   `--kv-cache-dtype auto → fp8`" in text
