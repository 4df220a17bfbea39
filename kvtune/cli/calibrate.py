"""`kvtune calibrate`: probe a live server, fit the cost model, save a named profile.

    kvtune calibrate --target engine --name cpu-tiny            # kvengine serve, torch executor, tiny, cpu
    kvtune calibrate --target vllm --model meta-llama/Meta-Llama-3-8B --preset llama-3-8b --device h100-80gb
    kvtune calibrate --target http://gpu-box:8000 --preset llama-3-8b --device h100-80gb --name h100-prod
    kvtune run --target sim --profile cpu-tiny ...               # the sim, with the fitted coefficients
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

from kvengine.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, device_preset, model_preset
from kvengine.entrypoints.flags import add_engine_flags, config_from_args, parse_size

from .commands import COMMANDS
from .args import add_db_argument
from ..store import Store, resolve_db_url
from ..targets import TargetStartError
from .target import add_server_flags, live_target, refuse_unservable, simulated_model_device
from .ray import add_ray_argument, connect_ray, refuse_target
from .args import name_or_url, positive_float, positive_int
from ..calibrate.errors import CalibrationError
from ..calibrate.runner import ProbeOptions
from ..calibrate.profile import save_profile
from ..calibrate.session import CalibrationRequest, calibrate_target, calibrate_url, format_profile

TARGETS = ("engine", "vllm", "sglang")
QUANTIZED_KV = tuple(d for d in KV_CACHE_DTYPES if d != "auto")


def add_calibrate_command(sub) -> None:
    p = sub.add_parser(
        "calibrate", help=COMMANDS["calibrate"].help,
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
    _add_model_device_flags(p)
    add_engine_flags(p, platform_block_size=True)
    _add_probe_flags(p)
    add_server_flags(p)
    add_ray_argument(p, "run the whole calibration (the server kvtune starts, its probes, the --quantized-kv "
                        "pass) in one Ray task on a slot of a cluster (the GPUs of --tensor-parallel-size on the "
                        "node Ray picks), never on this machine; the profile comes back and is stored here")
    add_db_argument(p)
    p.add_argument("--no-save", action="store_true", help="fit and report, but store nothing")
    p.add_argument("--json", action="store_true", help="end with the profile (less its observations) as one "
                                                       "JSON object")
    p.set_defaults(func=cmd_calibrate)


def _add_model_device_flags(p) -> None:
    g = p.add_argument_group("model and device (the presets the sim will run with the profile)")
    g.add_argument("--hf-config", dest="preset", metavar="PATH",
                   help="the model of a Hugging Face config.json (or its folder), instead of a --preset")
    g.add_argument("--preset", metavar="MODEL", help="model preset of the served model (default: tiny for the "
                                                     "engine's torch executor, else llama-3-8b)")
    g.add_argument("--device", metavar="DEVICE", help="device preset (default: cpu for a server kvtune starts "
                                                      "on this CPU, the engine's torch executor or vLLM's CPU "
                                                      "build, else h100-80gb); the engine's torch executor "
                                                      "runs on CUDA under a GPU preset (h200-141gb, ...)")
    g.add_argument("--executor", choices=("torch", "sim"), default="torch",
                   help="the engine target's executor (default: %(default)s)")
    g.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                   help="engine target: the memory budget on the CPU (e.g. 2GiB), a cap below the GPU's "
                        "memory on CUDA")
    g.add_argument("--cost-profile", metavar="FILE",
                   help="engine target with --executor sim: serve these coefficients (JSON), e.g. to check "
                        "that calibration recovers them")


def _add_probe_flags(p) -> None:
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
    g.add_argument("--quantized-kv", choices=QUANTIZED_KV, metavar="DTYPE",
                   help="then start the server again with this --kv-cache-dtype (one of "
                        f"{', '.join(QUANTIZED_KV)}), time its decodes and long contexts, and fit what the "
                        "quantized cache's reads cost beyond their bytes (a CPU dequantizes fp8 in software): "
                        "calibrate with the dtype a search will try, or the sim prices it at its bytes alone")
    g.add_argument("--seed", type=int, default=None,
                   help="probe prompts' seed (default: fresh prompts each run; the same seed twice on one server "
                        "would hit the prefix cache the first run left)")


def default_name(target: str, executor: str | None, preset: str, device: str) -> str:
    kind = "url" if target.startswith(("http://", "https://")) else target
    parts = [kind] + ([executor] if kind == "engine" and executor else []) + [preset, device]
    return "-".join(parts)


def cmd_calibrate(args) -> int:
    refuse_target(args)  # --ray with a URL: before the URL is asked anything
    preset, device = simulated_model_device(args)
    model = model_preset(preset)  # unknown presets, or one that is not the served model, fail before anything starts
    device_preset(device)
    config = config_from_args(args)
    _refuse_conflicting_flags(args, config)
    name = args.name or default_name(args.target, args.executor, model.name, device)
    url = args.target.startswith(("http://", "https://"))
    server = None if url else _server_target(args, config, preset, device)
    if server is not None:  # what its rules refuse fails before any start, and before the store
        refuse_unservable(server, config)
        if args.quantized_kv:
            refuse_unservable(server, dataclasses.replace(config, kv_cache_dtype=args.quantized_kv),
                              f"--quantized-kv {args.quantized_kv}")
    # a bad --ray fails before the store is made, a bad --db before any probe
    pool = connect_ray(args, config.tensor_parallel_size or 1) if args.ray else None
    try:
        return _calibrated(args, server, config, preset, device, name, pool)
    finally:
        if pool is not None:
            pool.close()  # a --ray local cluster ends here


def _calibrated(args, server, config: EngineConfig, preset: str, device: str, name: str, pool) -> int:
    """Calibrate (on `pool`'s cluster where --ray is given), then store and print the profile."""
    store = None if args.no_save else Store(resolve_db_url(args.db))
    try:
        profile = _calibrate(args, server, config, preset, device, name, pool)
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


def _refuse_conflicting_flags(args, config: EngineConfig) -> None:
    """ConfigError for flags that cannot go together, before anything starts."""
    if args.cost_profile and not (args.target == "engine" and args.executor == "sim"):
        raise ConfigError("--cost-profile needs --target engine --executor sim")
    if args.quantized_kv and args.target.startswith(("http://", "https://")):
        raise ConfigError(f"--quantized-kv {args.quantized_kv} needs a server kvtune starts (--target engine, vllm "
                          f"or sglang): it restarts it with that KV cache dtype, and cannot restart {args.target}")
    if args.quantized_kv and config.kv_cache_dtype not in (None, "auto"):
        raise ConfigError(f"--quantized-kv {args.quantized_kv} times a quantized cache against the server's "
                          f"own dtype: leave --kv-cache-dtype ({config.kv_cache_dtype}) at auto")


def _calibrate(args, server, config: EngineConfig, preset: str, device: str, name: str, pool=None):
    """The profile of the server at the --target URL, or of `server` (a target kvtune starts; in a task
    on `pool`'s cluster where one is given)."""
    options = ProbeOptions(request_timeout_s=args.request_timeout, deadline_s=args.probe_timeout, seed=args.seed)
    plan_args = {"quick": args.quick, "max_batch": args.max_batch, "max_prompt": args.max_prompt}
    if server is None:
        request = CalibrationRequest(args.target, preset, device, config, name, target="url", options=options,
                                     **plan_args)
        return calibrate_url(request, progress=_progress)
    # the server reads --cost-profile where it runs: a task's working folder is not this one
    cost_profile = os.path.abspath(args.cost_profile) if args.cost_profile and pool else args.cost_profile
    session = functools.partial(calibrate_target, config=config, preset=preset, device=device, name=name,
                                options=options, cost_profile=cost_profile, quantized_kv=args.quantized_kv,
                                **plan_args)
    if pool is None:
        return session(server, progress=_progress)
    return _on_ray(args, pool, server, session)


def _on_ray(args, pool, server, session):
    """`session` in one Ray task on one slot (cluster.rounds.calibrate): the profile, or CalibrationError
    with why not (the session's own error, or the reason Ray gives for a lost task). A task's output does
    not reach this process: the session's progress lines are printed as it ends, then where it ran."""
    from ..cluster.slots import Slot

    _progress(f"calibrating in a Ray task on a slot of {pool.slot_text} of Ray cluster {args.ray}; its "
              "progress is printed as it ends")
    done, lost = pool.calibrate(server, session)
    if lost is not None:
        raise CalibrationError(lost)
    for line in done.lines:
        _progress(line)
    _progress(f"calibrated on Ray cluster {args.ray}: {Slot.of(done.slot).label}")
    if done.error is not None:
        raise CalibrationError(done.error)
    return done.profile


def _server_target(args, config: EngineConfig, preset: str, device: str):
    return live_target(args.target, args, preset, device)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
