#!/usr/bin/env python3
"""How often a verdict says "better" when nothing is (A/A), and how often it finds a real gain (A/B).

Each simulated search is stage 2 as `kvtune search` runs it, decided by `kvtune.search.ranking.choose`
itself: three candidates and the default, `--repeats` runs each, then one more run of each while no
config is shown better, up to `--max-repeats`, a verdict at every look. Each run's goodput is drawn
around its config's true mean with the run-to-run spread (coefficient of variation) given, normal.

* A/A: every config has the default's mean. The share of searches ending in "better" is the false
  "better" rate. Goal <= 5 % (the ranking's error budget).
* A/B: one candidate's true mean is `--gain` (20 %) above the default's, the others equal to it. The
  share of searches that recommend that candidate is the power. Goal >= 80 % at the demo's spread.

`--db URL --study NAME` also takes the spreads from a stored search's live runs (the default's and
the recommended config's coefficients of variation) and resamples those runs themselves (A/A: the
default's runs under two labels).

`--live N` runs N live A/A stage 2s on the bundled engine (`--executor torch` or `sim`, in real
time), as `make demo`'s stage 2 runs (its trace, 2 MiB pool, SLOs, two candidates and the
default, 3-4 runs each, `run_stage2` and its verdict): the candidates are the default with
`--gpu-memory-utilization` changed, which a fixed `--kv-cache-memory-bytes` pool leaves unused,
so every config is the same server. It counts the live verdicts that say "better", then resamples
all their runs (one distribution: the same config) for `--searches` more A/A searches. The JSON's
`live_searches` says how many were live; the rest are draws.

    python benchmarks/verdict_calibration.py [--searches 400] [--cv 0.05,0.1,0.15] [--db URL --study NAME]
        [--live N [--executor torch|sim]] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from kvtune.search.measurement import Measurement
from kvtune.search.ranking import BETTER, choose
from kvtune.search.slo import parse_slo

SLO = parse_slo("ttft_p95=500ms")  # always met: the objective's mean alone decides
DEFAULT = {"config": 0}


def run(params: dict, repeat: int, goodput: float) -> Measurement:
    return Measurement("live", params["config"], dict(params), "COMPLETE", values=[goodput],
                       constraints={SLO.name: -0.3}, goodput_rps=goodput, throughput_rps=goodput,
                       observed={SLO.name: 0.2}, target="engine", measured_on="draws", repeat=repeat)


def search(draw, means: list[float], repeats: int, max_repeats: int) -> dict | None:
    """One stage 2 over configs of these true means (the last the default); the recommended
    params where the verdict is "better", else None."""
    configs = [{"config": i + 1} for i in range(len(means) - 1)] + [DEFAULT]
    live = []
    looks = max_repeats - repeats + 1
    for n in range(1, max_repeats + 1):
        live += [run(c, n, draw(c, mu)) for c, mu in zip(configs, means)]
        if n < repeats:
            continue
        verdict, _, _ = choose([], live, [SLO], DEFAULT, looks)
        if verdict.kind == BETTER:
            return verdict.recommended.params
    return None


def rates(draw, searches: int, gain: float, repeats: int, max_repeats: int) -> tuple[float, float]:
    aa = sum(search(draw, [1.0, 1.0, 1.0, 1.0], repeats, max_repeats) is not None for _ in range(searches))
    ab = sum(search(draw, [1.0 + gain, 1.0, 1.0, 1.0], repeats, max_repeats) == {"config": 1}
             for _ in range(searches))
    return aa / searches, ab / searches


def normal_draws(cv: float, rng):
    return lambda _config, mean: 10.0 * mean * (1 + cv * rng.standard_normal())


def stored_spreads(db: str, study: str) -> dict:
    """The stored search's live runs of the default and of the recommended config: their goodputs."""
    from kvtune.search.report_data import load_report_data

    data = load_report_data(db, study)
    out = {}
    for c in (data.default, data.verdict.recommended):
        if c is not None and c.runs:
            out[c.label] = [m.value for m in c.runs if m.ok]
    return out


def live_aa(searches: int, executor: str, workdir: str) -> tuple[list[str], list[float]]:
    """`searches` live A/A stage 2s on kvengine (the module's docstring says how); each one's verdict
    kind, and the goodputs of every completed run."""
    from pathlib import Path

    from kvengine.config import EngineConfig, device_preset, model_preset

    from kvtune.search import Objective, load_space
    from kvtune.search.stage2 import LiveConfig, LivePlan, default_params, run_stage2
    from kvtune.store import Store
    from kvtune.targets import EngineTarget
    from kvtune.workload import read_workload

    trace = Path(__file__).resolve().parents[1] / "kvtune/data/demo_pressure.jsonl"
    slos = (parse_slo("ttft_p95=2s"), parse_slo("tpot_p95=60ms"))  # make demo's
    objective, workload, space = Objective("goodput", slos), read_workload(str(trace)), load_space(None, [])
    target = EngineTarget(executor=executor, extra_args="--kv-cache-memory-bytes 2MiB")
    base = EngineConfig(max_model_len=512)
    dflt = default_params(space, target.rules.default_config(base).resolve(model_preset("tiny"), device_preset("cpu")))
    kinds, values = [], []
    for i in range(searches):
        same = [LiveConfig("default", -1, dflt)] + [
            LiveConfig(f"trial {n}", n, dflt | {"gpu_memory_utilization": g}) for n, g in ((1, 0.8), (2, 0.85))]
        plan = LivePlan(repeats=3, max_repeats=4)
        outcomes = run_stage2(target.run, same, space, base, workload, objective,
                              Store(f"sqlite:///{workdir}/aa.db"), f"aa-{i}", plan)
        live = [o.measurement for o in outcomes]
        verdict, _, _ = choose([], live, list(slos), dflt, plan.looks)
        kinds.append(verdict.kind)
        values += [m.value for m in live if m.ok]
        print(f"live A/A search {i + 1}: {verdict.kind} ({len(live)} runs)", flush=True)
    return kinds, values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--searches", type=int, default=400, help="A/A and A/B searches per spread (default: 400)")
    ap.add_argument("--cv", default="0.05,0.1,0.15", help="run-to-run spreads to draw at (default: %(default)s)")
    ap.add_argument("--gain", type=float, default=0.2, help="the A/B candidate's true gain (default: 0.2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-repeats", type=int, default=5)
    ap.add_argument("--db", help="a database holding a search with live runs")
    ap.add_argument("--study", help="that search's study name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live", type=int, default=0, help="live A/A stage 2s on the bundled engine (default: 0)")
    ap.add_argument("--executor", choices=("torch", "sim"), default="torch", help="the engine's, for --live")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.live < 0:
        ap.error(f"--live is a number of live searches (0 or more), got {args.live}")
    rng = np.random.default_rng(args.seed)
    rows = []
    for cv in [float(x) for x in args.cv.split(",")]:
        aa, ab = rates(normal_draws(cv, rng), args.searches, args.gain, args.repeats, args.max_repeats)
        rows.append({"spread": f"normal, cv {cv:g}", "cv": cv, "false_better_rate": aa, "power": ab})
    runs = list(stored_spreads(args.db, args.study).items()) if args.db and args.study else []
    runs = [(f"{args.study}: {label}'s {len(values)} runs resampled", values) for label, values in runs]
    live_kinds = []
    if args.live:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvtune-aa-") as workdir:
            live_kinds, values = live_aa(args.live, args.executor, workdir)
        runs.append((f"live A/A ({args.executor}): {len(values)} runs resampled", values))
    for spread, values in runs:
        if len(values) < 2:
            continue
        values = np.array(values)
        resample = lambda _c, mean, v=values: float(rng.choice(v)) / v.mean() * 10.0 * mean  # noqa: E731
        aa, ab = rates(resample, args.searches, args.gain, args.repeats, args.max_repeats)
        rows.append({"spread": spread, "cv": float(values.std(ddof=1) / values.mean()), "false_better_rate": aa,
                     "power": ab})
    print(f"{args.searches} A/A and {args.searches} A/B searches per spread; 3 candidates and the default, "
          f"{args.repeats}-{args.max_repeats} runs each; gain {args.gain:.0%}")
    print(f"{'spread':52} {'cv':>6} {'false better':>13} {'power':>7}")
    for r in rows:
        print(f"{r['spread']:52} {r['cv']:6.3f} {r['false_better_rate']:13.1%} {r['power']:7.1%}")
    out = {"false_better_rate": max(r["false_better_rate"] for r in rows), "rows": rows,
           "searches": args.searches, "live_searches": len(live_kinds),
           "live_false_better": sum(k == BETTER for k in live_kinds), "live_verdicts": live_kinds,
           "power": {r["spread"]: r["power"] for r in rows}}
    if live_kinds:
        print(f"live A/A stage 2s ({args.executor} executor): {sum(k == BETTER for k in live_kinds)} of "
              f"{len(live_kinds)} said better ({', '.join(live_kinds)})")
    print(f"goals: false better <= 5 % (worst {out['false_better_rate']:.1%}); power >= 80 % at the demo's spread")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
