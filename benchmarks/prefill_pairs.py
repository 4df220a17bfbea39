#!/usr/bin/env python3
"""Which attention pair count explains the torch executor's prefill times on this CPU.

Times prefill steps of the bundled engine's torch executor (tiny, cpu, no HTTP) for
n new tokens after c cached ones (a prefix hit), every case interleaved with the
others and repeated, and fits time = a + b * n + k * pairs by least squares of the
relative error, once per way of counting the attention's (query, key) pairs
(kvengine.executor.cost.kernel_pairs):

  causal         the pairs a causal mask keeps (the cost model's default)
  blocks         whole 512-key blocks up to each query's diagonal
  blocks+masked  the same, and all keys for a chunk after context: what torch's CPU
                 flash attention computes for the executor (cost.torch_attention_kernel)

Prints each counting's error per case and its RMS; fewer free terms than cases, so
a smaller RMS is a better model, not a looser one. About 20 s.

    python benchmarks/prefill_pairs.py [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from kvengine.config import EngineConfig
from kvengine.executor.cost import torch_attention_kernel
from kvengine.core.request import SamplingParams
from kvengine.executor.cost import kernel_pairs
from kvengine.engine.torch_engine import build_torch_engine

FRESH = (16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
AFTER_CONTEXT = [(c, n) for c in (512, 1024, 2048) for n in (16, 64, 256, 512, 1024)]
KERNEL = torch_attention_kernel("cpu")
COUNTINGS = {
    "causal": lambda c, n: kernel_pairs(n, c + n, 0),
    "blocks": lambda c, n: kernel_pairs(n, c + n, KERNEL["attention_key_block"]),
    "blocks+masked": lambda c, n: kernel_pairs(n, c + n, KERNEL["attention_key_block"],
                                               KERNEL["context_chunk_all_keys"]),
}


class PrefillTimer:
    """The engine's executor time (its forward passes) of one request's prefill."""

    def __init__(self, seed: int = 0):
        self.engine = build_torch_engine(EngineConfig(enable_prefix_caching=True), preset="tiny", device="cpu")
        self.rng = np.random.default_rng(seed)
        self.spent: list[float] = []
        execute = self.engine.executor.execute

        def timed(out):
            t0 = time.perf_counter()
            result = execute(out)
            self.spent.append(time.perf_counter() - t0)
            return result
        self.engine.executor.execute = timed

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(300, 30000, n).tolist()

    def prefill(self, prompt: list[int]) -> float:
        self.spent.clear()
        self.engine.add_request(str(self.rng.integers(1 << 62)), prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while self.engine.has_unfinished():
            self.engine.step()
        return sum(self.spent)

    def case(self, context: int, new: int) -> float:
        if not context:
            return self.prefill(self.tokens(new))
        prefix = self.tokens(context)
        self.prefill(prefix + self.tokens(1))  # caches the prefix's blocks
        return self.prefill(prefix + self.tokens(new))


def fit(times: np.ndarray, cases: list[tuple[int, int]], count) -> np.ndarray:
    """Relative errors of the least-squares a + b * n + k * pairs."""
    new = np.array([n for _, n in cases], float)
    pairs = np.array([count(c, n) for c, n in cases], float)
    design = np.stack([np.ones_like(new), new, pairs], 1) / times[:, None]
    coef, *_ = np.linalg.lstsq(design, np.ones_like(new), rcond=None)
    return design @ coef - 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timings per case, their median (default 5)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats {args.repeats}: must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    timer = PrefillTimer()
    timer.prefill(timer.tokens(300))  # warm-up
    cases = [(0, n) for n in FRESH] + AFTER_CONTEXT
    samples: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for i in timer.rng.permutation(len(cases)):
            samples[cases[i]].append(timer.case(*cases[i]))
    times = np.array([np.median(samples[case]) for case in cases])
    errors = {name: fit(times, cases, count) for name, count in COUNTINGS.items()}
    print(f"{'context+new':>12} {'ms':>8} " + " ".join(f"{name:>14}" for name in COUNTINGS))
    for i, (c, n) in enumerate(cases):
        print(f"{c:>5}+{n:<6} {times[i] * 1e3:8.2f} " + " ".join(f"{errors[name][i]:+14.1%}" for name in COUNTINGS))
    rms = {name: float(np.sqrt(np.mean(e ** 2))) for name, e in errors.items()}
    worst = {name: float(np.max(np.abs(e))) for name, e in errors.items()}
    print(f"{'rms':>12} {'':>8} " + " ".join(f"{rms[name]:14.1%}" for name in COUNTINGS))
    print(f"{'worst':>12} {'':>8} " + " ".join(f"{worst[name]:14.1%}" for name in COUNTINGS))
    if args.json:
        print(json.dumps({"cases": len(cases), "repeats": args.repeats,
                          "rms": {k: round(v, 4) for k, v in rms.items()},
                          "worst": {k: round(v, 4) for k, v in worst.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
