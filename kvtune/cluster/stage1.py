"""Stage 1 (the simulator's Optuna trials) in parallel on a Ray cluster (`kvtune search --ray`).

`Stage1OnRay` is the runner `search.flow.run_search` calls in place of `study.Stage1.optimize` (its
SearchRequest's `stage1_runner`): `pool.RayPool.run_stage1` starts one task per CPU of the cluster,
each running `work`: it opens the same study through the same database (`study.open_storage`,
`optuna.load_study`) and runs `Stage1.optimize` there with a sampler of its own seed (--seed plus the
task's index). Stage1 already shares a study among processes: each stops once the study holds the
trials asked (`study.count_taken`), a trial begun when it was full ends as surplus, and a point met
again reuses its twin's run (duplicate_of). The driver reports each finished trial (`Progress`)
between the waits' slices. Every task must reach the database: `sqlite_reason` says where it cannot.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import make_url

from .pool import RayPool


@dataclass
class Stage1Job:
    """What every task needs to open the study and run its trials (it pickles; the workload travels
    apart, through Ray's object store)."""
    db_url: str
    study: str
    heartbeat_s: float
    sampler: str
    seed: int
    space: object  # search.space.SearchSpace
    base: object  # kvengine.config.EngineConfig
    objective: object  # search.objective.Objective
    run: Callable  # the simulator's run (targets.SimTarget.run)
    n_trials: int
    gpus: int | None

    @classmethod
    def of(cls, stage1, req) -> Stage1Job:
        """The job of `stage1` (study.Stage1) in the search `req` (search.flow.SearchRequest)."""
        return cls(req.db_url, req.study, req.heartbeat_s, req.sampler, req.seed, stage1.space, stage1.base,
                   stage1.objective, stage1.run, stage1.n_trials, stage1.gpus)


def work(job: Stage1Job, workload, worker: int) -> int:
    """A Ray task: `Stage1.optimize` on the shared study, sampler seed `job.seed + worker` (so that
    the tasks do not all propose the same points). Returns how many trials it ran."""
    import optuna

    from ..search.study import Stage1, make_sampler, open_storage
    from ..store import Store

    sampler = make_sampler(job.sampler, job.seed + worker, len(job.objective.directions) > 1)
    study = optuna.load_study(study_name=job.study, storage=open_storage(job.db_url, job.heartbeat_s),
                              sampler=sampler)
    ran: list = []
    Stage1(study, job.space, job.base, job.objective, job.run, workload, Store(job.db_url), job.n_trials,
           on_trial=ran.append, gpus=job.gpus).optimize()
    return len(ran)


class Progress:
    """The driver's view of the tasks' trials: `poll()` tells `on_trial` of each trial that finished
    since the last poll and counts towards the trials asked (`study.counts`), as a Measurement like
    the one `Stage1` gives its own `on_trial`. Trials finished before it began are not told."""

    def __init__(self, study, on_trial: Callable):
        from ..search.study import FINISHED

        self.study, self.on_trial, self.told = study, on_trial, 0
        self.seen = {t.number for t in study.get_trials(deepcopy=False, states=FINISHED)}

    def poll(self) -> None:
        from ..search.study import FINISHED, counts

        for trial in self.study.get_trials(deepcopy=False, states=FINISHED):
            if trial.number in self.seen:
                continue
            self.seen.add(trial.number)
            if counts(trial):
                self.told += 1
                self.on_trial(measured(trial))


def measured(trial):
    """A finished stage-1 trial as a search.measurement.Measurement."""
    from optuna.trial import TrialState

    from ..search.measurement import Measurement

    attrs, complete = trial.user_attrs, trial.state == TrialState.COMPLETE
    return Measurement("sim", trial.number, dict(trial.params), trial.state.name,
                       list(trial.values) if complete else None, dict(trial.constraints or {}),
                       run_id=attrs.get("run_id"), reason=attrs.get("fail_reason"),
                       duplicate_of=attrs.get("duplicate_of"))


def sqlite_reason(db_url: str, pool: RayPool) -> str | None:
    """Why stage 1's tasks cannot share the database `db_url` on `pool`'s cluster (None: they can):
    a SQLite file is one machine's, unseen by nodes elsewhere; an in-memory one is one process's."""
    url = make_url(db_url)
    if url.get_backend_name() != "sqlite":
        return None
    if url.database in (None, "", ":memory:"):
        return "an in-memory SQLite database lives in this process alone"
    if not pool.one_host:
        return (f"the cluster has nodes on other machines, which cannot open the SQLite file {url.database}; "
                "a database every node reaches (--db postgresql://...) runs stage 1 on the cluster")
    return None


@dataclass
class Stage1OnRay:
    """`search.flow.SearchRequest.stage1_runner` on a Ray cluster: stage 1's trials in `pool`'s tasks."""
    pool: RayPool

    def __call__(self, stage1, req, say: Callable[[str], None]) -> None:
        """One task per CPU of the cluster, at most one per trial still to run (none on a resumed
        study that is full)."""
        from ..search.study import count_taken

        tasks = min(self.pool.cpus, stage1.n_trials - count_taken(stage1.study))
        if tasks < 1:
            stage1.optimize()  # nothing to run: it slims what a better trial pushed out
            return
        say(f"stage 1 on Ray cluster {self.pool.address}: {tasks} task(s) of one CPU share study {req.study!r}")
        progress = Progress(stage1.study, stage1.on_trial)
        failed = self.pool.run_stage1(Stage1Job.of(stage1, req), stage1.workload, tasks, progress.poll)
        progress.poll()
        for reason in failed:
            say(f"note: stage 1's {reason}; the other tasks went on (a trial it was running stays running "
                "until its heartbeat is stale, and a rerun of the study measures another in its place)")
        say(f"stage 1 on the Ray cluster: {progress.told} trial(s) finished")
        stage1.slim_dropped_runs()
