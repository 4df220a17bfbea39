#!/usr/bin/env python3
"""Do the fixes `kvtune diagnose` prints help when an operator applies them? (issue #24)

A held-out suite of fault scenarios (none of them the tests' runs) and healthy runs, each
replayed on a live server: `kvengine serve` with the simulated executor, serving an H100 in
real time over HTTP, driven by Locust. Each run is diagnosed, and its fixes are tried in the
virtual-time simulator on the server's mirrored pool, as `kvtune diagnose` does. Every fix
printed as helping is then applied to the live server's flags and the workload replayed
again: it helped if the fault is gone from the live run and it missed no SLO the first run
met, rejected no more requests and kept TTFT and e2e p95 within the trial's margin (the
same judgement, `trial.problems`, on live runs).

    python benchmarks/fix_efficacy.py [--only NAME ...] [--json]

A false positive is a warning or critical finding on a healthy run. Faults that come
together on a fault run (F1, F6 and F8 on one full pool) are listed with it, not counted.

Ends with {"scenarios", "faults_expected", "detected", "false_positives", "printed_fixes",
"helped_when_applied", "helped_share", "untested_printed", "per_scenario"}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.diagnose import Thresholds, diagnose
from kvtune.diagnose.model import HELPED, UNTESTED, FlagChange
from kvtune.diagnose.trial import Simulator, apply_change, problems, try_fixes
from kvtune.targets import EngineTarget, LiveOptions, SimTarget, TargetRunError, TargetStartError
from kvtune.workload import IntDist, SynthSpec, TraceRequest, Workload, synthesize

GIB = 1 << 30


@dataclass
class Scenario:
    name: str
    expect: set[str]  # the faults the run is built to show (empty: a healthy run)
    config: EngineConfig
    workload: Workload
    model: str = "llama-3-8b"
    device: str = "h100-80gb"


def _arrivals(rng, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1 / rate, n))


def scenarios() -> list[Scenario]:
    rng = np.random.default_rng(7)
    long_prompts = [TraceRequest(float(t), 700, 40) for t in _arrivals(rng, 220, 22)]
    long_prompts += [TraceRequest(1.5 + 1.2 * k, 3200, 16) for k in range(6)]
    long_prompts.sort(key=lambda r: r.arrival_s)
    tail = [TraceRequest(float(t), 13000 if rng.random() < 0.1 else 1400, 280) for t in _arrivals(rng, 90, 18)]
    gaps = 1.0 - 0.9 * np.arange(70) / 70
    return [
        Scenario("f1_head_of_line", {"F1"}, EngineConfig(kv_cache_memory_bytes=GIB, max_model_len=4096,
                                                         max_num_seqs=64), Workload(long_prompts, 16)),
        Scenario("f6_preemption_storm", {"F6"}, EngineConfig(num_gpu_blocks_override=420, max_num_seqs=256,
                                                             max_model_len=2048),
                 synthesize(SynthSpec(num_requests=110, rate=18, system_prompts=1, system_prompt_len=64,
                                      input_len=IntDist.fixed(420), output_len=IntDist.fixed(240), seed=3))),
        Scenario("f8_long_tail", {"F8"}, EngineConfig(kv_cache_memory_bytes=5 * GIB, max_model_len=16384),
                 Workload(tail, 16), model="qwen2.5-7b"),
        Scenario("f4_cache_thrash", {"F4"}, EngineConfig(kv_cache_memory_bytes=GIB // 2, max_model_len=2048),
                 synthesize(SynthSpec(num_requests=130, rate=8, system_prompts=10, system_prompt_len=1024,
                                      input_len=IntDist.fixed(96), output_len=IntDist.fixed(48), seed=5))),
        Scenario("f2_long_decodes", {"F2"}, EngineConfig(),
                 Workload([TraceRequest(i * 0.01, 1200, 2800) for i in range(90)], 16)),
        Scenario("f3_load_ramp_mha", {"F3"}, EngineConfig(),
                 Workload([TraceRequest(float(t), 1500, 1000) for t in np.cumsum(gaps)], 16), model="llama-2-7b"),
        Scenario("f7_sessions_no_caching", {"F7"}, EngineConfig(enable_prefix_caching=False),
                 synthesize(SynthSpec(num_requests=48, rate=3, turns=IntDist.fixed(6), think_time_s=0.5,
                                      system_prompts=1, system_prompt_len=2048, input_len=IntDist.fixed(200),
                                      output_len=IntDist.fixed(48), seed=11))),
        Scenario("healthy_steady", set(), EngineConfig(),
                 synthesize(SynthSpec(num_requests=90, rate=6, system_prompts=2, system_prompt_len=512,
                                      input_len=IntDist.fixed(200), output_len=IntDist.fixed(80), seed=13))),
        Scenario("healthy_bursty", set(), EngineConfig(),
                 synthesize(SynthSpec(num_requests=90, rate=6, arrival="gamma", burstiness=0.3,
                                      input_len=IntDist.fixed(300), output_len=IntDist.fixed(60), seed=17))),
    ]


def live_run(target: EngineTarget, config: EngineConfig, workload: Workload):
    try:
        return target.run(config, workload)
    except (TargetStartError, TargetRunError) as err:
        return str(err).splitlines()[0]


def evaluate(s: Scenario, th: Thresholds) -> dict:
    target = EngineTarget(LiveOptions(users=64, drain_timeout_s=120), executor="sim", preset=s.model,
                          device=s.device)
    first = live_run(target, s.config, s.workload)
    if isinstance(first, str):
        return {"name": s.name, "error": first}
    sim = Simulator.of(SimTarget(model_preset(s.model), device_preset(s.device)), s.workload)
    found = try_fixes(diagnose(first, th), first, sim, th)
    # An info finding (e.g. "the prompts share no prefixes") describes the workload, not a fault.
    fired = {d.id for d in found if d.severity != "info"} - {"insufficient_data"}
    out = {"name": s.name, "expect": sorted(s.expect), "fired": sorted(fired),
           "info": sorted(d.id for d in found if d.severity == "info"), "fixes": []}
    for d in found:
        for trial in d.trials:
            if trial.verdict == UNTESTED:
                out["fixes"].append({"fault": d.id, "change": trial.change, "verdict": UNTESTED})
            if trial.verdict != HELPED:
                continue
            config = apply_change(s.config, FlagChange(trial.flag, None, trial.value))
            second = live_run(target, config, s.workload)
            trouble = [second] if isinstance(second, str) else problems(d.id, first, second, th, ())
            out["fixes"].append({"fault": d.id, "change": trial.change, "verdict": HELPED,
                                 "helped_live": not trouble, "live_problems": trouble,
                                 "sim": trial.note})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    th = Thresholds()
    chosen = [s for s in scenarios() if not args.only or s.name in args.only]
    rows, t0 = [], time.perf_counter()
    for s in chosen:
        row = evaluate(s, th)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    done = [r for r in rows if "error" not in r]
    expected = sum(len(r["expect"]) for r in done)
    detected = sum(len(set(r["expect"]) & set(r["fired"])) for r in done)
    false_pos = sum(1 for r in done if not r["expect"] and r["fired"])
    printed = [f for r in done for f in r["fixes"] if f["verdict"] == HELPED]
    helped = sum(f["helped_live"] for f in printed)
    summary = {"scenarios": len(rows), "failed_to_run": len(rows) - len(done), "faults_expected": expected,
               "detected": detected, "false_positives": false_pos, "printed_fixes": len(printed),
               "helped_when_applied": helped, "helped_share": round(helped / len(printed), 3) if printed else None,
               "untested_printed": sum(f["verdict"] == UNTESTED for r in done for f in r["fixes"]),
               "wall_s": round(time.perf_counter() - t0, 1), "per_scenario": rows}
    print(f"{detected}/{expected} faults detected, {false_pos} false positives on healthy runs; "
          f"{helped}/{len(printed)} printed fixes helped when applied on the live server")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
