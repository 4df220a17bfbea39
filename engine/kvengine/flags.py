"""The engine's command-line flags, spelled as `vllm serve` spells them.

Shared by `kvengine` and by kvtune commands that build an engine config, so a
flag means the same thing everywhere and a recommended config pastes unchanged.
"""
from __future__ import annotations

import argparse

from .config import (BLOCK_SIZES, DEVICE_PRESETS, KV_CACHE_DTYPES, MODEL_PRESETS, EngineConfig,
                     device_preset, model_preset)


def add_model_flags(p: argparse.ArgumentParser, default_preset: str = "llama-3-8b",
                    default_device: str = "h100-80gb") -> None:
    p.add_argument("--preset", default=default_preset, metavar="MODEL",
                   help=f"model preset: {', '.join(MODEL_PRESETS)} (default: %(default)s)")
    p.add_argument("--device", default=default_device, metavar="DEVICE",
                   help=f"device preset: {', '.join(DEVICE_PRESETS)} (default: %(default)s)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache and scheduler (vllm serve's flags)")
    g.add_argument("--block-size", type=int, default=16,
                   help=f"tokens per KV block: {', '.join(map(str, BLOCK_SIZES))} (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.92,
                   help="share of device memory the engine may use, in (0, 1] (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests running at once (default: vLLM's for the device, 1024 or 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: vLLM's for the device, 8192 or 2048)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV storage: auto = the model dtype (default: %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse K/V of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prefills across steps (default: on)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit per request (default: the model's)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one request's prefill tokens per step, 0 = off (default: %(default)s)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="use this many KV blocks instead of sizing the pool from memory")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
    )


def specs_from_args(args: argparse.Namespace):
    return model_preset(args.preset), device_preset(args.device)

