"""`kvtune plan`: KV capacity for a preset or custom model on a preset or custom device."""
from __future__ import annotations

import dataclasses
import json
import sys

from kvengine.config import (DEVICE_PRESETS, DTYPE_BYTES, MODEL_PRESETS, ConfigError, EngineConfig, GiB)
from kvengine.entrypoints.flags import parse_size
from kvengine.core.memory import KVCacheMemoryError

from .commands import COMMANDS
from ..plan import CapacityPlan, ModelChoice, plan_capacity, planned_device, planned_model, workload_contexts
from ..workload import FORMATS, TraceError, read_workload
from .args import non_negative_float, positive_float, positive_int

KiB = 1 << 10


def add_plan_command(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help=COMMANDS["plan"].help,
        description="Capacity planning from the fault card's formulas (kvengine.core.memory): KV bytes per token, "
                    "the KV pool at a gpu_memory_utilization, the tokens that fit and the requests that fit at "
                    "given context lengths, with fp8 K/V side by side and a contiguous worst-case reservation "
                    "at max_model_len for comparison.")
    m = p.add_argument_group("model (a preset, a Hugging Face config.json, or a custom shape)")
    m.add_argument("--preset", metavar="MODEL", help=f"{', '.join(MODEL_PRESETS)} (default: llama-3-8b)")
    m.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    m.add_argument("--layers", type=positive_int, help="custom model: decoder layers")
    m.add_argument("--kv-heads", type=positive_int, help="custom model: K/V heads")
    m.add_argument("--head-dim", type=positive_int, help="custom model: head dimension")
    m.add_argument("--heads", type=positive_int, help="custom model: query heads (default: --kv-heads)")
    m.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16",
                   help="custom model: weights and `auto` K/V dtype (default: %(default)s)")
    m.add_argument("--weights-gib", type=positive_float, metavar="GIB",
                   help="weights size (default: counted from the shape)")
    m.add_argument("--quantization", metavar="METHOD",
                   help="vLLM's --quantization: the weights' format (fp8, mxfp4, awq, gptq, compressed-tensors, "
                        "modelopt, ...; default: the config's quantization_config, else the model dtype)")
    d = p.add_argument_group("device")
    d.add_argument("--device", metavar="DEVICE", help=f"{', '.join(DEVICE_PRESETS)} (default: h100-80gb)")
    d.add_argument("--device-memory", type=parse_size, metavar="SIZE", help="device memory, e.g. 80GiB")
    e = p.add_argument_group("engine")
    e.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                   help="(default: %(default)s, vLLM's)")
    e.add_argument("--kv-cache-memory-bytes", type=parse_size, metavar="SIZE",
                   help="the KV pool of each GPU (e.g. 4GiB), instead of sizing it from the utilisation")
    e.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="GPUs the model is split over; every figure is one GPU's (default: %(default)s)")
    e.add_argument("--reserve-gib", type=non_negative_float, metavar="GIB",
                   help="set aside this much instead of the activation peak and overhead estimates")
    e.add_argument("--block-size", type=int, default=16, help="(default: %(default)s)")
    e.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), fp8, ... (default: auto)")
    e.add_argument("--max-num-batched-tokens", type=positive_int, help="activation peak budget (default: vLLM's)")
    e.add_argument("--max-num-seqs", type=positive_int, help="(default: vLLM's for the device)")
    e.add_argument("--max-model-len", type=positive_int,
                   help="for the contiguous comparison (default: the model's, or the longest --context)")
    w = p.add_argument_group("contexts")
    w.add_argument("--context", type=positive_int, action="append", default=[], metavar="TOKENS",
                   help="a context length (prompt + output) to size concurrency for (repeatable)")
    w.add_argument("--workload", metavar="FILE", help="also its p50/p95/p99 input + output tokens")
    w.add_argument("--format", choices=FORMATS, help="the workload's format (default: detected)")
    p.add_argument("--json", action="store_true", help="end with the plan as one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    try:
        model = planned_model(ModelChoice(args.preset, args.hf_config, args.layers, args.kv_heads, args.head_dim,
                                          args.heads, args.dtype, args.weights_gib))
        device = planned_device(args.device, args.device_memory)
        contexts, from_workload = _contexts(args)
        config = _config(args, contexts)
        contexts = contexts or [config.resolve(model, device).max_model_len]
        plan = plan_capacity(model, device, config, contexts,
                             None if args.reserve_gib is None else int(args.reserve_gib * GiB))
    except (ConfigError, TraceError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KVCacheMemoryError as err:
        print(f"error: does not fit: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"fits": False, "reason": str(err)}))
        return 2
    plan.workload_contexts = from_workload
    print(format_plan(plan))
    if plan.refusal:
        print(f"error: does not fit: {plan.refusal}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan_json(plan)))
    return 2 if plan.refusal else 0


def _contexts(args) -> tuple[list[int], dict[str, int]]:
    from_workload = {}
    if args.workload:
        from_workload = workload_contexts(read_workload(args.workload, format=args.format))
    return list(args.context) + list(from_workload.values()), from_workload


def _config(args, contexts: list[int]) -> EngineConfig:
    max_len = args.max_model_len
    if max_len is None and args.layers is not None:  # a custom model has no limit of its own
        max_len = max(contexts, default=4096)
    return EngineConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization)


def format_plan(plan: CapacityPlan) -> str:
    cfg = plan.config
    tp = cfg.tensor_parallel_size
    on = f"{tp} × {plan.device} (tensor parallel; every figure is one GPU's)" if tp > 1 else plan.device
    sized = (f"kv_cache_memory_bytes {cfg.kv_cache_memory_bytes / GiB:g} GiB" if plan.pool_fixed
             else f"gpu_memory_utilization {cfg.gpu_memory_utilization:g}")
    title = f"kvtune plan: {plan.model} on {on}, {sized}, block_size {cfg.block_size}"
    lines = [title, "",
             f"  {'device memory':<34}{plan.total_bytes / GiB:10.2f} GiB",
             f"  {'× gpu_memory_utilization':<34}{plan.requested_bytes / GiB:10.2f} GiB",
             f"  {'− weights':<34}{plan.weights_bytes / GiB:10.2f} GiB"]
    if plan.reserve_given:
        lines.append(f"  {'− reserve (--reserve-gib)':<34}{plan.activation_bytes / GiB:10.2f} GiB")
    else:
        peak = f"− activation peak ({cfg.max_num_batched_tokens} tokens)"
        lines += [f"  {peak:<34}{plan.activation_bytes / GiB:10.2f} GiB",
                  f"  {'− overhead (CUDA context, graphs)':<34}{plan.overhead_bytes / GiB:10.2f} GiB"]
    lines += ["", _row("", [_dtype_label(c.kv_cache_dtype, plan) for c in plan.by_dtype]),
              _row("KV bytes per token", [f"{c.kv_bytes_per_token / KiB:g} KiB" for c in plan.by_dtype]),
              _row("KV pool", [f"{c.pool_bytes / GiB:.2f} GiB" for c in plan.by_dtype]),
              _row("tokens that fit", [f"{c.pool_tokens:,}" for c in plan.by_dtype])]
    names = {v: k for k, v in plan.workload_contexts.items()}
    for context in plan.contexts:
        label = f"requests at {context:,} tokens" + (f" ({names[context]})" if context in names else "")
        lines.append(_row(label, [f"{c.max_concurrency[str(context)]:.2f}" for c in plan.by_dtype]))
    lines.append(_row(f"contiguous at max_model_len {cfg.max_model_len:,}",
                      [f"{c.contiguous_requests:,}" for c in plan.by_dtype]))
    return "\n".join(lines)


def _dtype_label(dtype: str, plan: CapacityPlan) -> str:
    return f"auto ({plan.model_dtype})" if dtype == "auto" else dtype


def _row(label: str, cells: list[str]) -> str:
    return f"  {label:<42}" + "".join(f"{cell:>16}" for cell in cells)


def plan_json(plan: CapacityPlan) -> dict:
    primary = dataclasses.asdict(plan.primary)
    return {"model": plan.model, "device": plan.device, "fits": not plan.refusal,
            **({"reason": plan.refusal} if plan.refusal else {}), **primary,
            "memory": {"total_bytes": plan.total_bytes, "requested_bytes": plan.requested_bytes,
                       "weights_bytes": plan.weights_bytes, "activation_bytes": plan.activation_bytes,
                       "overhead_bytes": plan.overhead_bytes, "reserve_given": plan.reserve_given},
            "config": {k: v for k, v in dataclasses.asdict(plan.config).items() if k != "extra"},
            "workload_contexts": plan.workload_contexts,
            "by_dtype": {c.kv_cache_dtype: dataclasses.asdict(c) for c in plan.by_dtype}}
