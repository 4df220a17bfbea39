#!/usr/bin/env python3
"""kvengine's continuous batching against Hugging Face transformers' generate(), on the CPU.

The same random `tiny` Llama (4 layers, hidden 256, GQA 8/2, vocab 32000,
float32) runs 32 concurrent greedy requests (prompt 128, output 128 tokens):
  - kvengine: all requests added at once, stepped to the end (paged KV,
    chunked prefill under max_num_batched_tokens, batched decode);
  - HF sequential: model.generate() one request at a time;
  - HF batched: one generate() over the whole (padded) batch.
One torch thread throughout. Output tokens per second of each, the ratios, the
share of kvengine's tokens equal to HF's (both greedy, same weights), then the
same kvengine measurement for block sizes 8/16/32/64 and each kv_cache_dtype.

    python benchmarks/engine_vs_hf.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from kvengine.engine.clock import VirtualClock
from kvengine.config import EngineConfig, model_preset
from kvengine.model.llama import random_state_dict
from kvengine.core.request import SamplingParams
from kvengine.engine.torch_engine import build_torch_engine


def hf_model(spec, weights):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                      intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                      num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
                      rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                      tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(weights, strict=False)
    model.generation_config.eos_token_id = None  # run every request to its full length
    return model


def hf_generate(model, prompts: list[list[int]], output: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output,
                             min_new_tokens=output, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def run_kvengine(prompts, output, seed, repeat=1, **config) -> tuple[float, list[list[int]], dict]:
    """Best of `repeat` runs, each on a fresh engine (a second run on the same one
    would hit the prefix cache); engine start-up and a warm-up request not timed."""
    best = None
    for _ in range(repeat):
        engine = build_torch_engine(EngineConfig(**config), preset="tiny", seed=seed,
                                    clock=VirtualClock())
        sp = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
        engine.add_request("warmup", prompts[0][:16], SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        start = time.perf_counter()
        reqs = [engine.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        tok_s = sum(r.num_output_tokens for r in reqs) / (time.perf_counter() - start)
        if best is None or tok_s > best[0]:
            info = {"steps": steps, "num_gpu_blocks": engine.memory.num_gpu_blocks,
                    "kv_payload_bytes": engine.executor.kv_cache_bytes,
                    "kv_scale_bytes": engine.executor.kv_scale_bytes}
            best = (tok_s, [r.output_token_ids for r in reqs], info)
    return best


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two greedy runs agree, up to each pair's first difference."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same, total = same + n, total + len(x)
    return same / total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--hf-sequential", type=int, default=8, metavar="N",
                   help="time HF one-at-a-time on the first N requests; its tok/s does not "
                        "depend on N (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=2,
                   help="best of this many timed runs for kvengine and HF batched (default: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sweep", action="store_true", help="skip the block-size and dtype table")
    p.add_argument("--quick", action="store_true", help="8 requests of 32+32 tokens: a smoke run")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt, args.output, args.repeat = 8, 32, 32, 1
    torch.set_num_threads(1)
    spec = model_preset("tiny")
    weights = random_state_dict(spec, args.seed)
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, spec.vocab_size, (args.prompt,), generator=gen).tolist()
               for _ in range(args.requests)]
    n_out = args.requests * args.output
    print(f"tiny Llama ({spec.num_params / 1e6:.1f}M params, float32), {args.requests} requests x "
          f"(prompt {args.prompt} + output {args.output}), CPU, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}")

    hf = hf_model(spec, weights)
    hf_generate(hf, [prompts[0][:16]], 4)  # warm-up
    hf_batched = 0.0
    for _ in range(args.repeat):
        t = time.perf_counter()
        hf_out = hf_generate(hf, prompts, args.output)
        hf_batched = max(hf_batched, n_out / (time.perf_counter() - t))
    n_seq = min(args.hf_sequential or args.requests, args.requests)
    t = time.perf_counter()
    for prompt in prompts[:n_seq]:
        hf_generate(hf, [prompt], args.output)
    hf_seq = n_seq * args.output / (time.perf_counter() - t)
    del hf

    kv_tok_s, kv_out, info = run_kvengine(prompts, args.output, args.seed, args.repeat)
    agree = agreement(kv_out, hf_out)
    result = {
        "kvengine_tok_s": round(kv_tok_s, 1),
        "hf_sequential_tok_s": round(hf_seq, 1),
        "hf_batched_tok_s": round(hf_batched, 1),
        "ratio_vs_hf_batched": round(kv_tok_s / hf_batched, 2),
        "ratio_vs_hf_sequential": round(kv_tok_s / hf_seq, 2),
        "greedy_agreement_vs_hf": round(agree, 4),
        "requests": args.requests, "prompt_tokens": args.prompt, "output_tokens": args.output,
        "kvengine_steps": info["steps"], "repeat": args.repeat,
    }
    print(f"\n{'run':34}{'tok/s':>10}{'kvengine x':>12}")
    print(f"{'kvengine (bs 16, auto)':34}{kv_tok_s:>10.0f}{1.0:>12.2f}")
    print(f"{'HF generate, batched (padded)':34}{hf_batched:>10.0f}{kv_tok_s / hf_batched:>12.2f}")
    print(f"{f'HF generate, one at a time ({n_seq})':34}{hf_seq:>10.0f}{kv_tok_s / hf_seq:>12.2f}")
    print(f"kvengine's greedy tokens equal to HF's (up to the first difference): {agree:.1%}")

    if not args.no_sweep:
        rows = []
        for label, cfg in ([(f"block_size {bs}", {"block_size": bs}) for bs in (8, 16, 32, 64)]
                           + [(f"kv_cache_dtype {d}", {"kv_cache_dtype": d})
                              for d in ("auto", "fp8", "fp8_e5m2", "int8")]):
            tok_s, out, info = run_kvengine(prompts, args.output, args.seed, **cfg)
            rows.append({"config": label, "tok_s": round(tok_s, 1),
                         "greedy_agreement_vs_hf": round(agreement(out, hf_out), 4),
                         "kv_bytes_per_token": info["kv_payload_bytes"] // (
                             info["num_gpu_blocks"] * cfg.get("block_size", 16)),
                         "scale_bytes_per_token": info["kv_scale_bytes"] // (
                             info["num_gpu_blocks"] * cfg.get("block_size", 16))})
        print(f"\n{'kvengine config':24}{'tok/s':>9}{'vs HF batched':>15}{'KV B/token':>12}"
              f"{'+scales':>9}{'= HF greedy':>13}")
        for r in rows:
            print(f"{r['config']:24}{r['tok_s']:>9.0f}{r['tok_s'] / hf_batched:>15.2f}"
                  f"{r['kv_bytes_per_token']:>12}{r['scale_bytes_per_token']:>9}"
                  f"{r['greedy_agreement_vs_hf']:>13.1%}")
        result["sweep"] = rows
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
