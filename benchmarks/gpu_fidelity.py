#!/usr/bin/env python3
"""How well the uncalibrated simulator predicts real GPUs: public measurements, row by row.

Two kinds of rows, both public and shipped under benchmarks/data/ with their sources:

* per-operation (benchmarks/data/vidur/linear_ops.csv, Vidur's profiles of A100 and H100): one
  decoder layer's linear and elementwise operations at each token count and tensor-parallel size,
  times the model's layers (+ the embedding gather), against the simulator's step of that many
  tokens with no context, no sampling, no overheads and no all-reduce (those are priced from their
  own measured table), i.e. the part of the roofline these operations are;
* end-to-end (benchmarks/data/gpu_e2e/measurements.csv): a served model's mean TTFT and TPOT at a
  concurrency, or with every request at t=0, against `SimTarget` replaying the same fixed-length
  requests as a closed or open loop on the device preset; and vLLM's offline latency benchmark, one
  fixed batch's end-to-end latency (tensor parallelism and MoE on an H200).

`--fit` refits the kernel efficiencies (memory_efficiency, layer_overhead_s, compute_efficiency per GPU
generation)
to the per-operation rows of the FIT_MODELS only, and writes engine/kvengine/executor/data/
gpu_efficiency.json; every error printed is on the other models (held out whole) and on the
end-to-end rows, which no fit sees. Prints the median and p90 of |error| per model and device, and
the rows it could not represent, with why. `--json` ends with ttft_median_abs_err,
tpot_median_abs_err, latency_median_abs_err, op_median_abs_err, rows, unrepresentable. Goals: TPOT median |error| <= 15 %,
TTFT <= 25 %.

    python benchmarks/gpu_fidelity.py [--fit] [--json]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from kvengine.config import EngineConfig, ModelSpec, device_preset, model_preset
from kvengine.executor.cost import DATA, CostCoefficients, StepCost, StepShape, device_coefficients
from kvtune.targets import SimTarget, TargetStartError
from kvtune.workload import TraceRequest, Workload

ROOT = Path(__file__).resolve().parents[1]
OPS_CSV = ROOT / "benchmarks/data/vidur/linear_ops.csv"
E2E_CSV = ROOT / "benchmarks/data/gpu_e2e/measurements.csv"
DEVICES = {"h100": "h100-80gb", "a100": "a100-80gb"}
KERNELS = {"h100": "hopper", "a100": "ampere"}
LAYERS = {"meta-llama/Llama-2-7b-hf": 32, "meta-llama/Llama-2-70b-hf": 80, "codellama/CodeLlama-34b-Instruct-hf": 48,
          "internlm/internlm-20b": 60, "Qwen/Qwen-72B": 80, "microsoft/phi-2": 32, "meta-llama/Meta-Llama-3-8B": 32,
          "meta-llama/Meta-Llama-3-70B": 80}
# The models whose per-operation rows the fit sees; the rest are held out whole.
FIT_MODELS = ("meta-llama/Llama-2-7b-hf", "codellama/CodeLlama-34b-Instruct-hf", "Qwen/Qwen-72B")
PRESETS = {"Qwen/Qwen3-32B": "qwen3-32b", "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
           "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
           "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b"}
# vLLM's offline latency benchmark: a fixed batch sent at once, its end-to-end latency in the notes
BATCH_LATENCY = re.compile(r"end-to-end batch latency mean ([0-9.]+) ms")


def op_rows(device: str | None = None):
    """(row, measured seconds, ModelSpec of Vidur's shape or the reason there is none)."""
    with open(OPS_CSV) as f:
        for r in csv.DictReader(f):
            if device and r["device"] != device:
                continue
            layer = sum(float(r[f"{op}_ms"]) for op in ("input_layernorm", "attn_pre_proj", "attn_rope",
                                                         "attn_post_proj", "post_attention_layernorm",
                                                         "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
                        if r[f"{op}_ms"])
            measured = (LAYERS[r["model"]] * layer + float(r["emb_ms"])) / 1e3
            yield r, measured, vidur_model(r)


def vidur_model(r: dict) -> ModelSpec | str:
    if r["use_gated_mlp"] != "True":
        return "a non-gated MLP (GELU, two matrices): kvengine's ModelSpec has gated (SwiGLU) MLPs only"
    heads, hidden = int(r["n_head"]), int(r["n_embd"])
    # vocab 1: Vidur's rows hold no lm_head, whose read the step would otherwise add
    return ModelSpec(r["model"], LAYERS[r["model"]], hidden, heads, int(r["n_kv_head"]), hidden // heads,
                     int(r["n_expanded_embd"]), 1, 4096, dtype="float16")


def op_predicted(model: ModelSpec, device_key: str, tp: int, tokens: int, coeffs: CostCoefficients) -> float:
    shard = dataclasses.replace(model.tp_shard(tp), tensor_parallel_size=1)  # no all-reduce: not in these rows
    bare = dataclasses.replace(coeffs, step_overhead_s=0.0, per_seq_overhead_s=0.0)  # the layers' floor stays
    cost = StepCost.build(shard, device_preset(DEVICES[device_key]), "auto", 16, bare)
    return cost.step_time(StepShape(num_tokens=tokens, num_seqs=1, context_tokens=0, attention_token_pairs=0,
                                    num_samples=0))


# Each efficiency from the regime it governs: the memory one where a step of so few tokens only
# reads the weights, the compute one where so many make the GEMMs compute-bound (on either GPU).
MEMORY_BOUND_TOKENS, COMPUTE_BOUND_TOKENS = 16, 2048
# Prefill attention is not in Vidur's public profiles; its share of peak is the flash-attention
# kernels' published one: FlashAttention-2 (Dao, 2023, fig. 4: causal forward, head dim 128, 16k keys,
# about 190 of A100's 312 TFLOP/s) and FlashAttention-3 (Shah et al., 2024, fig. 5: causal BF16
# forward, head dim 128, 16k keys, about 600 of H100's 989 TFLOP/s).
ATTENTION_EFFICIENCY = {"a100": 0.6, "h100": 0.6}


def fit(device_key: str) -> dict:
    """Memory efficiency and the layers' kernel floor from the memory-bound rows of FIT_MODELS (the
    models' different weights per layer tell them apart), then compute efficiency from the
    compute-bound ones; each minimising the squared log error over a grid."""
    rows = [(r, m, spec) for r, m, spec in op_rows(device_key)
            if r["model"] in FIT_MODELS and not isinstance(spec, str)]

    def best(grid: dict, fixed: dict, keep) -> dict:
        chosen = [(spec, int(r["tensor_parallel_size"]), int(r["num_tokens"]), m) for r, m, spec in rows
                  if keep(int(r["num_tokens"]))]
        loss = lambda c: sum(math.log(op_predicted(spec, device_key, tp, n, c) / m) ** 2  # noqa: E731
                             for spec, tp, n, m in chosen)
        names = list(grid)
        points = [dict(zip(names, values)) for values in itertools.product(*grid.values())]
        return min(points, key=lambda p: loss(CostCoefficients(**fixed, **p)))

    shares = [round(float(v), 2) for v in np.arange(0.30, 1.001, 0.01)]
    floors = [round(float(v), 7) for v in np.arange(0.0, 40.01e-6, 1e-6)]
    memory = best({"memory_efficiency": shares, "layer_overhead_s": floors}, {"compute_efficiency": 1.0},
                  lambda n: n <= MEMORY_BOUND_TOKENS)
    compute = best({"compute_efficiency": shares}, memory, lambda n: n >= COMPUTE_BOUND_TOKENS)
    return {"coefficients": memory | compute | {"attention_efficiency": ATTENTION_EFFICIENCY[device_key]},
            "fitted_to": f"Vidur per-operation profiles on {device_key.upper()}: {', '.join(FIT_MODELS)}; memory "
                         f"efficiency and the layers' kernel floor on <= {MEMORY_BOUND_TOKENS} tokens, compute "
                         f"efficiency on >= {COMPUTE_BOUND_TOKENS}; attention efficiency from the flash-attention "
                         f"papers (benchmarks/gpu_fidelity.py)"}


def write_fit() -> None:
    kernels = {KERNELS[d]: fit(d) for d in DEVICES}
    doc = {"source": "microsoft/vidur data/profiling/compute (MIT licence), see benchmarks/data/vidur/SOURCES.md",
           "written_by": "benchmarks/gpu_fidelity.py --fit",
           "notes": "hopper: fitted on H100, used for H100, H200 and B200 (B200 unmeasured); ampere: fitted on "
                    "A100, used for A100, A10, L40S and L4 (the last three unmeasured). Attention, step and "
                    "per-sequence overheads keep CostCoefficients' defaults (no public per-step measurement of "
                    "vLLM V1's CPU time was found); Vidur's attention profiles are not in its public repository, "
                    "so prefill attention takes the flash-attention papers' share of peak.",
           "kernels": kernels}
    (DATA / "gpu_efficiency.json").write_text(json.dumps(doc, indent=2) + "\n")
    device_coefficients.cache_clear()
    print(f"wrote {DATA / 'gpu_efficiency.json'}: " + json.dumps({k: v["coefficients"] for k, v in kernels.items()}))


def e2e_rows():
    with open(E2E_CSV) as f:
        yield from csv.DictReader(f)


def e2e_reason(r: dict) -> str | None:
    """Why a measurement cannot be replayed on the simulator, or None."""
    if not r["engine"].startswith("vllm"):
        return f"engine {r['engine']!r}: not vLLM"
    if r["model"] not in PRESETS:
        return f"no shipped config.json of {r['model']}"
    if r["gpu"] not in ("h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "b200-180gb", "l40s-48gb", "l4-24gb"):
        return f"no device preset for {r['gpu']}"
    if not (r["ttft_mean_ms"] or r["ttft_median_ms"] or BATCH_LATENCY.search(r["notes"])):
        return "no TTFT, TPOT or batch latency given"
    if r["request_rate"] not in ("", "inf"):
        return "an open-loop Poisson rate: one seed's arrivals, not reproducible row by row"
    return None


def e2e_predicted(r: dict) -> dict:
    batch = BATCH_LATENCY.search(r["notes"])  # one batch of max_concurrency requests
    n = int(r["max_concurrency"]) if batch else int(r["num_prompts"]) if r["num_prompts"] else 10 * int(r["max_concurrency"])
    requests = [TraceRequest(0.0, int(r["input_len"]), int(r["output_len"]), hash_ids=tuple(range(i * 10**6, i * 10**6
                                                                                                  + 1)))
                for i in range(n)]
    workload = Workload(requests, hash_block_size=10**6).closed_loop(int(r["max_concurrency"]) if r["max_concurrency"]
                                                                     else None)
    config = EngineConfig(tensor_parallel_size=int(r["tensor_parallel_size"] or 1),
                          kv_cache_dtype="fp8" if r["kv_cache_dtype"] == "fp8" else "auto")
    result = SimTarget(model_preset(PRESETS[r["model"]]), device_preset(r["gpu"])).run(config, workload)
    return result.summary


def rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="refit the kernel efficiencies first (writes gpu_efficiency.json)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.fit:
        write_fit()
    unrepresentable, op_errs = [], defaultdict(list)
    for r, measured, spec in op_rows():
        if isinstance(spec, str):
            unrepresentable.append(f"per-op {r['device']} {r['model']} tp{r['tensor_parallel_size']} "
                                   f"{r['num_tokens']} tokens: {spec}")
            continue
        if r["model"] in FIT_MODELS:
            continue
        c = device_coefficients(device_preset(DEVICES[r["device"]]))
        pred = op_predicted(spec, r["device"], int(r["tensor_parallel_size"]), int(r["num_tokens"]), c)
        op_errs[(r["model"], r["device"])].append(rel(pred, measured))
    print("per-operation rows, held-out models (decoder layers' linear and elementwise ops per step):")
    print(f"{'model':40} {'device':6} {'rows':>5} {'median |err|':>13} {'p90 |err|':>10}")
    for (model, device), errs in sorted(op_errs.items()):
        print(f"{model:40} {device:6} {len(errs):5d} {np.median(errs):13.1%} {np.quantile(errs, 0.9):10.1%}")
    ttft_errs, tpot_errs, latency_errs, e2e = [], [], [], []
    print("\nend-to-end rows (TTFT and TPOT means, ms):")
    print(f"{'source':28} {'model':24} {'gpu':10} {'tp':>2} {'in/out':>11} {'conc':>5} "
          f"{'TTFT meas':>10} {'sim':>10} {'TPOT meas':>9} {'sim':>7}")
    for r in e2e_rows():
        why = e2e_reason(r)
        if why:
            unrepresentable.append(f"e2e {r['source_id']} {r['model']} {r['input_len']}/{r['output_len']}: {why}")
            continue
        try:
            s = e2e_predicted(r)
        except TargetStartError as err:  # vLLM refuses the same config at start-up (the same memory rule)
            unrepresentable.append(f"e2e {r['source_id']} {r['model']} {r['input_len']}/{r['output_len']}: "
                                   f"does not start at TP {r['tensor_parallel_size']} on {r['gpu']}: {str(err)[:120]}")
            continue
        batch = BATCH_LATENCY.search(r["notes"])
        if batch:  # the offline latency benchmark: one batch's end-to-end latency
            latency_errs.append(rel(s["e2e_mean"], float(batch.group(1)) / 1e3))
            e2e.append({"source": r["source_id"], "model": r["model"], "gpu": r["gpu"], "batch": r["max_concurrency"],
                        "latency_measured": float(batch.group(1)) / 1e3, "latency_sim": s["e2e_mean"]})
            print(f"{r['source_id'][:28]:28} {r['model'][-24:]:24} {r['gpu']:10} {r['tensor_parallel_size']:>2} "
                  f"{r['input_len'] + '/' + r['output_len']:>11} {r['max_concurrency']:>5}  batch latency "
                  f"{float(batch.group(1)):.1f} ms, sim {s['e2e_mean'] * 1e3:.1f} ms")
            continue
        ttft_meas = float(r["ttft_mean_ms"] or r["ttft_median_ms"]) / 1e3
        ttft_pred = s["ttft_mean"] if r["ttft_mean_ms"] else s["ttft_p50"]
        tpot_meas = float(r["tpot_mean_ms"] or r["tpot_median_ms"] or "nan") / 1e3
        tpot_meas = None if math.isnan(tpot_meas) else tpot_meas
        tpot_pred = s["tpot_mean"] if r["tpot_mean_ms"] else s["tpot_p50"]
        ttft_errs.append(rel(ttft_pred, ttft_meas))
        if tpot_meas:
            tpot_errs.append(rel(tpot_pred, tpot_meas))
        e2e.append({"source": r["source_id"], "model": r["model"], "gpu": r["gpu"], "input_len": int(r["input_len"]),
                    "output_len": int(r["output_len"]), "ttft_measured": ttft_meas, "ttft_sim": ttft_pred,
                    "tpot_measured": tpot_meas, "tpot_sim": tpot_pred})
        tpot_text = f"{tpot_meas * 1e3:9.1f} {tpot_pred * 1e3:7.1f}" if tpot_meas else f"{'-':>9} {tpot_pred * 1e3:7.1f}"
        print(f"{r['source_id'][:28]:28} {r['model'][-24:]:24} {r['gpu']:10} {r['tensor_parallel_size']:>2} "
              f"{r['input_len'] + '/' + r['output_len']:>11} {r['max_concurrency'] or 'all':>5} "
              f"{ttft_meas * 1e3:10.1f} {ttft_pred * 1e3:10.1f} {tpot_text}")
    by = defaultdict(lambda: defaultdict(list))
    for row in e2e:
        for name in ("ttft", "tpot", "latency"):
            if row.get(f"{name}_measured"):
                by[(row["model"], row["gpu"])][name].append(rel(row[f"{name}_sim"], row[f"{name}_measured"]))
    print(f"\n{'model':40} {'gpu':10} " + " ".join(f"{n + ' median/p90 |err|':>26}" for n in ("TTFT", "TPOT", "latency")))
    for (model, gpu), errs in sorted(by.items()):
        cells = [f"{np.median(errs[n]):12.1%} {np.quantile(errs[n], 0.9):6.1%} ({len(errs[n])})" if errs[n]
                 else f"{'-':>26}" for n in ("ttft", "tpot", "latency")]
        print(f"{model:40} {gpu:10} " + " ".join(f"{c:>26}" for c in cells))
    print(f"\nunrepresentable rows ({len(unrepresentable)}):")
    for line in dict.fromkeys(u.split(" tp")[0] + (": " + u.split(": ", 1)[1] if " tp" in u else "")
                              if u.startswith("per-op") else u for u in unrepresentable):
        print(f"  {line}")
    op_all = [e for errs in op_errs.values() for e in errs]
    out = {"ttft_median_abs_err": float(np.median(ttft_errs)) if ttft_errs else None,
           "tpot_median_abs_err": float(np.median(tpot_errs)) if tpot_errs else None,
           "ttft_p90_abs_err": float(np.quantile(ttft_errs, 0.9)) if ttft_errs else None,
           "tpot_p90_abs_err": float(np.quantile(tpot_errs, 0.9)) if tpot_errs else None,
           "latency_median_abs_err": float(np.median(latency_errs)) if latency_errs else None,
           "op_median_abs_err": float(np.median(op_all)), "op_p90_abs_err": float(np.quantile(op_all, 0.9)),
           "op_by_model": {f"{m} {d}": float(np.median(e)) for (m, d), e in sorted(op_errs.items())},
           "rows": len(op_all) + len(e2e), "e2e_rows": e2e, "unrepresentable": unrepresentable}
    print(f"\nper-op median |err| {out['op_median_abs_err']:.1%} (p90 {out['op_p90_abs_err']:.1%}); "
          f"TTFT median |err| {out['ttft_median_abs_err']:.1%}, TPOT {out['tpot_median_abs_err']:.1%}, "
          f"batch latency {out['latency_median_abs_err']:.1%} "
          f"(goals: TPOT <= 15 %, TTFT <= 25 %)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
