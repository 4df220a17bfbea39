"""kvtune calibrate in real time: a sim-executor engine that kvtune starts, stepping by known
coefficients, fitted back from its timings. The suite's one test that times the host: `serial`, in a
file of its own that tests/conftest.py orders first; the other workers yield it the CPU meanwhile."""
import dataclasses
import json

import pytest
from kvengine.config import EngineConfig

from kvtune.calibrate import get_profile, load_cost_profile
from kvtune.targets import SimTarget
from kvtune.workload import SynthSpec, parse_dist, synthesize
from test_calibrate import DEVICE, KNOWN, MODEL, QUANTIZED, calibrate_cli, close

# KNOWN with weights read three times as fast and a shorter step overhead: the probes' decode steps take
# about half of KNOWN's, so the test (real time, the host to itself) ends sooner; the overhead stays
# several times the server's own unmodelled cost of a step, and the per-sequence term is KNOWN's.
LIVE = dataclasses.replace(KNOWN, memory_efficiency=0.9, step_overhead_s=0.004)


@pytest.mark.slow
@pytest.mark.serial
def test_calibration_recovers_known_coefficients_and_a_quantized_caches_terms_live(tmp_path, capsys):
    """One real-time calibration of a sim-executor engine that kvtune starts, stepping by LIVE (and
    QUANTIZED's terms on fp8): the main fit recovers LIVE; --quantized-kv fp8 starts the engine again
    with --kv-cache-dtype fp8 and recovers the two terms a quantized cache adds; the sim then prices
    runs with the stored profile."""
    path = tmp_path / "coeffs.json"
    path.write_text(json.dumps(dataclasses.replace(LIVE, **QUANTIZED).to_dict()))
    db = f"sqlite:///{tmp_path}/kvtune.db"
    rc = calibrate_cli("--target", "engine", "--executor", "sim", "--cost-profile", str(path), "--preset", MODEL,
                       "--device", DEVICE, "--name", "known", "--quick", "--max-batch", "16",
                       "--quantized-kv", "fp8", "--db", db, "--json")
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    printed = json.loads(out.out.strip().splitlines()[-1])
    assert printed["name"] == "known" and printed["model"] == MODEL and printed["device"] == DEVICE
    profile = get_profile(db, "known")
    # Real time on a shared 2-core host: the roofline's two main terms hold to 10 % (-5 % and +8 % seen
    # when servers started beside the calibration); the small ones (attention, the per-step and
    # per-sequence overheads) move more with the host's load (-6.6 % attention, +18 % per sequence in
    # loaded runs), so they are held to 25 %: a broken fit misses by far more.
    small = {"attention_efficiency", "step_overhead_s", "per_seq_overhead_s"}
    off = close(profile.coefficients, LIVE, 0.10)
    assert set(off) <= small and all(abs(e) <= 0.25 for e in off.values()), profile.describe()
    assert profile.target == "engine" and profile.served_model == "kvtune-target"  # the name kvtune serves under
    assert profile.server["block_size"] == 16 and profile.server["max_model_len"] == 8192
    assert {"overhead", "prefill", "decode", "context", "prefix", "loaded", "all"} <= set(profile.residuals)
    assert profile.residuals["all"]["rms"] < 0.1
    assert profile.coefficients.kv_memory_efficiency is None  # one bandwidth serves weights and K/V here
    assert 0 < profile.client_overhead_s < 0.05
    # The drift check ran twice; a sim server's steps take their modelled time.
    assert profile.drift["probe"].endswith("(drift check)") and abs(profile.drift["change"]) < 0.25
    # A server of unknown kernels: its attention computes the causal pairs.
    assert profile.coefficients.attention_key_block == 0
    # fp8: the terms hold to the noise of real time on a shared host (the main fit's small terms: 25 %).
    assert profile.coefficients.quantized_step_overhead_s == pytest.approx(4e-3, rel=0.35), profile.describe()
    assert profile.coefficients.kv_dequant_per_element_s == pytest.approx(3e-12, rel=0.2), profile.describe()
    assert {"decode fp8", "context fp8"} <= set(profile.residuals)
    dequant = profile.fit["dequant"]
    assert dequant["kv_cache_dtype"] == "fp8" and dequant["rms"] < 0.1 < dequant["rms_without"]
    assert "--kv-cache-dtype fp8" in out.err
    # The stored coefficients drive the sim: its decode steps take the server's time, and it prices an
    # fp8 decode dearer than the same one in auto (the terms apply to fp8 only).
    sim = SimTarget(*profile.specs(), load_cost_profile(db, "known"))
    short = synthesize(SynthSpec(num_requests=4, rate=100.0, input_len=parse_dist("32"),
                                 output_len=parse_dist("16"), seed=1))
    assert sim.run(EngineConfig(), short).summary["tpot_p50"] > LIVE.step_overhead_s
    long = synthesize(SynthSpec(num_requests=8, rate=100.0, input_len=parse_dist("2048"),
                                output_len=parse_dist("16"), seed=1))
    auto, fp8 = (sim.run(EngineConfig(kv_cache_dtype=d), long).summary["tpot_p50"] for d in ("auto", "fp8"))
    assert fp8 > auto + 3e-3
