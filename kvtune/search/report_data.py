"""A study's results as the search left them: its measurements from the run store and the Optuna
study, and the one ranking's verdict over them. The report and the UI read this (nothing is written
back); it lives with the search, so nothing upstream imports the report."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import optuna
from kvengine.config import ConfigError, EngineConfig, device_preset, model_preset

from ..report.fmt import on_gpus
from ..results import RunResult
from .slo import SLO, SLOError, study_slos_from_attrs
from .live_runs import live_runs
from .study import open_storage, trial_score
from .validity import measured_on
from ..store import SUMMARY_FIGURES, RunNotFoundError, Store, missing_database
from .measurement import Candidate, Measurement
from .ranking import Verdict, choose

class ReportError(ValueError):
    """The study cannot be reported: its database is missing, or the study is unknown or empty."""


@dataclass
class StudyInfo:
    name: str
    objective: str  # goodput | throughput | multi | capacity
    directions: list[str]
    slos: list[SLO]
    latency: str  # the multi objective's latency axis
    workload: str | None
    preset: str | None
    device: str | None
    knobs: list[str]
    space: dict = field(default_factory=dict)  # knob -> the range searched, as text
    default_params: dict | None = None  # the live target's own default, as the search ran it
    live_requests: int | None = None  # stage 2 replayed only the first N requests (--live-head)
    tensor_parallel_size: int = 1  # GPUs one replica spans, fixed for the study
    model: str | None = None  # the simulated model's name (`preset` may be its config.json's path)
    gpus: int | None = None  # --gpus: each config served gpus / TP replicas, the traffic split evenly
    live_looks: int = 1  # how often stage 2 tested its runs (--repeats to --max-repeats): splits the error budget
    baseline_args: str | None = None  # the operator's deployment every config was compared against, if given

    @property
    def reference(self) -> str:
        """What the config every other is compared against is called."""
        return "the baseline" if self.baseline_args else "the default"

    @property
    def on(self) -> str:
        """Where the study ran: the device, times the GPUs of one replica."""
        return on_gpus(self.device, self.tensor_parallel_size)


@dataclass
class RunView:
    """A stored run the report plots and diagnoses."""
    label: str
    stage: str
    run_id: int
    result: RunResult


@dataclass
class ReportData:
    info: StudyInfo
    study: optuna.Study
    trials: list[Measurement]  # stage 1, every trial, by number
    live: list[Measurement]  # stage 2 re-runs
    candidates: list[Candidate]  # the configs compared across stages, best first, the default last
    default: Candidate
    verdict: Verdict
    best_run: RunView | None = None  # the recommended config's run, else the closest one's
    default_run: RunView | None = None

    @property
    def headline(self) -> Candidate | None:
        return self.verdict.recommended or self.verdict.closest or self.verdict.leader

    def measured_on(self, stage: str | None = "live") -> list[str]:
        """What the completed measurements of `stage` (live: stage 2's runs; sim: stage 1's trials) were
        measured on, in words ("vLLM 0.32.0", "the simulator (l4-24gb, virtual time)"); [] where none completed."""
        done = self.live if stage == "live" else self.trials if stage == "sim" else []
        return sorted({m.measured_on or m.target or "unknown" for m in done if m.ok})


def load_report_data(db_url: str, name: str, study: optuna.Study | None = None,
                     store: Store | None = None) -> ReportData:
    """The report's data of study `name` in `db_url`. `study` and `store`: the search's own, open
    already (opening Optuna's storage again checks its schema); the caller closes its store."""
    if study is None:
        _require_database(db_url)
        study = _load_study(db_url, name)
    own_store = store is None
    store = Store(db_url) if own_store else store
    try:
        load = functools.cache(lambda run_id: _load(store, run_id))  # a live run is scored, then plotted
        runs = {r.id: r for r in store.list_runs(limit=1_000_000, study=name)}
        info = study_info(study, runs)
        trials = [_stage1(t, info, runs) for t in study.get_trials(deepcopy=False)]
        live = live_runs(store, name, info.slos, runs.values(), load)
        verdict, candidates, default = choose(trials, live, info.slos, _default_params(info), info.live_looks,
                                              info.reference)
        data = ReportData(info, study, trials, live, candidates, default, verdict)
        if data.headline is not None:
            data.best_run = _run_view(load, data.headline, "recommended" if verdict.recommended else "closest")
        data.default_run = _run_view(load, default, default.label)
        return data
    finally:
        if own_store:
            store.close()


def _require_database(db_url: str) -> None:
    path = missing_database(db_url)
    if path is not None:
        raise ReportError(f"no database at {path}: run `kvtune search` first, or pass --db URL")


def _load_study(db_url: str, name: str) -> optuna.Study:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the heartbeat option
        storage = open_storage(db_url)
    names = sorted(optuna.get_all_study_names(storage))
    if name not in names:
        known = ", ".join(names) if names else "none yet"
        raise ReportError(f"no study {name!r} in this database; studies: {known}")
    study = optuna.load_study(study_name=name, storage=storage)
    if not study.get_trials(deepcopy=False):
        raise ReportError(f"study {name!r} has no trials yet: run `kvtune search --study {name}` first")
    return study


def study_info(study: optuna.Study, runs: dict) -> StudyInfo:
    attrs = study.user_attrs
    try:
        slos = study_slos_from_attrs(attrs)
    except SLOError as err:
        raise ReportError(str(err)) from None
    knobs = list(attrs.get("space") or {})
    if not knobs:
        knobs = list(dict.fromkeys(k for t in study.get_trials(deepcopy=False) for k in t.params))
    first_run = next(iter(runs.values()), None)
    return StudyInfo(
        name=study.study_name, objective=attrs.get("objective", "goodput"),
        directions=[d.name.lower() for d in study.directions],
        slos=slos, latency=attrs.get("latency", "ttft_p95"),
        workload=attrs.get("workload"), preset=attrs.get("preset") or (first_run and first_run.model),
        device=attrs.get("device") or (first_run and first_run.device), knobs=knobs,
        space=dict(attrs.get("space") or {}), default_params=attrs.get("default_params"),
        live_requests=attrs.get("live_requests"), tensor_parallel_size=attrs.get("tensor_parallel_size") or 1,
        model=attrs.get("model") or attrs.get("preset") or (first_run and first_run.model), gpus=attrs.get("gpus"),
        live_looks=attrs.get("live_looks") or 1, baseline_args=attrs.get("baseline_args"))


def _stage1(trial: optuna.trial.FrozenTrial, info: StudyInfo, runs: dict) -> Measurement:
    attrs, score = trial.user_attrs, trial_score(trial)
    run = runs.get(attrs.get("run_id"))
    observed = {slo.name: score.get("observed", {}).get(slo.name) for slo in info.slos}
    for slo in info.slos:  # a duplicate carries its twin's constraints but not its observations
        violation = (trial.constraints or {}).get(slo.name)
        if observed[slo.name] is None and violation is not None and violation < 1e8:
            observed[slo.name] = violation + slo.threshold_s
    return Measurement(
        stage="sim", number=trial.number, params=dict(trial.params), state=trial.state.name,
        values=list(trial.values) if trial.values is not None else None,
        constraints=dict(trial.constraints or {}), run_id=attrs.get("run_id"), reason=attrs.get("fail_reason"),
        duplicate_of=attrs.get("duplicate_of"), surplus=bool(attrs.get("surplus")),
        goodput_rps=score.get("goodput_rps"), throughput_rps=score.get("throughput_rps"), observed=observed,
        summary={k: getattr(run, k) for k in SUMMARY_FIGURES} if run is not None else {},
        target=run.target if run is not None else None, measured_on=measured_on("sim", info.device, {}))


def _default_params(info: StudyInfo) -> dict | None:
    """The target's default config in the study's knobs (what stage 2 re-runs as 'default'): as the
    search stored it (it knows the live target's rules), else GPU vLLM's for an older study."""
    if info.default_params is not None:
        return dict(info.default_params)
    try:
        default = EngineConfig().resolve(model_preset(info.preset or ""), device_preset(info.device or ""))
    except ConfigError:
        return None
    return {name: getattr(default, name) for name in info.knobs if hasattr(default, name)}


def _run_view(load, candidate: Candidate, label: str) -> RunView | None:
    m = candidate.measured
    if m is None or m.run_id is None:
        return None
    result = load(m.run_id)
    if not candidate.is_default:
        label = f"{label} ({candidate.label})"
    return None if result is None else RunView(label, m.stage, m.run_id, result)


def _load(store: Store, run_id: int | None) -> RunResult | None:
    if run_id is None:
        return None
    try:
        return store.load_run(run_id)
    except RunNotFoundError:
        return None
