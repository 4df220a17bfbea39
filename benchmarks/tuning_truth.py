#!/usr/bin/env python3
"""The truth (issue 22): does `kvtune search` pick what a live grid says is best, on a real server?

Server: the bundled engine's torch executor (`EngineTarget(executor="torch",
preset="tiny", device="cpu")`: real forward passes of the tiny random Llama) or,
with --server vllm, vLLM's CPU build in ./.venv-vllm (`VllmTarget`, serving
tests/checkpoint.py's tiny checkpoint, written in float32 to a temporary folder: vLLM's
`--dtype auto` serves it in bf16, so the same bytes hold twice the tokens they hold on the
engine; the simulator models each server in the dtype the server reports, as kvtune search's
stage 1 does).

Workload: `kvtune trace synth` single-turn requests (default 64 at 32 req/s
with --quick, 96 without; constant arrivals, prompts 96-192 tokens, answers
24-48), the same trace shape
for both servers, under real KV pressure: every config, the default included,
runs on one fixed KV pool of --pool-bytes (default: 1024 tokens of the served
16- or 32-bit K/V, 4096 (engine) or 2048 (vLLM) fp8 ones: 2 MiB on the engine's
float32, 1 MiB on vLLM's bf16; passed as --kv-cache-memory-bytes, fixed
--max-model-len 512), so the target's default (block 128, 128 seqs, auto)
preempts. (vLLM on 2 MiB, 2048 bf16 tokens: every config served about the
offered rate, the grid's best did not beat the default, and tau ranked noise.) The SLOs default to ttft_p95=2s, tpot_p95=150ms; the objective is
kvtune's goodput (requests/s meeting every SLO). At 32 req/s the pool decides:
configs that hold fewer requests at once queue, miss the TTFT SLO and fall
apart by whole req/s. At the earlier 16 req/s every config served the offered
rate, 9 of 12 tied within 0.5 req/s, and Kendall's tau ranked noise (-0.07
and -0.64 in two runs).

The grid: block_size x max_num_seqs x kv_cache_dtype, every config run
--repeats times (default 3), interleaved (round r runs every config once, in an
order rotated by r), each run scored by kvtune's own `Objective.evaluate` and
each config summarised by `kvtune.search.stats.interval` (mean + Student-t
interval). --quick: blocks 32,128 x seqs 8,32,128 x auto,fp8 = 12 configs x 3
runs (it includes the target's default, block 128 / 128 seqs / auto, so the
grid measures the default itself); the full mode adds block 16 on the engine
(64 on vLLM, which takes multiples of 32 only): 18 configs. Both modes use the
same blocks on both servers where the server takes them.

Each run starts its own server (no shared starts): a fresh process means an
empty pool, an empty prefix cache and no leftover queue, so every run of every
config starts from the same pool state; clearing the prefix cache of a running
vLLM needs /reset_prefix_cache, which vLLM serves only with
VLLM_SERVER_DEV_MODE=1, and a config change needs a restart anyway. kvtune's
own stage 2 starts a server per run too, so the grid and the search measure the
same thing.

Then `kvtune search` runs as a subprocess on the same workload, SLOs, pool and
space (gpu_memory_utilization pinned to the default's 0.92: the pool is
fixed), with --live-budget a quarter of the grid's live runs and --top-k what
3 repeats each fit in it (a 36-run grid: budget 9, top-k 2, the default the
third config). The pool reaches the search as the server's own flag
(`--server-args "--kv-cache-memory-bytes POOL"`): the target passes it to the server,
and stage 1 (the simulator), the target check, the default and every stage-2 run
size the pool by it (gpu_memory_utilization is then not searched).

Reported: recommended_over_best (the recommended config's grid mean over the
grid's best mean; goal >= 0.95, or tied: the intervals overlap),
verdict_right (the grid "beats the default" when its best config's interval
lies above the default's; then the verdict must be better or smallest_change,
else keep_default or inconclusive), kendall_tau (scipy's tau-b between each
grid config's goodput on the simulator, `SimTarget(model_preset("tiny"),
device_preset("cpu"))` with the same pool, one run each, and its live grid
mean; goal >= 0.7), live_runs_used (the search's) and grid_live_runs. Beside
it, separated_tau: the same concordance over only the pairs of configs whose
grid intervals do not overlap (a pair the grid cannot tell apart is ranked by
noise, whatever the simulator says), with separated_pairs, their count. With
--calibrate (or --profile NAME --profile-db FILE) a calibrated cost profile
runs the simulator instead, for the ranking and for the search's stage 1;
kvtune calibrate refuses a fit on a noisy host, and then the presets run. The
calibration runs on CALIBRATION_POOLS times the grid's pool, in the grid's
smallest blocks, so that its probes time the batches the grid's configs run.

--quick took 7-9 minutes on the engine on a shared 2-core host (36 grid runs of
about 10 s each, a server start included, then about 90 s of search); a vLLM
CPU run takes 40-75 s (its start and warm-up), so there --quick with
--seqs 8,128 (8 configs, 24 runs) takes 25-30 minutes with its calibration.

    python benchmarks/tuning_truth.py [--quick] [--server engine|vllm] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvengine.config import EngineConfig, device_preset, model_preset

from kvtune.plan import served_dtype, server_pool_of
from kvtune.search import Objective, parse_slo
from kvtune.search.stats import interval, welch
from kvtune.search.validity import run_doubts
from kvtune.targets import SimTarget
from kvtune.targets.base import TargetRunError, TargetStartError
from kvtune.targets.live import LiveOptions
from kvtune.targets.servers import EngineTarget, VllmTarget
from kvtune.workload import read_workload

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
KNOBS = ("block_size", "max_num_seqs", "kv_cache_dtype")
GRIDS = {  # server -> mode -> knob values
    "engine": {"quick": ((32, 128), (8, 32, 128), ("auto", "fp8")),
               "full": ((16, 32, 128), (8, 32, 128), ("auto", "fp8"))},
    "vllm": {"quick": ((32, 128), (8, 32, 128), ("auto", "fp8")),
             "full": ((32, 64, 128), (8, 32, 128), ("auto", "fp8"))},
}
MAX_MODEL_LEN = 512
# The calibration's pool, in grid pools. Step costs do not depend on the pool's size, but its probes
# can only time the batches it holds: the grid's pool at the default's 128-token blocks holds 6 of
# the probes' decodes at once, while the grid's fp8 configs run 20 and more; a fit that saw 6
# priced every further sequence at nothing (per_seq_overhead_s at its floor) and scored every fp8
# config the same. 8 pools in 32-token blocks hold the probes' largest batch (64).
CALIBRATION_POOLS = 8
GRID_INPUTS = ("server", "repeats", "requests", "rate", "input_len", "output_len", "pool_bytes", "slo", "grid")


class Stop(Exception):
    """SIGTERM/SIGHUP: unwind through the finally blocks that stop the servers."""


def _on_signal(signum, frame):
    raise Stop(f"signal {signum}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(cmd: list[str], cwd=None) -> subprocess.CompletedProcess:
    """Run a kvtune command to its end; stopped (SIGTERM/SIGINT here), it gets SIGTERM, so it stops the
    servers it started before it exits (SIGKILL after 60 s)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def key(params: dict) -> tuple:
    return tuple(params[k] for k in KNOBS)


def label(params: dict) -> str:
    return f"block {params['block_size']:>3} seqs {params['max_num_seqs']:>3} {params['kv_cache_dtype']:<4}"


def write_trace(path: Path, args) -> None:
    cmd = [PY, "-m", "kvtune", "trace", "synth", "-o", str(path), "--num-requests", str(args.requests),
           "--rate", str(args.rate), "--arrival", "constant", "--input-len", args.input_len,
           "--output-len", args.output_len, "--seed", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def make_target(args, ckpt: str | None, log_dir: str):
    options = LiveOptions(device="cpu", users=256)
    if args.server == "engine":
        return EngineTarget(options=options, executor="torch", preset="tiny", device="cpu", log_dir=log_dir)
    return VllmTarget(options=options, model=ckpt, platform="cpu", log_dir=log_dir,
                      env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})


def track_servers(target) -> list:
    """Every server the target makes, so main's finally can stop them: a ManagedServer whose start
    is cut short (SIGTERM, Ctrl-C while it waits for /health) raises out of __enter__, so no
    __exit__ stops it and the server lives on (see the report of issue 22)."""
    made, server = [], target.server

    def tracked(config):
        made.append(server(config))
        return made[-1]
    target.server = tracked
    return made


def run_grid(target, configs: list[dict], base: EngineConfig, workload, objective, repeats: int) -> dict:
    """{key: {"params", "values": [goodput or None], "feasible": [...], "preemptions": [...], "doubts": [...]}}"""
    out = {key(p): {"params": p, "values": [], "feasible": [], "preemptions": [], "doubts": [], "errors": [],
                    "observed": [], "reported": {}} for p in configs}
    n, total, t0 = 0, repeats * len(configs), time.perf_counter()
    for r in range(repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]  # interleaved, rotated per round
        for params in order:
            cell, n = out[key(params)], n + 1
            try:
                values, sc, result = objective.evaluate(target.run, dataclasses.replace(base, **params),
                                                        workload)
                cell["values"].append(values[0])
                cell["feasible"].append(sc.feasible)
                cell["preemptions"].append(result.summary.get("preemptions"))
                cell["observed"].append(sc.observed)
                cell["doubts"] += run_doubts(result, sc)
                cell["reported"] = result.config  # the config the server reported it ran
                what = f"goodput {values[0]:.2f} req/s{'' if sc.feasible else ' (misses SLOs)'}, " \
                       f"{result.summary.get('preemptions')} preemptions"
            except (TargetStartError, TargetRunError) as err:
                cell["values"].append(None)
                cell["errors"].append(str(err).splitlines()[0])
                what = f"failed: {cell['errors'][-1]}"
            log(f"  grid {n}/{total} ({time.perf_counter() - t0:.0f} s) round {r + 1} {label(params)}: {what}")
    return out


def sim_target(profile_db: str | None, profile: str | None) -> SimTarget:
    """The presets' simulator (tiny on cpu), or one with a calibrated cost profile."""
    if not profile:
        return SimTarget(model_preset("tiny"), device_preset("cpu"))
    from kvtune.calibrate import get_profile
    prof = get_profile(profile_db, profile)
    model, device = prof.specs()
    return SimTarget(model, device, prof.coefficients, prof.client_overhead_s, prof.client_overhead_busy_s)


def calibrate(args, db: str, log_dir: Path) -> str | None:
    """`kvtune calibrate` of the grid's server into `db`, on CALIBRATION_POOLS times the grid's pool in
    the grid's smallest blocks; the profile's name, or None where kvtune refused the fit (then nothing
    was saved and the presets' simulator is used)."""
    cmd = [PY, "-m", "kvtune", "calibrate", "--target", args.server, "--name", "truth", "--db", db,
           "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(min(args.grid[0])),
           "--kv-cache-memory-bytes", str(CALIBRATION_POOLS * args.pool_bytes),
           "--server-log-dir", str(log_dir)] + (["--quick"] if args.quick else [])
    quantized = [d for d in args.grid[2] if d != "auto"]
    if quantized:  # the grid's quantized cache costs what the probes of the default's cannot show
        cmd += ["--quantized-kv", quantized[0]]
    if args.server == "vllm":
        cmd += ["--model", args.ckpt, "--vllm-platform", "cpu", "--preset", "tiny", "--device", "cpu"]
    log("calibrate: " + " ".join(cmd))
    proc = child(cmd)
    if proc.returncode != 0 or "nothing saved" in proc.stdout:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        print(f"note: kvtune calibrate saved no profile (exit {proc.returncode}); the simulator runs on the "
              f"presets. Its last lines:\n{tail}")
        return None
    return "truth"


def as_served(sim: SimTarget, grid: dict) -> SimTarget:
    """The simulator of the model in the dtype the grid's server kept its KV cache in (kvtune search's
    stage 1 learns the same from its target check): vLLM serves the float32 checkpoint in bf16."""
    for cell in grid.values():
        pool = server_pool_of(cell["reported"]) if cell["params"]["kv_cache_dtype"] == "auto" else None
        dtype = served_dtype(sim.model, pool) if pool is not None else None
        if dtype is not None:
            log(f"the server keeps the KV cache in {dtype}, not the preset's {sim.model.dtype}: so does the sim")
            return sim.with_model(dataclasses.replace(sim.model, dtype=dtype))
    return sim


def sim_values(configs: list[dict], base: EngineConfig, workload, objective, sim: SimTarget) -> dict:
    """{key: (goodput, its SLO percentiles, preemptions)} of one simulator run each."""
    out = {}
    for params in configs:
        try:
            values, sc, result = objective.evaluate(sim.run, dataclasses.replace(base, **params), workload)
            out[key(params)] = (values[0], sc.observed, result.summary.get("preemptions"))
        except (TargetStartError, TargetRunError):
            out[key(params)] = (0.0, {}, None)
    return out


def save_grid(path: Path, grid: dict, grid_s: float, args) -> None:
    """The measured grid, so --grid can rank it again without measuring it again."""
    inputs = {k: getattr(args, k) for k in GRID_INPUTS}
    path.write_text(json.dumps({"inputs": inputs, "grid_s": grid_s, "cells": list(grid.values())}, default=list))


def load_grid(path: str, args) -> tuple[dict, float]:
    """The grid save_grid wrote to `path`; SystemExit with the reason where it cannot be read, is not
    one, or was measured on other inputs than `args`."""
    try:
        data = json.loads(Path(path).read_text())
        saved = {k: (tuple(tuple(x) for x in v) if k == "grid" else v) for k, v in data["inputs"].items()}
        cells = {key(c["params"]): c for c in data["cells"]}
        grid_s = float(data["grid_s"])
    except OSError as err:
        raise SystemExit(f"error: --grid {path}: cannot read it ({err.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"error: --grid {path} is not a grid.json that tuning_truth saved ({err!r})") from None
    inputs = {k: getattr(args, k) for k in GRID_INPUTS}
    differ = [f"{k} {saved.get(k)!r} (saved) vs {inputs[k]!r}" for k in GRID_INPUTS if saved.get(k) != inputs[k]]
    if differ:
        raise SystemExit(f"error: --grid {path} was measured on other inputs: {'; '.join(differ)}")
    return cells, grid_s


def run_search(args, trace: Path, workdir: Path, ckpt: str | None, pool: int, grid_runs: int,
               study: str = "truth") -> tuple[dict | None, str]:
    blocks, seqs, dtypes = args.grid
    budget = args.live_budget or grid_runs // 4
    top_k = args.top_k or max(1, budget // 3 - 1)
    args.search_top_k, args.search_budget = top_k, budget
    cmd = [PY, "-m", "kvtune", "search", "--server-args", f"--kv-cache-memory-bytes {pool}", "--workload", str(trace), "--target", args.server, "--max-model-len", str(MAX_MODEL_LEN),
           "--top-k", str(top_k), "--repeats", "3", "--live-budget", str(budget), "--trials", str(args.trials),
           "--space", f"block_size={','.join(map(str, blocks))}", "--space", f"max_num_seqs={','.join(map(str, seqs))}",
           "--space", f"kv_cache_dtype={','.join(dtypes)}",
           "--db", f"sqlite:///{workdir / 'search.db'}", "--study", study, "--no-report", "--json",
           "--server-log-dir", str(workdir / "search-logs")]
    for slo in args.slo:
        cmd += ["--slo", slo]
    if args.profile:
        cmd += ["--profile", args.profile]  # its model and device replace --preset/--device
    if args.server == "engine":
        cmd += ["--executor", "torch", "--preset", "tiny", "--device", "cpu"]
    else:
        cmd += ["--model", ckpt, "--vllm-platform", "cpu", "--preset", "tiny", "--device", "cpu",
                "--server-env", "HF_HUB_OFFLINE=1"]
    log(f"search: {' '.join(cmd)}")
    proc = child(cmd, cwd=workdir)
    text = proc.stdout + ("\n" + proc.stderr if proc.stderr.strip() else "")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1]), text
    except (IndexError, ValueError):
        return None, text + f"\n(exit {proc.returncode})"


def separated_concordance(sims: list[float], ivs: list) -> tuple[float | None, int]:
    """(concordant - discordant) / pairs over the pairs whose live intervals do not overlap (a sim
    tie counts as neither), and how many such pairs there are."""
    score = pairs = 0
    for i, j in itertools.combinations(range(len(ivs)), 2):
        if ivs[i].overlaps(ivs[j]):
            continue
        pairs += 1
        live, sim = ivs[i].mean - ivs[j].mean, sims[i] - sims[j]
        score += (live * sim > 0) - (live * sim < 0)
    return (score / pairs if pairs else None), pairs


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def kendall(xs: list[float], ys: list[float]) -> float | None:
    try:
        from scipy.stats import kendalltau
        tau = kendalltau(xs, ys).statistic
    except ImportError:  # tau-a, O(n^2)
        n = len(xs)
        s = sum((1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 else 0)
                for i in range(n) for j in range(i + 1, n))
        tau = s / (n * (n - 1) / 2) if n > 1 else float("nan")
    return None if tau is None or not math.isfinite(tau) else float(tau)


def judge_search(res: dict, ivs: dict, best, grid_runs: int, grid_beats: bool) -> dict:
    """One search's verdict against the grid: right or not, its pick's grid mean over the best's, and
    its advice (the verdict and the flags it recommends)."""
    verdict, rec = res.get("verdict"), res.get("recommended")
    out = {"verdict": verdict, "recommended": rec, "leader": res.get("leader"), "live_runs_used": res.get("live_runs"),
           "search_reasons": res.get("reasons"), "recommended_over_best": None, "tied_with_best": None,
           # as verdict_stability counts it: the flags a change recommends, else the verdict
           "advice": f"set {label(rec)}" if rec and verdict in ("better", "smallest_change") else verdict}
    pick = rec or res.get("leader")
    piv = ivs.get(key(pick)) if pick and all(k in pick for k in KNOBS) else None
    if piv is not None:
        out["recommended_over_best"] = round(piv.mean / best.mean, 3) if best.mean > 0 else None
        out["tied_with_best"] = piv.overlaps(best)
    out["recommended_is_leader"] = rec is None and pick is not None
    right = ({"better", "smallest_change"} if grid_beats else {"keep_default", "inconclusive"})
    out["verdict_right"] = verdict in right
    print(f"\nverdict {verdict}; recommended {label(rec) if rec else None}"
          + (f" (leader {label(pick)})" if rec is None and pick else ""))
    if piv is not None:
        print(f"{'recommended' if rec else 'leader (nothing recommended)'}/best: {piv.mean:.2f} / "
              f"{best.mean:.2f} = {out['recommended_over_best']} "
              f"(goal >= 0.95, or tied: {'tied' if out['tied_with_best'] else 'not tied'} within the spread)")
    print(f"verdict right: {out['verdict_right']} (the grid says {'beat' if grid_beats else 'keep'} the "
          f"default; right is {' or '.join(sorted(right))})")
    print(f"live runs: search {out['live_runs_used']} vs grid {grid_runs} "
          f"({(out['live_runs_used'] or 0) / grid_runs:.0%})")
    return out


def search_shares(searches: list[dict], asked: int) -> dict:
    """Over the searches asked for (one that printed nothing counts as missing every goal): the share
    whose verdict was right, whose pick met the recommended/best goal, and that gave the most common advice."""
    if not asked:
        return {}
    advice = Counter(s["advice"] for s in searches)
    goal = [s for s in searches if (s["recommended_over_best"] or 0) >= 0.95 or s["tied_with_best"]]
    return {"share_verdict_right": round(sum(s["verdict_right"] for s in searches) / asked, 3),
            "share_recommended_goal": round(len(goal) / asked, 3),
            "share_same_advice": round(advice.most_common(1)[0][1] / asked, 3) if searches else 0.0,
            "advice": dict(advice)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("engine", "vllm"), default="engine")
    ap.add_argument("--quick", action="store_true", help="12 configs x 3 runs (about 10 minutes on the engine)")
    ap.add_argument("--repeats", type=int, default=3, help="grid runs per config (default: 3)")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (--quick), 96")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--input-len", default="96-192")
    ap.add_argument("--output-len", default="24-48")
    ap.add_argument("--pool-bytes", type=int, default=None,
                    help="the fixed KV pool (default: 1024 tokens of the served K/V: 2 MiB engine, 1 MiB vLLM)")
    ap.add_argument("--slo", action="append", default=None, help="default: ttft_p95=2s, tpot_p95=150ms")
    ap.add_argument("--trials", type=int, default=None, help="stage-1 trials (default: 24 --quick, 48)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="stage-2 configs besides the default (default: what 3 runs each fit in the budget)")
    ap.add_argument("--blocks", help="override the grid's block sizes, e.g. 32,128")
    ap.add_argument("--seqs", help="override the grid's max_num_seqs values, e.g. 8,128")
    ap.add_argument("--dtypes", help="override the grid's kv_cache_dtype values, e.g. auto,fp8")
    ap.add_argument("--live-budget", type=int, default=None, help="default: a quarter of the grid's runs")
    ap.add_argument("--no-search", action="store_true", help="the grid and the simulator only")
    ap.add_argument("--searches", type=int, default=1,
                    help="run the search this many times against the one grid (fresh studies): the share of "
                         "them right, meeting the recommended/best goal and giving the same advice")
    ap.add_argument("--grid", dest="grid_file", metavar="FILE",
                    help="a grid.json an earlier run saved (same inputs): rank it again, measure no grid")
    ap.add_argument("--calibrate", action="store_true",
                    help="first `kvtune calibrate` the server (on 8 grid pools; --quick with --quick); its "
                         "profile, if kvtune saves one, runs the simulator of the ranking and of stage 1")
    ap.add_argument("--profile", metavar="NAME", help="a calibrated profile for the simulator (and stage 1)")
    ap.add_argument("--profile-db", metavar="SQLITE_PATH", help="the sqlite file that holds --profile")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if args.profile and not args.profile_db:
        ap.error("--profile needs --profile-db (the sqlite file kvtune calibrate --db wrote it to)")
    if args.searches < 1:
        ap.error(f"--searches must be at least 1, got {args.searches}")
    if args.pool_bytes is not None and args.pool_bytes <= 0:
        ap.error(f"--pool-bytes must be a positive number of bytes, got {args.pool_bytes}")
    args.mode = "quick" if args.quick else "full"
    args.slo = args.slo or ["ttft_p95=2s", "tpot_p95=150ms"]
    args.requests = args.requests or (64 if args.quick else 96)
    args.pool_bytes = args.pool_bytes or ((2 if args.server == "engine" else 1) << 20)  # 1024 served tokens
    args.trials = args.trials or (24 if args.quick else 48)
    blocks, seqs, dtypes = GRIDS[args.server][args.mode]
    args.grid = (tuple(map(int, args.blocks.split(","))) if args.blocks else blocks,
                 tuple(map(int, args.seqs.split(","))) if args.seqs else seqs,
                 tuple(args.dtypes.split(",")) if args.dtypes else dtypes)
    saved = load_grid(args.grid_file, args) if args.grid_file else None  # before a work dir or a calibration
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    objective = Objective("goodput", tuple(parse_slo(s) for s in args.slo))
    t_start = time.perf_counter()

    workdir = Path(tempfile.mkdtemp(prefix="kvtune-truth-"))
    trace = workdir / "trace.jsonl"
    write_trace(trace, args)
    workload = read_workload(str(trace))
    ckpt = None
    if args.server == "vllm":
        sys.path.insert(0, str(REPO / "tests"))
        from checkpoint import write_tiny_llama
        ckpt = str(workdir / "ckpt")
        write_tiny_llama(ckpt, dtype="float32")
    for sub in ("grid-logs", "search-logs", "calibrate-logs"):
        (workdir / sub).mkdir()
    args.ckpt = ckpt
    db = workdir / "search.db"  # the search's store; a profile it uses must be in it
    if args.profile and args.profile_db:
        shutil.copyfile(args.profile_db.removeprefix("sqlite:///"), db)
    elif args.calibrate:
        args.profile = calibrate(args, f"sqlite:///{db}", workdir / "calibrate-logs")
    args.profile_db = f"sqlite:///{db}"
    target = make_target(args, ckpt, str(workdir / "grid-logs"))
    base = EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=args.pool_bytes)
    default = target.rules.default_config(base)
    dkey = (default.block_size, default.max_num_seqs, default.kv_cache_dtype)
    blocks, seqs, dtypes = args.grid
    configs = [dict(zip(KNOBS, c)) for c in itertools.product(blocks, seqs, dtypes)]
    if dkey not in {key(p) for p in configs}:
        configs.append(dict(zip(KNOBS, dkey)))  # the grid always measures the default itself
    grid_runs = len(configs) * args.repeats
    print(f"# {args.server}: {len(workload)} requests over {workload.duration_s:.1f} s ({args.input_len} prompt, "
          f"{args.output_len} output tokens), KV pool {args.pool_bytes} bytes, max-model-len {MAX_MODEL_LEN}, "
          f"SLOs {', '.join(args.slo)}; grid {len(configs)} configs x {args.repeats} runs, interleaved, "
          f"a server start per run; default {label(dict(zip(KNOBS, dkey)))}; work dir {workdir}", flush=True)

    if saved is not None:
        grid, grid_s = saved
        log(f"the grid measured earlier: {args.grid_file}")
    else:
        t_grid = time.perf_counter()
        servers = track_servers(target)
        try:
            grid = run_grid(target, configs, base, workload, objective, args.repeats)
        finally:
            for server in servers:
                server.stop()  # a no-op for those already stopped
        grid_s = time.perf_counter() - t_grid
        save_grid(workdir / "grid.json", grid, grid_s, args)
        log(f"the grid is saved in {workdir / 'grid.json'} (--grid FILE ranks it again)")
    sim = as_served(sim_target(args.profile_db, args.profile), grid)
    sims = sim_values(configs, base, workload, objective, sim)
    ivs = {k: interval(c["values"]) for k, c in grid.items()}
    measured = {k: iv for k, iv in ivs.items() if iv is not None}
    if not measured:
        print("error: no grid run completed; see the logs in " + str(workdir), file=sys.stderr)
        return 1
    best_key = max(measured, key=lambda k: measured[k].mean)
    best, dflt = measured[best_key], ivs.get(dkey)

    print(f"\ngrid ({grid_s:.0f} s): goodput req/s, mean [bootstrap interval] over runs; sim: one simulator run")
    for k in sorted(grid, key=lambda k: -(ivs[k].mean if ivs[k] else -1)):
        c, iv = grid[k], ivs[k]
        prem = [p for p in c["preemptions"] if p is not None]
        marks = (" <- default" if k == dkey else "") + (" <- best" if k == best_key else "")
        figs = f"{iv.mean:6.2f} [{iv.lo:.2f}, {iv.hi:.2f}] n={iv.n}" if iv else "   -- no run completed"
        ttft = [o.get("ttft_p95") for o in c.get("observed", []) if o.get("ttft_p95") is not None]
        sim_v, sim_obs, sim_prem = sims[k]
        print(f"  {label(c['params'])}  {figs}  meets SLOs {sum(c['feasible'])}/{len(c['values'])}  "
              f"ttft p95 {_ms(sum(ttft) / len(ttft) if ttft else None)}  "
              f"preemptions {sum(prem) / len(prem) if prem else float('nan'):.1f}  "
              f"| sim {sim_v:.2f}, ttft p95 {_ms(sim_obs.get('ttft_p95'))}, preemptions {sim_prem}{marks}"
              + (f"  errors: {c['errors'][0]}" if c["errors"] else "")
              + (f"  doubts: {len(c['doubts'])}" if c["doubts"] else ""))
    doubts = Counter(re.sub(r"\d+", "N", d) for c in grid.values() for d in c["doubts"])
    if doubts:
        print(f"doubts kvtune raises on the grid's runs ({sum(doubts.values())} in {grid_runs} runs): "
              + "; ".join(f"{n}x {d}" for d, n in doubts.most_common(3)))
    # the grid's own test is the verdict's: Welch, one-sided, at 5 %
    test = welch(best, dflt) if dflt is not None and best_key != dkey else None
    grid_beats = dflt is None or (test is not None and test.p < 0.05)
    print(f"grid: the best {'beats' if grid_beats else 'does not beat'} the default by Welch's t-test at 5 % "
          f"(best {best.mean:.2f} [{best.lo:.2f}, {best.hi:.2f}], default "
          + (f"{dflt.mean:.2f} [{dflt.lo:.2f}, {dflt.hi:.2f}]" if dflt else "no run completed")
          + (f"; one-sided p = {test.p:.2g})" if test else ")"))

    keys = [k for k in measured]
    tau = kendall([sims[k][0] for k in keys], [measured[k].mean for k in keys])
    print(f"Kendall's tau, simulator vs live grid means over {len(keys)} configs: "
          f"{'n/a' if tau is None else f'{tau:.3f}'} (goal >= 0.7)")
    sep_tau, sep_pairs = separated_concordance([sims[k][0] for k in keys], [measured[k] for k in keys])
    print(f"over the {sep_pairs} of {len(keys) * (len(keys) - 1) // 2} pairs the grid separates (intervals apart): "
          f"{'n/a' if sep_tau is None else f'{sep_tau:.3f}'}")

    out = {"server": args.server, "mode": args.mode, "grid_live_runs": grid_runs, "grid_s": round(grid_s, 1),
           "sim": (f"profile {args.profile}" if args.profile else "presets tiny/cpu") + f", {sim.model.dtype}",
           "kendall_tau": None if tau is None else round(tau, 3), "grid_beats_default": grid_beats,
           "separated_tau": None if sep_tau is None else round(sep_tau, 3), "separated_pairs": sep_pairs,
           "best": dict(zip(KNOBS, best_key)), "default": dict(zip(KNOBS, dkey)),
           "recommended_over_best": None, "tied_with_best": None, "verdict_right": None, "verdict": None,
           "recommended": None, "live_runs_used": None,
           "grid": [{**grid[k]["params"], "mean": iv.mean if iv else None, "lo": iv.lo if iv else None,
                     "hi": iv.hi if iv else None, "n": iv.n if iv else 0, "sim": sims[k][0],
                     "feasible_runs": sum(grid[k]["feasible"]), "doubts": len(grid[k]["doubts"])}
                    for k, iv in ivs.items()]}
    if not args.no_search:
        searches = []
        for i in range(args.searches):
            t1 = time.perf_counter()
            res, text = run_search(args, trace, workdir, ckpt, args.pool_bytes, grid_runs, f"truth-{i + 1}")
            print(f"\nkvtune search {i + 1} of {args.searches} ({time.perf_counter() - t1:.0f} s), its output:")
            print("\n".join("  " + ln for ln in text.splitlines() if ln.strip() and not ln.startswith("{")))
            if res is None:
                print("error: kvtune search printed no JSON line", file=sys.stderr)
                continue
            searches.append(judge_search(res, ivs, best, grid_runs, grid_beats) | {
                "search_s": round(time.perf_counter() - t1, 1), "search_top_k": args.search_top_k,
                "search_live_budget": args.search_budget})
        out.update(searches[0] if searches else {})
        out["searches"] = searches
        out.update(search_shares(searches, args.searches))
        if args.searches > 1:
            print(f"\nover {args.searches} searches: verdict right {out['share_verdict_right']}, recommended/best "
                  f"goal met {out['share_recommended_goal']}, the same advice {out['share_same_advice']} "
                  f"(goal >= 0.9): {out['advice']}")
    out["total_s"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Stop, KeyboardInterrupt) as err:  # the servers and kvtune children were stopped on the way out
        print(f"error: stopped ({err or 'interrupt'})", file=sys.stderr)
        sys.exit(1)
