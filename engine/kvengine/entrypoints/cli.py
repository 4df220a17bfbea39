"""`kvengine`: the bundled paged-KV engine's command line (`python -m kvengine`, the `kvengine` script)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvengine.config import DEVICE_PRESETS, GiB, MODEL_PRESETS, ConfigError
from kvengine.entrypoints.flags import add_engine_flags, add_model_flags, add_serve_flags, config_from_args, specs_from_args
from kvengine.core.memory import KVCacheMemoryError, kv_bytes_per_token, plan_memory


def cmd_plan(args) -> int:
    """Size the KV pool the way the engine (and vLLM) does at start-up."""
    model, device = specs_from_args(args)
    config = config_from_args(args).resolve(model, device)
    plan = plan_memory(model, device, config)
    contexts = sorted(set(args.context or [config.max_model_len]))
    result = {
        "model": model.name, "device": device.name, "config": dataclasses.asdict(config),
        "kv_bytes_per_token": kv_bytes_per_token(model, config.kv_cache_dtype),
        "block_bytes": plan.block_bytes, "weights_bytes": plan.weights_bytes,
        "activation_bytes": plan.activation_bytes, "overhead_bytes": plan.overhead_bytes,
        "kv_cache_bytes": plan.kv_cache_bytes, "num_gpu_blocks": plan.num_gpu_blocks,
        "pool_tokens": plan.num_tokens,
        "max_concurrency": {str(c): round(plan.max_concurrency(c), 2) for c in contexts},
    }
    result["config"].pop("extra")
    print(f"{model.name} on {device.name}: {model.num_params / 1e9:.2f}B params, "
          f"weights {plan.weights_bytes / GiB:.2f} GiB, activation peak "
          f"{plan.activation_bytes / GiB:.2f} GiB, overhead {plan.overhead_bytes / GiB:.2f} GiB")
    print(f"KV: {result['kv_bytes_per_token']:,} bytes/token ({config.kv_cache_dtype}), "
          f"{plan.block_bytes:,} bytes/block of {config.block_size}, "
          f"{plan.num_gpu_blocks:,} blocks")
    for line in plan.log_lines(config.max_model_len):
        print(line)
    for c in contexts:
        print(f"  at {c:>7,} tokens per request: {plan.max_concurrency(c):8.2f} requests")
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_presets(args) -> int:
    """List the model and device presets."""
    models = {n: dict(dataclasses.asdict(m), num_params=m.num_params) for n, m in MODEL_PRESETS.items()}
    devices = {n: dataclasses.asdict(d) for n, d in DEVICE_PRESETS.items()}
    print(f"{'model':14}{'params':>10}{'layers':>8}{'kv heads':>10}{'head dim':>10}{'max len':>9}  dtype")
    for m in MODEL_PRESETS.values():
        print(f"{m.name:14}{m.num_params / 1e9:>9.2f}B{m.num_layers:>8}{m.num_kv_heads:>10}"
              f"{m.head_dim:>10}{m.max_position_embeddings:>9}  {m.dtype}")
    print(f"\n{'device':12}{'memory':>10}{'HBM TB/s':>10}{'BF16 TFLOP/s':>14}")
    for d in DEVICE_PRESETS.values():
        print(f"{d.name:12}{d.memory_bytes / GiB:>7.0f}GiB{d.hbm_bandwidth / 1e12:>10.3f}"
              f"{d.bf16_flops / 1e12:>14.0f}")
    if args.json:
        print(json.dumps({"models": models, "devices": devices}))
    return 0


def cmd_serve(args) -> int:
    from kvengine.entrypoints.serve import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvengine", description="The bundled vLLM-style paged-KV engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="size the KV pool for a model, device and config",
                       description=cmd_plan.__doc__)
    add_model_flags(p)
    add_engine_flags(p)
    p.add_argument("--context", type=int, action="append", metavar="TOKENS",
                   help="also report max concurrency at this context length (repeatable)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API and vLLM's /metrics",
                       description="Serve the engine over HTTP, as `vllm serve` does: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics.")
    add_model_flags(p, default_preset="tiny", default_device="cpu")
    add_engine_flags(p, platform_block_size=True)
    add_serve_flags(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("presets", help="list model and device presets", description=cmd_presets.__doc__)
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.set_defaults(func=cmd_presets)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KVCacheMemoryError as err:
        print(f"error: engine cannot start: {err}", file=sys.stderr)
        return 1

