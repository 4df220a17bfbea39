"""`kvtune search`: the main job. Stage 1 on the sim target, stage 2 on a live one; the flow is
kvtune/search/flow.py's, this module parses the flags and prints what the flow says."""
from __future__ import annotations

import dataclasses
import json
import sys
import time

from kvengine.config import QUANTIZATION_FLAGS, ConfigError, device_preset, model_preset
from kvengine.entrypoints.flags import given_flags

from .commands import COMMANDS
from .args import add_db_argument
from ..calibrate import get_profile
from ..store import resolve_db_url
from ..targets import SimTarget
from .target import add_server_flags, live_target, simulated_model_device
from .ray import add_ray_argument, connect_ray
from ..workload import FORMATS, read_workload
from .args import add_max_concurrency, positive_float, positive_int
from ..search.flow import SearchError, SearchRequest, run_search
from ..search.objective import OBJECTIVES, Objective
from ..search.slo import parse_slo
from ..search.space import SearchSpace, load_space
from ..search.advice import describe
from ..search.stage2 import LivePlan
from ..search.study import SAMPLERS

LIVE_TARGETS = ("engine", "vllm", "sglang", "none")


def add_search_command(sub) -> None:
    p = sub.add_parser(
        "search", help=COMMANDS["search"].help,
        description="Search block_size, gpu_memory_utilization, max_num_seqs and kv_cache_dtype (and "
                    "optionally max_num_batched_tokens, enable_prefix_caching) with Optuna: stage 1 on the "
                    "sim target, stage 2 re-runs the top configs and vLLM's default on a live target. Ends "
                    "with a report and the exact launch command.")
    p.add_argument("--workload", required=True, metavar="FILE", help="the trace of your traffic")
    p.add_argument("--format", choices=FORMATS, help="trace format (default: detected)")
    add_max_concurrency(p)
    p.add_argument("--baseline-args", default="", metavar="ARGS",
                   help="the KV-cache and scheduler flags of your current deployment, as one shell string (e.g. "
                        "\"--block-size 32 --max-num-seqs 128\"): every config is it with the searched knobs "
                        "changed, and the verdict compares with it instead of the server's defaults; flags every "
                        "server should get, and its environment, go in --server-args and --server-env")
    p.add_argument("--slo", action="append", default=[], metavar="METRIC_pPCT=VALUE",
                   help="e.g. ttft_p95=500ms, tpot_p95=50ms, e2e_p99=10s (repeatable)")
    p.add_argument("--objective", choices=OBJECTIVES, default="goodput",
                   help="goodput (req/s meeting every SLO), throughput, multi (throughput vs --latency), "
                        "capacity (highest rate scale within the SLOs) (default: %(default)s)")
    p.add_argument("--latency", default="ttft_p95", help="the multi objective's latency axis (default: %(default)s)")
    p.add_argument("--trials", type=positive_int, default=200, help="stage-1 trials in the study (default: %(default)s)")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default: %(default)s)")
    p.add_argument("--space", action="append", default=[], metavar="KNOB=VALUES",
                   help="override a knob's range: block_size=16,32 or max_num_seqs=32:512:log or "
                        "gpu_memory_utilization=0.85:0.95:0.01 (repeatable)")
    p.add_argument("--space-file", metavar="YAML", help="the search space as YAML (knob: list or {low, high, step, log})")
    p.add_argument("--search-batched-tokens", action="store_true", help="also search max_num_batched_tokens")
    p.add_argument("--search-prefix-caching", action="store_true", help="also search enable_prefix_caching")
    g = p.add_argument_group("the model and device of stage 1")
    g.add_argument("--hf-config", dest="preset", metavar="PATH",
                   help="the model of a Hugging Face config.json (or its folder), instead of a --preset")
    g.add_argument("--preset", help="model preset (default: the config.json of a local --model the target serves, "
                                    "else llama-3-8b)")
    g.add_argument("--device", help="device preset (default: cpu for a server kvtune starts on the CPU, else "
                                    "h100-80gb)")
    g.add_argument("--max-model-len", type=positive_int, help="fixed for every trial (default: the model's)")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="GPUs one replica is split over, fixed for every trial (default: %(default)s)")
    g.add_argument("--quantization", choices=tuple(QUANTIZATION_FLAGS), metavar="METHOD",
                   help="vLLM's --quantization of the served weights, fixed for every trial (default: the "
                        "checkpoint's quantization_config)")
    g.add_argument("--gpus", type=positive_int, metavar="N",
                   help="the GPUs to serve with: stage 1 also chooses TP among N's divisors (unless "
                        "--tensor-parallel-size fixes it), N / TP replicas sharing the traffic evenly")
    g.add_argument("--profile", metavar="NAME",
                   help="a calibrated cost profile (kvtune calibrate --name NAME) for stage 1; its model and "
                        "device replace --preset/--device")
    g = p.add_argument_group("stage 2")
    g.add_argument("--target", choices=LIVE_TARGETS, default="engine",
                   help="where to re-run the best configs; none skips stage 2 (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=3, help="configs re-run live, besides the default (default: %(default)s)")
    g.add_argument("--executor", choices=("sim", "torch"), default="sim",
                   help="the engine target's executor: sim serves the same simulated device in wall-clock "
                        "time (default: %(default)s)")
    g.add_argument("--live-head", type=positive_int, metavar="N", help="stage 2 replays only the first N requests")
    g.add_argument("--repeats", type=positive_int, default=3,
                   help="runs of every live config, interleaved, before a verdict (default: %(default)s)")
    g.add_argument("--max-repeats", type=positive_int, default=5,
                   help="while the leader and the default still overlap, run up to this many (default: %(default)s)")
    g.add_argument("--live-budget", type=positive_int, metavar="RUNS",
                   help="most live runs in all, the default's included (default: no cap)")
    add_ray_argument(g, "run the search on a Ray cluster: stage 1's trials as one task per CPU sharing the "
                        "study (--db must reach every node: postgresql://... on a cluster of several machines), "
                        "stage 2's rounds one per slot (the GPUs of --tensor-parallel-size on one node), as "
                        "many at once as it has slots")
    add_server_flags(p)
    g = p.add_argument_group("storage and output")
    add_db_argument(g)
    g.add_argument("--study", help="study name: resume it, or share it with other kvtune search processes "
                                   "(default: a new name from the workload and the time)")
    g.add_argument("--heartbeat", type=positive_float, default=30.0, metavar="S",
                   help="trial heartbeat; trials of a killed process fail after 3x this (default: %(default)s)")
    g.add_argument("--report-dir", metavar="DIR", help="where the report goes (default: reports/<study>/)")
    g.add_argument("--no-report", action="store_true", help="do not write the report")
    g.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.set_defaults(func=cmd_search)


def _study_name(args) -> str:
    from pathlib import Path
    return args.study or f"{Path(args.workload).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_search(args) -> int:
    # a server the target check kept for the first live run stops with the search, and then the Ray
    # connection (and a cluster --ray local started)
    to_close: list = []
    try:
        return _search(args, to_close)
    finally:
        for each in to_close:
            each.close()


def _search(args, to_close: list) -> int:
    try:
        slos = tuple(parse_slo(s) for s in args.slo)
        objective = Objective(args.objective, slos, latency=args.latency)
        baseline = given_flags(args.baseline_args, "--baseline-args")
        if args.max_concurrency and args.objective == "capacity":
            raise ValueError("--objective capacity scales the arrival rate, and with --max-concurrency the "
                             "clients' slots set it: choose goodput or throughput for a closed loop")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    optional = tuple(name for name, on in (("max_num_batched_tokens", args.search_batched_tokens),
                                           ("enable_prefix_caching", args.search_prefix_caching)) if on)
    space = load_space(args.space_file, args.space, optional)
    db_url = resolve_db_url(args.db)
    # a bad trace fails before anything is made
    workload = read_workload(args.workload, format=args.format).closed_loop(args.max_concurrency)
    if args.profile:
        profile = get_profile(args.db, args.profile)
        sim = profile.sim_target()
        args.preset, args.device = profile.model, profile.device
        dtypes = next((k.grid() for k in space.knobs if k.name == "kv_cache_dtype"), [])
        untimed = profile.untimed_kv_dtypes(dtypes)
        if untimed:
            print(f"note: cost profile {profile.name!r} did not time a quantized KV cache, so stage 1 prices "
                  f"{', '.join(untimed)} at its bytes alone; where the server dequantizes in software (a CPU) "
                  f"that is optimistic. `kvtune calibrate --quantized-kv {untimed[0]}` times it")
    else:
        try:
            asked = args.device
            args.preset, args.device = simulated_model_device(args)
            if asked is None and args.device == "cpu":
                print("note: the live server runs on this CPU: stage 1 simulates the `cpu` preset, a rough "
                      "estimate; `kvtune calibrate` fits its timings (then --profile NAME)")
            sim = SimTarget(model_preset(args.preset), device_preset(args.device))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    live = _live_target(args) if args.target != "none" else None
    stage1_runner = pool = None
    if args.ray:
        try:
            live, stage1_runner, pool = _on_ray(args, live, db_url)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    to_close += [each for each in (live, pool) if each is not None]
    request = SearchRequest(
        workload=workload, workload_path=args.workload, objective=objective, space=space, sim=sim,
        preset=args.preset, device=args.device, study=_study_name(args), db_url=db_url, trials=args.trials,
        sampler=args.sampler, seed=args.seed, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization, gpus=args.gpus,
        heartbeat_s=args.heartbeat,
        profile=args.profile, live=live, live_kind=args.target, explicit_knobs=_explicit_knobs(space, optional),
        top_k=args.top_k, live_head=args.live_head,
        plan=LivePlan(args.repeats, max(args.max_repeats, args.repeats), args.live_budget),
        baseline=baseline, baseline_args=args.baseline_args.strip(), stage1_runner=stage1_runner)
    try:
        outcome = run_search(request, say=print, stage1_progress=_progress, on_live=_print_live)
    except SearchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    data, name = outcome.data, outcome.study
    print(_final_table(data, objective))
    print(describe(data.verdict))
    report = None
    if not args.no_report:
        from ..report import write_report
        md, html = write_report(db_url, name, args.report_dir or f"reports/{name}", data)
        report = str(md)
        print(f"report: {md} and {html}")
    v = data.verdict
    if args.json:
        rec = v.recommended  # the one answer: stage 1's best is an input to stage 2, not advice
        print(json.dumps({"study": name, "feasible": bool(outcome.feasible), "verdict": v.kind, "stage": v.stage,
                          "reasons": v.reasons, "recommended": rec.params if rec else None,
                          "recommended_label": rec.label if rec else None,
                          "equivalent": [c.params for c in v.beat],
                          "leader": v.leader.params if v.leader else None, "report": report,
                          "measured_on": data.measured_on(v.stage),
                          "reference": v.reference, "alpha": v.alpha,
                          "comparisons": [dataclasses.asdict(c) for c in v.comparisons],
                          "live": [_live_json(c) for c in data.candidates if c.runs],
                          "live_runs": sum(len(c.runs) for c in data.candidates)}))
    return 3 if live is not None and not v.measured else 0  # the live stage could not measure


def _print_live(o) -> None:
    print(f"  {o.candidate.label} #{o.repeat}: " + (f"failed: {o.error}" if o.error else _score_text(o.score)))


def _live_json(c) -> dict:
    spread = {k: {"mean": iv.mean, "lo": iv.lo, "hi": iv.hi, "n": iv.n} for k, iv in c.spread.items()}
    return {"label": c.label, "params": c.params, "is_default": c.is_default, "runs": len(c.runs),
            "completed": sum(m.ok for m in c.runs), "errors": [m.reason for m in c.runs if m.reason],
            "feasible": c.live.feasible if c.live else None, "spread": spread}


class _progress:
    """A rich progress bar on a terminal; a line every tenth of the trials otherwise."""

    def __init__(self, total: int):
        self.total = total

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.progress = Progress(TextColumn("stage 1"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), disable=not sys.stdout.isatty())
        self.progress.__enter__()
        self.task = self.progress.add_task("", total=self.total)
        self.done = 0

        def on_trial(record):
            self.done += 1
            state = "failed" if record.state == "FAIL" else ("ok" if record.feasible else "infeasible")
            self.progress.update(self.task, advance=1, description=f"trial {record.number} {state}")
            if self.progress.disable and (self.done % max(1, self.total // 10) == 0 or record.state == "FAIL"):
                reason = f": {record.reason}" if record.reason else ""
                print(f"  trial {record.number}: {state}{reason} ({self.done} run by this search)", flush=True)
        return on_trial

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def _live_target(args):
    preset, device = (args.preset, args.device) if args.executor == "sim" else ("tiny", "cpu")
    if args.target != "engine":
        preset, device = args.preset, args.device
    return live_target(args.target, args, preset, device)


def _on_ray(args, live, db_url: str):
    """The Ray cluster --ray names (cli.ray.connect_ray): (`live` with its servers started there
    (cluster.target.RayTarget; None without a live target), stage 1's runner there
    (cluster.stage1.Stage1OnRay; None where its tasks cannot reach the database: a note says why),
    the pool). A ValueError says why not, before anything is written."""
    from ..cluster.stage1 import Stage1OnRay, sqlite_reason
    from ..cluster.target import RayTarget

    pool = connect_ray(args, args.tensor_parallel_size)
    reason = sqlite_reason(db_url, pool)
    if reason is not None:
        print(f"note: --ray {args.ray}: stage 1 runs here, not on the cluster: {reason}")
    return (RayTarget(live, pool) if live is not None else None,
            Stage1OnRay(pool) if reason is None else None, pool)


def _explicit_knobs(space: SearchSpace, optional: tuple[str, ...]) -> set[str]:
    """The knobs whose values the operator chose (--space, --space-file)."""
    default = {k.name: k for k in SearchSpace.default(optional).knobs}
    return {k.name for k in space.knobs if default.get(k.name) != k}


def _score_text(sc) -> str:
    obs = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sc.observed.items() if v is not None)
    return (f"goodput {sc.goodput_rps:.2f} req/s, throughput {sc.throughput_rps:.2f} req/s"
            + (f", {obs}" if obs else "") + ("" if sc.feasible else " (misses SLOs)"))


def _final_table(data, objective: Objective) -> str:
    """The compared configs, best first, the default last: stage 1's value and the live runs'
    mean with its interval (n runs)."""
    unit = "" if objective.kind == "capacity" else " req/s"
    tp = any("tensor_parallel_size" in c.params for c in data.candidates)
    lines = [f"{'config':>10}  {'block':>5} {'util':>5} {'seqs':>5} {'kv':>9}" + (f" {'tp':>3}" if tp else "")
             + f"  {'sim value':>12}  {'live mean [95% interval] (runs)':>34}  feasible"]
    for c in data.candidates:
        p = c.params
        util = p.get("gpu_memory_utilization")
        sim = "-" if c.sim is None else "failed" if not c.sim.ok else f"{c.sim.value:.2f}{unit}"
        iv = c.spread.get("value")
        if iv is not None:
            live = f"{iv.mean:.2f} [{iv.lo:.2f}, {iv.hi:.2f}]{unit} ({iv.n})"
        else:
            live = "failed" if c.runs else "-"
        m = c.measured
        feas = "-" if m is None or not m.ok else ("yes" if m.feasible else "no")
        label = c.label.replace("the ", "") if c.is_default else c.label.replace("trial ", "")
        lines.append(f"{label:>10}  {p.get('block_size', '-'):>5} {'-' if util is None else f'{util:.2f}':>5} "
                     f"{p.get('max_num_seqs', '-'):>5} {p.get('kv_cache_dtype', '-'):>9}"
                     + (f" {p.get('tensor_parallel_size', '-'):>3}" if tp else "")
                     + f"  {sim:>12}  {live:>34}  {feas}")
    return "\n".join(lines)
