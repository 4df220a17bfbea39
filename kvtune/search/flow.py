"""The search from start to end: stage 1 on the simulator, the live stage, one ranking, and the
scores and diagnoses stored with the runs. `kvtune search` builds a SearchRequest and prints what
this says; the report and the UI only read what it stored.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from kvengine.config import EngineConfig
from sqlalchemy.exc import DBAPIError

from ..diagnose.trial import Simulator, diagnosed
from ..environment import host_environment
from ..plan import served_dtype, server_pool_of
from ..store import Store, StoreError
from ..targets import LiveTarget, SimTarget, TargetRunError, TargetStartError
from ..workload import Workload, head
from .objective import Objective
from .report_data import ReportData, load_report_data
from .slo import diagnosis_thresholds
from .space import SearchSpace, tensor_parallel_knob
from .stage2 import (
    LiveOutcome,
    LivePlan,
    default_params,
    live_candidates,
    simpler_leaders,
    representable,
    run_stage2,
)
from .study import Stage1, is_feasible, open_storage, open_study, ranked_trials, trial_score


class SearchError(Exception):
    """The search could not go on; `exit_code` is the command's (2: the live target does not serve,
    1: no stage-1 trial completed)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class SearchRequest:
    """A search, its inputs parsed and checked by the caller."""
    workload: Workload
    workload_path: str
    objective: Objective
    space: SearchSpace  # as asked; the live target's rules narrow it
    sim: SimTarget
    preset: str
    device: str
    study: str
    db_url: str
    trials: int
    sampler: str = "tpe"
    seed: int = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1  # fixed for every trial: the GPUs one replica spans
    quantization: str | None = None  # vLLM's --quantization, fixed for every trial
    gpus: int | None = None  # the GPUs to serve with: TP searched among its divisors (unless fixed), gpus / TP replicas
    heartbeat_s: float = 30.0
    profile: str | None = None  # a calibrated cost profile's name
    live: LiveTarget | None = None  # None: stage 1 only
    live_kind: str = "none"
    explicit_knobs: set[str] = field(default_factory=set)  # the knobs whose values the operator chose
    top_k: int = 3
    live_head: int | None = None
    plan: LivePlan = field(default_factory=lambda: LivePlan(3, 5, None))
    # --baseline-args: the operator's deployment, {knob: value} (as given_flags reads it) and its text;
    # every config is it with the searched knobs changed, and the verdict is against it
    baseline: dict = field(default_factory=dict)
    baseline_args: str = ""
    # runs stage 1's trials elsewhere, in place of Stage1.optimize here: `runner(stage1, request, say)`
    # (cluster.stage1.Stage1OnRay: tasks on a Ray cluster sharing the study); None: in this process
    stage1_runner: Callable[[Stage1, SearchRequest, Callable[[str], None]], None] | None = None


@dataclass
class SearchOutcome:
    study: str
    ranked: list  # stage 1's completed trials, best first
    feasible: list
    data: ReportData  # the study's results: its verdict is the one ranking's


def run_search(req: SearchRequest, say: Callable[[str], None] = print,
               stage1_progress: Callable[[int], AbstractContextManager] | None = None,
               on_live: Callable[[LiveOutcome], None] | None = None) -> SearchOutcome:
    """Run `req`; `say` hears each note and stage line, `stage1_progress(trials)` gives the context whose
    value is told of each stage-1 trial, `on_live` of each live run."""
    model, device = req.sim.model, req.sim.device
    base = EngineConfig(max_model_len=req.max_model_len, tensor_parallel_size=req.tensor_parallel_size,
                        quantization=req.quantization)
    base = dataclasses.replace(base, **req.baseline)
    space, sim_base, default = req.space, base, base.resolve(model, device)
    live = req.live
    if req.gpus:
        if live is not None:
            raise SearchError("--gpus compares replica layouts on the simulator only (--target none): a live "
                              "run would have to serve each layout's replicas", 2)
        if req.gpus % req.tensor_parallel_size:
            raise SearchError(f"--tensor-parallel-size {req.tensor_parallel_size} does not divide --gpus {req.gpus}", 2)
        asked = next((k for k in space.knobs if k.name == "tensor_parallel_size"), None)
        if asked is not None and any(req.gpus % tp for tp in asked.grid()):
            raise SearchError(f"--space tensor_parallel_size: every value must divide --gpus {req.gpus}", 2)
        if asked is None and req.tensor_parallel_size == 1:
            space = space.with_knobs({"tensor_parallel_size": tensor_parallel_knob(model, req.gpus)})
        say(f"note: {req.gpus} GPUs: each config serves {req.gpus} / TP replicas, the traffic split evenly among "
            "them (a balancer spreading requests; prefix caches are not shared across replicas); the simulator "
            "runs one replica at its share of the rate and counts requests per second for all of them")
    if live is None and (base.kv_cache_memory_bytes or base.num_gpu_blocks_override):
        fixed_by = "--kv-cache-memory-bytes" if base.kv_cache_memory_bytes else "--num-gpu-blocks-override"
        space, notes = space.pool_fixed_by(f"the baseline's {fixed_by}", req.explicit_knobs, "the simulator")
        for note in notes:
            say(f"note: {note}")
    if live is not None:
        # the live target's own rules: what it takes, what it runs when given no flags, its pool
        space, notes = space.for_target(live.rules, req.explicit_knobs)
        sim_base = live.rules.sim_config(base)
        default = _live_default(live, sim_base, req.baseline, model, device)
        if sim_base is not base:
            notes.append(f"stage 1 sizes the KV pool as the live server does: {live.rules.pool_text}")
        for note in notes:
            say(f"note: {note}")
    store = Store(req.db_url)
    sim = req.sim
    if live is not None:
        sim = _check_live(req, live, space.config(default_params(space, default), base), sim_base, say)
        model = sim.model
        default = _live_default(live, sim_base, req.baseline, model, device)
    slos = req.objective.slos
    attrs = {"workload": req.workload_path, "preset": req.preset, "device": req.device, "profile": req.profile,
             "slos": [str(s) for s in slos],
             "slo_specs": [{"metric": s.metric, "percentile": s.percentile, "threshold_s": s.threshold_s} for s in slos],
             "space": {k.name: knob_text(k) for k in space.knobs},
             "latency": req.objective.latency, "live_requests": req.live_head, "sim_model_dtype": model.dtype,
             "tensor_parallel_size": req.tensor_parallel_size, "model": model.name, "gpus": req.gpus,
             "max_concurrency": req.workload.max_concurrency, "baseline_args": req.baseline_args or None}
    study = open_study(open_storage(req.db_url, req.heartbeat_s), req.study, req.objective, req.sampler, req.seed,
                       attrs)
    stage1 = Stage1(study, space, sim_base, req.objective, sim.run, req.workload, store, req.trials, gpus=req.gpus)
    dflt = default_params(space, default)
    study.set_user_attr("default_params", dflt)  # the report's and the UI's "default" is this one
    study.set_user_attr("environment", host_environment())  # where this search ran, for the report
    if representable(space, dflt):
        stage1.enqueue(dflt)
    gpus = f"{req.tensor_parallel_size} × " if req.tensor_parallel_size > 1 else ""
    say(f"study {req.study!r} in {store.display_url}: {req.trials} stage-1 trials of {model.name} on "
        f"{gpus}{req.device}, objective {req.objective.kind}" + (f", SLOs {', '.join(map(str, slos))}" if slos else ""))
    with (stage1_progress or (lambda _n: nullcontext(None)))(req.trials) as on_trial:
        if on_trial is not None:
            stage1.on_trial = on_trial
        if req.stage1_runner is not None:
            req.stage1_runner(stage1, req, say)
        else:
            stage1.optimize()
    ranked = ranked_trials(study, req.objective)
    if not ranked:
        raise SearchError("no stage-1 trial completed; see the failed trials' reasons above", 1)
    feasible = [t for t in ranked if is_feasible(t)]
    if slos and not feasible:
        say(nothing_feasible(ranked[0], slos))
    if live is not None:
        notes = simpler_leaders(stage1, ranked, req.top_k, dflt)
        for note in notes:
            say(f"note: {note}")
        if notes:
            ranked = ranked_trials(study, req.objective)
            feasible = [t for t in ranked if is_feasible(t)]
        _stage2(req, sim, live, ranked, dflt, space, base, store, say, on_live, study, stage1)
    return SearchOutcome(req.study, ranked, feasible, _stored_verdict(req, sim, store, stage1, say))


def _check_live(req: SearchRequest, live, config: EngineConfig, sim_base: EngineConfig, say) -> SimTarget:
    """The live target starts and answers before stage 1 spends minutes; the simulator stage 1 runs:
    req.sim, with the model in the dtype the server keeps its KV cache in where its pool says that
    is not the preset's (vLLM serves a float32 checkpoint in bf16), so stage 1's pool is the server's."""
    say(f"checking the {req.live_kind} target: starting it with its default config (kept for its first live run)")
    try:
        reported = live.check(config)
    except (TargetStartError, TargetRunError) as err:
        raise SearchError(f"the {req.live_kind} target does not serve, so stage 2 could not measure; fix this "
                          f"before a search (nothing was searched):\n{err}", 2) from None
    pool = server_pool_of(reported or {})
    dtype = None if pool is None or sim_base.num_gpu_blocks_override else served_dtype(req.sim.model, pool)
    if dtype is None:
        return req.sim
    say(f"note: the {req.live_kind} server keeps the KV cache of {req.sim.model.name} in {dtype} under "
        f"kv_cache_dtype auto ({pool.num_gpu_blocks:,} blocks of {pool.block_size} tokens in "
        f"{pool.pool_bytes:,} bytes), not in the preset's {req.sim.model.dtype}: stage 1 simulates it in {dtype}")
    return req.sim.with_model(dataclasses.replace(req.sim.model, dtype=dtype))


def _live_default(live, sim_base: EngineConfig, baseline: dict, model, device) -> EngineConfig:
    """What the live server runs as the comparison's baseline: its own defaults where the fixed flags
    leave a knob open, the operator's --baseline-args over them."""
    return dataclasses.replace(live.rules.default_config(sim_base), **baseline).resolve(model, device)


def _stage2(req, sim, live, ranked, dflt, space, base, store, say, on_live, study, stage1) -> None:
    candidates, notes = live_candidates(ranked, req.top_k, dflt)
    for note in notes:
        say(f"note: {note}")
    live_workload = head(req.workload, req.live_head) if req.live_head else req.workload
    plan = req.plan
    candidates = plan.fit(candidates)  # before the looks are counted: a tight budget lowers the repeats
    study.set_user_attr("live_looks", plan.looks)  # the report's verdict spends the error budget as stage 2 did
    say(f"stage 2: {len(candidates)} configs on the {req.live_kind} target, {plan.repeats}-{plan.max_repeats} "
        f"runs each, interleaved ({len(live_workload)} requests over {live_workload.duration_s:.0f} s a run)")
    def number_of(params: dict, winner: int) -> int | None:  # a descent's step, as a stage-1 trial
        trial = stage1.run_more(params, winner)
        return trial.number if trial is not None else None

    pool = live if hasattr(live, "run_rounds") else None  # cluster.target.RayTarget: rounds in parallel
    if pool is not None:
        say(f"stage 2 on {pool.pool.describe}")
    run_stage2(live.run, candidates, space, base, live_workload, req.objective, store, req.study, plan,
               on_result=on_live, simulator=Simulator.of(sim, live_workload, req.profile), number_of=number_of,
               pool=pool)
    for note in plan.notes:
        say(f"note: {note}")


def _stored_verdict(req: SearchRequest, sim: SimTarget, store: Store, stage1: Stage1, say):
    """The report's data (its verdict is the one ranking's), once the stage-1 runs it shows are stored
    in full and diagnosed."""
    data = load_report_data(req.db_url, req.study, stage1.study, store)
    shown = [v.run_id for v in (data.best_run, data.default_run) if v is not None]
    if stage1.keep_full(shown):  # a stage-1 run the report shows was stored in summary: back in full
        data = load_report_data(req.db_url, req.study, stage1.study, store)
    _diagnose_shown(store, data, Simulator.of(sim, req.workload, req.profile), req.objective.slos, say)
    return data


def _diagnose_shown(store: Store, data, simulator: Simulator, slos, say) -> None:
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
            say(f"note: the diagnoses of run {view.run_id} were not stored ({str(err).splitlines()[0][:200]}); "
                  f"`kvtune diagnose --run {view.run_id}` works them out")


def knob_text(knob) -> str:
    """A knob's range as the study stores it: `16,32` or `0.85:0.95:0.01` or `32:512:log`."""
    if knob.choices is not None:
        return ",".join(map(str, knob.choices))
    return f"{knob.low:g}:{knob.high:g}" + (":log" if knob.log else f":{knob.step:g}" if knob.step else "")


def nothing_feasible(closest, slos) -> str:
    misses = []
    for slo in slos:
        observed = trial_score(closest).get("observed", {}).get(slo.name)
        if observed is not None and observed > slo.threshold_s:
            misses.append(f"{slo.name} {observed * 1000:.0f} ms vs {slo.threshold_s * 1000:g} ms")
    params = ", ".join(f"{k} {v}" for k, v in closest.params.items())
    return (f"no configuration met the SLOs; the closest, trial {closest.number} ({params}), "
            f"misses {'; '.join(misses) or 'them'}. The report's diagnoses say why.")
