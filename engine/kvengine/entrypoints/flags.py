"""The engine's command-line flags, spelled as `vllm serve` spells them.

Shared by `kvengine` and by kvtune commands that build an engine config, so a
flag means the same thing everywhere and a recommended config pastes unchanged.
"""
from __future__ import annotations

import argparse
import dataclasses
import re

from kvengine.config import (BLOCK_SIZES, DEVICE_PRESETS, MODEL_PRESETS, EngineConfig,
                     device_preset, model_preset)
from kvengine.entrypoints.limits import (MAX_N_SEQUENCES, MAX_NUM_QUEUED_REQS, MAX_REQUEST_BODY_BYTES, REQUEST_READ_TIMEOUT_S,
                     ServerLimits)


def add_model_flags(p: argparse.ArgumentParser, default_preset: str = "llama-3-8b",
                    default_device: str = "h100-80gb") -> None:
    p.add_argument("--preset", default=default_preset, metavar="MODEL",
                   help=f"model preset: {', '.join(MODEL_PRESETS)} (default: %(default)s)")
    p.add_argument("--hf-config", dest="preset", metavar="PATH",
                   help="the model of a Hugging Face config.json (or its folder), instead of a --preset")
    p.add_argument("--device", default=default_device, metavar="DEVICE",
                   help=f"device preset: {', '.join(DEVICE_PRESETS)} (default: %(default)s)")


# EngineConfig's fields that are `vllm serve` flags (their metadata says how), in its order.
ENGINE_FLAG_FIELDS = tuple(f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata)
_TYPES = {"int | None": int, "int": int, "float": float, "str": str, "str | None": str}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_flags(p: argparse.ArgumentParser, platform_block_size: bool = False) -> None:
    """One flag per EngineConfig field, as vLLM's EngineArgs derives its CLI. platform_block_size:
    --block-size left out means the platform's (128 on the CPU, as vLLM's CPU build; 16 on GPUs),
    for a server that knows where it runs; else 16."""
    g = p.add_argument_group("KV cache and scheduler (vllm serve's flags)")
    for f in ENGINE_FLAG_FIELDS:
        kwargs, help_text, default = {}, f.metadata["help"], f.default
        if f.name == "block_size":
            help_text += ": " + ", ".join(map(str, BLOCK_SIZES))
            if platform_block_size:
                default = None
                help_text += " (default: vLLM's for the device, 128 on the CPU, 16 on GPUs)"
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
            help_text += f" (default: {'on' if default else 'off'})"
        else:
            kwargs["type"] = parse_size if f.metadata.get("size") else _TYPES[f.type]
            if f.metadata.get("size"):
                kwargs["metavar"] = "SIZE"
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if default is not None and "(default" not in help_text:
                help_text += " (default: %(default)s)"
        g.add_argument(flag_name(f.name), default=default, help=help_text, **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in ENGINE_FLAG_FIELDS})


def given_flags(text: str, what: str) -> dict:
    """The engine knobs a shell string of `vllm serve` flags sets ({field: value}), only those it
    names; ValueError naming `what` and the first argument that is not such a flag or its value."""
    import shlex

    try:
        tokens = shlex.split(text)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    parser = argparse.ArgumentParser(prog=what, add_help=False, exit_on_error=False)
    add_engine_flags(parser)
    try:
        parsed, unknown = parser.parse_known_args(tokens)
    except argparse.ArgumentError as err:
        raise ValueError(f"{what}: {err}") from None
    if unknown:
        raise ValueError(f"{what}: {unknown[0]} is not a KV-cache or scheduler flag (vllm serve's names: "
                         "--block-size, --max-num-seqs, --kv-cache-dtype, ...)")
    names = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
    return {f.name: getattr(parsed, f.name) for f in ENGINE_FLAG_FIELDS
            if flag_name(f.name) in names or "--no-" + flag_name(f.name)[2:] in names}


def launch_flags(config: EngineConfig) -> list[str]:
    """The `vllm serve` / `kvengine serve` arguments that reproduce `config`: the searched knobs
    always, the others where they are not the default; a None (unresolved: block_size left to the
    platform) is left out, so the server takes its own."""
    args = []
    for f in ENGINE_FLAG_FIELDS:
        value = getattr(config, f.name)
        if value is None or (value == f.default and not f.metadata.get("always")):
            continue
        if f.type == "bool":
            args.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            args += [flag_name(f.name), f"{value:g}" if isinstance(value, float) else str(value)]
    return args


def specs_from_args(args: argparse.Namespace):
    return model_preset(args.preset), device_preset(args.device)


EXECUTORS = ("torch", "sim")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1 << 10, "M": 10**6, "MB": 10**6, "MIB": 1 << 20,
          "G": 10**9, "GB": 10**9, "GIB": 1 << 30, "T": 10**12, "TB": 10**12, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '3e9'-free plain bytes: for --device-memory."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1000000000, got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving (vllm serve's flags where they exist)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model name(s) in the API and the metrics' model_name label (the first one)")
    g.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every /v1 route and every "
                                     "route that changes state (POST /reset_prefix_cache)")
    g.add_argument("--seed", type=int, default=0, help="random weights and sampling seed (default: 0)")
    g.add_argument("--executor", choices=EXECUTORS, default="torch",
                   help="torch: real forward passes; sim: the cost model's latencies in wall-clock time "
                        "(default: %(default)s)")
    g.add_argument("--model", metavar="PATH",
                   help="a local Hugging Face folder (config.json + *.safetensors) for the torch executor")
    g.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                   help="on the CPU, the memory budget that plays the device's total memory (e.g. 2GiB)")
    g.add_argument("--cost-profile", metavar="FILE",
                   help="the sim executor's cost coefficients as JSON (a calibrated profile); default: "
                        "the roofline's")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_limit_flags(p)


def _at_least(kind, low, inclusive: bool = False):
    """An argparse type: a `kind` number above `low` (or equal to it, if `inclusive`)."""
    what = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value
    return parse


_positive_int, _positive_float, _count = _at_least(int, 0), _at_least(float, 0), _at_least(int, 0, inclusive=True)


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one client may ask of the server; defaults no real workload reaches."""
    g = p.add_argument_group("request limits")
    g.add_argument("--max-n-sequences", type=_positive_int, default=MAX_N_SEQUENCES, metavar="N",
                   help="largest `n` a request may ask for; vLLM's VLLM_MAX_N_SEQUENCES (16384 there) "
                        "(default: %(default)s)")
    g.add_argument("--max-num-queued-reqs", type=_count, default=MAX_NUM_QUEUED_REQS, metavar="N",
                   help="most sequences in flight (waiting + running, a request with n counts n), as "
                        "vLLM's flag; beyond it a request gets 503 with Retry-After; 0 = no limit "
                        "(default: %(default)s)")
    g.add_argument("--max-request-body-size", type=parse_size, default=MAX_REQUEST_BODY_BYTES, metavar="SIZE",
                   help="largest request body, beyond it 413 (default: 32MiB)")
    g.add_argument("--request-read-timeout", type=_positive_float, default=REQUEST_READ_TIMEOUT_S,
                   metavar="SECONDS", help="a request's head and body must arrive within this time of its "
                                           "first byte, else the connection is closed (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="close an idle keep-alive connection after this; vLLM's "
                        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default: %(default)s)")
    g.add_argument("--h11-max-incomplete-event-size", type=parse_size, default=4 << 20, metavar="SIZE",
                   help="largest request head (request line and headers), as vLLM's flag (default: 4MiB)")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_n_sequences=args.max_n_sequences, max_num_queued_reqs=args.max_num_queued_reqs,
                        max_request_body_bytes=args.max_request_body_size)
