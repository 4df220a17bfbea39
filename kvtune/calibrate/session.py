"""One calibration: probe a server, fit the cost model, and the profile (or the refusal).

    profile = calibrate_url(CalibrationRequest("http://127.0.0.1:8000", "tiny", "cpu", EngineConfig(), "cpu-tiny"))
    profile = calibrate_target(EngineTarget(...), config, "tiny", "cpu", "cpu-tiny")  # starts, stops the server
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvengine.config import DeviceSpec, EngineConfig, ModelSpec, device_preset, model_preset
from kvengine.executor.cost import TIED_TO, CostCoefficients, torch_attention_kernel

from ..plan import ServerPool, served_dtype
from .fit import (
    RMS_LIMIT,
    FitRefusedError,
    QuantizedProbes,
    bound_side,
    degenerate_reasons,
    fit_coefficients,
    fit_dequant,
    step_shapes,
    unseen,
)
from .design import design_probes
from .errors import CalibrationError
from .runner import ProbeOptions, run_probes
from .server import ServerInfo, server_info
from .timings import ProbeRun, speed_drift
from .profile import CalibrationProfile

DRIFT_WARN = 0.10  # a server's speed moving more than this while probed gets a warning
QUANTIZED_KINDS = ("decode", "context")  # the probes whose steps read the K/V cache


@dataclass(frozen=True)
class CalibrationRequest:
    """One calibration of the server at `url`: it serves the `preset` model on the `device`
    preset, configured as `config` describes where /metrics does not say (None: the defaults);
    the profile is named `name`, and records the server as `target` (url, or the kind kvtune
    started: engine, vllm, ...) and `executor` (kvengine's, where it is one). The probe plan:
    `quick` (fewer lengths, batch sizes and repeats), the largest decode batch and the longest
    prompt probed, and the run's `options` (timeouts, seed; None: ProbeOptions' defaults)."""

    url: str
    preset: str
    device: str
    config: EngineConfig | None
    name: str
    target: str = "url"
    executor: str | None = None
    quick: bool = False
    max_batch: int = 64
    max_prompt: int | None = None
    options: ProbeOptions | None = None


@dataclass
class Probed:
    """One server's probe runs, and what they were designed with: the model and device presets
    (the model in the dtype the server serves it in), what the server said of itself, its config
    as that corrects it, what the plan could not cover, and the wall time the probes took."""

    url: str
    model: ModelSpec
    device_spec: DeviceSpec
    info: ServerInfo
    server_config: EngineConfig
    notes: list[str]
    runs: list[ProbeRun]
    wall_s: float


@dataclass
class _QuantizedPass:
    """The probes of the server started again with a quantized KV cache, as the fit takes
    them, and its speed's drift while probed (speed_drift; {} without one)."""

    probes: QuantizedProbes
    drift: dict


def calibrate_target(server_target, config: EngineConfig, preset: str, device: str, name: str,
                     cost_profile: str | None = None, quantized_kv: str | None = None, *, quick: bool = False,
                     max_batch: int = 64, max_prompt: int | None = None, options: ProbeOptions | None = None,
                     progress=None, base: CostCoefficients | None = None) -> CalibrationProfile:
    """Start the target's server with `config` (as a trial would), probe it, stop it, and fit.
    `quantized_kv` (fp8, int8, ...): before the fit, start it again with that KV cache dtype and
    probe its decodes and long contexts; the fit chooses its splits on both servers' timings
    (fit_coefficients' `quantized`), then fits the dequantization its reads add to the second's."""
    executor = getattr(server_target, "executor", None)
    base = base or _default_base(executor, device)
    with _started(server_target, config, cost_profile) as server:
        request = CalibrationRequest(server.url, preset, device, config, name, target=server_target.name,
                                     executor=executor, quick=quick, max_batch=max_batch, max_prompt=max_prompt,
                                     options=options)
        probed = probe_server(request, check_alive=server.check_alive, progress=progress)
    if not quantized_kv or quantized_kv == "auto":
        return fit_profile(probed, request, base)
    quantized = _probe_quantized(server_target, request, probed.model, probed.device_spec, quantized_kv, base,
                                 cost_profile, progress)
    profile = fit_profile(probed, request, base, quantized=quantized.probes)
    return add_dequant(profile, quantized.probes, quantized.drift)


def _started(server_target, config: EngineConfig, cost_profile: str | None):
    server = server_target.server(config)
    if cost_profile:
        server.command += ["--cost-profile", cost_profile]
    return server


def _default_base(executor: str | None, device: str) -> CostCoefficients:
    """The coefficients a fit leaves alone and starts from: the cost model's, with the torch
    executor's attention pair counting where the server is kvengine's torch executor."""
    return CostCoefficients(**(torch_attention_kernel(device) if executor == "torch" else {}))


def _probe_quantized(server_target, request: CalibrationRequest, model: ModelSpec, device_spec: DeviceSpec,
                     kv_cache_dtype: str, kernel: CostCoefficients, cost_profile: str | None = None,
                     progress=None) -> _QuantizedPass:
    """The decode and long-context probes (planned as `request` says) of the target's server
    started with `request.config` but `kv_cache_dtype`, as step shapes and timings (their pairs
    counted as `kernel` says; each probe class named with the dtype), and its speed's drift while
    probed (speed_drift; {} without one)."""
    config = dataclasses.replace(request.config, kv_cache_dtype=kv_cache_dtype)
    if progress:
        progress(f"the same server with --kv-cache-dtype {kv_cache_dtype}: its dequantization cost")
    with _started(server_target, config, cost_profile) as server:
        info = server_info(server.url)
        if info.kv_cache_dtype and info.kv_cache_dtype != kv_cache_dtype:
            raise CalibrationError(f"{server.url} reports kv_cache_dtype {info.kv_cache_dtype!r}, not the "
                                   f"{kv_cache_dtype!r} it was started with")
        probed = _probe(dataclasses.replace(request, url=server.url, config=config), info, model, device_spec,
                        server.check_alive, progress, kinds=QUANTIZED_KINDS)
    shapes, observations = step_shapes(probed.runs, model, device_spec, probed.server_config, kernel)
    for o in observations:
        o.kind = f"{o.kind} {kv_cache_dtype}"
    probes = QuantizedProbes(shapes, observations, kv_cache_dtype, probed.server_config.block_size)
    return _QuantizedPass(probes, speed_drift(probed.runs) or {})


def add_dequant(profile: CalibrationProfile, quantized: QuantizedProbes, drift: dict) -> CalibrationProfile:
    """`profile` with the dequantization terms fitted to `quantized` (its other coefficients held);
    FitRefusedError where they leave a probe class over RMS_LIMIT or a probe untimed."""
    dtype, model, device_spec = quantized.kv_cache_dtype, *profile.specs()
    fit = fit_dequant(quantized.shapes, quantized.observations, model, device_spec, dtype, quantized.block_size,
                      profile.coefficients, profile.client_overhead_s, profile.client_overhead_busy_s)
    residuals = fit.residuals()
    dequant = {"kv_cache_dtype": dtype, "n": residuals["all"]["n"], "rms": residuals["all"]["rms"],
               "rms_without": fit.without["all"]["rms"], "drift": drift}
    profile = dataclasses.replace(
        profile, coefficients=fit.coefficients,
        residuals=profile.residuals | {k: v for k, v in residuals.items() if k != "all"},
        observations=profile.observations + [_observation(o) for o in fit.observations],
        fit=profile.fit | {"dequant": dequant})
    reasons = [f"probe {o.label!r} ({dtype}): its {o.measure} has no usable timing" for o in fit.dropped]
    reasons += [f"residual rms {'over all its timings' if kind == 'all' else f'of the {kind} probes'} is "
                f"{r['rms']:.1%} (n={r['n']}, worst {r['max']:.1%}), over the {RMS_LIMIT:.0%} limit"
                for kind, r in residuals.items() if r["rms"] > RMS_LIMIT]
    if reasons:
        raise FitRefusedError(
            f"the {dtype} probes do not fit the profile's cost model with a dequantization term:\n"
            + "".join(f"  - {r}\n" for r in reasons)
            + "to do:\n  - calibrate when the server is quiet: nothing else on its machine, no other client\n"
            + "the refused fit:\n" + format_profile(profile), reasons, profile)
    return profile


def _observation(o) -> dict:
    """An Observation as the profile keeps it."""
    return {"kind": o.kind, "label": o.label, "measure": o.measure, "measured_s": o.measured_s,
            "predicted_s": o.predicted_s}


def _probe(request: CalibrationRequest, info: ServerInfo, model: ModelSpec, device_spec, check_alive, progress,
           kinds: tuple[str, ...] | None = None) -> Probed:
    """Design the probes for the server at `request.url` (`info` what it says of itself,
    `request.config` its flags) and run them (those of `kinds`, where given): the runs, and what
    they were designed with (Probed)."""
    url = request.url
    server_config = _server_config(request.config or EngineConfig(), info, model, device_spec)
    pool = info.num_gpu_blocks * server_config.block_size if info.num_gpu_blocks else None
    plan = design_probes(info.max_model_len, max_batch=min(request.max_batch, server_config.max_num_seqs),
                         max_prompt=request.max_prompt, pool_tokens=pool,
                         batch_tokens=server_config.max_num_batched_tokens, quick=request.quick,
                         block_size=server_config.block_size, kinds=kinds)
    if progress:
        for note in plan.notes:
            progress(f"note: {note}")
        progress(f"probing {url} ({info.model_name}, max_model_len {info.max_model_len}): {len(plan)} probes, "
                 f"{plan.num_requests} requests")
    t0 = time.perf_counter()

    def each(i, n, run):
        if progress:
            measured = ", ".join(f"{m} {run.measured(m) * 1e3:.2f} ms" for m in run.measures)
            progress(f"  [{i}/{n}] {run.probe.label}: {measured}")

    runs = run_probes(url, info.model_name, plan, request.options, check_alive=check_alive, progress=each)
    return Probed(url, model, device_spec, info, server_config, list(plan.notes), runs, time.perf_counter() - t0)


def calibrate_url(request: CalibrationRequest, *, check_alive=None, progress=None,
                  base: CostCoefficients | None = None) -> CalibrationProfile:
    """Probe the server `request` names, fit, and return the profile. `check_alive`: the
    server's own report where a probe fails (a managed server's exit); `progress`: called
    with each line of progress. `base`: the coefficients the fit leaves alone and starts
    from; by default the cost model's, with the attention kernel's pair counting of the
    torch executor where the server is kvengine's torch executor."""
    probed = probe_server(request, check_alive=check_alive, progress=progress)
    return fit_profile(probed, request, base or _default_base(request.executor, request.device))


def probe_server(request: CalibrationRequest, *, check_alive=None, progress=None) -> Probed:
    """Run the probes designed for the server `request` names (see calibrate_url)."""
    model, device_spec = model_preset(request.preset), device_preset(request.device)
    info = server_info(request.url)
    model = _served_model(model, info, progress)
    return _probe(request, info, model, device_spec, check_alive, progress)


def fit_profile(probed: Probed, request: CalibrationRequest, base: CostCoefficients,
                quantized: QuantizedProbes | None = None) -> CalibrationProfile:
    """The profile fitted to `probed` (named, and its server described, as `request` says; its
    splits chosen on `quantized` too, where given); FitRefusedError, saying why and what to try,
    where degenerate_reasons refuses it."""
    model, device_spec, server_config = probed.model, probed.device_spec, probed.server_config
    shapes, observations = step_shapes(probed.runs, model, device_spec, server_config, base)
    result = fit_coefficients(shapes, observations, model, device_spec, server_config.kv_cache_dtype,
                              server_config.block_size, base=base, quantized=quantized)
    profile = CalibrationProfile(
        name=request.name, model=model.name, model_spec=dataclasses.asdict(model), dtype=model.dtype,
        device=request.device, coefficients=result.coefficients,
        client_overhead_s=result.client_overhead_s, client_overhead_busy_s=result.client_overhead_busy_s,
        target=request.target, url=probed.url, executor=request.executor,
        served_model=probed.info.model_name,
        server=probed.info.to_dict() | {"config": {k: v for k, v in vars(server_config).items() if k != "extra"}},
        residuals=result.residuals(), roofline_residuals=result.initial,
        observations=[_observation(o) for o in result.observations],
        probe_wall_s=round(probed.wall_s, 2), drift=speed_drift(probed.runs) or {}, notes=probed.notes,
        fit={"cost": result.cost, "nfev": result.nfev, "message": result.message, **result.split_costs})
    reasons = degenerate_reasons(result)
    if reasons:
        _refuse(profile, reasons, _advice(profile, result, probed, request))
    return profile


def _advice(profile: CalibrationProfile, result, probed: Probed, request: CalibrationRequest) -> list[str]:
    """What to try, for what went wrong: noise (a busy machine, too few samples), timings the
    stream could not time, or prompts the cost model does not reach."""
    advice = []
    drift = profile.drift.get("change")
    if drift is not None and abs(drift) > DRIFT_WARN:
        advice.append(f"calibrate when the server is quiet: its speed moved {drift:+.0%} between the first "
                      "and the last probes (other work on its machine, or other clients of the server?)")
    else:
        advice.append("calibrate when the server is quiet: nothing else on its machine, no other client")
    if request.quick:
        advice.append("drop --quick: the full plan has more lengths, batch sizes and repeats per term, "
                      "and longer decode windows")
    if result.dropped:
        advice.append("a probe without a timing: its streams came in too few chunks in its window (a "
                      "server whose frontend falls behind merges tokens, or sends a stream in one burst): a "
                      "quieter machine, or smaller batches (--max-batch)")
    if profile.target == "url":
        advice.append(f"check that --preset {request.preset} --device {request.device} describe the served model, and that "
                      "the scheduler flags (--max-num-seqs, --max-num-batched-tokens, --block-size, ...) are "
                      "the server's: the fit replays the probes with them")
    longest = max(run.probe.prompt_len for run in probed.runs)
    advice.append(f"where the longest prompts misfit, leave them out (--max-prompt, now {longest})")
    return advice


def _refuse(profile: CalibrationProfile, reasons: list[str], advice: list[str]):
    raise FitRefusedError(
        f"the fit is not usable as a cost profile ({len(reasons)} "
        f"{'reason' if len(reasons) == 1 else 'reasons'}; rms limit {RMS_LIMIT:.0%}):\n"
        + "".join(f"  - {r}\n" for r in reasons)
        + "to do:\n" + "".join(f"  - {a}\n" for a in advice)
        + "the refused fit:\n" + format_profile(profile), reasons, profile)


def _served_model(model: ModelSpec, info: ServerInfo, progress=None) -> ModelSpec:
    """`model` in the dtype the server keeps its KV cache in, where its pool says that is not the
    preset's (vLLM serves a float32 checkpoint in bf16): the fit replays the probes on that pool."""
    if not info.num_gpu_blocks or not info.block_size:
        return model
    pool = ServerPool(info.num_gpu_blocks, info.block_size, info.kv_cache_dtype or "auto", info.pool_bytes)
    dtype = served_dtype(model, pool)
    if dtype is None:
        return model
    if progress:
        progress(f"the server keeps {model.name}'s KV cache in {dtype} ({pool.num_gpu_blocks:,} blocks of "
                 f"{pool.block_size} tokens in {pool.pool_bytes:,} bytes), not in the preset's {model.dtype}: "
                 f"the fit models it in {dtype}")
    return dataclasses.replace(model, dtype=dtype)


def _server_config(config: EngineConfig, info: ServerInfo, model, device) -> EngineConfig:
    """The flags' config, corrected by what the server says about itself."""
    from kvengine.config import KV_CACHE_DTYPES
    changes = {"max_model_len": min(info.max_model_len, model.max_position_embeddings)}
    if info.block_size:
        changes["block_size"] = info.block_size
    if info.enable_prefix_caching is not None:
        changes["enable_prefix_caching"] = info.enable_prefix_caching
    if info.kv_cache_dtype in KV_CACHE_DTYPES:
        changes["kv_cache_dtype"] = info.kv_cache_dtype
    return dataclasses.replace(config, num_gpu_blocks_override=None, **changes).resolve(model, device)


def format_profile(profile: CalibrationProfile) -> str:
    c = profile.coefficients
    lines = [f"profile {profile.name}: {profile.model} on {profile.device}, fitted on {profile.target}"
             + (f" ({profile.executor} executor)" if profile.executor else "") + f" at {profile.url} "
             f"in {profile.probe_wall_s:.0f} s of probes",
             *(f"  {name:<29}{value:10.4g}{_bound_note(name, value)}" if value is not None
               else f"  {name:<29}    (= {TIED_TO[name]})"
               for name, value in c.to_dict().items() if name not in NOT_FITTED),
             f"  {'attention pairs':<29}{_kernel_line(c)}",
             (f"  {'client overhead':<29}{profile.client_overhead_s * 1e3:8.3f} ms idle, "
              f"{profile.client_overhead_busy_s * 1e3:.3f} ms busy (on TTFT; the engine core does not model it)"),
             *_drift_lines(profile.drift),
             *(f"  note: {note}" for note in profile.notes),
             "residuals (predicted/measured - 1)   calibrated: rms    max   bias    roofline: rms     max"]
    for kind, r in profile.residuals.items():
        u = profile.roofline_residuals.get(kind)
        roofline = f"          {u['rms']:7.1%} {u['max']:7.1%}" if u else ""  # none for a quantized pass
        lines.append(f"  {kind:<10} n={r['n']:<3}                   {r['rms']:6.1%} {r['max']:6.1%} "
                     f"{r['bias']:+6.1%}{roofline}")
    dequant = profile.fit.get("dequant")
    if dequant:
        lines.append(f"  {dequant['kv_cache_dtype']} probes (a second server start): rms {dequant['rms']:.1%} with "
                     f"the dequantization terms, {dequant['rms_without']:.1%} without them (n={dequant['n']})")
        lines += [line.replace("server speed", f"{dequant['kv_cache_dtype']} server speed", 1)
                  for line in _drift_lines(dequant.get("drift") or {})]
    return "\n".join(lines)


# Set, not fitted: the block penalty's scale, and how the attention kernel counts its pairs.
NOT_FITTED = ("block_overhead_tokens", "attention_key_block", "context_chunk_all_keys")


def _bound_note(name: str, value: float) -> str:
    """Where the fit left a coefficient at a bound. An efficiency at its top or an overhead
    at its floor prices its term at about zero: the probes' timings did not show it (a GPU
    serving a small model is host-bound, and its roofline terms go so)."""
    side = bound_side(name, value)  # None for 0: never fitted (no probe could)
    if side is None:
        return ""
    return (f"   (at the fit's {side} bound: "
            + ("the probes did not show this term)" if unseen(name, value)
               else "the timings asked for more than it allows)"))


def _kernel_line(c: CostCoefficients) -> str:
    blocks = f"keys in blocks of {c.attention_key_block}" if c.attention_key_block else "causal pairs only"
    return blocks + (", all keys for a chunk after context" if c.context_chunk_all_keys else "")


def _drift_lines(drift: dict) -> list[str]:
    if not drift:
        return []
    each = f" (median of {drift['runs']} runs each)" if drift.get("runs", 1) > 1 else ""
    line = (f"  {'server speed':<29}{drift['probe']}: ITL {drift['first_s'] * 1e3:.3f} ms first, "
            f"{drift['last_s'] * 1e3:.3f} ms last{each} ({drift['change']:+.1%})")
    if abs(drift["change"]) <= DRIFT_WARN:
        return [line]
    warning = (f"  warning: the server's speed moved {drift['change']:+.0%} while it was probed (other work on "
               "its machine?); the fit averages over that, so calibrate again when the machine is quiet")
    return [line, warning]
