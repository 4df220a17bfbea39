#!/usr/bin/env python3
"""Exhaustive grid vs Optuna (TPE, GP) on the sim target: how many trials to 98% of the best.

Same space, workload, SLOs and objective (goodput) for all three. The grid
evaluates every point once; each sampler's study then runs over the same
discrete space, and a trial's value is looked up from the grid's measurement
(the sim target is deterministic, so this is exactly what running it again
would give). Reported: the trial at which each sampler's best-so-far first
reaches 98% of the grid's best, median over seeds, and that as a share of the
grid's size.

    python benchmarks/search_efficiency.py [--requests 300] [--seeds 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import optuna

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.search.slo import parse_slo, score
from kvtune.search.space import Knob, SearchSpace
from kvtune.targets import SimTarget, TargetStartError
from kvtune.workload import head, rate_scale, read_workload

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"
SPACE = SearchSpace((
    Knob("block_size", choices=(16, 32, 64, 128)),
    Knob("gpu_memory_utilization", low=0.80, high=0.95, step=0.05),
    Knob("max_num_seqs", choices=(16, 32, 64, 128, 256, 512, 1024)),
    Knob("kv_cache_dtype", choices=("auto", "fp8")),
))


def key(params: dict) -> tuple:
    return tuple((k, round(v, 4) if isinstance(v, float) else v) for k, v in sorted(params.items()))


def measure_grid(target, workload, slos, base) -> dict[tuple, float]:
    values = {}
    for params in SPACE.grid():
        try:
            result = target.run(SPACE.config(params, base), workload)
            values[key(params)] = score(result, slos).goodput_rps
        except TargetStartError:
            values[key(params)] = 0.0  # cannot start: no goodput
    return values


def trials_to_reach(sampler, grid: dict[tuple, float], goal: float) -> int:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    best = 0.0
    for n in range(1, len(grid) + 1):
        trial = study.ask()
        value = grid[key(SPACE.suggest(trial))]
        study.tell(trial, value)
        best = max(best, value)
        if best >= goal:
            return n
    return len(grid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate-scale", type=float, default=4.0, help="replay faster than the trace (default: 4)")
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--device", default="a100-40gb")
    ap.add_argument("--slo", action="append", default=None, help="default: ttft_p95=2s, tpot_p95=60ms")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    slos = [parse_slo(s) for s in (args.slo or ["ttft_p95=2s", "tpot_p95=60ms"])]
    workload = rate_scale(head(read_workload(args.trace), args.requests), args.rate_scale)
    target = SimTarget(model_preset(args.preset), device_preset(args.device))
    base = EngineConfig(max_model_len=8192)
    t0 = time.perf_counter()
    grid = measure_grid(target, workload, slos, base)
    grid_s = time.perf_counter() - t0
    best = max(grid.values())
    if best <= 0:
        print("error: no grid point has any goodput; loosen --slo", file=sys.stderr)
        return 2
    goal = 0.98 * best
    tpe = [trials_to_reach(optuna.samplers.TPESampler(seed=s), grid, goal) for s in range(args.seeds)]
    gp = [trials_to_reach(optuna.samplers.GPSampler(seed=s), grid, goal) for s in range(args.seeds)]
    out = {"grid_trials": len(grid), "tpe_trials_to_98": statistics.median(tpe),
           "gp_trials_to_98": statistics.median(gp)}
    out["ratio_tpe"] = round(out["tpe_trials_to_98"] / len(grid), 3)
    out["ratio_gp"] = round(out["gp_trials_to_98"] / len(grid), 3)
    print(f"# {args.preset} on {args.device}, {len(workload)} requests of {Path(args.trace).name} at "
          f"{args.rate_scale}x, SLOs {', '.join(map(str, slos))}; grid measured in {grid_s:.0f} s")
    at_goal = sum(v >= goal for v in grid.values())
    out["grid_points_at_goal"] = at_goal
    # Without replacement, a random order needs (N + 1) / (k + 1) draws on average to hit one of k.
    out["random_expected_trials"] = round((len(grid) + 1) / (at_goal + 1), 1)
    print(f"grid: {len(grid)} configs, best goodput {best:.2f} req/s; goal 98% = {goal:.2f} req/s, "
          f"reached by {at_goal} configs (random order would need {out['random_expected_trials']} on average)")
    print(f"TPE trials to the goal, per seed: {tpe} -> median {out['tpe_trials_to_98']} "
          f"({out['ratio_tpe']:.1%} of the grid)")
    print(f"GP  trials to the goal, per seed: {gp} -> median {out['gp_trials_to_98']} "
          f"({out['ratio_gp']:.1%} of the grid)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
