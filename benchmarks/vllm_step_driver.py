#!/usr/bin/env python3
"""Drive vLLM's real V1 Scheduler + KVCacheManager on step traces, no model, and
record every step's decisions. Run it with the python of a venv that has vLLM:

    .venv-vllm/bin/python benchmarks/vllm_step_driver.py --traces in.jsonl --out out.jsonl
    .venv-vllm/bin/python benchmarks/vllm_step_driver.py            # JSONL stdin -> stdout

One trace per input line, one result per output line (flushed, so a caller can
hold one process open and send traces one at a time: vLLM's import takes seconds).

Trace:
    {"name": str,
     "config": {"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "long_prefill_token_threshold", "enable_chunked_prefill",
                "enable_prefix_caching"},
     "requests": [{"request_id", "prompt_token_ids", "max_tokens", "arrival_step"}],
     "aborts": [{"step", "request_id"}],
     "timing": bool}                      # also record schedule() ns and len(running)

A step: the requests arriving at it are added, its aborts applied (one
finish_requests call per id, in trace order), schedule(), then one token for every
request whose prefill is done (ignore_eos), update_from_output(). The trace ends
when every request has arrived and none is unfinished (or at max_steps).

Result:
    {"name": str, "steps": [step records], "prefix_cache": {requests, queries, hits,
     preempted_requests, preempted_queries, preempted_hits}, "schedule_ns": [...],
     "running": [...]}  or {"name": str, "error": str}
A step record:
    {"scheduled": [[request_id, num_tokens], ...],  # in the scheduler's order
     "preempted": [request_id, ...],                 # sorted
     "finished": [request_id, ...],                  # stopped by update_from_output, in order
     "hits": [[request_id, prefix_hit_tokens], ...]} # admitted from waiting this step
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# Just enough of an HF config for ModelConfig; no weights are ever read.
FAKE_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "max_position_embeddings": 65536, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}
FAKE_TOKEN = 7  # any non-EOS id; ignore_eos anyway
PREFIX_KEYS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
               "preempted_hits")


def write_fake_model(path: str) -> str:
    """The fake model's config.json in the folder `path`; returns `path`."""
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(FAKE_MODEL_CONFIG, f)
    return path


def build_scheduler(cfg: dict, model_dir: str):
    """vLLM's Scheduler on the CPU: an explicit cpu DeviceConfig (no device to infer),
    one full-attention group (or the trace's kv_groups: full and sliding-window layers) with no
    tensors, a pool of exactly num_blocks."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs, num_blocks = cfg["block_size"], cfg["num_blocks"]
    mc = ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True,
                     max_model_len=cfg["max_model_len"])
    sc = SchedulerConfig(max_num_seqs=cfg["max_num_seqs"],
                         max_num_batched_tokens=cfg["max_num_batched_tokens"],
                         max_model_len=cfg["max_model_len"], is_encoder_decoder=False,
                         enable_chunked_prefill=cfg.get("enable_chunked_prefill", True),
                         long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
                         async_scheduling=False)
    cc = CacheConfig(block_size=bs, enable_prefix_caching=cfg.get("enable_prefix_caching", True))
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                    device_config=DeviceConfig(device="cpu"))
    groups = cfg.get("kv_groups") or {"kinds": ["full"]}
    specs = [FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float16) if kind == "full"
             else SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float16,
                                    sliding_window=groups["window"])
             for kind in groups["kinds"]]
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)])
    vc.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=bs, hash_block_size=bs, log_stats=True)
    # The engine core's knobs must have reached the scheduler as given.
    assert sched.scheduler_config.enable_chunked_prefill == cfg.get("enable_chunked_prefill", True)
    assert sched.cache_config.enable_prefix_caching == cfg.get("enable_prefix_caching", True)
    return sched, block_hasher(vc, bs)


def block_hasher(vc, block_size: int):
    """What EngineCore gives each request for prefix caching."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(block_size, fn)


def make_request(item: dict, hasher):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    sp = SamplingParams(max_tokens=int(item["max_tokens"]), ignore_eos=True, temperature=0.0)
    return Request(request_id=str(item["request_id"]), prompt_token_ids=list(item["prompt_token_ids"]),
                   sampling_params=sp, pooling_params=None, block_hasher=hasher)


def run_trace(trace: dict, model_dir: str, max_steps: int) -> dict:
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    sched, hasher = build_scheduler(trace["config"], model_dir)
    timing = bool(trace.get("timing"))
    pending = sorted(trace["requests"], key=lambda r: r.get("arrival_step", 0))
    aborts: dict[int, list[str]] = {}
    for a in trace.get("aborts", ()):
        aborts.setdefault(int(a["step"]), []).append(str(a["request_id"]))
    prefix = dict.fromkeys(PREFIX_KEYS, 0)
    steps, schedule_ns, running = [], [], []
    pi = step = 0
    while True:
        while pi < len(pending) and pending[pi].get("arrival_step", 0) <= step:
            sched.add_request(make_request(pending[pi], hasher))
            pi += 1
        for rid in aborts.get(step, ()):
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        if pi >= len(pending) and not sched.has_unfinished_requests():
            break
        if step >= max_steps:
            return {"name": trace.get("name"), "error": f"still running at max_steps={max_steps}"}
        waiting = {r.request_id for q in (sched.waiting, getattr(sched, "kv_holding_waiting", ())) for r in q}
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        if timing:
            schedule_ns.append(time.perf_counter_ns() - t0)
            running.append(len(sched.running))
        req_ids = list(so.num_scheduled_tokens)
        sampled, hits = [], []
        for rid in req_ids:
            req = sched.requests[rid]
            # num_computed_tokens already counts this step's tokens
            sampled.append([FAKE_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
            if rid in waiting:
                hits.append([rid, req.num_computed_tokens - so.num_scheduled_tokens[rid]])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        finished = []
        for eco in sched.update_from_output(so, mro).values():
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                for k in PREFIX_KEYS:
                    prefix[k] += getattr(stats.prefix_cache_stats, k)
            finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        steps.append({"scheduled": [[rid, so.num_scheduled_tokens[rid]] for rid in req_ids],
                      "preempted": sorted(so.preempted_req_ids), "finished": finished, "hits": hits})
        step += 1
    out = {"name": trace.get("name"), "steps": steps, "prefix_cache": prefix}
    if timing:
        out["schedule_ns"], out["running"] = schedule_ns, running
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", help="JSONL of traces (default: stdin)")
    ap.add_argument("--out", help="JSONL of results (default: stdout)")
    ap.add_argument("--max-steps", type=int, default=100000)
    args = ap.parse_args(argv)
    # vLLM may log to stdout: results get the real stdout, everything else goes to stderr.
    results = open(args.out, "w") if args.out else os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm  # noqa: F401  (pay the import before the first trace)
    source = open(args.traces) if args.traces else sys.stdin
    with tempfile.TemporaryDirectory(prefix="kvt_fake_model_") as folder:
        model_dir = write_fake_model(folder)
        for line in source:
            if not line.strip():
                continue
            trace = json.loads(line)
            try:
                res = run_trace(trace, model_dir, args.max_steps)
            except Exception as err:  # one bad trace must not lose the batch
                res = {"name": trace.get("name"), "error": f"{err!r}\n{traceback.format_exc()[-2000:]}"}
            results.write(json.dumps(res, separators=(",", ":")) + "\n")
            results.flush()
    results.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
