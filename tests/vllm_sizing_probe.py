"""What vLLM's own code says a model's KV pool is, without starting the model.

Run with the vLLM venv's python (tests/vllm_sizing.py's `vllm_sizing` does):

    .venv-vllm/bin/python tests/vllm_sizing_probe.py MODEL_DIR [--tp N] [--block-size B]
        [--kv-cache-dtype auto|fp8...] [--max-model-len L] [--max-num-batched-tokens T]
        [--available-bytes BYTES]
    .venv-vllm/bin/python tests/vllm_sizing_probe.py --batch '[["MODEL_DIR", "--tp", "2"], ...]'

MODEL_DIR holds a config.json (and, as the server needs, a tokenizer). The probe
prints one JSON line on stdout (with --batch, one per entry, in order):

* the VllmConfig the OpenAI API server would build: the same argument parser
  (AsyncEngineArgs.add_cli_args), the same flags as tests/vllm_sizing.py's real
  start (`--load-format dummy --dtype bfloat16 -O0`), the same usage context, so
  the platform's check_and_update_config (CPU: block size 128, or 16 for MLA) and
  the scheduler defaults (max_num_batched_tokens, which sizes sliding windows)
  are the server's;
* the model config's own answers: num_kv_heads per rank
  (model_config.get_num_kv_heads(parallel_config)), head size, layers, use_mla;
* one KV cache spec per attention layer, made by the layer classes' own
  get_kv_cache_spec: `Attention.get_kv_cache_spec` / `MLAAttention.get_kv_cache_spec`
  called on a stand-in that carries what the layer's __init__ would have set
  (num_kv_heads per rank, head size, its per-layer sliding window, its backend
  from vLLM's own get_attn_backend, its KV dtype), then the model runner's
  customize_attention_spec. Which layers slide is each model file's rule
  (LAYER_WINDOW below: layer_types for Llama/Gemma2/Gemma3, layer_idx % 2 == 0 for
  GPT-OSS, the model-wide window otherwise, as Attention falls back to
  cache_config.sliding_window);
* what the engine core does with them (EngineCore._initialize_kv_caches):
  register_all_kvcache_specs, resolve_kv_cache_layout, get_kv_cache_configs for
  one spec dict and `--available-bytes` per worker, generate_scheduler_kv_cache_config,
  the min block size of the groups (what cache_config_info reports) and
  get_kv_cache_capacity / get_max_concurrency_for_kv_cache_config (what the
  "KV cache size: N tokens, Maximum concurrency ..." log line says).

Nothing is loaded or allocated: no weights, no KV tensors, no process group.

TP > 1 on this CPU: AsyncEngineArgs.create_engine_config is tried with
`--tensor-parallel-size N` first. If vLLM refuses it here, the probe builds the
config at TP 1 and puts a ParallelConfig(tensor_parallel_size=N) (vLLM's own
class, same other fields) in its place before anything reads it; the JSON says
so in "tp_workaround". Only num_kv_heads per rank (model_config.get_num_kv_heads)
and the worker count (one spec dict and one memory figure per rank) depend on TP
in the sizing path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GIB = 1 << 30
SERVER_FLAGS = ["--load-format", "dummy", "--dtype", "bfloat16", "-O0"]


def _layer_types_window(hf, i):
    """llama.py / gemma2.py / gemma3.py: config.sliding_window on layer_types' sliding layers."""
    types = getattr(hf, "layer_types", None)
    if types and types[i] == "sliding_attention":
        return hf.sliding_window
    return None


# Per-layer sliding window as each model file passes it to Attention(per_layer_sliding_window=...);
# None there makes Attention take cache_config.sliding_window (the model-wide window, which
# arg_utils sets only when every layer slides or there are no layer_types).
LAYER_WINDOW = {
    "LlamaForCausalLM": _layer_types_window,
    "Gemma2ForCausalLM": _layer_types_window,
    "Gemma3ForCausalLM": _layer_types_window,
    "GptOssForCausalLM": lambda hf, i: hf.sliding_window if i % 2 == 0 else None,  # gpt_oss.py
}
SINKS = {"GptOssForCausalLM"}  # attention sinks (Attention(sinks=...)): the backend choice sees them


def build_vllm_config(args) -> tuple[object, str | None]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def make(tp: int):
        argv = ["--model", args.model_dir, *SERVER_FLAGS, "--tensor-parallel-size", str(tp),
                "--kv-cache-dtype", args.kv_cache_dtype]
        if args.block_size:
            argv += ["--block-size", str(args.block_size)]
        if args.max_model_len:
            argv += ["--max-model-len", str(args.max_model_len)]
        if args.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
        return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)

    try:
        return make(args.tp), None
    except Exception as err:  # reported, then the workaround
        if args.tp == 1:
            raise
        refusal = f"{type(err).__name__}: {err}".splitlines()[0]
    import dataclasses

    from vllm.config import ParallelConfig

    config = make(1)
    old = config.parallel_config
    kwargs = {f.name: getattr(old, f.name) for f in dataclasses.fields(old)
              if f.init and f.name != "world_size"}  # world_size is derived (TP x PP)
    config.parallel_config = ParallelConfig(**{**kwargs, "tensor_parallel_size": args.tp})
    return config, (f"create_engine_config refused TP {args.tp} ({refusal}); built at TP 1 and "
                    f"replaced parallel_config by ParallelConfig(tensor_parallel_size={args.tp})")


def layer_specs(vllm_config) -> tuple[dict, list, list[dict]]:
    """{layer name: spec} of one rank, the layers' backends, and a per-layer summary."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    hf = model_config.hf_text_config
    arch = (model_config.architectures or [""])[0]
    cache_dtype = cache_config.cache_dtype
    act_dtype = model_config.dtype
    start, end = model_config.get_layers_start_end_indices(parallel_config)
    window_of = LAYER_WINDOW.get(arch, lambda hf, i: None)

    specs, backends, summary = {}, [], []
    for i in range(start, end):
        if model_config.use_mla:
            head_size = model_config.get_head_size()  # kv_lora_rank + qk_rope_head_dim
            num_heads = model_config.get_num_attention_heads(parallel_config)
            backend = get_attn_backend(head_size, act_dtype, cache_dtype, use_mla=True,
                                       use_sparse=False, num_heads=num_heads)
            layer = SimpleNamespace(kv_cache_dtype=cache_dtype, head_size=head_size, sliding_window=None,
                                    indexer=None, non_causal_multi_token_decode=False,
                                    attn_backend=backend)
            spec = MLAAttention.get_kv_cache_spec(layer, vllm_config)
            name = f"model.layers.{i}.self_attn.mla_attn"
        else:
            window = window_of(hf, i)
            if window is None:
                window = cache_config.sliding_window
            head_size = model_config.get_head_size()
            num_kv_heads = model_config.get_num_kv_heads(parallel_config)
            backend = get_attn_backend(head_size, act_dtype, cache_dtype, use_mla=False,
                                       has_sink=arch in SINKS, attn_type=AttentionType.DECODER,
                                       has_sliding_window=window is not None)
            layer = SimpleNamespace(
                attn_type=AttentionType.DECODER, kv_cache_dtype=cache_dtype, sliding_window=window,
                attn_backend=backend, num_kv_heads=num_kv_heads, head_size=head_size,
                head_size_v=head_size, kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_config))
            spec = Attention.get_kv_cache_spec(layer, vllm_config)
            name = f"model.layers.{i}.self_attn.attn"
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(backend, spec)  # as GPUModelRunner.get_kv_cache_spec
        specs[name] = spec
        backends.append(backend)
        summary.append(spec_summary(name, spec, backend))
    return specs, backends, summary


def spec_summary(name, spec, backend=None) -> dict:
    out = {"kind": type(spec).__name__, "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes}
    if name:
        out = {"layer": name, **out}
    for key in ("num_kv_heads", "head_size", "head_size_v", "sliding_window"):
        value = getattr(spec, key, None)
        if value is not None:
            out[key] = value
    if getattr(spec, "dtype", None) is not None:
        out["dtype"] = str(spec.dtype).removeprefix("torch.")
    if backend is not None:
        out["backend"] = backend.get_name()
    return out


def size(vllm_config, specs: dict, backends: list, available_bytes: int) -> dict:
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import (
        _pool_bytes_per_block,
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    parallel_config = vllm_config.parallel_config
    workers = parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size
    register_all_kvcache_specs(vllm_config)
    per_worker = [dict(specs) for _ in range(workers)]
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [layouts] * workers, list(specs.values()))
    record_kv_cache_layout(vllm_config.cache_config, layout.name)
    configs = get_kv_cache_configs(vllm_config, per_worker, [available_bytes] * workers)
    scheduler = generate_scheduler_kv_cache_config(configs)
    groups = scheduler.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    tokens, concurrency = get_kv_cache_capacity(vllm_config, scheduler)
    worker_groups = configs[0].kv_cache_groups
    return {
        "num_blocks": scheduler.num_blocks,
        "num_blocks_per_worker": [c.num_blocks for c in configs],
        "kv_cache_layout": layout.name,
        "block_size": block_size,
        "groups": [{
            "layers": len(g.layer_names),
            **spec_summary(None, g.kv_cache_spec),
            "uniform_type": isinstance(w.kv_cache_spec, UniformTypeKVCacheSpecs),
            "max_memory_usage_bytes": g.kv_cache_spec.max_memory_usage_bytes(vllm_config),
        } for g, w in zip(groups, worker_groups)],
        # one block of every group's layers: available bytes // this is num_blocks (groups alias one pool)
        "bytes_per_block": _pool_bytes_per_block(vllm_config, worker_groups),
        "kv_cache_tensors": [{"layers": len(t.layers), "size": t.size, "offset": t.offset}
                             for t in configs[0].kv_cache_tensors],
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, scheduler),
        "max_concurrency_worker": get_max_concurrency_for_kv_cache_config(vllm_config, configs[0]),
        "kv_cache_tokens": tokens,
        "logged_max_concurrency": round(concurrency, 2),
        "max_model_len": vllm_config.model_config.max_model_len,
    }


def probe(args) -> dict:
    from vllm.config import set_current_vllm_config

    vllm_config, workaround = build_vllm_config(args)
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    out = {
        "model_dir": args.model_dir,
        "architecture": (model_config.architectures or [""])[0],
        "tp": parallel_config.tensor_parallel_size,
        "tp_workaround": workaround,
        "use_mla": bool(model_config.use_mla),
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "total_num_kv_heads": model_config.get_total_num_kv_heads(),
        "head_size": model_config.get_head_size(),
        "num_layers": model_config.get_num_layers(parallel_config),
        "sliding_window": model_config.get_sliding_window(),
        "cache_config_sliding_window": cache_config.sliding_window,
        "cache_dtype": cache_config.cache_dtype,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "config_block_size": cache_config.block_size,
        "user_specified_block_size": bool(cache_config.user_specified_block_size),
        "max_model_len": model_config.max_model_len,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
        "enable_prefix_caching": cache_config.enable_prefix_caching,
        "available_bytes": args.available_bytes,
    }
    with set_current_vllm_config(vllm_config):
        specs, backends, summary = layer_specs(vllm_config)
        out["layer_specs"] = summary
        try:
            out.update(size(vllm_config, specs, backends, args.available_bytes))
        except Exception as err:  # noqa: BLE001 - vLLM's refusal (too little memory...) is the answer
            out["error"] = f"{type(err).__name__}: {err}"
            out["traceback"] = traceback.format_exc(limit=6)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--available-bytes", type=int, default=GIB)
    return p


def _probe_printed(args) -> int:
    """One probe, its JSON line printed; 1 where it sized nothing."""
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the one JSON line
    try:
        out = probe(args)
    except Exception as err:  # noqa: BLE001
        out = {"model_dir": args.model_dir, "error": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc(limit=8)}
    finally:
        sys.stdout = real_stdout
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out and "num_blocks" not in out and "layer_specs" not in out else 0


def main(argv=None) -> int:
    """One probe from the arguments, or with `--batch JSON` (a list of argument lists) one per entry, a
    JSON line each, in order: vLLM is imported once for them all."""
    argv = sys.argv[1:] if argv is None else argv
    batch = json.loads(argv[1]) if argv[:1] == ["--batch"] else [argv]
    return max(_probe_printed(_parser().parse_args(each)) for each in batch)


if __name__ == "__main__":
    sys.exit(main())
