"""kvtune calibrate: the fit recovers known coefficients, profiles live in the store,
and a server that dies mid-probe fails clearly with nothing saved."""
import argparse
import dataclasses
import math
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from kvengine.engine.clock import VirtualClock
from kvengine.config import ConfigError, EngineConfig, device_preset, model_preset
from kvengine.executor.cost import StepShape, CostCoefficients, torch_attention_kernel
from kvengine.engine.llm_engine import LLMEngine
from kvengine.core.request import SamplingParams

from kvtune.cli.calibrate import add_calibrate_command
from kvtune.calibrate import (
    CalibrationError,
    CalibrationProfile,
    ProfileNotFoundError,
    design_probes,
    fit_coefficients,
    fit_dequant,
    format_profile,
    get_profile,
    list_profiles,
    load_cost_profile,
    save_profile,
    speed_drift,
    step_shapes,
)
from kvtune.calibrate.design import (
    ITL,
    LOADED_FIRST,
    LOADED_SPACING,
    PREFILL_TIME,
    TTFT,
    probe_prompts,
)
from kvtune.calibrate.timings import ProbeRun, RequestTiming, TrialRun, steady_itl
from kvtune.store import Store
from kvtune.targets.process import ManagedServer, free_port

# Far from the defaults. The overheads are large enough that the server's own unmodelled
# costs (the loop's bookkeeping between steps, publishing tokens, sleep overshoot: about
# 0.4 ms a step) stay well under the 5% the recovery allows; fast compute keeps the long
# prefills short, and attention still takes half of an 8k-token prefill.
KNOWN = CostCoefficients(memory_efficiency=0.3, compute_efficiency=0.9, attention_efficiency=0.15,
                         step_overhead_s=0.01, per_seq_overhead_s=1e-3)
FITTED = ("memory_efficiency", "compute_efficiency", "attention_efficiency", "step_overhead_s",
          "per_seq_overhead_s")
MODEL, DEVICE = "llama-3-8b", "h100-80gb"


def close(fitted: CostCoefficients, known: CostCoefficients, tol: float) -> dict:
    """The coefficients off by more than `tol` (relative), with their errors."""
    errors = {k: getattr(fitted, k) / getattr(known, k) - 1 for k in FITTED}
    return {k: round(e, 4) for k, e in errors.items() if abs(e) > tol}


# ---------------------------------------------------------------- the fit alone (virtual time)

def virtual_runs(plan, coeffs, client_s, busy_s, config, prefill_times=False, specs=(MODEL, DEVICE)):
    """What the plan's probes would measure on an engine stepping exactly by `coeffs`,
    each token reaching the client `client_s` late (`busy_s` for requests arriving at a
    busy engine, in the middle of a step), with the engine's own prefill times if asked:
    ProbeRuns without any HTTP."""
    model, device = model_preset(specs[0]), device_preset(specs[1])
    rng = np.random.default_rng(1)
    runs = []
    for probe in plan.probes:
        engine = None
        trials = []
        for _ in range(1 if probe.background else probe.repeats):
            drawn = probe_prompts(probe, rng)
            warm, prompts = drawn.warmup, drawn.prompts
            engine = LLMEngine(config, model, device, clock=VirtualClock(), cost_coefficients=coeffs)
            if probe.background:
                trials.append(virtual_loaded_trial(engine, probe, warm, rng, busy_s))
                continue
            if warm:
                engine.add_request("w", warm, SamplingParams(max_tokens=1, ignore_eos=True))
                while engine.has_unfinished():
                    engine.step()
            start = engine.clock.now
            reqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=probe.max_tokens, ignore_eos=True))
                    for i, p in enumerate(prompts)]
            while engine.has_unfinished():
                engine.step()
            timings = [RequestTiming(start, [t + client_s for t in r.token_times]) for r in reqs]
            trials.append(TrialRun(warm, prompts, timings))
            if prefill_times and TTFT in probe.measures and len(reqs) == 1:
                trials[-1].prefill_time_s = reqs[0].first_token_time - reqs[0].first_scheduled_time
        runs.append(ProbeRun(probe, trials))
    return runs


def virtual_loaded_trial(engine, probe, warm, rng, busy_s):
    shared = warm[:probe.prefix_len] if warm is not None else []
    if warm is not None:
        engine.add_request("w", warm, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    background = [rng.integers(1000, 30000, n).tolist() for n in probe.background_lens()]
    total = LOADED_FIRST + LOADED_SPACING * probe.repeats + 4 * LOADED_SPACING
    bg = [engine.add_request(f"b{i}", p, SamplingParams(max_tokens=total, ignore_eos=True))
          for i, p in enumerate(background)]
    arrivals, timings, sent_at = [], [], []
    for k in range(probe.repeats):
        while bg[0].num_output_tokens < LOADED_FIRST + k * LOADED_SPACING:
            engine.step()
        sent_at.append(bg[0].num_output_tokens)
        before = engine.clock.now
        engine.step()  # the step it lands in, halfway on average
        sent = (before + engine.clock.now) / 2
        prompt = shared + rng.integers(1000, 30000, probe.prompt_len - probe.prefix_len).tolist()
        req = engine.add_request(f"a{k}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while not req.num_output_tokens:
            engine.step()
        arrivals.append(prompt)
        timings.append(RequestTiming(sent, [req.token_times[0] + busy_s]))
    while engine.has_unfinished():
        engine.step()
    return TrialRun(warm, arrivals, timings, background, [RequestTiming(0.0, list(r.token_times)) for r in bg],
                    sent_at)


@pytest.mark.parametrize("per_prefill_s, busy_arrival_s, prefill_times",
                         [(0.0, 0.0, True), (4e-3, 0.0, True), (4e-3, 0.0, False), (0.0, 3e-3, True)])
def test_fit_recovers_coefficients_from_exact_timings(per_prefill_s, busy_arrival_s, prefill_times):
    known = dataclasses.replace(KNOWN, per_prefill_overhead_s=per_prefill_s, busy_arrival_overhead_s=busy_arrival_s)
    config = EngineConfig(max_model_len=4096).resolve(model_preset(MODEL), device_preset(DEVICE))
    plan = design_probes(4096, max_batch=64, batch_tokens=config.max_num_batched_tokens, quick=True)
    runs = virtual_runs(plan, known, 2e-3, 5e-3, config, prefill_times)
    shapes, observations = step_shapes(runs, model_preset(MODEL), device_preset(DEVICE), config)
    assert {o.kind for o in observations} == {"overhead", "prefill", "decode", "context", "prefix", "loaded"}
    # The server's prefill times: one per single-request TTFT probe, with no client overhead.
    timed = [o for o in observations if o.measure == PREFILL_TIME]
    assert len(timed) == (sum(TTFT in p.measures and p.batch == 1 and not p.background for p in plan.probes)
                          if prefill_times else 0)
    assert all(o.client is None for o in timed)
    result = fit_coefficients(shapes, observations, model_preset(MODEL), device_preset(DEVICE), "auto", 16)
    assert close(result.coefficients, known, 0.01) == {}
    # The server's own prefill times or the loaded probes tell these apart from the client overhead.
    for name, value in (("per_prefill_overhead_s", per_prefill_s), ("busy_arrival_overhead_s", busy_arrival_s)):
        assert getattr(result.coefficients, name) == pytest.approx(value, rel=0.01, abs=2e-5), name
    assert result.client_overhead_s == pytest.approx(2e-3, rel=0.02)
    assert result.client_overhead_busy_s == pytest.approx(5e-3, rel=0.02)
    residuals = result.residuals()
    assert residuals["all"]["max"] < 0.01
    assert residuals["all"]["n"] == len(observations)
    assert result.initial["all"]["rms"] > 0.2  # the roofline's defaults are far off these timings
    # A GPU's decodes are bound by their K/V reads: no second attention share is made up.
    assert result.coefficients.decode_attention_efficiency is None


# A CPU's quantized cache, as kvengine's torch executor reads it: its own kernels each step, and
# each element of the padded batch converted (llama-3-8b: 65,536 K/V elements per token).
QUANTIZED = {"quantized_step_overhead_s": 4e-3, "kv_dequant_per_element_s": 3e-12}


def test_dequant_fit_recovers_a_quantized_caches_terms_from_exact_timings():
    """The main fit's coefficients, held, plus the two terms a quantized cache adds, from the
    decode and long-context probes of an fp8 server stepping exactly by them."""
    known = dataclasses.replace(KNOWN, **QUANTIZED)
    model, device = model_preset(MODEL), device_preset(DEVICE)
    config = EngineConfig(max_model_len=4096, kv_cache_dtype="fp8").resolve(model, device)
    plan = design_probes(4096, max_batch=64, batch_tokens=config.max_num_batched_tokens, quick=True)
    plan.probes = [p for p in plan.probes if p.kind in ("decode", "context")]
    runs = virtual_runs(plan, known, 2e-3, 5e-3, config)
    shapes, observations = step_shapes(runs, model, device, config)
    fit = fit_dequant(shapes, observations, model, device, "fp8", config.block_size, KNOWN, 2e-3, 5e-3)
    for name, value in QUANTIZED.items():
        assert getattr(fit.coefficients, name) == pytest.approx(value, rel=0.01), name
    assert close(fit.coefficients, KNOWN, 1e-12) == {}  # the rest as the main fit left them
    assert fit.residuals()["all"]["max"] < 0.01
    assert fit.without["all"]["rms"] > 0.1  # without the terms, the fp8 server is far slower than priced
    # An fp8 server that reads as fast as its bytes say gets no terms, not negative ones.
    runs = virtual_runs(plan, KNOWN, 2e-3, 5e-3, config)
    shapes, observations = step_shapes(runs, model, device, config)
    fit = fit_dequant(shapes, observations, model, device, "fp8", config.block_size, KNOWN, 2e-3, 5e-3)
    assert fit.coefficients.quantized_step_overhead_s == 0 and fit.coefficients.kv_dequant_per_element_s == 0
    with pytest.raises(CalibrationError, match="quantized KV cache"):
        fit_dequant(shapes, observations, model, device, "auto", config.block_size, KNOWN, 2e-3, 5e-3)


def test_fit_prices_each_attention_kernel_apart_where_it_shows():
    # A CPU's shape: compute-bound decodes whose paged attention runs at half the prefill's
    # share, prefills through torch's CPU flash attention (whole 512-key blocks), and chunks
    # after context (the prefix probes', the long prefills' second chunks) slower per pair
    # under their explicit mask.
    kernel = CostCoefficients(**torch_attention_kernel("cpu"))
    known = dataclasses.replace(kernel, memory_efficiency=20.0, compute_efficiency=1.2, attention_efficiency=0.7,
                                decode_attention_efficiency=0.35, context_attention_efficiency=0.55,
                                step_overhead_s=2e-3, per_seq_overhead_s=1.5e-4)
    model, device = model_preset("tiny"), device_preset("cpu")
    # A pool the probes fit in (the CPU preset's memory would hold millions of tiny blocks).
    config = EngineConfig(max_model_len=4096, num_gpu_blocks_override=8192).resolve(model, device)
    plan = design_probes(4096, max_batch=64, batch_tokens=config.max_num_batched_tokens, quick=True)
    runs = virtual_runs(plan, known, 4e-3, 5e-3, config, True, specs=("tiny", "cpu"))
    shapes, observations = step_shapes(runs, model, device, config, kernel)
    result = fit_coefficients(shapes, observations, model, device, "auto", 16, base=kernel)
    fitted = result.coefficients
    assert (fitted.attention_key_block, fitted.context_chunk_all_keys) == (512, True)
    assert fitted.decode_attention_efficiency == pytest.approx(0.35, rel=0.02)
    assert fitted.context_attention_efficiency == pytest.approx(0.55, rel=0.02)
    assert fitted.kv_memory_efficiency is None  # the K/V reads do not stand in for either
    # Every term that shows in a step is recovered (the weights' reads never do here).
    for name in ("compute_efficiency", "attention_efficiency", "step_overhead_s", "per_seq_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(known, name), rel=0.02), name
    # All but a loaded probe's ITL, whose window (a prefill's step among the decodes') the
    # replay places to within about 1%.
    assert result.residuals()["all"]["max"] < 0.015 and result.residuals()["prefill"]["max"] < 0.005
    # Counted as causal pairs, the same timings leave the fresh prefills up to 10% off (a
    # share of its own for the chunks after context makes up for their count).
    shapes, observations = step_shapes(runs, model, device, config)
    causal = fit_coefficients(shapes, observations, model, device, "auto", 16).residuals()
    assert causal["prefill"]["max"] > 0.05


def test_probe_plan_is_bounded_and_fits_the_context():
    for quick in (True, False):
        plan = design_probes(4096, max_batch=64, pool_tokens=200_000, batch_tokens=2048, quick=quick)
        assert plan.num_requests <= (470 if quick else 910)  # most of them 32-token decodes
        for p in plan.probes:
            assert p.prompt_len + p.max_tokens <= 4096
            assert p.batch * (p.prompt_len + p.max_tokens) <= 200_000
            assert set(p.measures) <= {TTFT, ITL}
        # It opens and closes with the same decode probe, three times at each end with another
        # probe between each: the server's drift while probed.
        check = plan.probes[0]
        assert check == plan.probes[-1] and check.measures == (ITL,)
        at = [i for i, p in enumerate(plan.probes) if p == check]
        assert at == [0, 2, 4, len(plan) - 5, len(plan) - 3, len(plan) - 1]
    small = design_probes(512, max_batch=4, quick=True)
    assert max(p.batch for p in small.probes) <= 4
    assert all(p.prompt_len + p.max_tokens <= 512 for p in small.probes)


def test_loaded_probes_shrink_their_background_to_fit_a_small_pool():
    """A 1024-token pool (max-model-len 512): a background of 8 would need more KV than the pool
    has, be preempted and stall, so the probe gets a background that fits, and no probe twice."""
    for quick in (True, False):
        roomy = design_probes(512, max_batch=128, quick=quick)
        plan = design_probes(512, max_batch=128, pool_tokens=1024, quick=quick)
        loaded = [p for p in plan.probes if p.background]
        assert loaded and all(p.kv_tokens() <= 0.8 * 1024 for p in loaded)
        assert any(p.kv_tokens() > 0.8 * 1024 for p in roomy.probes if p.background)
        assert max(p.background for p in loaded) < max(p.background for p in roomy.probes)
        assert len(set(loaded)) == len(loaded)
        assert all(f"B={p.background} " in p.label for p in loaded)


def test_probes_fit_a_pool_of_large_blocks_and_say_what_they_cannot_time():
    """1,024 tokens in blocks of 128 are 8 blocks: each 56-token decode holds a whole block, so 6
    (80% of the pool) decode at once, not 14. A decode batch the pool cannot hold would run in
    waves; the plan times the largest it holds instead, and says that larger batches are
    extrapolated (a fit that saw 6 priced every further sequence at nothing)."""
    plan = design_probes(512, max_batch=64, pool_tokens=1024, block_size=128, quick=True)
    decodes = sorted({p.batch for p in plan.probes if p.kind == "decode"})
    assert decodes == [1, 4, 6]
    assert all(p.kv_tokens(128) <= 0.8 * 1024 for p in plan.probes)
    assert len(plan.notes) == 1 and "at most 6 sequences (not 64)" in plan.notes[0]
    # Counted in tokens, the same pool seemed to hold twice as many.
    assert max(p.kv_tokens(1) for p in plan.probes if p.kind == "decode") < 0.8 * 1024 / 2
    # In blocks of 32 (two per request) 8x the pool holds the plan's largest batch: no note.
    roomy = design_probes(512, max_batch=64, pool_tokens=8 * 1024, block_size=32, quick=True)
    assert max(p.batch for p in roomy.probes) == 64 and roomy.notes == []


def decode_run(probe, gap_s: float, tokens: int = 24) -> ProbeRun:
    times = [0.01 + gap_s * i for i in range(tokens)]
    return ProbeRun(probe, [TrialRun(None, [[1]] * probe.batch, [RequestTiming(0.0, times)] * probe.batch)])


def test_speed_drift_compares_the_closing_probe_with_the_opening_one():
    plan = design_probes(4096, max_batch=64, quick=True)
    check = plan.probes[0]
    runs = [decode_run(check, 0.010), decode_run(plan.probes[1], 0.009), decode_run(check, 0.012)]
    drift = speed_drift(runs)
    assert drift["probe"] == check.label
    assert drift["first_s"] == pytest.approx(0.010) and drift["last_s"] == pytest.approx(0.012)
    assert drift["change"] == pytest.approx(0.2)
    assert speed_drift(runs[:1]) is None  # a plan without the check says nothing
    # A closing check whose stream gave no gap (one token) has no timing: no drift, not "+nan%".
    assert math.isnan(decode_run(check, 0.01, tokens=1).measured(ITL))
    assert speed_drift([runs[0], decode_run(check, 0.01, tokens=1)]) is None
    other = dataclasses.replace(check, batch=check.batch * 2)
    assert speed_drift([decode_run(check, 0.01), decode_run(other, 0.01)]) is None


def test_steady_itl_uses_the_steps_where_the_whole_batch_decodes():
    # Request b starts a step later; step times 10 ms, except a 50 ms step before b's first token.
    a = [0.0, 0.05, 0.06, 0.07, 0.08, 0.09]
    b = [0.05, 0.06, 0.07, 0.08, 0.09, 0.10]
    assert steady_itl([a, b]) == pytest.approx(0.01)


def test_steady_itl_keeps_a_stretched_step_and_drops_a_late_read():
    steps = [0.01 * i for i in range(12)]  # the window: tokens 0..10, ten 10 ms gaps
    stretched = steps[:6] + [t + 0.02 for t in steps[6:]]  # one step took 30 ms: a TPOT has it
    assert steady_itl([stretched, stretched]) == pytest.approx(0.012)
    late_read = list(steps)
    late_read[5] += 0.008  # the client read token 5 late: its gap grew, the next shrank
    assert steady_itl([late_read, late_read]) == pytest.approx(0.01)


# ---------------------------------------------------------------- against a live server

def sim_server(tmp_path, coeffs: CostCoefficients, *flags) -> ManagedServer:
    path = tmp_path / "coeffs.json"
    path.write_text(json.dumps(coeffs.to_dict()))
    port = free_port()
    cmd = [sys.executable, "-m", "kvengine", "serve", "--port", str(port), "--executor", "sim",
           "--preset", MODEL, "--device", DEVICE, "--cost-profile", str(path), *flags]
    return ManagedServer(cmd, port, start_timeout_s=60, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("content,message", [
    ('{"per_prefill_overhead_s": -1}', "per_prefill_overhead_s must be >= 0, got -1"),
    ('{"memory_efficiency": 0}', "memory_efficiency must be > 0, got 0"),
    ('{"step_overhead_s": "1ms"}', "step_overhead_s must be a finite number, got '1ms'"),
])
def test_a_bad_cost_profile_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    p = subprocess.run([sys.executable, "-m", "kvengine", "serve", "--executor", "sim", "--cost-profile",
                        str(path), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and f"--cost-profile {path}: {message}" in p.stderr


def calibrate_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_calibrate_command(parser.add_subparsers())
    args = parser.parse_args(["calibrate", *argv])
    return args.func(args)


def test_quantized_kv_needs_a_server_kvtune_starts(capsys):
    with pytest.raises(ConfigError, match="--quantized-kv fp8 needs a server kvtune starts .*cannot restart "
                                          "http://127.0.0.1:9"):
        calibrate_cli("--target", "http://127.0.0.1:9", "--quantized-kv", "fp8", "--no-save")
    with pytest.raises(ConfigError, match=r"leave --kv-cache-dtype \(int8\) at auto"):
        calibrate_cli("--quantized-kv", "fp8", "--kv-cache-dtype", "int8", "--no-save")


@pytest.mark.slow
def test_a_server_dying_mid_probe_fails_clearly_and_saves_nothing(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/kvtune.db"
    server = sim_server(tmp_path, KNOWN, "--max-model-len", "2048")
    server.start()
    killer = threading.Timer(2.0, server.stop, kwargs={"timeout_s": 1.0})
    killer.start()
    try:
        rc = calibrate_cli("--target", server.url, "--preset", MODEL, "--device", DEVICE, "--name", "doomed",
                           "--db", db)
    finally:
        killer.cancel()
        server.stop()
    err = capsys.readouterr().err
    assert rc == 1
    assert server.url in err and "probe '" in err and "nothing saved" in err
    with Store(db) as store:
        assert store.list_profiles() == []


def test_an_unreachable_server_is_a_calibration_error():
    from kvtune.calibrate import CalibrationRequest, calibrate_url
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CalibrationError, match=f"cannot reach {url}"):
        calibrate_url(CalibrationRequest(url, MODEL, DEVICE, EngineConfig(), "x"))



def test_a_metrics_page_that_is_not_prometheus_text_is_read_as_no_metrics():
    """A server (or a proxy in front of it) answering /metrics with HTML: the server's
    defaults and no prefill times, not a traceback."""
    import asyncio
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx
    from kvtune.calibrate.server import prefill_times, server_info

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = (b'{"data": [{"id": "m", "max_model_len": 2048}]}' if self.path == "/v1/models"
                    else b"<html>login</html>")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        info = server_info(url)
        assert (info.model_name, info.max_model_len, info.num_gpu_blocks) == ("m", 2048, None)

        async def read():
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                return await prefill_times(client)
        assert asyncio.run(read()) is None
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- profiles in the store

def test_profile_round_trips_through_the_store(tmp_path):
    db = f"sqlite:///{tmp_path}/kvtune.db"
    profile = CalibrationProfile(
        name="cpu-tiny", model="tiny", device="cpu", coefficients=KNOWN, client_overhead_s=0.004,
        target="engine", url="http://127.0.0.1:8000", executor="torch", served_model="kvtune-target",
        server={"block_size": 16, "config": {"max_num_seqs": 256}},
        residuals={"prefill": {"n": 5, "rms": 0.1, "max": 0.2, "bias": 0.01}},
        observations=[{"kind": "prefill", "label": "prefill L=16", "measure": "ttft", "measured_s": 0.008,
                       "predicted_s": 0.0081}],
        drift={"probe": "decode B=4 (drift check)", "first_s": 0.002, "last_s": 0.0021, "change": 0.05})
    save_profile(db, profile)
    back = get_profile(db, "cpu-tiny")
    assert back == profile
    assert load_cost_profile(db, "cpu-tiny") == KNOWN
    assert back.specs() == (model_preset("tiny"), device_preset("cpu"))
    # Saving under the same name replaces it; other names are listed.
    save_profile(db, CalibrationProfile(name="cpu-tiny", model="tiny", device="cpu",
                                        coefficients=CostCoefficients(step_overhead_s=0.01)))
    save_profile(db, CalibrationProfile(name="h100", model=MODEL, device=DEVICE, coefficients=CostCoefficients()))
    assert load_cost_profile(db, "cpu-tiny").step_overhead_s == 0.01
    assert [p.name for p in list_profiles(db)] == ["cpu-tiny", "h100"]
    with pytest.raises(ProfileNotFoundError, match=r"no cost profile 'nope'.*cpu-tiny, h100"):
        load_cost_profile(db, "nope")


def test_a_profile_asked_of_a_missing_database_creates_none(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2}\n')
    db = tmp_path / "absent.db"
    p = subprocess.run([sys.executable, "-m", "kvtune", "run", "--target", "sim", "--profile", "cpu",
                        "--workload", str(trace), "--db", f"sqlite:///{db}"], capture_output=True, text=True)
    assert p.returncode == 2 and f"no database at {db}" in p.stderr, p.stderr
    assert not db.exists()


def test_the_report_marks_coefficients_the_fit_left_at_a_bound():
    """A host-bound server (a small model on a GPU) shows no compute and no per-sequence
    cost: the report says so instead of printing 1000 as a measured efficiency."""
    def report(coefficients):
        return format_profile(CalibrationProfile(name="p", model="tiny", device="h200-141gb",
                                                 coefficients=coefficients))
    lines = report(dataclasses.replace(KNOWN, compute_efficiency=1000.0, per_seq_overhead_s=1e-10)).splitlines()
    marked = {line.split()[0]: line for line in lines if "bound" in line}
    assert set(marked) == {"compute_efficiency", "per_seq_overhead_s"}
    assert "upper bound: the probes did not show" in marked["compute_efficiency"]
    assert "lower bound: the probes did not show" in marked["per_seq_overhead_s"]
    squeezed = report(dataclasses.replace(KNOWN, attention_efficiency=1e-5))
    assert "lower bound: the timings asked for more than it allows" in squeezed
    assert "bound" not in report(KNOWN)


def test_an_empty_store_says_how_to_make_a_profile(tmp_path):
    with pytest.raises(ProfileNotFoundError, match="kvtune calibrate"):
        load_cost_profile(f"sqlite:///{tmp_path}/empty.db", "nope")


def test_run_and_search_use_a_stored_profile(tmp_path, capsys):
    """`--profile NAME` puts the fitted coefficients (and their model/device) into the sim target. The
    commands run in this process (`kvtune.cli.main`: the same parser, dispatch and errors)."""
    from kvengine.config import device_preset, model_preset
    from kvengine.executor.cost import CostCoefficients, StepCost
    from kvtune.calibrate import CalibrationProfile, save_profile
    from kvtune.workload import TraceRequest, Workload, write_workload
    from kvtune_cli import kvtune_main

    db = f"sqlite:///{tmp_path}/p.db"
    slow = CostCoefficients(memory_efficiency=0.4, step_overhead_s=0.004)
    save_profile(db, CalibrationProfile(name="slow-a10", model="llama-3-8b", device="a10-24gb", coefficients=slow))
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(0.0, 1000, 3)]), str(trace))
    assert kvtune_main("run", "--workload", trace, "--profile", "slow-a10", "--db", db, "--json") == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    cost = StepCost.build(model_preset("llama-3-8b"), device_preset("a10-24gb"), "auto", 16, slow)
    assert summary["ttft_p50"] == pytest.approx(cost.step_time(StepShape(1000, 1, 1000, 1000 * 1001 // 2, 1, 1)))
    assert "a10-24gb" in out
    assert kvtune_main("run", "--workload", trace, "--profile", "nope", "--db", db) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "slow-a10" in err
    # A search trying fp8 with a profile that never timed a quantized cache says so; one that did, not.
    save_profile(db, CalibrationProfile(name="timed-fp8", model="llama-3-8b", device="a10-24gb", coefficients=slow,
                                        fit={"dequant": {"kv_cache_dtype": "fp8"}}))
    for name, noted in (("slow-a10", True), ("timed-fp8", False)):
        assert kvtune_main("search", "--workload", trace, "--profile", name, "--db", db, "--target", "none",
                           "--trials", "2", "--no-report", "--study", name, "--space", "kv_cache_dtype=auto,fp8") == 0
        out = capsys.readouterr().out
        assert ("did not time a quantized KV cache, so stage 1 prices fp8 at its bytes alone" in out) == noted
        assert ("--quantized-kv fp8" in out) == noted


def test_a_second_probe_run_on_the_same_server_hits_no_cached_prefix(tmp_path):
    """Probe prompts are drawn anew each run: a calibration repeated on a server (whose prefix
    cache still holds the first one's blocks) must time real prefills, not cache hits."""
    from kvtune.calibrate.design import Probe, ProbePlan
    from kvtune.calibrate.runner import run_probes
    from kvtune.scrape import fetch, metrics_url, parse_exposition
    plan = ProbePlan([Probe("prefill", "prefill L=256", 256, 1, (TTFT,), repeats=2)])
    with sim_server(tmp_path, KNOWN) as server:
        for _ in range(2):
            run_probes(server.url, MODEL, plan)
        snapshot = parse_exposition(fetch(metrics_url(server.url), 10.0))
    assert snapshot.get("prefix_queries") >= 4 * 256  # the two runs' prompts (and warm-ups) were looked up
    assert snapshot.get("prefix_hits") == 0


def test_a_probe_whose_fresh_prompts_hit_the_prefix_cache_fails_clearly(tmp_path):
    """The same seed twice on one server: the second run's prompts are in the cache, and the
    probe says so instead of timing lookups as prefills."""
    from kvtune.calibrate.design import Probe, ProbePlan
    from kvtune.calibrate.runner import ProbeOptions, run_probes
    plan = ProbePlan([Probe("prefill", "prefill L=256", 256, 1, (TTFT,), repeats=2)])
    with sim_server(tmp_path, KNOWN) as server:
        runs = run_probes(server.url, MODEL, plan, ProbeOptions(seed=7))
        assert len(runs) == 1
        with pytest.raises(CalibrationError, match=r"probe 'prefill L=256' on http://127\.0\.0\.1:\d+: the server's "
                                                   r"prefix cache served \d+ of 512 prompt tokens"):
            run_probes(server.url, MODEL, plan, ProbeOptions(seed=7))


def test_a_loaded_prefix_probes_arrivals_hit_the_warm_prefix_amid_decodes(tmp_path):
    """Arrivals sharing a warm prefix while a batch decodes: on the live server each finds the
    prefix cached (its hit counter), and the replay prices their chunks as chunks after
    context, in the same steps as the batch's decodes."""
    from kvengine.executor.cost import STEP_SHAPE_FIELDS
    from kvtune.calibrate.design import Probe, ProbePlan
    from kvtune.calibrate.runner import run_probes
    from kvtune.scrape import fetch, metrics_url, parse_exposition
    arrivals, prefix = 6, 256
    plan = ProbePlan([Probe("loaded", "loaded prefix B=4 P=256 S=64", prefix + 64, 1, (TTFT, ITL),
                            prefix_len=prefix, warm_suffix=16, repeats=arrivals, background=4,
                            background_len=128)])
    with sim_server(tmp_path, KNOWN) as server:
        runs = run_probes(server.url, MODEL, plan)
        snapshot = parse_exposition(fetch(metrics_url(server.url), 10.0))
    assert snapshot.get("prefix_hits") == arrivals * prefix  # every arrival, its whole prefix
    config = EngineConfig().resolve(model_preset(MODEL), device_preset(DEVICE))
    shapes, observations = step_shapes(runs, model_preset(MODEL), device_preset(DEVICE), config)
    ttft = next(o for o in observations if o.measure == TTFT)
    steps = shapes[ttft.steps]
    chunk, decode = (STEP_SHAPE_FIELDS.index(f) for f in ("context_chunk_pairs", "decode_token_pairs"))
    mixed = (steps[:, chunk] > 0) & (steps[:, decode] > 0)
    assert mixed.sum() >= int(np.ceil(0.8 * arrivals))  # the selected arrivals' own steps
