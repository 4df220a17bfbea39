"""`kvtune search`: the main job. Stage 1 on the sim target, stage 2 on a live one."""
from __future__ import annotations

import json
import sys
import time

from sqlalchemy.exc import DBAPIError

from kvengine.config import EngineConfig, device_preset, model_preset

from .commands import COMMANDS
from .args import add_db_argument
from ..calibrate import get_profile
from ..environment import host_environment
from ..store import Store, StoreError, resolve_db_url
from ..diagnose.trial import Simulator, diagnosed
from ..targets import SimTarget
from .target import add_server_flags, live_target
from ..workload import FORMATS, head, read_workload
from .args import positive_float, positive_int
from ..search.objective import OBJECTIVES, Objective
from ..search.slo import diagnosis_thresholds, parse_slo
from ..search.space import SearchSpace, load_space
from ..targets import TargetRunError, TargetStartError
from ..search.ranking import describe
from ..search.stage2 import DEFAULT_NUMBER, Candidate, LivePlan, default_params, representable, run_stage2
from ..search.study import SAMPLERS, Stage1, is_feasible, open_storage, open_study, ranked_trials

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
    g.add_argument("--preset", default="llama-3-8b", help="model preset (default: %(default)s)")
    g.add_argument("--device", default="h100-80gb", help="device preset (default: %(default)s)")
    g.add_argument("--max-model-len", type=positive_int, help="fixed for every trial (default: the model's)")
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
    live_targets: list = []  # a server the target check kept for the first live run stops with the search
    try:
        return _search(args, live_targets)
    finally:
        for live in live_targets:
            live.close()


def _search(args, live_targets: list) -> int:
    try:
        slos = tuple(parse_slo(s) for s in args.slo)
        objective = Objective(args.objective, slos, latency=args.latency)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    optional = tuple(name for name, on in (("max_num_batched_tokens", args.search_batched_tokens),
                                           ("enable_prefix_caching", args.search_prefix_caching)) if on)
    space = load_space(args.space_file, args.space, optional)
    db_url = resolve_db_url(args.db)
    workload = read_workload(args.workload, format=args.format)  # a bad trace fails before anything is made
    if args.profile:
        profile = get_profile(args.db, args.profile)
        sim = profile.sim_target()
        model, device = sim.model, sim.device
        args.preset, args.device = profile.model, profile.device
    else:
        model, device = model_preset(args.preset), device_preset(args.device)
        sim = SimTarget(model, device)
    base = EngineConfig(max_model_len=args.max_model_len)
    live = _live_target(args) if args.target != "none" else None
    live_targets += [live] if live is not None else []
    sim_base, default = base, base.resolve(model, device)
    if live is not None:
        # the live target's own rules: what it takes, what it runs when given no flags, its pool
        space, notes = space.for_target(live.rules, _explicit_knobs(space, optional))
        sim_base = live.rules.sim_config(base)
        default = live.rules.default_config(sim_base).resolve(model, device)
        if sim_base is not base:
            notes.append(f"stage 1 sizes the KV pool as the live server does: {live.rules.pool_text}")
        for note in notes:
            print(f"note: {note}")
    store = Store(db_url)
    name = _study_name(args)
    attrs = {"workload": args.workload, "preset": args.preset, "device": args.device, "profile": args.profile,
             "slos": [str(s) for s in slos],
             "slo_specs": [{"metric": s.metric, "percentile": s.percentile, "threshold_s": s.threshold_s} for s in slos],
             "space": {k.name: _knob_text(k) for k in space.knobs},
             "latency": args.latency, "live_requests": args.live_head}
    study = open_study(open_storage(db_url, args.heartbeat), name, objective, args.sampler, args.seed, attrs)
    stage1 = Stage1(study, space, sim_base, objective, sim.run, workload, store, args.trials)
    dflt = default_params(space, default)
    study.set_user_attr("default_params", dflt)  # the report's and the UI's "default" is this one
    study.set_user_attr("environment", host_environment())  # where this search ran, for the report
    if representable(space, dflt):
        stage1.enqueue(dflt)
    if live is not None:
        print(f"checking the {args.target} target: starting it with its default config (kept for its first live run)")
        try:
            live.check(space.config(dflt, base))
        except (TargetStartError, TargetRunError) as err:
            print(f"error: the {args.target} target does not serve, so stage 2 could not measure; fix this "
                  f"before a search (nothing was searched):\n{err}", file=sys.stderr)
            return 2
    print(f"study {name!r} in {store.display_url}: {args.trials} stage-1 trials of {args.preset} on "
          f"{args.device}, objective {objective.kind}" + (f", SLOs {', '.join(map(str, slos))}" if slos else ""))
    with _progress(args.trials) as on_trial:
        stage1.on_trial = on_trial
        stage1.optimize()
    ranked = ranked_trials(study, objective)
    if not ranked:
        print("error: no stage-1 trial completed; see the failed trials' reasons above", file=sys.stderr)
        return 1
    feasible = [t for t in ranked if is_feasible(t)]
    if slos and not feasible:
        print(_nothing_feasible(ranked[0], slos))
    if args.target != "none":
        candidates = [Candidate("default" if t.params == dflt else f"trial {t.number}", t.number, dict(t.params))
                      for t in ranked[:args.top_k]]
        if all(c.label != "default" for c in candidates):
            dnum = next((t.number for t in ranked if t.params == dflt), DEFAULT_NUMBER)
            candidates.append(Candidate("default", dnum, dflt))
        candidates.sort(key=lambda c: c.label != "default")  # the default first: it runs on the checked server
        live_workload = head(workload, args.live_head) if args.live_head else workload
        plan = LivePlan(args.repeats, max(args.max_repeats, args.repeats), args.live_budget)
        print(f"stage 2: {len(candidates)} configs on the {args.target} target, {plan.repeats}-{plan.max_repeats} "
              f"runs each, interleaved ({len(live_workload)} requests over {live_workload.duration_s:.0f} s a run)")
        run_stage2(live.run, candidates, space, base, live_workload, objective, store, name, plan,
                   on_result=lambda o: print(f"  {o.candidate.label} #{o.repeat}: " + (
                       f"failed: {o.error}" if o.error else _score_text(o.score))),
                   simulator=Simulator.of(sim, live_workload, args.profile))
        for note in plan.notes:
            print(f"note: {note}")
    from ..report.data import load_report_data  # the report's verdict is the one printed here
    data = load_report_data(db_url, name)
    shown = [v.run_id for v in (data.best_run, data.default_run) if v is not None]
    if stage1.keep_full(shown):  # a stage-1 run the report shows was stored in summary: back in full
        data = load_report_data(db_url, name)
    _diagnose_shown(store, data, Simulator.of(sim, workload, args.profile), slos)
    print(_final_table(data, objective))
    print(describe(data.verdict))
    report = None
    if not args.no_report:
        from ..report import write_report
        md, html = write_report(db_url, name, args.report_dir or f"reports/{name}")
        report = str(md)
        print(f"report: {md} and {html}")
    v = data.verdict
    if args.json:
        rec = v.recommended
        print(json.dumps({"study": name, "feasible": bool(feasible), "verdict": v.kind, "stage": v.stage,
                          "reasons": v.reasons, "recommended": rec.params if rec else None,
                          "recommended_label": rec.label if rec else None,
                          "leader": v.leader.params if v.leader else None,
                          "best_trial": ranked[0].number, "best_params": ranked[0].params,
                          "best_values": ranked[0].values, "report": report,
                          "live": [_live_json(c) for c in data.candidates if c.runs],
                          "live_runs": sum(len(c.runs) for c in data.candidates)}))
    return 3 if live is not None and not v.measured else 0  # the live stage could not measure


def _diagnose_shown(store: Store, data, simulator: Simulator, slos) -> None:
    """The stage-1 runs the report shows are diagnosed once, here, with the study's SLOs (stage 2
    stored its own runs' diagnoses): the report and the UI read them."""
    thresholds = diagnosis_thresholds(list(slos))
    for view in (data.best_run, data.default_run):
        if view is None or view.stage != "sim":
            continue
        try:
            if not store.load_diagnoses(view.run_id):
                store.save_diagnoses(view.run_id, diagnosed(view.result, thresholds, simulator, slos))
        except (StoreError, DBAPIError) as err:  # another worker of the study rewrote the run meanwhile
            print(f"note: the diagnoses of run {view.run_id} were not stored ({str(err).splitlines()[0][:200]}); "
                  f"`kvtune diagnose --run {view.run_id}` works them out")


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
                print(f"  trial {record.number}: {state}{reason} ({self.done} run by this process)", flush=True)
        return on_trial

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def _live_target(args):
    preset, device = (args.preset, args.device) if args.executor == "sim" else ("tiny", "cpu")
    if args.target != "engine":
        preset, device = args.preset, args.device
    return live_target(args.target, args, preset, device)


def _explicit_knobs(space: SearchSpace, optional: tuple[str, ...]) -> set[str]:
    """The knobs whose values the operator chose (--space, --space-file)."""
    default = {k.name: k for k in SearchSpace.default(optional).knobs}
    return {k.name for k in space.knobs if default.get(k.name) != k}


def _knob_text(knob) -> str:
    if knob.choices is not None:
        return ",".join(map(str, knob.choices))
    return f"{knob.low:g}:{knob.high:g}" + (":log" if knob.log else f":{knob.step:g}" if knob.step else "")


def _score_text(sc) -> str:
    obs = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sc.observed.items() if v is not None)
    return (f"goodput {sc.goodput_rps:.2f} req/s, throughput {sc.throughput_rps:.2f} req/s"
            + (f", {obs}" if obs else "") + ("" if sc.feasible else " (misses SLOs)"))


def _nothing_feasible(closest, slos) -> str:
    misses = []
    for slo in slos:
        observed = closest.user_attrs.get(f"observed_{slo.name}")
        if observed is not None and observed > slo.threshold_s:
            misses.append(f"{slo.name} {observed * 1000:.0f} ms vs {slo.threshold_s * 1000:g} ms")
    return (f"no configuration met the SLOs; the closest, trial {closest.number} ({_params_text(closest.params)}), "
            f"misses {'; '.join(misses) or 'them'}. The report's diagnoses say why.")


def _params_text(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items())


def _final_table(data, objective: Objective) -> str:
    """The compared configs, best first, the default last: stage 1's value and the live runs'
    mean with its interval (n runs)."""
    unit = "" if objective.kind == "capacity" else " req/s"
    lines = [f"{'config':>10}  {'block':>5} {'util':>5} {'seqs':>5} {'kv':>9}  {'sim value':>12}  "
             f"{'live mean [95% interval] (runs)':>34}  feasible"]
    for c in data.candidates:
        p = c.params
        util = p.get("gpu_memory_utilization")
        sim = "-" if c.sim is None or not c.sim.ok else f"{c.sim.value:.2f}{unit}"
        iv = c.spread.get("value")
        if iv is not None:
            live = f"{iv.mean:.2f} [{iv.lo:.2f}, {iv.hi:.2f}]{unit} ({iv.n})"
        else:
            live = "failed" if c.runs else "-"
        m = c.measured
        feas = "-" if m is None or not m.ok else ("yes" if m.feasible else "no")
        label = "default" if c.is_default else c.label.replace("trial ", "")
        lines.append(f"{label:>10}  {p.get('block_size', '-'):>5} {'-' if util is None else f'{util:.2f}':>5} "
                     f"{p.get('max_num_seqs', '-'):>5} {p.get('kv_cache_dtype', '-'):>9}  {sim:>12}  {live:>34}  {feas}")
    return "\n".join(lines)
