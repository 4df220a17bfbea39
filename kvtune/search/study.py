"""The Optuna study: RDB storage shared with the run store, samplers, and the
stage-1 trial loop that several processes can run on one study at once.

What stage 1 stores: every trial's run in summary (its figures, config, workload
profile and series downsampled to at most 200 points; kvtune.store), except the
best KEEP_FULL trials by the study's ranking and the default config's trial, which
keep every request in full (the report and the UI plot and diagnose the best and
the default). A trial is stored in full when it enters that set and slimmed once a
better one pushes it out, so the set holds whichever process ran what and wherever
a search stops. `Stage1.keep_full(run_ids)` stores any other stage-1 run in full
again (the simulator is deterministic: it re-runs the config), for the runs a
report is about to show when its ranking picked another trial."""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.trial import TrialState

from kvengine.config import EngineConfig

from ..store import Store
from ..store.schema import configure_sqlite
from ..targets import TargetRunError, TargetStartError
from ..stopping import failure_reason, interruption, stop_signals_held
from ..workload import rate_scale
from .objective import Objective
from .measurement import Measurement
from .slo import SLO, study_slos_from_attrs
from .space import SearchSpace, check_config

SAMPLERS = ("tpe", "gp", "random")
FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
KEEP_FULL = 3  # the best stage-1 runs kept in full, besides the default's; the rest in summary

optuna.logging.set_verbosity(optuna.logging.ERROR)  # we report failed trials ourselves


OPTUNA_STUDIES_TABLE = "studies"


class StudyError(ValueError):
    """A study that cannot be opened or resumed as asked."""


class TrialFailed(Exception):
    """Ends a trial as FAIL (its reason is in the trial's user attributes), not the search."""


def open_storage(db_url: str, heartbeat_s: float = 30.0) -> optuna.storages.RDBStorage:
    """Optuna's tables beside the run store's, in the same database.

    A heartbeat lets a resumed search fail the trials a killed process left RUNNING."""
    engine_kwargs = {"connect_args": {"timeout": 60}} if db_url.startswith("sqlite") else {}
    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(db_url, engine_kwargs=engine_kwargs,
                                                     heartbeat_interval=int(max(1, heartbeat_s)),
                                                     grace_period=int(max(3, 3 * heartbeat_s)))
            if db_url.startswith("sqlite"):
                # Optuna's sessions read, then write: begun deferred, SQLite fails one at once ("database
                # is locked") where another writer (its heartbeat thread, a second search) holds the
                # lock, instead of waiting its turn. The pool's connections are made again with it.
                configure_sqlite(storage.engine, every_transaction_writes=True)
                storage.engine.dispose()
            return storage
        except sqlalchemy.exc.DatabaseError as err:
            # Two searches starting at once both create Optuna's schema; the loser retries.
            # PostgreSQL reports the lost race as IntegrityError (pg_type's unique key) or
            # ProgrammingError (DuplicateTable), SQLite as OperationalError.
            text = str(err)
            schema_race = any(s in text for s in ("already exists", "alembic_version", "duplicate key"))
            if not schema_race or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def study_slos(db_url: str, name: str) -> list[SLO]:
    """The SLOs study `name` was searched with, from Optuna's tables beside the run store; none where
    the database holds no such study (nothing is created)."""
    engine = sqlalchemy.create_engine(db_url)
    try:
        if OPTUNA_STUDIES_TABLE not in sqlalchemy.inspect(engine).get_table_names():
            return []
    finally:
        engine.dispose()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(db_url, skip_table_creation=True)
    try:
        return study_slos_from_attrs(optuna.load_study(study_name=name, storage=storage).user_attrs)
    except KeyError:  # no study of that name
        return []
    finally:
        storage.remove_session()
        storage.engine.dispose()


def make_sampler(name: str, seed: int | None, multi: bool) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise StudyError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


def open_study(storage, name: str, objective: Objective, sampler: str, seed: int | None,
               attrs: dict) -> optuna.Study:
    """Create the study, or resume it if it exists (the objective must match)."""
    study = optuna.create_study(study_name=name, storage=storage, directions=objective.directions,
                                sampler=make_sampler(sampler, seed, len(objective.directions) > 1),
                                load_if_exists=True)
    existing = study.user_attrs.get("objective")
    if existing is not None:
        for key, wanted in (("objective", objective.kind), ("slos", attrs.get("slos")),
                            ("workload", attrs.get("workload")), ("preset", attrs.get("preset")),
                            ("device", attrs.get("device")), ("max_concurrency", attrs.get("max_concurrency")),
                            ("baseline_args", attrs.get("baseline_args"))):
            if study.user_attrs.get(key) != wanted:
                raise StudyError(f"study {name!r} was created with {key} {study.user_attrs.get(key)!r}, not "
                                 f"{wanted!r}: its trials would not compare; resume it with the same settings "
                                 "or choose another --study name")
    else:
        for key, value in (attrs | {"objective": objective.kind}).items():
            study.set_user_attr(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    fail_trials_without_heartbeat(study, storage)
    return study


STARTED = "started"  # the user attr a trial gets as its objective begins, once it has a heartbeat


def mark_started(trial: optuna.Trial) -> None:
    """Beat for `trial`, then mark it started: every trial that is marked has a heartbeat, so
    Optuna's fail_stale_trials ends it should its process die; one that is not marked died first."""
    storage = trial.study._storage
    if isinstance(storage, optuna.storages.RDBStorage) and storage.heartbeat_interval is not None:
        storage.record_heartbeat(trial._trial_id)
    trial.set_user_attr(STARTED, True)


def fail_trials_without_heartbeat(study: optuna.Study, storage) -> list[int]:
    """Fail the RUNNING trials whose objective never began (not marked started) and that started
    longer ago than the grace period.

    Optuna's fail_stale_trials skips a RUNNING trial with no heartbeat row: one
    whose process was killed between creating it and its heartbeat thread's
    first beat. It would stay RUNNING for ever and count against --trials."""
    if not isinstance(storage, optuna.storages.RDBStorage) or storage.heartbeat_interval is None:
        return []
    grace = timedelta(seconds=storage.grace_period or 2 * storage.heartbeat_interval)
    now = datetime.now()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get(STARTED) or trial.datetime_start is None or now - trial.datetime_start <= grace:
            continue
        try:
            storage.set_trial_user_attr(trial._trial_id, "interrupted", True)  # it measured nothing
            storage.set_trial_user_attr(trial._trial_id, "fail_reason",
                                        "its search process died before the trial's first heartbeat")
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished meanwhile: it was alive after all
        failed.append(trial.number)
    return failed


SIMPLIFIES = "simplifies"  # a trial's user attr: the number of the leader it tries with fewer changed knobs
# A stage-1 trial's user attr: the simulator's score of its run (slo.Score's figures, `observed` {SLO: s}),
# one attribute because Optuna commits each attribute on its own.
SCORE = "score"
_SCORE_FIGURES = ("goodput_rps", "throughput_rps", "output_tok_s", "completed", "requests", "good", "feasible")


def stage1_attrs(run_id: int, score) -> dict:
    """The user attrs of a measured stage-1 trial: its run's id and its slo.Score (SCORE)."""
    return {"run_id": run_id, SCORE: {**{k: v for k, v in score.as_dict().items() if k in _SCORE_FIGURES},
                                      "observed": dict(score.observed)}}


def trial_score(trial) -> dict:
    """The score a stage-1 trial stored (SCORE); {} where it has none. A study written before SCORE
    kept each figure as an attribute of its own, and `observed_<SLO>`: read the same way."""
    attrs = trial.user_attrs
    if SCORE in attrs:
        return attrs[SCORE]
    observed = {k.removeprefix("observed_"): v for k, v in attrs.items() if k.startswith("observed_")}
    figures = {k: attrs[k] for k in _SCORE_FIGURES if k in attrs}
    return figures | {"observed": observed} if figures or observed else {}


def counts(trial) -> bool:
    """Whether a trial counts towards the requested number: measured (complete, or failed for a
    reason of its config), or running right now. A surplus slot, an interrupted trial and one
    whose process died (Optuna failed it as stale: no reason of ours) measured nothing."""
    attrs = trial.user_attrs
    if attrs.get("surplus") or attrs.get("interrupted") or attrs.get(SIMPLIFIES) is not None:
        return False
    if trial.state == TrialState.FAIL:
        return "fail_reason" in attrs
    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)


def count_taken(study: optuna.Study, trials: list | None = None) -> int:
    """Trials that count towards the requested number (`counts`), of `trials` where given (the
    study's, read once) or read now."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    return sum(1 for t in trials if counts(t))  # counts() takes no waiting trial


class Stage1:
    """Runs trials until the study holds `n_trials` of them, whoever ran them."""

    def __init__(self, study: optuna.Study, space: SearchSpace, base: EngineConfig, objective: Objective,
                 run, workload, store: Store, n_trials: int, on_trial=None, gpus: int | None = None):
        self.study, self.space, self.base, self.objective = study, space, base, objective
        self.run, self.workload, self.store, self.n_trials = run, workload, store, n_trials
        self.gpus = gpus  # each config serves gpus / TP replicas, the traffic split evenly among them
        self.on_trial = on_trial or (lambda record: None)
        self._enqueued: dict | None = None
        self._trial: optuna.Trial | None = None  # the trial this process runs (or ran last)
        self._measured: Measurement | None = None  # what that trial measured, before Optuna is told
        self.study.ask = self._ask  # what study.optimize asks for is this process's trial at once (_ask)

    def _ask(self, *args, **kwargs) -> optuna.Trial:
        """optuna.Study.ask, as study.optimize calls it for each trial: the trial Optuna stores as
        RUNNING is this process's (`_trial`, nothing measured yet) before a stop signal can be
        handled, so that _fail_interrupted ends it even when the signal comes before the objective
        starts (a trial left RUNNING is counted by no one and skipped by every later search)."""
        with stop_signals_held():
            self._trial, self._measured = optuna.Study.ask(self.study, *args, **kwargs), None
        return self._trial

    def enqueue(self, params: dict) -> None:
        """A config to try first (vLLM's defaults), once per study."""
        self.study.enqueue_trial(params, skip_if_exists=True)
        self._enqueued = self._enqueued or dict(params)

    def optimize(self, one_more: bool = False) -> None:
        """Optuna's own loop (so the storage heartbeat runs), stopped once the study is full;
        `one_more`: one trial (the enqueued one run_more asks for), full or not."""
        trials = self.study.get_trials(deepcopy=False)
        if count_taken(self.study, trials) >= self.n_trials and not one_more:
            self.slim_dropped_runs(trials)
            return

        def after_trial(study, _trial):  # the study's trials read once for both
            trials = study.get_trials(deepcopy=False)
            self.slim_dropped_runs(trials)
            if not one_more and count_taken(study, trials) >= self.n_trials:
                study.stop()

        try:
            self.study.optimize(self._objective, n_trials=1 if one_more else None, callbacks=[after_trial],
                                catch=(TrialFailed,), gc_after_trial=False)
        except BaseException as err:
            if interruption(err):
                self._fail_interrupted(err)
            raise
        self.slim_dropped_runs()

    def run_more(self, params: dict, simplifies: int):
        """One trial of `params` beyond the requested number, marked as a simpler form of trial
        `simplifies` (stage2.simpler_leaders' checks; it does not count towards --trials): the
        completed trial that measured them (an earlier one of the same params, where there is one),
        or None where it failed."""
        def measured():
            done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.params == params]
            return next((t for t in done if "duplicate_of" not in t.user_attrs), done[0] if done else None)

        if (earlier := measured()) is not None:
            return earlier
        self.study.enqueue_trial(params, user_attrs={SIMPLIFIES: simplifies})
        self.optimize(one_more=True)
        return measured()

    def slim_dropped_runs(self, trials: list | None = None) -> list[int]:
        """Store in summary the stage-1 runs kept in full that are no longer among those kept
        (a better trial came); returns their ids. Another process's trial counts once finished.
        `trials`: the study's, where the caller has just read them."""
        trials = self.study.get_trials(deepcopy=False) if trials is None else trials
        points = [_point(t) for t in trials if t.state == TrialState.COMPLETE]
        keep = full_detail_numbers(points, self._default_params())
        kept_runs = {p.run_id for p in points if p.number in keep}
        dropped = {p.run_id for p in points if p.run_id is not None and p.run_id not in kept_runs}
        try:
            return self.store.slim_runs(dropped)
        except sqlalchemy.exc.SQLAlchemyError as err:  # housekeeping: the next trial tries again
            logging.getLogger("kvtune.search").warning("could not slim stage-1 runs: %s", err)
            return []

    def keep_full(self, run_ids) -> list[int]:
        """Store these stage-1 runs of the study in full: re-run on the simulator each one stored in
        summary and put its requests and series back (same run id). Returns the ids re-run.

        Ids that are not a completed stage-1 trial's run (a live run) are left alone, and so is a run
        whose re-run does not reproduce its stored summary (a changed workload file or simulator)."""
        wanted = {i for i in run_ids if i is not None}
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        trials = {t.user_attrs["run_id"]: t for t in done
                  if t.user_attrs.get("run_id") in wanted and "duplicate_of" not in t.user_attrs}
        redone = []
        for run_id in sorted(set(trials) - self.store.full_runs(trials)):
            trial = trials[run_id]
            config = self.space.config(dict(trial.params), self.base)
            workload = self.replica_workload(config)
            if self.objective.kind == "capacity":  # the run at the rate scale it found (the lowest if none)
                workload = rate_scale(workload, trial.values[0] or self.objective.capacity_low)
            try:
                result = self.run(config, workload)
            except (TargetStartError, TargetRunError):
                continue
            if not _same_figures(self.store.load_run(run_id).summary, result.summary):
                logging.getLogger("kvtune.search").warning(
                    "trial %d's re-run differs from its stored run %d: it stays in summary", trial.number, run_id)
                continue
            self.store.save_run(result, run_id=run_id)
            redone.append(run_id)
        return redone

    def replicas(self, config: EngineConfig) -> int:
        return self.gpus // config.tensor_parallel_size if self.gpus else 1

    def replica_workload(self, config: EngineConfig):
        """What one replica serves: the trace at 1 / replicas of its rate (an even split), and of a
        closed loop's requests in flight."""
        replicas, closed = self.replicas(config), self.workload.max_concurrency
        if replicas == 1:
            return self.workload
        return rate_scale(self.workload, 1 / replicas).closed_loop(closed and math.ceil(closed / replicas))

    def _default_params(self) -> dict | None:
        """The default config (the report's and stage 2's), as the search stored it, else the first enqueued."""
        return self.study.user_attrs.get("default_params") or self._enqueued

    def _detail(self, done: list, number: int, params: dict, values: list[float], sc) -> str:
        """'full' when this trial enters the best (or is the default) among the completed ones, else 'summary'."""
        this = _Point(number, params, list(values), dict(sc.violations), None)
        keep = full_detail_numbers([_point(t) for t in done] + [this], self._default_params())
        return "full" if number in keep else "summary"

    def _objective(self, trial: optuna.Trial):  # `trial` is `_trial` (_ask)
        try:
            mark_started(trial)
            others = [t for t in self.study.get_trials(deepcopy=False) if t.number != trial.number]
            if trial.user_attrs.get(SIMPLIFIES) is None and self._counted_before(trial.number, others) >= self.n_trials:
                trial.set_user_attr("surplus", True)  # another process took the last slot
                self.study.stop()
                raise TrialFailed("surplus")
            record = self._measured = self._run_trial(trial, [t for t in others if t.state == TrialState.COMPLETE])
        except KeyboardInterrupt as err:  # said here: Optuna fails the trial on Ctrl-C, then it is finished
            reason = failure_reason(err)  # first, as it lets go of a write the Ctrl-C cut short
            trial.set_user_attr("interrupted", True)
            trial.set_user_attr("fail_reason", reason)
            raise
        self.on_trial(record)
        if record.state == "FAIL":
            raise TrialFailed(record.reason)
        return record.values

    @staticmethod
    def _counted_before(number: int, trials: list) -> int:
        return sum(1 for t in trials if t.number < number and counts(t))

    def _fail_interrupted(self, err: BaseException) -> None:
        """End the trial this process ran when `err` stopped it. Measured already (the signal came
        before Optuna was told): finished as measured. Else FAIL (Ctrl-C is failed by Optuna itself,
        a SIGTERM would leave it RUNNING), without its run, so that it does not count and a resumed
        search measures another in its place."""
        (trial, self._trial), (record, self._measured) = (self._trial, None), (self._measured, None)
        if trial is None:
            return
        storage, reason = self.study._storage, failure_reason(err)
        frozen = storage.get_trial(trial._trial_id)
        try:
            if frozen.state == TrialState.RUNNING and record is not None:
                complete = record.state == "COMPLETE"
                storage.set_trial_state_values(trial._trial_id, TrialState.COMPLETE if complete else TrialState.FAIL,
                                               record.values if complete else None)
                return
            if frozen.state == TrialState.RUNNING:
                storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
                storage.set_trial_user_attr(trial._trial_id, "fail_reason", reason)
                storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            elif frozen.state != TrialState.FAIL or counts(frozen):
                return  # it finished before the signal
        except optuna.exceptions.UpdateFinishedTrialError:
            return
        self._forget_run(frozen)

    def _forget_run(self, trial) -> None:
        """The run an interrupted trial stored before it failed (a twin's run is the twin's)."""
        run_id = trial.user_attrs.get("run_id")
        if run_id is not None and "duplicate_of" not in trial.user_attrs:
            self.store.delete_run(run_id)

    def _run_trial(self, trial: optuna.Trial, done: list) -> Measurement:
        """Measure `trial` on the simulator; `done`: the study's other completed trials, read as it
        began (a twin of its params is not measured again; its run is kept in full if it ranks)."""
        params = self.space.suggest(trial)
        twin = next((t for t in done if t.params == params), None)
        if twin is not None:  # same point again: reuse its measurement, do not pay for it twice
            for name, value in (twin.constraints or {}).items():
                trial.set_constraint(name, value)
            trial.set_user_attr("duplicate_of", twin.number)
            for key, value in twin.user_attrs.items():
                if key not in ("duplicate_of", "fail_reason"):
                    trial.set_user_attr(key, value)
            return Measurement("sim", trial.number, params, "COMPLETE", list(twin.values), dict(twin.constraints or {}),
                               run_id=twin.user_attrs.get("run_id"), duplicate_of=twin.number)
        config = self.space.config(params, self.base)
        invalid = check_config(config)
        if invalid:
            return self._fail(trial, params, f"invalid config: {invalid}")
        replicas = self.replicas(config)
        try:
            values, sc, result = self.objective.evaluate(self.run, config, self.replica_workload(config))
        except (TargetStartError, TargetRunError) as err:
            return self._fail(trial, params, str(err))
        values = self.objective.for_replicas(values, replicas)
        if self.gpus:
            trial.set_user_attr("replicas", replicas)
        for name, value in sc.violations.items():
            trial.set_constraint(name, value)
        run_id = self.store.save_run(result, study=self.study.study_name, trial=trial.number,
                                     detail=self._detail(done, trial.number, params, values, sc))
        for key, value in stage1_attrs(run_id, sc).items():
            trial.set_user_attr(key, value)
        return Measurement("sim", trial.number, params, "COMPLETE", values, dict(sc.violations), run_id=run_id)

    def _fail(self, trial, params: dict, reason: str) -> Measurement:
        trial.set_user_attr("fail_reason", reason)
        logging.getLogger("kvtune.search").info("trial %d failed: %s", trial.number, reason)
        return Measurement("sim", trial.number, params, "FAIL", reason=reason)


@dataclass
class _Point:
    """A completed stage-1 trial, as the choice of runs kept in full reads it."""
    number: int
    params: dict
    values: list[float]
    constraints: dict
    run_id: int | None
    duplicate_of: int | None = None


def _point(trial) -> _Point:
    attrs = trial.user_attrs
    return _Point(trial.number, dict(trial.params), list(trial.values or []), dict(trial.constraints or {}),
                  attrs.get("run_id"), attrs.get("duplicate_of"))


def full_detail_numbers(points: list, default_params: dict | None, k: int = KEEP_FULL) -> set[int]:
    """The trials whose runs stay in full: the best k by the study's ranking (ranked_trials; for
    multi, by the first value, the front's throughput end) and the default config's. Duplicates
    (their twin's run) are left out."""
    done = sorted((p for p in points if p.duplicate_of is None and p.values), key=lambda p: p.number)
    ranked = sorted(done, key=lambda p: (not _feasible(p.constraints), -_first(p), _violation(p)))
    keep = {p.number for p in ranked[:k]}
    if default_params is not None:
        keep |= {p.number for p in done if p.params == default_params}
    return keep


def _first(point: _Point) -> float:
    value = point.values[0]
    return value if math.isfinite(value) else -math.inf


def _same_figures(a: dict, b: dict) -> bool:
    """Two summaries alike, NaN equal to NaN (a rate over no time)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _feasible(constraints: dict | None) -> bool:
    return all(v <= 0 for v in (constraints or {}).values())


def ranked_trials(study: optuna.Study, objective: Objective) -> list:
    """Completed stage-1 trials, best first: feasible before infeasible, then by the objective
    (multi: the Pareto front first, by throughput). Duplicates appear once."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "duplicate_of" not in t.user_attrs]
    if objective.kind == "multi":
        front = {t.number for t in study.best_trials}
        return sorted(done, key=lambda t: (not _feasible(t.constraints), t.number not in front, -t.values[0]))
    return sorted(done, key=lambda t: (not _feasible(t.constraints), -t.values[0], _violation(t)))


def _violation(trial) -> float:  # a FrozenTrial or a _Point
    return sum(max(v, 0.0) for v in (trial.constraints or {}).values())


def is_feasible(trial) -> bool:
    return _feasible(trial.constraints)
