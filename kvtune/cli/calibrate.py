"""`kvtune calibrate`: probe a live server, fit the cost model, save a named profile.

    kvtune calibrate --target engine --name cpu-tiny            # kvengine serve, torch executor, tiny, cpu
    kvtune calibrate --target vllm --model meta-llama/Meta-Llama-3-8B --preset llama-3-8b --device h100-80gb
    kvtune calibrate --target http://gpu-box:8000 --preset llama-3-8b --device h100-80gb --name h100-prod
    kvtune run --target sim --profile cpu-tiny ...               # the sim, with the fitted coefficients
"""
from __future__ import annotations

import json
import sys
import time

from kvengine.config import ConfigError, EngineConfig, device_preset, model_preset
from kvengine.cost import TIED_TO, CostCoefficients, torch_attention_kernel
from kvengine.flags import add_engine_flags, config_from_args, parse_size

from ..store import Store, add_db_argument, resolve_db_url
from ..targets import TargetStartError
from ..targets.build import add_server_flags, live_target
from ..workload.cli import name_or_url, positive_float, positive_int
from .fit import (
    RMS_LIMIT,
    FitRefusedError,
    bound_side,
    degenerate_reasons,
    fit_coefficients,
    step_shapes,
    unseen,
)
from .probes import (
    CalibrationError,
    ProbeOptions,
    ServerInfo,
    design_probes,
    run_probes,
    server_info,
    speed_drift,
)
from .profile import CalibrationProfile, save_profile

TARGETS = ("engine", "vllm", "sglang")
# Per target (and engine executor): the model and device presets when none is given.
DEFAULT_SPECS = {"engine:torch": ("tiny", "cpu"), "engine:sim": ("llama-3-8b", "h100-80gb")}
FALLBACK_SPECS = ("llama-3-8b", "h100-80gb")
DRIFT_WARN = 0.10  # a server's speed moving more than this while probed gets a warning


def add_calibrate_command(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the sim's cost model to a live server and save it as a named profile",
        description="Probe a live server with a designed set of requests (prefill lengths, decode batch "
                    "sizes, long contexts, prefix hits), fit kvengine's cost coefficients to the timings by "
                    "least squares, report the residuals per probe class, and save the named profile in the "
                    "store for `kvtune run/search --target sim --profile NAME`.")
    p.add_argument("--target", type=name_or_url(TARGETS), default="engine", metavar="TARGET",
                   help="engine (start kvengine serve), vllm, sglang, or the URL of a running server "
                        "(default: %(default)s)")
    p.add_argument("--name", metavar="PROFILE",
                   help="the profile's name (default: from the target, model and device); an existing "
                        "profile of that name is replaced")
    g = p.add_argument_group("model and device (the presets the sim will run with the profile)")
    g.add_argument("--preset", metavar="MODEL", help="model preset of the served model (default: tiny for the "
                                                     "engine's torch executor, else llama-3-8b)")
    g.add_argument("--device", metavar="DEVICE", help="device preset (default: cpu for the engine's torch "
                                                      "executor, else h100-80gb); the engine's torch executor "
                                                      "runs on CUDA under a GPU preset (h200-141gb, ...)")
    g.add_argument("--executor", choices=("torch", "sim"), default="torch",
                   help="the engine target's executor (default: %(default)s)")
    g.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                   help="engine target: the memory budget on the CPU (e.g. 2GiB), a cap below the GPU's "
                        "memory on CUDA")
    g.add_argument("--cost-profile", metavar="FILE",
                   help="engine target with --executor sim: serve these coefficients (JSON), e.g. to check "
                        "that calibration recovers them")
    add_engine_flags(p, platform_block_size=True)
    g = p.add_argument_group("probes")
    g.add_argument("--quick", action="store_true", help="a smaller probe set (about half the requests)")
    g.add_argument("--max-batch", type=positive_int, default=64,
                   help="largest decode batch probed, capped at --max-num-seqs (default: %(default)s)")
    g.add_argument("--max-prompt", type=positive_int, metavar="TOKENS",
                   help="longest probe prompt (default: the server's max_model_len less 64)")
    g.add_argument("--probe-timeout", type=positive_float, default=900.0, metavar="S",
                   help="limit on the whole probe run (default: %(default)s)")
    g.add_argument("--request-timeout", type=positive_float, default=120.0, metavar="S",
                   help="limit on one probe request (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None,
                   help="probe prompts' seed (default: fresh prompts each run; the same seed twice on one server "
                        "would hit the prefix cache the first run left)")
    add_server_flags(p)
    add_db_argument(p)
    p.add_argument("--no-save", action="store_true", help="fit and report, but store nothing")
    p.add_argument("--json", action="store_true", help="end with the profile (less its observations) as one "
                                                       "JSON object")
    p.set_defaults(func=cmd_calibrate)


def default_name(target: str, executor: str | None, preset: str, device: str) -> str:
    kind = "url" if target.startswith(("http://", "https://")) else target
    parts = [kind] + ([executor] if kind == "engine" and executor else []) + [preset, device]
    return "-".join(parts)


def cmd_calibrate(args) -> int:
    key = f"engine:{args.executor}" if args.target == "engine" else args.target
    preset, device = DEFAULT_SPECS.get(key, FALLBACK_SPECS)
    preset, device = args.preset or preset, args.device or device
    model_preset(preset), device_preset(device)  # unknown presets fail before anything starts
    config = config_from_args(args)
    if args.cost_profile and not (args.target == "engine" and args.executor == "sim"):
        raise ConfigError("--cost-profile needs --target engine --executor sim")
    name = args.name or default_name(args.target, args.executor, preset, device)
    store = None if args.no_save else Store(resolve_db_url(args.db))  # a bad --db fails before any probe
    options = ProbeOptions(request_timeout_s=args.request_timeout, deadline_s=args.probe_timeout, seed=args.seed)
    plan_args = {"quick": args.quick, "max_batch": args.max_batch, "max_prompt": args.max_prompt}
    try:
        if args.target.startswith(("http://", "https://")):
            profile = calibrate_url(args.target, preset, device, config, name, options=options, target="url",
                                    progress=_progress, **plan_args)
        else:
            server = _server_target(args, config, preset, device)
            profile = calibrate_target(server, config, preset, device, name, options=options,
                                       cost_profile=args.cost_profile, progress=_progress, **plan_args)
    except (CalibrationError, TargetStartError) as err:
        print(f"error: calibrate: {err}", file=sys.stderr)
        print("nothing saved", file=sys.stderr)
        if store is not None:
            store.close()
        return 1
    print(format_profile(profile))
    if store is not None:
        with store:
            save_profile(store, profile)
        print(f"profile {profile.name!r} stored in {store.display_url}; use it with "
              f"`kvtune run --target sim --profile {profile.name}`")
    if args.json:
        data = profile.to_dict()
        data.pop("observations")
        print(json.dumps(data))
    return 0


def _server_target(args, config: EngineConfig, preset: str, device: str):
    return live_target(args.target, args, preset, device)


def calibrate_target(server_target, config: EngineConfig, preset: str, device: str, name: str,
                     cost_profile: str | None = None, **kwargs) -> CalibrationProfile:
    """Start the target's server with `config` (as a trial would), calibrate against it, stop it."""
    server = server_target.server(config)
    if cost_profile:
        server.command += ["--cost-profile", cost_profile]
    with server:
        return calibrate_url(server.url, preset, device, config, name, target=server_target.name,
                             executor=getattr(server_target, "executor", None), check_alive=server.check_alive,
                             **kwargs)


def calibrate_url(url: str, preset: str, device: str, config: EngineConfig | None, name: str,
                  target: str = "url", executor: str | None = None, quick: bool = False, max_batch: int = 64,
                  max_prompt: int | None = None, options: ProbeOptions | None = None, check_alive=None,
                  progress=None, base: CostCoefficients | None = None) -> CalibrationProfile:
    """Probe the server at `url` (which serves `preset` on `device`, configured as
    `config` describes, where /metrics does not say), fit, and return the profile.
    `base`: the coefficients the fit leaves alone and starts from; by default the cost
    model's, with the attention kernel's pair counting of the torch executor where the
    server is kvengine's torch executor."""
    if base is None:
        base = CostCoefficients(**(torch_attention_kernel(device) if executor == "torch" else {}))
    model, device_spec = model_preset(preset), device_preset(device)
    info = server_info(url)
    server_config = _server_config(config or EngineConfig(), info, model, device_spec)
    pool = info.num_gpu_blocks * server_config.block_size if info.num_gpu_blocks else None
    plan = design_probes(info.max_model_len, max_batch=min(max_batch, server_config.max_num_seqs),
                         max_prompt=max_prompt, pool_tokens=pool,
                         batch_tokens=server_config.max_num_batched_tokens, quick=quick)
    if progress:
        progress(f"probing {url} ({info.model_name}, max_model_len {info.max_model_len}): {len(plan)} probes, "
                 f"{plan.num_requests} requests")
    t0 = time.perf_counter()

    def each(i, n, run):
        if progress:
            measured = ", ".join(f"{m} {run.measured(m) * 1e3:.2f} ms" for m in run.measures)
            progress(f"  [{i}/{n}] {run.probe.label}: {measured}")

    runs = run_probes(url, info.model_name, plan, options, check_alive=check_alive, progress=each)
    probe_wall = time.perf_counter() - t0
    kv_dtype = server_config.kv_cache_dtype
    shapes, observations = step_shapes(runs, model, device_spec, server_config, base)
    result = fit_coefficients(shapes, observations, model, device_spec, kv_dtype, server_config.block_size,
                              base=base)
    profile = CalibrationProfile(
        name=name, model=model.name, device=device, coefficients=result.coefficients,
        client_overhead_s=result.client_overhead_s, client_overhead_busy_s=result.client_overhead_busy_s,
        target=target, url=url, executor=executor,
        served_model=info.model_name,
        server=info.to_dict() | {"config": {k: v for k, v in vars(server_config).items() if k != "extra"}},
        residuals=result.residuals(), roofline_residuals=result.initial,
        observations=[{"kind": o.kind, "label": o.label, "measure": o.measure, "measured_s": o.measured_s,
                       "predicted_s": o.predicted_s} for o in result.observations],
        probe_wall_s=round(probe_wall, 2), drift=speed_drift(runs) or {},
        fit={"cost": result.cost, "nfev": result.nfev, "message": result.message, **result.split_costs})
    reasons = degenerate_reasons(result)
    if reasons:
        # What to try, for what went wrong: noise (a busy machine, too few samples), timings
        # the stream could not time, or prompts the cost model does not reach.
        advice = []
        drift = profile.drift.get("change")
        if drift is not None and abs(drift) > DRIFT_WARN:
            advice.append(f"calibrate when the server is quiet: its speed moved {drift:+.0%} between the first "
                          "and the last probe (other work on its machine, or other clients of the server?)")
        else:
            advice.append("calibrate when the server is quiet: nothing else on its machine, no other client")
        if quick:
            advice.append("drop --quick: the full plan has more lengths, batch sizes and repeats per term, "
                          "and longer decode windows")
        if result.dropped:
            advice.append("a probe without a timing: its streams came in too few chunks in its window (a "
                          "server whose frontend falls behind merges tokens, or sends a stream in one burst): a "
                          "quieter machine, or smaller batches (--max-batch)")
        if target == "url":
            advice.append(f"check that --preset {preset} --device {device} describe the served model, and that "
                          "the scheduler flags (--max-num-seqs, --max-num-batched-tokens, --block-size, ...) are "
                          "the server's: the fit replays the probes with them")
        longest = max(run.probe.prompt_len for run in runs)
        advice.append(f"where the longest prompts misfit, leave them out (--max-prompt, now {longest})")
        raise FitRefusedError(
            f"the fit is not usable as a cost profile ({len(reasons)} "
            f"{'reason' if len(reasons) == 1 else 'reasons'}; rms limit {RMS_LIMIT:.0%}):\n"
            + "".join(f"  - {r}\n" for r in reasons)
            + "to do:\n" + "".join(f"  - {a}\n" for a in advice)
            + "the refused fit:\n" + format_profile(profile), reasons, profile)
    return profile


def _server_config(config: EngineConfig, info: ServerInfo, model, device) -> EngineConfig:
    """The flags' config, corrected by what the server says about itself."""
    import dataclasses

    from kvengine.config import KV_CACHE_DTYPES
    changes = {"max_model_len": min(info.max_model_len, model.max_position_embeddings)}
    if info.block_size:
        changes["block_size"] = info.block_size
    if info.enable_prefix_caching is not None:
        changes["enable_prefix_caching"] = info.enable_prefix_caching
    if info.kv_cache_dtype in KV_CACHE_DTYPES:
        changes["kv_cache_dtype"] = info.kv_cache_dtype
    return dataclasses.replace(config, num_gpu_blocks_override=None, **changes).resolve(model, device)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
             "residuals (predicted/measured - 1)   calibrated: rms    max   bias    roofline: rms     max"]
    for kind, r in profile.residuals.items():
        u = profile.roofline_residuals.get(kind, {})
        lines.append(f"  {kind:<10} n={r['n']:<3}                   {r['rms']:6.1%} {r['max']:6.1%} "
                     f"{r['bias']:+6.1%}          {u.get('rms', float('nan')):7.1%} {u.get('max', float('nan')):7.1%}")
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
    line = (f"  {'server speed':<29}{drift['probe']}: ITL {drift['first_s'] * 1e3:.3f} ms first, "
            f"{drift['last_s'] * 1e3:.3f} ms last ({drift['change']:+.1%})")
    if abs(drift["change"]) <= DRIFT_WARN:
        return [line]
    warning = (f"  warning: the server's speed moved {drift['change']:+.0%} while it was probed (other work on "
               "its machine?); the fit averages over that, so calibrate again when the machine is quiet")
    return [line, warning]
