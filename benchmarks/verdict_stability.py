#!/usr/bin/env python3
"""Does the same search give the same advice when run again? The demo's search, N times.

Runs `make demo`'s search (its trace, SLOs, space, budget; stage 1 on the calibrated profile the
demo stores, calibrated here first when missing; stage 2 live on kvengine's torch executor on this
CPU) N times, each a fresh study, and prints each verdict: its kind and the flags it recommends
(the changes from the default). The share of reruns that give the most common advice is the
stability. Goal >= 90 %. Where a verdict lists several equivalent configs (`equivalent` in
`search --json`: each shown to beat the default and tied with the recommended one), a rerun also
agrees with advice it lists as equivalent: `share_consistent` is the largest share of reruns that
one piece of advice holds in, recommended or listed. The reruns are real live searches.
With --fresh-calibration each rerun first calibrates its own profile, as a fresh clone's
`make demo` does (about a minute more each): the advice must then hold across calibrations too,
not only across live runs on one fitted simulator.

    python benchmarks/verdict_stability.py [--runs 5] [--fresh-calibration]
        [--db sqlite:///reports/stability.db] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "kvtune/data/demo_pressure.jsonl"
PROFILE = "demo-cpu"
# make demo's search, as the Makefile gives it (DEMO_SLOS, DEMO_LIMITS, DEMO_SPACE and the search line)
LIMITS = ["--max-model-len", "512"]
SEARCH = ["--slo", "ttft_p95=2s", "--slo", "tpot_p95=60ms", *LIMITS, "--space", "kv_cache_dtype=auto,fp8",
          "--space", "max_num_seqs=8:256:log", "--target", "engine", "--executor", "torch",
          "--server-args", "--kv-cache-memory-bytes 2MiB", "--trials", "50", "--top-k", "2", "--repeats", "3",
          "--max-repeats", "4", "--live-budget", "12", "--no-report", "--json"]


def kvtune(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtune", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def ensure_profile(db: str, name: str = PROFILE, fresh: bool = False) -> list[str]:
    """Stage 1's flags for the demo's calibrated profile `name` in `db`, calibrated as `make demo`
    does where it is missing (or always, when `fresh`). Refused twice: `make demo` goes on with the
    uncalibrated preset, and so does a fresh rerun; otherwise SystemExit."""
    from kvtune.calibrate import get_profile

    if not fresh:
        try:
            get_profile(db, name)
            return ["--profile", name]
        except Exception:  # noqa: BLE001 (missing profile or database: calibrate)
            pass
    for _ in range(2):  # the demo's own retry: a calibration may be refused on a busy host
        p = kvtune("calibrate", "--target", "engine", "--executor", "torch", "--quick", "--max-prompt", "512",
                   "--quantized-kv", "fp8", *LIMITS, "--name", name, "--db", db)
        if p.returncode == 0:
            return ["--profile", name]
    if fresh:
        print(f"calibration of {name} refused twice: stage 1 on the uncalibrated preset, as make demo does")
        return ["--preset", "tiny", "--device", "cpu"]
    raise SystemExit(f"calibration refused twice:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def advice(out: dict, default: dict | None) -> str:
    """A verdict as advice: its kind and the flags it changes."""
    rec = out.get("recommended")
    if out["verdict"] in ("better", "smallest_change") and rec:
        from kvtune.search.advice import changed_flags

        return f"set {changed_flags(rec, default)}"
    return out["verdict"]


def equivalent_advice(out: dict, default: dict | None) -> list[str]:
    """The advice a verdict stands behind: each equivalent config's flags, or its kind alone."""
    from kvtune.search.advice import changed_flags

    if out.get("equivalent"):  # only a `better` verdict lists any
        return sorted({f"set {changed_flags(p, default)}" for p in out["equivalent"]})
    return [advice(out, default)]


def consistency(rows: list[dict]) -> tuple[str, float]:
    """The advice that holds in the most reruns (recommended, or listed as equivalent) and that share."""
    held = collections.Counter(a for r in rows for a in set(r.get("equivalent_advice") or [r["advice"]]))
    best, count = max(held.items(), key=lambda kv: (kv[1], kv[0]))
    return best, count / len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--db", default="sqlite:///reports/stability.db")
    ap.add_argument("--fresh-calibration", action="store_true",
                    help="calibrate a new profile before each rerun, as a fresh clone's make demo does")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    (ROOT / "reports").mkdir(exist_ok=True)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    if not args.fresh_calibration:
        ensure_profile(args.db)
    rows = []
    for i in range(args.runs):
        study = f"stability-{time.strftime('%Y%m%d-%H%M%S')}-{i}"
        t0 = time.monotonic()
        stage1 = (ensure_profile(args.db, f"{study}-cpu", fresh=True) if args.fresh_calibration
                  else ["--profile", PROFILE])
        p = kvtune("search", "--workload", str(TRACE), *stage1, *SEARCH, "--db", args.db,
                   "--study", study)
        if p.returncode != 0:
            rows.append({"study": study, "advice": f"failed (exit {p.returncode})", "error": p.stderr[-500:]})
            print(f"run {i + 1}: failed: {p.stderr[-300:]}")
            continue
        out = json.loads(p.stdout.strip().splitlines()[-1])
        default = next((c["params"] for c in out["live"] if c["is_default"]), None)
        rows.append({"study": study, "stage1": " ".join(stage1), "advice": advice(out, default),
                     "equivalent_advice": equivalent_advice(out, default),
                     "verdict": out["verdict"], "reasons": out["reasons"], "wall_s": round(time.monotonic() - t0)})
        also = [a for a in rows[-1]["equivalent_advice"] if a != rows[-1]["advice"]]
        print(f"run {i + 1}: {rows[-1]['advice']}" + (f" (equivalent: {'; '.join(also)})" if also else "")
              + f"  ({rows[-1]['wall_s']} s)")
    counts = collections.Counter(r["advice"] for r in rows)
    mode, same = counts.most_common(1)[0]
    share = same / len(rows)
    held, share_held = consistency(rows)
    print(f"\n{same} of {len(rows)} reruns gave the most common advice ({mode}): {share:.0%} (goal >= 90 %)")
    print(f"{share_held:.0%} of reruns stand behind \"{held}\", recommended or listed as equivalent")
    if args.json:
        print(json.dumps({"share_same": share, "runs": len(rows), "advice": dict(counts), "mode": mode,
                          "share_consistent": share_held, "consistent_advice": held,
                          "fresh_calibration": args.fresh_calibration,
                          "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
