"""Calibration that reproduces (issue 42, point 9): the drift check's statistic is not moved
by one disturbed run, and the main fit's split is chosen with the quantized server's probes
in its cost, so an fp8 pass is not refused for a split its own server's noise picked."""
import dataclasses

import numpy as np
import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.executor.cost import CostCoefficients, torch_attention_kernel
from test_calibrate import decode_run, virtual_runs

from kvtune.calibrate import design_probes, speed_drift, step_shapes
from kvtune.calibrate.fit import FitRefusedError, QuantizedProbes
from kvtune.calibrate.design import ITL
from kvtune.calibrate.server import ServerInfo
from kvtune.calibrate.session import DRIFT_WARN, CalibrationRequest, Probed, add_dequant, fit_profile

MAX_MODEL_LEN = 512  # the demo's


# ---------------------------------------------------------------- the drift check

def drift_plan_runs(opening: list[float], closing: list[float], kinds=("decode", "context")):
    """The quick plan's decode runs, each drift check timed at the given ITLs in order, every
    other probe's at 9 ms."""
    plan = design_probes(4096, max_batch=64, quick=True, kinds=kinds)
    check, itls = plan.probes[0], iter([*opening, *closing])
    return [decode_run(p, next(itls) if p == check else 0.009) for p in plan.probes]


def test_one_disturbed_drift_run_does_not_move_the_drift():
    # The first run lands on a burst of other work (60% slower), the rest read the server's speed.
    runs = drift_plan_runs([0.016, 0.010, 0.0101], [0.0099, 0.0101, 0.010])
    drift = speed_drift(runs)
    assert drift["runs"] == 3
    assert drift["first_s"] == pytest.approx(0.0101) and drift["last_s"] == pytest.approx(0.010)
    assert abs(drift["change"]) < 0.02 < DRIFT_WARN
    # Compared run against run (the first against the last), the same timings read -37%.
    assert runs[-1].probe == runs[0].probe
    assert runs[-1].measured(ITL) / runs[0].measured(ITL) - 1 == pytest.approx(-0.375)


def test_a_server_that_slowed_down_shows_in_the_drift():
    drift = speed_drift(drift_plan_runs([0.010, 0.010, 0.011], [0.013, 0.014, 0.012]))
    assert drift["change"] == pytest.approx(0.3) and drift["change"] > DRIFT_WARN


def test_the_drift_checks_count_once_in_the_fit():
    """Six runs of the drift check are one decode observation of all their trials (their median),
    not six: the fit weighs the B=4 decode as it weighs every other batch size."""
    runs = drift_plan_runs([0.010] * 3, [0.010, 0.010, 0.030])
    config = EngineConfig(max_model_len=4096).resolve(model_preset("tiny"), device_preset("cpu"))
    _, observations = step_shapes(runs, model_preset("tiny"), device_preset("cpu"), config)
    checks = [o for o in observations if o.label == runs[0].probe.label]
    assert len(checks) == 1 and checks[0].measured_s == pytest.approx(0.010)
    assert len(observations) == len({(o.label, o.measure) for o in observations})


# ---------------------------------------------------------------- the split, with the quantized probes

# A CPU whose K/V gathers read far slower than its weights (kv_memory_efficiency): an fp8 cache,
# a quarter of the float32 bytes, decodes long contexts faster through the same kernel, and adds
# no dequantization cost of its own.
KERNEL = CostCoefficients(**torch_attention_kernel("cpu"))
SLOW_GATHERS = dataclasses.replace(KERNEL, memory_efficiency=2.0, compute_efficiency=0.5, attention_efficiency=1.0,
                                   kv_memory_efficiency=0.02, context_attention_efficiency=0.6,
                                   step_overhead_s=5e-3, per_seq_overhead_s=2e-4, per_prefill_overhead_s=1e-3)


def served(kv_cache_dtype: str, kinds=None):
    """The virtual server's config, and its quick probes' runs, timed exactly by SLOW_GATHERS."""
    model, device = model_preset("tiny"), device_preset("cpu")
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=4096,
                          kv_cache_dtype=kv_cache_dtype).resolve(model, device)
    plan = design_probes(MAX_MODEL_LEN, max_batch=64, batch_tokens=config.max_num_batched_tokens, quick=True,
                         kinds=kinds)
    return config, virtual_runs(plan, SLOW_GATHERS, 4e-3, 4e-3, config, kv_cache_dtype == "auto",
                                specs=("tiny", "cpu"))


def jitter(runs, rel: float, seed: int):
    """Each probe's timings stretched by its own factor 1 + N(0, rel), as a shared host's noise
    moves a whole probe: its token times (from each request's send) and prefill times."""
    rng = np.random.default_rng(seed)
    for run in runs:
        f = 1.0 + rng.normal(0.0, rel)
        for trial in run.trials:
            for r in (*trial.requests, *trial.background_requests):
                r.token_times = [r.sent + (t - r.sent) * f for t in r.token_times]
            if trial.prefill_time_s is not None:
                trial.prefill_time_s *= f
    return runs


@pytest.fixture(scope="module")
def fp8_probes():
    config, runs = served("fp8", kinds=("decode", "context"))
    shapes, observations = step_shapes(runs, model_preset("tiny"), device_preset("cpu"), config, KERNEL)
    for o in observations:
        o.kind = f"{o.kind} fp8"
    return QuantizedProbes(shapes, observations, "fp8", config.block_size)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_split_chosen_with_the_quantized_probes_passes_the_fp8_pass(fp8_probes, seed):
    """On the server's own dtype, 5% noise a probe makes a slow decode kernel
    (decode_attention_efficiency) fit as well as slow K/V gathers; the fp8 server, reading a
    quarter of the bytes faster, then runs far faster than that split prices it, which no
    dequantization term (>= 0) undoes: refused. Chosen with the fp8 probes in the cost, the
    split is the gathers', and both passes fit."""
    config, runs = served("auto")
    probed = Probed("virtual", model_preset("tiny"), device_preset("cpu"),
                    ServerInfo("virtual", "tiny", MAX_MODEL_LEN), config, [], jitter(runs, 0.05, seed), 0.0)
    # the server's own dtype: accepted
    alone = fit_profile(probed, CalibrationRequest("virtual", "tiny", "cpu", config, "alone"), KERNEL)
    assert alone.coefficients.decode_attention_efficiency is not None
    with pytest.raises(FitRefusedError, match="fp8 probes is .* over the 35% limit") as refused:
        add_dequant(alone, fp8_probes, {})
    assert refused.value.profile.fit["dequant"]["rms"] > 0.5

    both = fit_profile(probed, CalibrationRequest("virtual", "tiny", "cpu", config, "both"), KERNEL,
                       quantized=fp8_probes)
    assert both.coefficients.decode_attention_efficiency is None
    assert both.coefficients.kv_memory_efficiency == pytest.approx(SLOW_GATHERS.kv_memory_efficiency, rel=0.25)
    assert both.residuals["all"]["rms"] < 0.1
    assert both.fit["quantized_cost"] < both.fit["cost"]  # the exact fp8 timings fit better than the noisy
    profile = add_dequant(both, fp8_probes, {})
    assert profile.fit["dequant"]["rms"] < 0.1
    # The fp8 cache added nothing of its own: its terms stay small.
    assert profile.coefficients.quantized_step_overhead_s < 1e-3
