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
default's runs under two labels). No live search runs here: the draws stand in for repeats, which
the JSON's `live_searches` (0) says.

    python benchmarks/verdict_calibration.py [--searches 400] [--cv 0.05,0.1,0.15] [--db URL --study NAME] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from kvtune.search.ranking import BETTER, Measurement, choose
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
    from kvtune.search.results import load_report_data

    data = load_report_data(db, study)
    out = {}
    for c in (data.default, data.verdict.recommended):
        if c is not None and c.runs:
            out[c.label] = [m.value for m in c.runs if m.ok]
    return out


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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    for cv in [float(x) for x in args.cv.split(",")]:
        aa, ab = rates(normal_draws(cv, rng), args.searches, args.gain, args.repeats, args.max_repeats)
        rows.append({"spread": f"normal, cv {cv:g}", "cv": cv, "false_better_rate": aa, "power": ab})
    if args.db and args.study:
        for label, values in stored_spreads(args.db, args.study).items():
            if len(values) < 2:
                continue
            values = np.array(values)
            cv = float(values.std(ddof=1) / values.mean())
            resample = lambda _c, mean, v=values: float(rng.choice(v)) / v.mean() * 10.0 * mean  # noqa: E731
            aa, ab = rates(resample, args.searches, args.gain, args.repeats, args.max_repeats)
            rows.append({"spread": f"{args.study}: {label}'s {len(values)} runs resampled", "cv": cv,
                         "false_better_rate": aa, "power": ab})
    print(f"{args.searches} A/A and {args.searches} A/B searches per spread; 3 candidates and the default, "
          f"{args.repeats}-{args.max_repeats} runs each; gain {args.gain:.0%}")
    print(f"{'spread':52} {'cv':>6} {'false better':>13} {'power':>7}")
    for r in rows:
        print(f"{r['spread']:52} {r['cv']:6.3f} {r['false_better_rate']:13.1%} {r['power']:7.1%}")
    out = {"false_better_rate": max(r["false_better_rate"] for r in rows), "rows": rows,
           "searches": args.searches, "live_searches": 0,
           "power": {r["spread"]: r["power"] for r in rows}}
    print(f"goals: false better <= 5 % (worst {out['false_better_rate']:.1%}); power >= 80 % at the demo's spread")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
