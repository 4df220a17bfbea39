#!/usr/bin/env python3
"""How well the sim predicts a live server, calibrated and not.

For each held-out workload, shaped unlike the probes: replays it on the bundled
engine's torch executor on the CPU (`kvengine serve --executor torch --preset
tiny --device cpu`, started by kvtune, a fresh server per workload whose pool
never wraps: see `evictions`) twice, calibrates against that server between the
two runs, and replays it on the sim (calibrated, and the plain roofline):

* azure:  a slice of the Azure 2023 conversation trace, lengths scaled to the
          tiny model's 4096 context and a CPU's speed;
* prefix: a synthetic workload sharing system prompts (kvtune.workload.synthesize);
* bursty: another Azure slice re-timed as a bursty gamma process (burstiness 0.3).

Prints predicted vs measured TTFT p50/p95, TPOT p50/p95, throughput and
preemptions with relative errors, next to the roofline's. Measured is the mean of
the two live runs; their spread (the second against the first) is the noise
floor, the error a perfect simulator would show against one run; each cell's
error beyond its own spread is the part that noise does not explain. Goal: within
15% on the p50s and 25% on the p95s. A fixed decode, timed before each
workload's first run and after its second, shows the machine's drift. About 11
minutes on 2 cores (--quick: about 5).

--device cuda runs the same benchmark against the engine on a GPU (same model,
workloads and pool, so the figures compare with the CPU's); the profile's
device is the GPU's preset (h200-141gb, ...), whose bandwidth and FLOP/s the
uncalibrated roofline uses.

    python benchmarks/sim_fidelity.py [--quick] [--device cpu|cuda] [--preset tiny]
                                      [--device-memory SIZE] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

from kvengine.config import EngineConfig, model_preset
from kvengine.entrypoints.flags import parse_size
from kvengine.executor.torch_executor import gpu_preset_name, resolve_device, torch_device_spec

from kvtune.calibrate import CalibrationRequest, calibrate_url, format_profile
from kvtune.calibrate.stream import stream_request
from kvtune.calibrate.timings import steady_itl
from kvtune.scrape import fetch, metrics_url, parse_exposition
from kvtune.targets import EngineTarget, LiveOptions, SimTarget
from kvtune.targets.live import run_live
from kvtune.targets.process import ManagedServer, free_port
from kvtune.workload import (
    IntDist,
    SynthSpec,
    length_scale,
    read_workload,
    retime,
    synthesize,
)

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"
P50S = ("ttft_p50", "tpot_p50")
P95S = ("ttft_p95", "tpot_p95")
COLUMNS = (*P50S, *P95S, "output_tok_s", "preemptions")
GOALS = {"p50": 0.15, "p95": 0.25}


def azure_slice(start: int, count: int):
    """Requests [start, start+count) of the Azure conversation trace, from time 0, with
    lengths x0.25 (the tiny model's 4096 context, a CPU's speed)."""
    trace = read_workload(str(TRACE))
    part = trace.with_requests(trace.requests[start:start + count])
    t0 = part.requests[0].arrival_s
    part = part.with_requests([dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in part.requests])
    return length_scale(part, 0.25, max_input=3000, max_output=400)


def workloads(quick: bool) -> list[tuple[str, object]]:
    n = 90 if quick else 280
    azure = azure_slice(2000, n)
    prefix = synthesize(SynthSpec(num_requests=n, rate=4.0, system_prompts=4, system_prompt_len=768,
                                  input_len=IntDist.uniform(32, 384), output_len=IntDist.uniform(16, 128),
                                  seed=7))
    bursty = retime(azure_slice(9000, n), rate=4.0, burstiness=0.3, seed=3)
    return [("azure", azure), ("prefix", prefix), ("bursty", bursty)]


def reference_itl(url: str, repeats: int = 3) -> float:
    """The machine's speed now: the mean inter-token gap of a fixed decode (256-token prompt,
    96 tokens), the median of `repeats`."""
    import asyncio

    async def timed() -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
            gaps = []
            for _ in range(repeats):
                timing = await stream_request(client, "", list(range(1000, 1256)), 96)
                gaps.append(steady_itl([timing.token_times]))
            return gaps

    return float(statistics.median(asyncio.run(timed())))


def evictions(url: str) -> float:
    """Cached blocks the server evicted to reuse them: its pool has wrapped where > 0.

    A server hands out never-used blocks in address order until its pool
    wraps; after that, in the order its traffic freed them, scattered over the pool. On a
    CPU the decode's K/V reads of scattered blocks are up to 2x slower at 4k context
    (measured on the torch executor: each block a cache and TLB miss), and the cost model
    has no term for where blocks lie. So each workload gets a fresh server whose pool
    (771k tokens at 2 GiB) outlasts its two runs and its probes (about 700k tokens)."""
    return parse_exposition(fetch(metrics_url(url), 30.0)).get("kvengine_evictions") or 0.0


def fresh_cache(url: str, run):
    """run() on a server whose prefix cache was just reset (each run starts cold)."""
    httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
    return run()


def rel(pred, meas):
    if pred is None or meas is None:
        return None
    if meas == 0:
        return 0.0 if pred == 0 else None
    return pred / meas - 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer probes and shorter workloads (about 5 minutes)")
    ap.add_argument("--device", default="cpu", help="the engine's torch device: cpu, cuda or cuda:N "
                                                      "(default: %(default)s)")
    ap.add_argument("--preset", default="tiny", help="the engine's model preset, random weights (default: "
                                                     "%(default)s; on a GPU a larger one, e.g. llama-2-7b with "
                                                     "--device-memory 24GiB, gives its roofline terms work to show)")
    ap.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                    help="the device's total memory as the engine sees it (default: 2GiB on the CPU; 3.4GiB "
                         "on a GPU, whose 1.5 GiB non-torch overhead then leaves the CPU's pool)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"error: {TRACE}: no such file", file=sys.stderr)
        return 2
    try:
        torch_device = resolve_device(args.device)
        model_preset(args.preset)
    except ValueError as err:  # kvengine's ConfigError
        print(f"error: {err}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    config = EngineConfig()
    # The sim and the live server size their pools from the same device spec and budget.
    budget = args.device_memory or parse_size("2GiB" if torch_device == "cpu" else "3.4GiB")
    model, device = model_preset(args.preset), torch_device_spec(torch_device, budget)
    profile_device = "cpu" if torch_device == "cpu" else gpu_preset_name(
        device.name, torch_device_spec(torch_device).memory_bytes)  # the card's own memory, not the budget
    options = LiveOptions(device=profile_device, drain_timeout_s=120, scrape_interval_s=2.0)
    target = EngineTarget(options, executor="torch", preset=args.preset, device=torch_device,
                          device_memory=str(budget))
    rows, profiles, drift, spreads, wrapped = [], {}, {}, {}, {}
    # A server per workload, its prefix cache reset before each run. Each workload runs live
    # twice with its fit in between: a shared 2-CPU machine's speed drifts by 5-20% over
    # minutes, and a fit between two runs compared with their mean cancels a steady drift. A
    # fixed decode is timed before the first run and after the second to show the drift.
    # Fresh servers, because a pool that has wrapped is a slower server (see evictions).
    for name, workload in workloads(args.quick):
        port = free_port()
        with ManagedServer(target.command(config, port), port, env={"OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"}) as server:
            if not rows:
                print(f"# server: {' '.join(target.command(config, port)[2:])}", flush=True)
            live_run = functools.partial(run_live, server.url, workload, "engine", args.preset, config, options,
                                         check_alive=server.check_alive)
            request = CalibrationRequest(server.url, args.preset, profile_device, config, f"sim-fidelity-{name}",
                                         target="engine", executor="torch", quick=args.quick)
            calibrate = functools.partial(calibrate_url, request, check_alive=server.check_alive)
            before = reference_itl(server.url)
            lives = [fresh_cache(server.url, live_run)]
            t0 = time.perf_counter()
            profile = fresh_cache(server.url, calibrate)
            print(f"# {name}: calibrated in {time.perf_counter() - t0:.0f} s\n{format_profile(profile)}", flush=True)
            lives.append(fresh_cache(server.url, live_run))
            drift[name] = reference_itl(server.url) / before - 1.0
            wrapped[name] = evictions(server.url)
        calibrated = SimTarget(model, device, profile.coefficients, profile.client_overhead_s,
                               profile.client_overhead_busy_s).run(config, workload)
        roofline = SimTarget(model, device).run(config, workload)
        live = mean_summary([run.summary for run in lives])
        spreads[name] = {k: rel(lives[1].summary.get(k), lives[0].summary.get(k)) for k in COLUMNS}
        rows.append((name, len(workload), live, calibrated.summary, roofline.summary))
        profiles[name] = profile
        print(f"# {name}: {len(workload)} requests over {workload.duration_s:.0f} s, live runs "
              f"{', '.join(f'{run.wall_s:.0f} s' for run in lives)} "
              f"({sum(run.summary['failed'] for run in lives)} failed); the reference decode's ITL moved "
              f"{drift[name]:+.1%} from before the first run to after the second"
              + (f"; WARNING: its pool wrapped ({wrapped[name]:.0f} cached blocks evicted), so its later "
                 "steps read scattered blocks (see evictions)" if wrapped[name] else ""), flush=True)
    load_after = os.getloadavg()
    print(format_table(rows, spreads))
    out = {"calibrated": summary_errors(rows, 3), "uncalibrated": summary_errors(rows, 4),
           "live_noise": noise_floor(spreads),
           "machine_drift": {k: round(v, 4) for k, v in drift.items()},
           "pool_evictions": wrapped,
           "profiles": {name: {"coefficients": p.coefficients.to_dict(), "client_overhead_s": p.client_overhead_s,
                               "client_overhead_busy_s": p.client_overhead_busy_s, "fit_residuals": p.residuals}
                        for name, p in profiles.items()},
           "wall_s": round(time.perf_counter() - t_start, 1),
           "load_average": [round(load_before[0], 2), round(load_after[0], 2)]}
    for key, columns in (("max_excess_over_noise_p50", P50S), ("max_excess_over_noise_p95", P95S)):
        out["calibrated"][key] = excess_over_noise(out["calibrated"]["per_workload"], spreads, columns)
    print(verdict(out))
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs: "
          "other work on this machine shows as live latency the sim cannot know about")
    if args.json:
        print(json.dumps(out))
    return 0


def mean_summary(summaries: list[dict]) -> dict:
    """The live figures: each column's mean over the runs (None where a run has none)."""
    out = {}
    for k in COLUMNS:
        values = [s.get(k) for s in summaries]
        out[k] = None if any(v is None for v in values) else float(np.mean(values))
    return out


def noise_floor(spreads: dict) -> dict:
    """The second live run against the first, per workload and column, with the worst
    p50 and p95: what a perfect simulator's error would look like against one run."""
    return {"max_rel_spread_p50": worst(spreads, P50S), "max_rel_spread_p95": worst(spreads, P95S),
            "per_workload": spreads}


def excess_over_noise(errors: dict, spreads: dict, keys) -> float | None:
    """The most by which a cell's |error| exceeds the two live runs' own disagreement on
    it (0 where every error is within it): the part the noise floor does not explain."""
    excess = {name: {k: None if e[k] is None else max(0.0, abs(e[k]) - abs(spreads[name][k] or 0.0))
                     for k in keys} for name, e in errors.items()}
    return worst(excess, keys)


def summary_errors(rows, column: int) -> dict:
    errors = {}
    for name, _, live, *sims in rows:
        sim = sims[column - 3]
        errors[name] = {k: rel(sim.get(k), live.get(k)) for k in COLUMNS}
    return {"max_rel_error_p50": worst(errors, P50S), "max_rel_error_p95": worst(errors, P95S),
            "max_rel_error_throughput": worst(errors, ("output_tok_s",)), "per_workload": errors}


def worst(per_workload: dict, keys) -> float | None:
    """The largest |relative error| over the workloads and these columns."""
    values = [abs(e[k]) for e in per_workload.values() for k in keys if e[k] is not None]
    return round(max(values), 4) if values else None


def _fmt(key, value):
    if value is None:
        return "-"
    if key == "preemptions":
        return f"{int(value)}"
    if key == "output_tok_s":
        return f"{value:.1f}"
    return f"{value * 1000:.1f}"


def _err(e):
    return "" if e is None else f"{e:+.0%}"


def format_table(rows, spreads: dict) -> str:
    """Live is the mean of the runs; "spread" is the second live run against the first."""
    header = (f"{'workload':10}{'metric':14}{'live':>10}{'spread':>8}{'calibrated':>12}{'err':>7}"
              f"{'roofline':>11}{'err':>7}")
    lines = ["", header]
    for name, n, live, cal, unc in rows:
        label = name
        for k in COLUMNS:
            unit = "tok/s" if k == "output_tok_s" else ("" if k == "preemptions" else "ms")
            lines.append(f"{label:10}{k + (' ' + unit if unit else ''):14}{_fmt(k, live.get(k)):>10}"
                         f"{_err(spreads[name][k]):>8}"
                         f"{_fmt(k, cal.get(k)):>12}{_err(rel(cal.get(k), live.get(k))):>7}"
                         f"{_fmt(k, unc.get(k)):>11}{_err(rel(unc.get(k), live.get(k))):>7}")
            label = ""
    return "\n".join(lines)


def verdict(out) -> str:
    c, u, n = out["calibrated"], out["uncalibrated"], out["live_noise"]
    def ok(v, goal):
        return v is not None and v <= goal
    return (f"\ncalibrated sim: worst p50 error {c['max_rel_error_p50']:.0%} (goal {GOALS['p50']:.0%}: "
            f"{'met' if ok(c['max_rel_error_p50'], GOALS['p50']) else 'missed'}), worst p95 error "
            f"{c['max_rel_error_p95']:.0%} (goal {GOALS['p95']:.0%}: "
            f"{'met' if ok(c['max_rel_error_p95'], GOALS['p95']) else 'missed'}); uncalibrated roofline: "
            f"{u['max_rel_error_p50']:.0%} / {u['max_rel_error_p95']:.0%}; live run against live run (the noise "
            f"floor): {n['max_rel_spread_p50']:.0%} / {n['max_rel_spread_p95']:.0%}; the calibrated errors beyond "
            f"each cell's own spread: {c['max_excess_over_noise_p50']:.0%} / {c['max_excess_over_noise_p95']:.0%}")


if __name__ == "__main__":
    sys.exit(main())
