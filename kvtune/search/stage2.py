"""Stage 2, a race on the live target: the simulator's best distinct results against the default.

The entrants: stage 1's ranking, best first, grouped into results (trials the simulator scores
within SIM_TIE of each other are one result: running two of them spends the budget on one
answer), each result entering in its simplest form (its cheapest change, `space.change_cost`;
`simpler_leaders` first tries each changed flag back at the default's value in the simulator),
until `top_k` have entered; the default's own result is the default, and where places are left,
the configs the simulator scores level with it enter, best ranked first (live can tell apart
what the simulator cannot). Every round runs each config still in the race once, interleaved
(A B C A B C ...) so that drift of the host hits every config alike. From round `repeats` on,
after each round, the one ranking (`ranking.choose`) judges the runs: it stops the race once it
can say "better", "infeasible", "failed" or "inconclusive" (more runs mend no doubt), and a
config out of the leader's tie leaves it (it can no longer win); at `max_repeats` rounds, or at
the budget, the race ends. Once a config is shown better, the descent: its steps back towards the
default on a knob of discrete values (block 32 and 64 for a block-16 winner over a default of 128),
the smallest change first, run `repeats` times each; the one ranking recommends a step that beats
the default and that it cannot tell from the winner (the smaller change), and the descent goes on
from there. Random sampling overshoots a knob that matters little, and which overshoot a search
finds moves with each calibration: the descent gives the same advice on a rerun. A live test is the
only judge; the simulator only orders.

Every run is stored with what it scored, its SLO verdicts, the doubts about its own evidence
and its diagnoses: the report and the UI read them, they never re-score or re-diagnose.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvengine.config import EngineConfig

from ..diagnose.trial import Simulator, diagnosed
from ..stopping import failure_reason
from ..store import Store
from ..targets import TargetRunError, TargetStartError
from .live_runs import LIVE_LABEL, live_measurement, live_runs
from .measurement import Measurement, combine
from .objective import Objective
from .ranking import (
    BETTER,
    FAILED,
    INCONCLUSIVE,
    INFEASIBLE,
    SIM_TIE,
    choose,
    within_tie,
)
from .slo import Score, diagnosis_thresholds
from .space import SearchSpace, change_cost
from .study import is_feasible
from .validity import run_doubts

DEFAULT_NUMBER = -1  # the trials table's number for the target's default config when stage 1 never ran it
NAMED_TWINS = 4  # a note names this many of the trials a live candidate stands for


@dataclass
class LiveConfig:
    """A config the live stage runs: its label, stage 1's trial number (DEFAULT_NUMBER for a default
    stage 1 never ran) and its knobs. Its measurements become measurement.Candidate's runs."""
    label: str  # "default" or "trial 17"
    number: int
    params: dict


@dataclass
class LivePlan:
    repeats: int = 3  # runs of every config before a verdict
    max_repeats: int = 5  # while the intervals still overlap, up to this many
    budget: int | None = None  # most live runs in all (the default's included)
    notes: list[str] = field(default_factory=list)

    @property
    def looks(self) -> int:
        """How many times the runs are tested before stopping: each splits the error budget."""
        return max(self.max_repeats - self.repeats + 1, 1)

    def fit(self, candidates: list[LiveConfig]) -> list[LiveConfig]:
        """The candidates the budget allows at `repeats` runs each (the default always stays)."""
        if self.budget is None:
            return candidates
        keep = list(candidates)
        while len(keep) > 2 and len(keep) * self.repeats > self.budget:
            drop = next(c for c in reversed(keep) if c.label != "default")
            keep.remove(drop)
            self.notes.append(f"the live budget ({self.budget} runs) leaves out {drop.label}")
        if len(keep) * self.repeats > self.budget:
            self.repeats = max(1, self.budget // len(keep))
            self.notes.append(f"the live budget ({self.budget} runs) allows {self.repeats} run(s) per config")
        return keep


@dataclass
class LiveOutcome:
    candidate: LiveConfig
    repeat: int
    values: list[float] | None = None
    score: Score | None = None
    run_id: int | None = None
    error: str | None = None
    slot_lost: bool = False  # failed with its Ray task (a node lost), not through its config
    measurement: Measurement | None = None


def same_result(a, b) -> bool:
    """Two completed stage-1 trials the simulator cannot tell apart: both feasible or both not, and
    their (first) values within ranking.SIM_TIE of each other, the stage-1 verdict's tie (bit-identical
    runs, a knob that never bound, are the plainest case; a trace that both serve whole is another)."""
    va, vb = a.values[0], b.values[0]
    return is_feasible(a) == is_feasible(b) and within_tie(va, vb)


def live_candidates(ranked: list, top_k: int, dflt: dict) -> tuple[list[LiveConfig], list[str]]:
    """The race's entrants (the module's docstring says which), the default first (it runs on the
    checked server), and notes naming the trials an entrant stands for."""
    groups = _results(ranked)
    level = _default_result(groups, dflt)
    picked, notes = [], []
    for group in [g for g in groups if g is not level] + [[t] for t in level if t.params != dflt]:
        if len(picked) == top_k:
            break
        pick = min(group, key=lambda t: change_cost(t.params, dflt))  # stable: the best ranked of the cheapest
        picked.append(pick)
        if any(group[0] is t for t in level):
            notes.append(f"trial {pick.number} runs live though the simulator scores it level with the default: "
                         "the live stage tells apart what the simulator cannot")
        elif len(group) > 1:
            notes.append(_stands_for(pick, [t for t in group if t is not pick]))
    stood_for = [t for t in level if t.params != dflt and all(t is not p for p in picked)]
    if stood_for:
        notes.append(_stands_for(next(t for t in level if t.params == dflt), stood_for))
    dnum = next((t.number for t in ranked if t.params == dflt), DEFAULT_NUMBER)
    candidates = [LiveConfig("default", dnum, dflt)]
    candidates += [LiveConfig(f"trial {t.number}", t.number, dict(t.params)) for t in picked]
    return candidates, notes


def _stands_for(pick, others: list) -> str:
    named = ", ".join(f"trial {t.number}" for t in others[:NAMED_TWINS])
    more = f" and {len(others) - NAMED_TWINS} more" if len(others) > NAMED_TWINS else ""
    return (f"trial {pick.number} stands for {named}{more} in stage 2: the simulator scored them within "
            f"{SIM_TIE:.0%} of each other (one result at its precision), and it is the smallest change")


def _results(ranked: list) -> list[list]:
    """Stage 1's ranked trials grouped into results (`same_result` with the group's first), best first."""
    groups: list[list] = []
    for trial in ranked:
        group = next((g for g in groups if same_result(g[0], trial)), [])
        if not group:
            groups.append(group)
        group.append(trial)
    return groups


def _default_result(groups: list[list], dflt: dict) -> list:
    """The group of `_results` the default's trial is in; empty where stage 1 never ran the default."""
    return next((g for g in groups if any(t.params == dflt for t in g)), [])


def simpler_leaders(stage1, ranked: list, top_k: int, dflt: dict) -> list[str]:
    """For each entrant of a result other than the default's (`live_candidates`), try it with each
    changed knob put back to the default's value, one at a time, in the simulator (one more stage-1
    trial each); a knob whose default gives the same result (`same_result` with the config it came
    from) stays at the default. Random sampling almost never lands on the default's exact value of a
    knob that does not matter, so without this a recommendation changes flags for nothing. (An
    entrant level with the default is left as it is: every knob would go back.) Notes say what was
    dropped; the new trials join the study and its ranking."""
    notes = []
    level = _default_result(_results(ranked), dflt)
    for cand in live_candidates(ranked, top_k, dflt)[0][1:]:
        leader = next((t for t in ranked if t.number == cand.number), None)
        if leader is None or len(leader.values) != 1 or any(t is leader for t in level):
            continue
        params, dropped = dict(leader.params), []
        for name in [k for k in leader.params if k in dflt and leader.params[k] != dflt[k]]:
            trial_params = params | {name: dflt[name]}
            if not representable(stage1.space, trial_params):
                continue
            trial = stage1.run_more(trial_params, leader.number)
            if trial is not None and same_result(trial, leader):
                params, simpler = trial_params, trial
                dropped.append(f"{name} {leader.params[name]}")
        if dropped:
            notes.append(f"trial {simpler.number} is trial {leader.number} without {', '.join(dropped)} (back at "
                         f"the default's value): the simulator scores it the same within {SIM_TIE:.0%}")
    return notes


def default_params(space: SearchSpace, default: EngineConfig) -> dict:
    """The target's default config, in the space's knobs."""
    return {name: getattr(default, name) for name in space.names}


def representable(space: SearchSpace, params: dict) -> bool:
    """Whether Optuna can take these params as a trial of this space."""
    return all(params[k.name] in k.choices if k.choices is not None else k.low <= params[k.name] <= k.high
               for k in space.knobs)


def run_stage2(run, candidates: list[LiveConfig], space: SearchSpace, base: EngineConfig, workload,
               objective: Objective, store: Store, study: str, plan: LivePlan | None = None,
               on_result=None, simulator: Simulator | None = None,
               number_of: Callable[[dict, int], int | None] | None = None, pool=None) -> list[LiveOutcome]:
    """The race, then the descent (the module's docstring): the winner's steps (`space.steps_toward`)
    enter one at a time; a step the one ranking recommends is the new winner, whose own steps follow,
    until none is left. `number_of(params, winner)`: the stage-1 trial number of a step of trial
    `winner` (None: it failed in the simulator, and is not run); without it there is no descent.
    Each run's diagnoses are stored with it, their fixes first tried on `simulator`. A resumed search
    continues where the stored runs of `study` stop: a config's completed runs count as its first
    repeats and against the budget, as if the search had not been interrupted.
    `pool`: a cluster.target.RayTarget, whose cluster's slots run up to `pool.size` rounds at once
    (`_Race.rounds`); None: one run after another, here."""
    plan = plan or LivePlan()
    candidates = plan.fit(candidates)
    stored = [m for m in live_runs(store, study, objective.slos) if m.ok]
    race = _Race(run, space, base, workload, objective, store, study, plan, on_result, simulator,
                 next((c.params for c in candidates if c.label == "default"), None), _resumed(candidates, stored),
                 pool)
    verdict, tried = race.rounds(candidates, plan.max_repeats), [c.params for c in candidates]
    while number_of is not None and verdict is not None and verdict.kind == BETTER and not race.spent:
        step = next((p for p in space.steps_toward(verdict.recommended.params, race.dflt) if p not in tried), None)
        if step is None:
            break
        tried.append(step)
        winner = verdict.recommended.live.number
        if (number := number_of(step, winner)) is None:
            continue
        knob = next(k for k, v in step.items() if verdict.recommended.params.get(k) != v)
        plan.notes.append(f"trial {number} is trial {winner} with {knob} {step[knob]}, a step back towards the "
                          f"default's {race.dflt[knob]}: it ran live once trial {winner} was shown better")
        cand = LiveConfig(f"trial {number}", number, step)
        race.outcomes += _resumed([cand], stored)
        verdict = race.rounds([cand], plan.repeats)
    return race.outcomes


@dataclass
class _Race:
    """Stage 2's runs so far (`outcomes`) and how to add rounds of them."""
    run: Callable
    space: SearchSpace
    base: EngineConfig
    workload: object
    objective: Objective
    store: Store
    study: str
    plan: LivePlan
    on_result: Callable | None
    simulator: Simulator | None
    dflt: dict | None
    outcomes: list[LiveOutcome]
    pool: object = None  # cluster.target.RayTarget: rounds in waves, one slot each

    @property
    def spent(self) -> bool:
        return self.plan.budget is not None and len(self.outcomes) >= self.plan.budget

    def rounds(self, active: list[LiveConfig], last: int):
        """Rounds 1..`last` of `active`, interleaved, skipping the runs already done, a wave of rounds at
        a time (one round here; on a cluster `pool.size` rounds at once, each a Ray task running its
        configs in order on one slot, so that the slot is a block: every config meets it once per
        round). From round `repeats` on the verdict after each wave, which stops the rounds once decided
        and drops the configs out of the leader's tie. The last verdict (None where none was reached)."""
        verdict, plan = None, self.plan
        width = self.pool.size if self.pool is not None else 1
        for first in range(1, last + 1, width):
            numbers = range(first, min(first + width, last + 1))
            wave = self._within_budget([[c for c in active if not self._ran(c, r)] for r in numbers])
            if not any(wave) and self.spent:
                return verdict
            self._run_wave(wave, first)
            failed = {id(o.candidate) for o in self.outcomes if o.error and not o.slot_lost and o.repeat == 1}
            active = [c for c in active if id(c) not in failed]  # a config that failed its first run will fail again
            if numbers[-1] < plan.repeats:
                continue
            verdict, _, _ = choose([], [o.measurement for o in self.outcomes], list(self.objective.slos), self.dflt,
                                   plan.looks)
            if verdict.kind in (BETTER, INFEASIBLE, FAILED, INCONCLUSIVE) or not active or self.spent:
                break  # more runs mend no doubt
            still = {id(c) for c in active if c.params == self.dflt or any(t.params == c.params for t in verdict.tied)}
            active = [c for c in active if id(c) in still]  # configs out of the tie cannot win any more
        return verdict

    def _ran(self, cand: LiveConfig, repeat: int) -> bool:
        return any(o.candidate is cand and o.repeat == repeat for o in self.outcomes)

    def _within_budget(self, wave: list[list[LiveConfig]]) -> list[list[LiveConfig]]:
        """The wave's runs, in order, as far as the live budget goes."""
        if self.plan.budget is None:
            return wave
        room, kept = max(self.plan.budget - len(self.outcomes), 0), []
        for rnd in wave:
            kept.append(rnd[:room])
            room -= len(kept[-1])
        return kept

    def _run_wave(self, wave: list[list[LiveConfig]], first: int) -> None:
        """Round `first + i` of the wave is `wave[i]`: here one run after another; on a cluster each
        round a task. Every run's row is started before a task is submitted, so an interrupted wave
        leaves failed rows."""
        if self.pool is None:
            for i, rnd in enumerate(wave):
                for cand in rnd:
                    self._record(self._run_once(cand, first + i))
            return
        started = [[self._started(cand, first + i) for cand in rnd] for i, rnd in enumerate(wave)]
        started = [rnd for rnd in started if rnd]

        def on_round(i: int, runs, error: str | None) -> None:
            for outcome, run in zip(started[i], runs or [None] * len(started[i])):
                if error is not None or run.error is not None:
                    self._failed(outcome, error or run.error)
                    outcome.slot_lost = error is not None
                else:
                    self._finished(outcome, run.values, run.score, run.result)
                self._record(outcome)

        configs = [[self.space.config(o.candidate.params, self.base) for o in rnd] for rnd in started]
        try:
            if configs:
                self.pool.run_rounds(self.objective, configs, self.workload, on_round)
        except BaseException as err:  # a signal, Ctrl-C: the unfinished rows say so, and a resume runs them
            for outcome in (o for rnd in started for o in rnd if o.measurement is None):
                self.store.mark_run(outcome.run_id, "failed", failure_reason(err))
            raise

    def _run_once(self, cand: LiveConfig, repeat: int) -> LiveOutcome:
        config = self.space.config(cand.params, self.base)
        outcome = self._started(cand, repeat)
        try:
            values, sc, result = self.objective.evaluate(self.run, config, self.workload)
        except (TargetStartError, TargetRunError) as err:
            return self._failed(outcome, str(err))
        except BaseException as err:  # a signal, Ctrl-C: the row says so, and a resume runs it again
            self.store.mark_run(outcome.run_id, "failed", failure_reason(err))
            raise
        return self._finished(outcome, values, sc, result)

    def _started(self, cand: LiveConfig, repeat: int) -> LiveOutcome:
        """A run's outcome with its row: from the start, so an interrupted run stays in the study as a
        failed one, with why."""
        outcome = LiveOutcome(cand, repeat)
        outcome.run_id = self.store.start_run("live", "", "", config={"params": cand.params}, label=_label(outcome),
                                              study=self.study, trial=cand.number)
        return outcome

    def _failed(self, outcome: LiveOutcome, error: str) -> LiveOutcome:
        cand = outcome.candidate
        outcome.error = error
        self.store.mark_run(outcome.run_id, "failed", error)
        outcome.measurement = Measurement("live", cand.number, dict(cand.params), "FAIL", run_id=outcome.run_id,
                                          reason=error, repeat=outcome.repeat)
        return outcome

    def _finished(self, outcome: LiveOutcome, values, sc: Score, result) -> LiveOutcome:
        """A completed run stored with its scores, doubts and diagnoses."""
        cand = outcome.candidate
        outcome.values, outcome.score = values, sc
        result.summary["score"] = sc.as_dict() | {"values": values}
        result.summary["doubts"] = run_doubts(result, sc)
        result.summary["repeat"] = outcome.repeat
        self.store.save_run(result, study=self.study, trial=cand.number, label=_label(outcome), run_id=outcome.run_id)
        thresholds = diagnosis_thresholds(list(self.objective.slos))
        self.store.save_diagnoses(outcome.run_id, diagnosed(result, thresholds, self.simulator, self.objective.slos))
        outcome.measurement = live_measurement(cand.number, cand.params, outcome.run_id, result)
        return outcome

    def _record(self, outcome: LiveOutcome) -> None:
        """Keep a run, rewrite its config's row in the trials table (the means of its completed runs so
        far), and tell `on_result`."""
        cand = outcome.candidate
        self.outcomes.append(outcome)
        merged, _ = combine([o.measurement for o in self.outcomes if o.candidate is cand], list(self.objective.slos))
        if merged.ok:
            self.store.save_trial(self.study, cand.number, "live", "COMPLETE", cand.params, values=merged.values,
                                  constraints=merged.constraints, run_id=merged.run_id)
        else:
            self.store.save_trial(self.study, cand.number, "live", "FAIL", cand.params, reason=merged.reason)
        if self.on_result:
            self.on_result(outcome)

def _resumed(candidates: list[LiveConfig], stored: list[Measurement]) -> list[LiveOutcome]:
    """Stored completed runs as the outcomes of the candidates they ran, numbered 1, 2, ... per config."""
    outcomes = []
    for m in stored:
        cand = next((c for c in candidates if c.params == m.params), None)
        if cand is None:
            continue
        m.repeat = sum(o.candidate is cand for o in outcomes) + 1
        outcomes.append(LiveOutcome(cand, m.repeat, m.values, run_id=m.run_id, measurement=m))
    return outcomes


def _label(outcome: LiveOutcome) -> str:
    return f"{LIVE_LABEL} {outcome.candidate.label} #{outcome.repeat}"
