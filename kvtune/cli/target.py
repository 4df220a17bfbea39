"""The one place that turns command-line flags into a live target.

`kvtune run`, `kvtune search` (stage 2) and `kvtune calibrate` take the same
server flags and build their servers here, so a flag means the same thing in
each and the three never drift apart.
"""
from __future__ import annotations

import argparse
import os
import sys

from kvengine.config import ConfigError, EngineConfig

from ..targets.live import LiveOptions
from ..targets.servers import VLLM_COMMAND_ENV, EngineTarget, SglangTarget, UrlTarget, VllmTarget


def env_entry(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or " " in name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. VLLM_CPU_KVCACHE_SPACE=4), got {text!r}")
    return name.strip(), value


def add_server_flags(p, users_default: int = 256) -> None:
    """The flags of a server kvtune starts (engine, vllm, sglang) and of the live replay."""
    from .args import positive_float, positive_int  # argparse types

    g = p.add_argument_group("servers kvtune starts")
    g.add_argument("--model", metavar="MODEL", help="vllm/sglang: the model to serve; engine: a local "
                                                    "Hugging Face folder")
    g.add_argument("--vllm-command", default=None, metavar="CMD",
                   help="how to run vLLM: a console script (`vllm`, run as `vllm serve MODEL`) or the module "
                        "form (`PY -m vllm.entrypoints.openai.api_server`, run with --model MODEL) (default: "
                        f"${VLLM_COMMAND_ENV}, else the module form in ./.venv-vllm when it exists, else vllm)")
    g.add_argument("--vllm-platform", choices=("cpu", "cuda"), default=None,
                   help="the vLLM build's platform (default: cpu when its environment holds vllm-cpu)")
    g.add_argument("--sglang-python", default="python3", help="the python that has sglang (default: %(default)s)")
    g.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra arguments for the vllm or sglang server, as one shell string")
    g.add_argument("--server-env", action="append", type=env_entry, default=[], metavar="NAME=VALUE",
                   help="environment of the started server (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=4; it is "
                        "part of what was measured and of the report's launch command")
    g.add_argument("--start-timeout", type=positive_float, default=600.0, metavar="S",
                   help="how long a started server may take to become healthy (default: %(default)s)")
    g.add_argument("--server-log-dir", metavar="DIR",
                   help="keep started servers' logs here, one file per start (server-NNNN-SERVER-CONFIG.log, "
                        "in start order); made if missing (default: a new temporary folder per start, named "
                        "in the error of a failed start or a server that died, removed after a clean stop)")
    g = p.add_argument_group("live runs")
    g.add_argument("--users", type=positive_int, default=users_default,
                   help="most requests in flight (default: %(default)s)")
    g.add_argument("--locust-workers", "--workers", dest="workers", type=int, default=0,
                   help="replay through a Locust master and this many workers on loopback (0: one process)")
    g.add_argument("--scrape-interval", type=positive_float, default=1.0, metavar="S",
                   help="seconds between /metrics scrapes (default: %(default)s)")
    g.add_argument("--drain-timeout", type=positive_float, default=300.0, metavar="S",
                   help="how long requests may run after the last arrival (default: %(default)s)")


def live_options(args, device: str | None) -> LiveOptions:
    return LiveOptions(users=args.users, workers=args.workers, scrape_interval_s=args.scrape_interval,
                       drain_timeout_s=args.drain_timeout, device=device or "unknown")


def server_log_dir(path: str | None) -> str | None:
    """--server-log-dir, made if missing (as any output folder), as an absolute path: a start error
    recorded in the store names its log wherever it is read. A folder that cannot be made or written
    is refused here, before any server starts."""
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--server-log-dir {path}: cannot make the folder: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--server-log-dir {path}: the folder is not writable")
    return os.path.abspath(path)


def refuse_unservable(target, config: EngineConfig, flag: str | None = None) -> None:
    """ConfigError, before any server starts or anything is stored, for a config that the target's own
    rules (the ones a search narrows its space by) say its server refuses: the server would only say
    the same once started (CPU vLLM after its whole start-up). `flag`: the flag that asked for the
    config, where it is not the one the rule names (--quantized-kv)."""
    refusal = getattr(target, "refusal", None)  # a server kvtune starts; a URL's is not ours to check
    why = refusal(config) if refusal is not None else None
    if why:
        raise ConfigError(f"{flag + ': ' if flag else ''}{why}; nothing was started")


def live_target(kind: str, args, preset: str | None, device: str | None):
    """The engine, vllm or sglang target (or a URL's) that the flags describe."""
    options = live_options(args, device)
    if kind not in ("engine", "vllm", "sglang"):
        return UrlTarget(kind, options)
    common = dict(options=options, start_timeout_s=args.start_timeout, env=dict(args.server_env),
                  log_dir=server_log_dir(args.server_log_dir))
    if kind == "engine":
        memory = getattr(args, "device_memory", None)
        return EngineTarget(**common, executor=args.executor, preset=preset, device=device,
                            model_path=args.model, device_memory=str(memory) if memory else None,
                            extra_args=args.server_args)
    if kind == "vllm":
        vllm = VllmTarget(**common, model=args.model or "", extra_args=args.server_args,
                          platform=args.vllm_platform)
        if args.vllm_command:
            vllm.vllm_command = args.vllm_command
        if device is None and vllm.resolved_platform == "cpu":
            options.device = "cpu"  # what the runs are labelled with
        return vllm
    return SglangTarget(**common, model=args.model or "", python=args.sglang_python,
                        extra_args=args.server_args)


def served_config(args) -> str | None:
    """The local folder (with its config.json) of the model the target serves: the --model of a server
    kvtune starts, or the id a running server's /v1/models gives, where that is a folder on this host."""
    model = getattr(args, "model", None) if args.target in ("vllm", "sglang", "engine") else None
    if args.target.startswith(("http://", "https://")):
        model = _served_id(args.target)
    if model and os.path.isfile(os.path.join(model, "config.json")):
        return model
    return None


def _served_id(url: str) -> str | None:
    import httpx

    from ..httpclient import http_get

    try:
        return http_get(url.rstrip("/") + "/v1/models", timeout=5.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None  # not reachable yet, or not an OpenAI server: the asked or default model stands


def simulated_model(args, default: str) -> str:
    """The model the simulator runs for a live target: the served checkpoint's config.json where kvtune
    can read it (a --preset/--hf-config must then describe the same model), else the one asked, else
    `default`. Raises ConfigError naming both shapes where they disagree."""
    from kvengine.config import model_preset

    served = served_config(args)
    if served is None:
        if args.preset is None and default is not None and args.target.startswith(("http://", "https://")):
            print(f"note: the simulator runs {default}, the default: {args.target} serves no model whose "
                  "config.json is on this host; give --hf-config (or --preset) for the model it serves",
                  file=sys.stderr)
        return args.preset or default
    if args.preset is None:
        return served
    asked, theirs = model_preset(args.preset), model_preset(served)
    if shape(asked) != shape(theirs):
        raise ConfigError(f"--preset/--hf-config {args.preset} describes {describe(asked)}, but the target serves "
                          f"{served}: {describe(theirs)}; the simulator must run the served model (leave the "
                          "preset out to use its config.json)")
    return args.preset


def shape(model) -> tuple:
    """What a preset must share with the served model: the layers, heads and cache that size its pool."""
    return (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim, model.attention_kinds,
            model.kv_lora_rank + model.qk_rope_head_dim)


def describe(model) -> str:
    kv = (f"an MLA latent of {model.kv_lora_rank + model.qk_rope_head_dim}" if model.uses_mla
          else f"{model.num_kv_heads} K/V heads of {model.head_dim}")
    return f"{model.num_layers} layers, {model.num_heads} heads, {kv} ({model.name})"


def serves_on_cpu(args) -> bool:
    """Whether the server kvtune starts for `args` runs on this CPU: vLLM's CPU build, or kvengine's
    torch executor (which runs here)."""
    if args.target == "vllm":
        from ..targets.servers import default_vllm_command
        from ..targets.rules import vllm_platform
        command = getattr(args, "vllm_command", None) or default_vllm_command()
        return (getattr(args, "vllm_platform", None) or vllm_platform(command)) == "cpu"
    return args.target == "engine" and getattr(args, "executor", None) == "torch"


DEFAULT_MODEL, DEFAULT_DEVICE = "llama-3-8b", "h100-80gb"  # a GPU deployment's, where nothing says otherwise


def simulated_model_device(args) -> tuple[str, str]:
    """The one policy for the model and device presets the simulator runs for a command (search's
    stage 1, a calibrated profile, `run --target sim`), where the flags give none: the served
    checkpoint's config.json (`simulated_model`), else `tiny` for kvengine's torch executor (what it
    serves), else DEFAULT_MODEL; `cpu` for a server kvtune starts on this CPU, else DEFAULT_DEVICE."""
    torch_engine = args.target == "engine" and getattr(args, "executor", None) == "torch"
    preset = simulated_model(args, "tiny" if torch_engine else DEFAULT_MODEL)
    return preset, args.device or ("cpu" if serves_on_cpu(args) else DEFAULT_DEVICE)
