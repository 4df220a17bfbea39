"""The one ranking: a config beats the default only beyond the spread of their runs; doubtful
evidence makes the verdict inconclusive; ties go to the smallest change. Then stage 2's
interleaved repeats, early stop and budget, on the real simulator, and `kvtune search`
refusing a target that does not serve before stage 1 starts."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import optuna
import pytest

from kvengine.config import EngineConfig, device_preset, model_preset

from kvtune.search import Objective, load_space, parse_slo
from kvtune.search.advice import describe
from kvtune.search.measurement import Measurement, meets_in
from kvtune.search.ranking import (
    BETTER,
    FAILED,
    INCONCLUSIVE,
    INFEASIBLE,
    KEEP_DEFAULT,
    SMALLEST_CHANGE,
    ALPHA,
    choose,
    compare,
)
from kvtune.search.stats import interval
from kvtune.search.stage2 import (
    SIM_TIE,
    LiveConfig,
    LivePlan,
    default_params,
    live_candidates,
    run_stage2,
)
from kvtune.search.study import stage1_attrs, trial_score
from kvtune.store import Store
from kvtune.targets import SimTarget
from kvtune.workload import TraceRequest, Workload, write_workload

SLO = parse_slo("ttft_p95=500ms")
DEFAULT = {"block_size": 16, "max_num_seqs": 256, "kv_cache_dtype": "auto"}
A = {"block_size": 32, "max_num_seqs": 256, "kv_cache_dtype": "auto"}  # one flag from the default
B = {"block_size": 32, "max_num_seqs": 64, "kv_cache_dtype": "fp8"}  # three flags from it


def run(params, number, repeat, goodput, ttft=0.2, doubts=()):
    return Measurement("live", number, dict(params), "COMPLETE", values=[goodput],
                       constraints={SLO.name: ttft - SLO.threshold_s}, goodput_rps=goodput, throughput_rps=goodput,
                       observed={SLO.name: ttft}, target="vllm", measured_on="vLLM 0.32.0", repeat=repeat,
                       doubts=list(doubts))


def runs(params, number, goodputs, **kw):
    return [run(params, number, i + 1, g, **kw) for i, g in enumerate(goodputs)]


def trials_named(note: str) -> list[int]:
    """The trial numbers a note or a reason names, in its order."""
    return [int(n) for n in re.findall(r"trial (\d+)", note)]


def numbers(text: str) -> list[float]:
    """Every number in a text, in its order."""
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]


def test_intervals_are_deterministic_and_hold_the_mean():
    assert interval([3.0]).lo == interval([3.0]).hi == 3.0
    iv = interval([3.1, 5.5, 6.6])
    assert iv.lo < iv.mean < iv.hi and iv == interval([3.1, 5.5, 6.6]) and iv.n == 3
    assert interval([]) is None and interval([float("nan")]) is None


def test_overlapping_runs_keep_the_default_even_when_a_mean_is_higher():
    # the issue's own numbers: candidates 3.10 / 5.52 / 6.64, the default 3.55 / 6.11 / 6.39
    live = runs(B, 7, [3.10, 5.52, 6.64]) + runs(DEFAULT, -1, [3.55, 6.11, 6.39])
    verdict, candidates, default = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == KEEP_DEFAULT and verdict.recommended.is_default and verdict.stage == "live"
    tests = [compare(c, default, [SLO]) for c in candidates[:-1]]
    assert all(t is None or t.p >= ALPHA for t in tests)  # no test says any config beats the default
    assert {len(c.runs) for c in candidates} == {3} and verdict.recommended.live.repeat == 3
    assert candidates[-1].is_default and candidates[-1].spread["value"].n == 3


def test_beyond_the_spread_wins_and_ties_at_the_top_go_to_the_smallest_change():
    live = (runs(B, 7, [8.0, 8.2, 8.1]) + runs(A, 9, [7.9, 8.15, 8.05]) + runs(DEFAULT, -1, [5.0, 5.1, 4.9]))
    verdict, _, default = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == BETTER
    assert verdict.leader.params == B and verdict.recommended.params == A  # tied with B; one flag, not three
    assert compare(verdict.recommended, default, [SLO]).p < ALPHA
    assert trials_named(verdict.reasons[0]) == [9]  # the reason is the recommended config's


def test_meeting_an_slo_in_every_run_that_the_default_misses_in_every_run_wins():
    live = runs(A, 3, [4.0, 4.4, 3.9], ttft=0.3) + runs(DEFAULT, -1, [4.1, 4.2, 4.0], ttft=0.9)
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == BETTER and verdict.recommended.params == A
    assert "meets ttft_p95" in verdict.reasons[0]


def test_the_default_missing_slos_without_a_clear_winner_is_the_smallest_change():
    live = (runs(A, 3, [4.0, 4.4, 3.9], ttft=0.45) + runs(B, 4, [4.2, 4.1, 4.3], ttft=0.4)
            + [run(DEFAULT, -1, 1, 4.1, ttft=0.3), run(DEFAULT, -1, 2, 4.2, ttft=0.9), run(DEFAULT, -1, 3, 4.0, ttft=0.9)])
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == SMALLEST_CHANGE and verdict.recommended.params == A


def test_doubtful_runs_make_the_verdict_inconclusive_and_recommend_nothing():
    live = (runs(A, 3, [8.0, 8.2, 8.1], doubts=["the host's CPUs were 99% busy over the run"])
            + runs(DEFAULT, -1, [5.0, 5.1, 4.9]))
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == INCONCLUSIVE and verdict.recommended is None and verdict.leader.params == A
    assert any("99% busy" in r for r in verdict.reasons) and "inconclusive" in describe(verdict)


def test_no_live_run_completing_is_no_measurement():
    failed = [Measurement("live", -1, dict(DEFAULT), "FAIL", reason="the server did not start", repeat=1)]
    verdict, _, _ = choose([], failed, [SLO], DEFAULT)
    assert verdict.kind == FAILED and not verdict.measured and verdict.recommended is None
    assert len(verdict.reasons) == 1 and verdict.reasons[0].endswith(failed[0].reason)  # the run's own reason


def test_the_simulator_alone_ties_within_two_percent_and_keeps_the_default_then():
    def sim(params, number, value):
        return Measurement("sim", number, dict(params), "COMPLETE", values=[value],
                           constraints={SLO.name: -0.1}, observed={SLO.name: 0.4})
    verdict, _, _ = choose([sim(B, 1, 7.15), sim(A, 2, 7.14), sim(DEFAULT, 0, 7.05)], [], [SLO], DEFAULT)
    assert verdict.kind == KEEP_DEFAULT and verdict.stage == "sim" and verdict.recommended.is_default
    assert [c.params for c in verdict.tied] == [B, A, DEFAULT]  # within 2 % of each other
    verdict, _, _ = choose([sim(B, 1, 7.15), sim(A, 2, 7.14), sim(DEFAULT, 0, 5.0)], [], [SLO], DEFAULT)
    assert verdict.kind == BETTER and verdict.recommended.params == A  # tied with B, the smaller change


# ---------------------------------------------------------------- stage 2 on the real simulator

def busy() -> Workload:
    return Workload([TraceRequest(i / 20.0, 1500 + (i * 37) % 500, 60) for i in range(60)])


def stage2(tmp_path, plan, params, run=None):
    model, device = model_preset("llama-3-8b"), device_preset("l4-24gb")
    space = load_space(None, ["block_size=16,32", "max_num_seqs=8,256", "kv_cache_dtype=auto,fp8"])
    base = EngineConfig(max_model_len=4096)
    dflt = default_params(space, base.resolve(model, device))
    cands = [LiveConfig(f"trial {i}", i, p) for i, p in enumerate(params)] + [LiveConfig("default", -1, dflt)]
    store = Store(f"sqlite:///{tmp_path}/s.db")
    outcomes = run_stage2(run or SimTarget(model, device).run, cands, space, base, busy(),
                          Objective("goodput", (SLO,)), store, "s", plan)
    return outcomes, store, dflt


def test_an_interrupted_stage2_resumes_with_its_counts_budget_and_rows_as_if_it_had_not_stopped(tmp_path):
    """Interrupted during the default's second run, then resumed: the completed runs count as those
    configs' first repeats and against --live-budget, the interrupted run stays as a failed row, and
    each config ends with the runs an uninterrupted stage 2 gives it."""
    fp8 = {"block_size": 32, "max_num_seqs": 256, "kv_cache_dtype": "fp8"}
    sim = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb")).run
    calls = []

    def interrupted(config, workload):
        calls.append(config)
        if len(calls) == 4:  # the default's second run (trial 0 #1, default #1, trial 0 #2, then this)
            raise KeyboardInterrupt
        return sim(config, workload)

    plan = LivePlan(repeats=3, max_repeats=3, budget=6)
    with pytest.raises(KeyboardInterrupt):
        stage2(tmp_path, plan, [fp8], interrupted)
    outcomes, store, dflt = stage2(tmp_path, LivePlan(repeats=3, max_repeats=3, budget=6), [fp8])
    assert [(o.candidate.label, o.repeat) for o in outcomes] == [
        ("trial 0", 1), ("default", 1), ("trial 0", 2), ("default", 2), ("trial 0", 3), ("default", 3)]
    rows = sorted(store.list_runs(study="s"), key=lambda r: r.id)
    failed = [r for r in rows if r.status == "failed"]
    assert len(rows) == 7 and len(failed) == 1 and failed[0].label == "live default #2"
    verdict, candidates, _ = choose([], [o.measurement for o in outcomes], [SLO], dflt)
    assert [len(c.runs) for c in candidates] == [3, 3] and {c.live.repeat for c in candidates} == {3}


def test_stage2_interleaves_its_repeats_stores_each_runs_score_and_stops_once_separated(tmp_path):
    fp8 = {"block_size": 32, "max_num_seqs": 256, "kv_cache_dtype": "fp8"}
    few = {"block_size": 16, "max_num_seqs": 8, "kv_cache_dtype": "auto"}
    outcomes, store, dflt = stage2(tmp_path, LivePlan(repeats=2, max_repeats=4), [fp8, few])
    order = [(o.candidate.label, o.repeat) for o in outcomes]
    assert order[:6] == [("trial 0", 1), ("trial 1", 1), ("default", 1), ("trial 0", 2), ("trial 1", 2),
                         ("default", 2)]
    # the simulator repeats itself exactly: after the minimum the intervals either separate or never will
    verdict, _, _ = choose([], [o.measurement for o in outcomes], [SLO], dflt)
    assert len(outcomes) == 6 or verdict.kind != BETTER
    stored = [r for r in store.list_runs(study="s") if r.label.startswith("live ")]
    assert len(stored) == len(outcomes)
    first = store.load_run(stored[-1].id)
    assert {"score", "doubts", "repeat"} <= set(first.summary) and first.summary["score"]["values"]


@pytest.mark.parametrize("serves", [(16, 32, 64), (16, 32)])
def test_after_a_win_the_descent_recommends_the_smallest_step_back_that_still_wins(tmp_path, serves):
    """A server on which every block size in `serves` serves alike and any other crawls (one sequence at
    a time). Block 16 beats the default (128) in the race; the descent then runs its steps back towards
    128, the smallest change first (64, then 32), and recommends the first the test cannot tell from
    block 16 while it beats the default; a step that loses is passed over."""
    model, device = model_preset("llama-3-8b"), device_preset("l4-24gb")
    sim = SimTarget(model, device).run
    space = load_space(None, ["block_size=16,32,64,128", "max_num_seqs=256", "kv_cache_dtype=auto"])
    base = EngineConfig(max_model_len=4096, block_size=128)
    dflt = default_params(space, base.resolve(model, device))

    def server(config, workload):
        if config.block_size in serves:
            return sim(dataclasses.replace(config, block_size=16), workload)
        return sim(dataclasses.replace(config, max_num_seqs=1), workload)

    numbers = iter(range(100, 110))
    asked = []

    def number_of(params, winner):
        asked.append((params["block_size"], winner))
        return next(numbers)

    plan = LivePlan(repeats=2, max_repeats=2)
    cands = [LiveConfig("trial 0", 0, dict(dflt, block_size=16)), LiveConfig("default", -1, dflt)]
    outcomes = run_stage2(server, cands, space, base, busy(), Objective("throughput", ()),
                          Store(f"sqlite:///{tmp_path}/s.db"), "s", plan, number_of=number_of)
    verdict, _, _ = choose([], [o.measurement for o in outcomes], [], dflt, plan.looks)
    assert verdict.kind == BETTER and verdict.recommended.params["block_size"] == max(serves)
    assert asked == ([(64, 0)] if 64 in serves else [(64, 0), (32, 0)])  # the first winning step ends it
    assert {o.candidate.params["block_size"] for o in outcomes} == {16, 128, *(b for b, _ in asked)}
    assert trials_named(plan.notes[0])[:2] == [100, 0]


def test_a_live_budget_drops_the_weakest_candidates_never_the_default(tmp_path):
    fp8 = {"block_size": 32, "max_num_seqs": 256, "kv_cache_dtype": "fp8"}
    few = {"block_size": 16, "max_num_seqs": 8, "kv_cache_dtype": "auto"}
    plan = LivePlan(repeats=2, max_repeats=2, budget=4)
    outcomes, _, _ = stage2(tmp_path, plan, [fp8, few])
    assert len(outcomes) == 4 and {o.candidate.label for o in outcomes} == {"trial 0", "default"}
    assert [trials_named(n) for n in plan.notes] == [[1]]  # the note names the one left out


def test_search_refuses_a_target_that_does_not_serve_before_stage_1(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(busy(), str(trace))
    db = tmp_path / "s.db"
    p = subprocess.run([sys.executable, "-m", "kvtune", "search", "--workload", str(trace), "--trials", "4",
                        "--target", "vllm", "--model", str(tmp_path), "--vllm-command", str(tmp_path / "no-vllm"),
                        "--device", "l4-24gb", "--db", f"sqlite:///{db}", "--study", "x", "--no-report"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "does not serve" in p.stderr and "nothing was searched" in p.stderr
    # checked before the study opens: no study (and no trial) is left behind
    assert "x" not in optuna.get_all_study_names(storage=f"sqlite:///{db}")


def test_a_gain_under_two_percent_changes_no_flags_however_tight_its_runs():
    live = runs(A, 3, [4.44, 4.44, 4.45]) + runs(DEFAULT, -1, [4.38, 4.39, 4.40])
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == KEEP_DEFAULT


def test_stage2_runs_one_of_the_configs_the_simulator_ran_identically(tmp_path):
    """Light traffic never fills 64 sequences, so 64 and 256 run the same schedule to the bit: stage 2
    runs one of them (the one nearer the default), and its budget goes to the next distinct result.
    Values within SIM_TIE are one result too."""
    sim = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    objective = Objective("goodput", (SLO,))
    light = Workload([TraceRequest(i / 4.0, 200, 20) for i in range(12)])
    space = load_space(None, ["block_size=16,32", "max_num_seqs=64,256", "kv_cache_dtype=auto"])
    configs = [{"block_size": 32, "max_num_seqs": 64, "kv_cache_dtype": "auto"}, A,
               {"block_size": 16, "max_num_seqs": 64, "kv_cache_dtype": "auto"}]
    trials = []
    for number, params in enumerate(configs):
        values, sc, _ = objective.evaluate(sim.run, space.config(params, EngineConfig()), light)
        attrs = stage1_attrs(number, sc)
        dists = {k: optuna.distributions.CategoricalDistribution(sorted({c[k] for c in configs})) for k in params}
        trial = optuna.trial.create_trial(params=params, distributions=dists, values=values, user_attrs=attrs)
        trial.number = number
        trials.append(trial)
    assert trials[0].values == trials[1].values  # the same schedule
    assert abs(trials[2].values[0] / trials[1].values[0] - 1) < SIM_TIE  # the light trace: each serves it all
    trials[2].values = [trials[2].values[0] * 0.95]  # as a config the sim scored lower would be
    candidates, notes = live_candidates(trials, 2, DEFAULT)
    assert [c.params for c in candidates] == [DEFAULT, A, configs[2]]
    assert len(notes) == 1 and trials_named(notes[0]) == [1, 0]  # trial 1 stands for trial 0
    assert f"{SIM_TIE:.0%}" in notes[0]
    # Within SIM_TIE they are still one result; beyond it, each is its own candidate.
    value = trials[0].values[0]
    for factor, one in ((1 - 0.9 * SIM_TIE, True), (1 - 1.1 * SIM_TIE, False)):
        trials[0].values = [value * factor]
        candidates, notes = live_candidates(sorted(trials, key=lambda t: -t.values[0]), 2, DEFAULT)
        assert ([c.params for c in candidates] == [DEFAULT, A, configs[2]]) == one
    assert [c.params for c in candidates] == [DEFAULT, A, configs[0]] and notes == []


def test_stage2_candidates_drop_the_knobs_whose_default_gives_the_same_result(tmp_path):
    """A leader that changes max_num_seqs and block_size, where only max_num_seqs matters: the
    simulator runs it with each changed knob back at the default's value, and keeps the default
    where the result holds (block_size), not where it drops (max_num_seqs)."""
    from kvtune.search.stage2 import simpler_leaders
    from kvtune.search.study import SIMPLIFIES, Stage1, count_taken, open_storage, open_study, ranked_trials

    db = f"sqlite:///{tmp_path}/s.db"
    space = load_space(None, ["block_size=16,32", "max_num_seqs=8,256", "kv_cache_dtype=auto",
                              "gpu_memory_utilization=0.9"])
    dflt = {"block_size": 16, "max_num_seqs": 8, "kv_cache_dtype": "auto", "gpu_memory_utilization": 0.9}
    objective = Objective("throughput", ())
    burst = Workload([TraceRequest(0.0, 200, 50) for _ in range(64)])  # 8 at a time is a queue
    study = open_study(open_storage(db), "simpler", objective, "tpe", 0, {})
    sim = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    with Store(db) as store:
        stage1 = Stage1(study, space, EngineConfig(max_model_len=4096), objective, sim.run, burst, store, 1)
        stage1.enqueue(dflt | {"block_size": 32, "max_num_seqs": 256})
        stage1.optimize()
        notes = simpler_leaders(stage1, ranked_trials(study, objective), 1, dflt)
    ranked = ranked_trials(study, objective)
    by_params = {(t.params["block_size"], t.params["max_num_seqs"]): t for t in ranked}
    assert set(by_params) == {(32, 256), (16, 256), (16, 8)}  # two more trials, one per changed knob
    leader = by_params[(32, 256)].number
    assert [t.user_attrs.get(SIMPLIFIES) for t in (by_params[(16, 256)], by_params[(16, 8)])] == [leader, leader]
    assert count_taken(study) == 1  # on top of --trials: a resumed search samples none in their place
    assert by_params[(16, 8)].values[0] < 0.5 * by_params[(32, 256)].values[0]  # the queue: not the same
    assert len(notes) == 1 and trials_named(notes[0]) == [by_params[(16, 256)].number, leader]
    assert "block_size 32" in notes[0] and "max_num_seqs" not in notes[0]  # the knob dropped, not the one kept
    candidates, _ = live_candidates(ranked, 1, dflt)
    assert [c.params for c in candidates] == [dflt, dflt | {"max_num_seqs": 256}]


def test_a_result_the_default_stands_for_takes_no_place_of_the_top_k():
    """The simulator scores a config level with the default: the default stands for that result, and
    the live stage measures the next result against it instead of running the default alone."""
    dists = {k: optuna.distributions.CategoricalDistribution([16, 32, 64, 128, 256, "auto"]) for k in DEFAULT}
    level, lower = dict(DEFAULT, block_size=32), dict(DEFAULT, block_size=64)
    trials = []
    for number, (params, value) in enumerate([(level, 10.05), (DEFAULT, 10.0), (lower, 9.0)]):
        trial = optuna.trial.create_trial(params=params, distributions=dists, values=[value])
        trial.number = number
        trials.append(trial)
    candidates, notes = live_candidates(trials, 1, DEFAULT)
    assert [(c.label, c.params) for c in candidates] == [("default", DEFAULT), ("trial 2", lower)]
    assert len(notes) == 1 and trials_named(notes[0]) == [1, 0]  # the default (trial 1) stands for trial 0
    # Where every config is level with the default, the sim's leader still runs live beside it.
    trials[2].values = [10.0]
    candidates, notes = live_candidates(trials, 1, DEFAULT)
    assert [(c.label, c.params) for c in candidates] == [("default", DEFAULT), ("trial 0", level)]
    assert [trials_named(n) for n in notes] == [[0], [1, 2]]  # trial 0 runs live; the default stands for trial 2


def test_a_result_enters_as_its_smallest_change_whatever_the_simulators_order_inside_it():
    """Trials the simulator scores alike are one result; which of them it ranks first moves with each
    calibration. The result enters as the smallest change: unquantized before fp8, then the smallest
    step from the default's value (block 32 from 16, not 256), so a rerun enters the same config."""
    dists = {k: optuna.distributions.CategoricalDistribution([16, 32, 64, 128, 256, "auto", "fp8"])
             for k in DEFAULT}
    fp8, near, far = dict(DEFAULT, kv_cache_dtype="fp8"), dict(DEFAULT, block_size=32), dict(DEFAULT, block_size=256)
    for values in ((12.05, 11.95, 12.0), (11.95, 12.0, 12.05), (12.0, 12.05, 11.95)):
        trials = []
        for number, (params, value) in enumerate(zip((fp8, near, far, DEFAULT), (*values, 5.0))):
            trial = optuna.trial.create_trial(params=params, distributions=dists, values=[value])
            trial.number = number
            trials.append(trial)
        ranked = sorted(trials, key=lambda t: -t.values[0])
        candidates, _ = live_candidates(ranked, 1, DEFAULT)
        assert [c.params for c in candidates] == [DEFAULT, near], values


def test_the_race_enters_distinct_results_first_and_level_configs_only_in_places_left():
    """Entrants in the simulator's order: every distinct result before any config the simulator
    scores level with the default (the default stands for those), whatever their headroom."""
    dists = {k: optuna.distributions.CategoricalDistribution([16, 32, 64, 128, 256, "auto"]) for k in DEFAULT}
    level, lower, lowest = dict(DEFAULT, block_size=32), dict(DEFAULT, block_size=64), dict(DEFAULT, block_size=128)
    trials = []
    for number, (params, value) in enumerate([(DEFAULT, 10.0), (level, 9.99), (lower, 9.0), (lowest, 8.0)]):
        trial = optuna.trial.create_trial(params=params, distributions=dists, values=[value])
        trial.number = number
        trials.append(trial)
    assert [c.params for c in live_candidates(trials, 2, DEFAULT)[0]] == [DEFAULT, lower, lowest]
    candidates, notes = live_candidates(trials, 3, DEFAULT)
    assert [c.params for c in candidates] == [DEFAULT, lower, lowest, level]
    assert [trials_named(n) for n in notes] == [[1]]  # the one entrant level with the default


def test_a_config_meeting_the_slos_in_every_run_is_preferred_to_a_higher_mean_that_missed_one():
    live = (runs(B, 7, [9.0, 9.4, 9.2], ttft=0.3)[:2] + [run(B, 7, 3, 9.3, ttft=0.7)]
            + runs(A, 9, [8.0, 8.2, 8.1], ttft=0.3) + runs(DEFAULT, -1, [5.0, 5.1, 4.9], ttft=0.45))
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == BETTER and verdict.leader.params == A and verdict.recommended.params == A
    assert [c.params for c in verdict.fragile] == [B] and meets_in(verdict.fragile[0]) == (2, 3)
    assert meets_in(verdict.recommended) == (3, 3)
    # the reason naming the fragile trial 7: its mean against trial 9's, its 2 of 3 runs, trial 9 preferred
    said = [numbers(r) for r in verdict.reasons if r.startswith("trial 7 ")]
    assert said == [[7, 9.23, 8.1, 2, 3, 9]], verdict.reasons


def test_a_tie_goes_by_the_simulators_order_not_by_the_live_means():
    """Two one-flag changes of one step each (block 16 -> 32, 256 seqs -> 128) tied live: the one the
    simulator ranked higher is recommended, whichever live mean is higher, so a rerun's noise does
    not flip the advice."""
    C = dict(DEFAULT, max_num_seqs=128)

    def sim(params, number, value):
        return Measurement("sim", number, dict(params), "COMPLETE", values=[value],
                           constraints={SLO.name: -0.1}, observed={SLO.name: 0.4})
    trials = [sim(C, 1, 9.0), sim(A, 2, 8.5), sim(DEFAULT, 0, 5.0)]
    for a_runs, c_runs in (([8.3, 8.1, 8.2], [8.0, 8.2, 8.1]), ([8.0, 8.2, 8.1], [8.3, 8.1, 8.2])):
        live = runs(A, 2, a_runs) + runs(C, 1, c_runs) + runs(DEFAULT, 0, [5.0, 5.1, 4.9])
        verdict, _, _ = choose(trials, live, [SLO], DEFAULT)
        assert verdict.kind == BETTER and verdict.recommended.params == C


def test_between_equal_gains_an_unquantized_kv_cache_is_preferred_whatever_the_simulators_order():
    """The demo's two answers: fp8 KV and a smaller block both beat the default, tied with each other.
    Whichever the simulator ranked first (it moves with each calibration), the change that keeps the
    KV cache unquantized is recommended, also against a quantized one changing fewer flags."""
    fp8 = dict(DEFAULT, kv_cache_dtype="fp8")
    small_blocks = dict(DEFAULT, block_size=DEFAULT["block_size"] // 2, max_num_seqs=64)

    def sim(params, number, value):
        return Measurement("sim", number, dict(params), "COMPLETE", values=[value],
                           constraints={SLO.name: -0.1}, observed={SLO.name: 0.4})
    for fp8_sim, blocks_sim in ((9.0, 8.0), (8.0, 9.0)):
        trials = [sim(fp8, 1, fp8_sim), sim(small_blocks, 2, blocks_sim), sim(DEFAULT, 0, 2.0)]
        live = runs(fp8, 1, [8.3, 8.1, 8.2]) + runs(small_blocks, 2, [8.0, 8.2, 8.1]) + runs(DEFAULT, 0, [2.0, 2.1, 1.9])
        verdict, _, _ = choose(trials, live, [SLO], DEFAULT)
        assert verdict.kind == BETTER and verdict.recommended.params == small_blocks
        assert trials_named(verdict.reasons[0]) == [2] and trials_named(verdict.reasons[1]) == [1, 2]


def test_a_stage1_recommendation_is_among_the_configs_compared_even_ranked_below_the_top():
    """Stage 1 only: six configs tied on the simulator, the smallest change ranked last of them; the
    configs the report and the terminal compare include the one recommended."""
    def sim(params, number, value):
        return Measurement("sim", number, dict(params), "COMPLETE", values=[value],
                           constraints={SLO.name: -0.1}, observed={SLO.name: 0.4})
    changed = [dict(DEFAULT, block_size=DEFAULT["block_size"] * 2, max_num_seqs=n, kv_cache_dtype="fp8")
               for n in (40, 48, 56, 64, 72)]
    smallest = dict(DEFAULT, max_num_seqs=DEFAULT["max_num_seqs"] // 2)
    trials = [sim(p, i + 1, 9.0 - 0.01 * i) for i, p in enumerate(changed)] + [sim(smallest, 6, 8.9),
                                                                                 sim(DEFAULT, 0, 2.0)]
    verdict, candidates, _ = choose(trials, [], [SLO], DEFAULT)
    assert verdict.stage == "sim" and verdict.recommended.params == smallest
    assert any(c.params == smallest for c in candidates)


def test_a_smaller_change_tied_at_the_top_but_not_beyond_the_default_loses_to_one_that_is():
    """The 12-config vLLM truth run of 2026-12-03: block 32 / fp8 beat the default beyond the spread,
    fp8 alone tied with it but overlapped the default's runs; the one shown to gain is recommended,
    and nothing claims that no config beats the default."""
    live = (runs(B, 10, [29.09, 29.71, 22.53]) + runs(A, 15, [22.07, 23.06, 16.74])
            + runs(DEFAULT, -1, [7.82, 14.84, 16.96]))
    verdict, _, default = choose([], live, [SLO], DEFAULT)
    assert [c.params for c in verdict.tied] == [B, A]
    assert verdict.kind == BETTER and verdict.recommended.params == B
    assert compare(verdict.recommended, default, [SLO]).p < ALPHA / 2  # Holm's first step over the two tied
    assert compare(verdict.tied[1], default, [SLO]).p >= ALPHA  # A alone is not shown to gain


def test_the_verdict_keeps_each_configs_test_against_the_default_and_whether_it_counts():
    """What `search --json` prints as `comparisons`: every live config's p-value against the default and
    whether the verdict counted it as beating the default (Holm over the tied: A is not shown to gain);
    one run of a config is no test."""
    live = (runs(B, 10, [29.09, 29.71, 22.53]) + runs(A, 15, [22.07, 23.06, 16.74])
            + runs(DEFAULT, -1, [7.82, 14.84, 16.96]))
    verdict, _, default = choose([], live, [SLO], DEFAULT)
    assert verdict.alpha == ALPHA and choose([], live, [SLO], DEFAULT, looks=2)[0].alpha == ALPHA / 2
    assert [(c.label, c.beats) for c in verdict.comparisons] == [("trial 10", True), ("trial 15", False)]
    for c, config in zip(verdict.comparisons, verdict.tied):
        test = compare(config, default, [SLO])
        assert (c.label, c.params, c.p, c.why) == (config.label, config.params, test.p, test.why)
    assert verdict.comparisons[0].p < verdict.alpha / 2 <= verdict.alpha <= verdict.comparisons[1].p
    once, _, _ = choose([], runs(A, 4, [30.0]) + runs(DEFAULT, -1, [7.82, 14.84, 16.96]), [SLO], DEFAULT)
    assert [(c.label, c.p, c.beats, c.why) for c in once.comparisons] == [("trial 4", None, False, None)]


def test_intervals_are_student_t_and_cover_the_mean_as_often_as_they_say():
    """The issue's point: a percentile bootstrap of 3 values covers the mean about 75 % of the time."""
    import numpy as np

    iv = interval([11.0, 12.0, 13.0])  # mean 12, sd 1: t(0.975, 2) = 4.303 over sqrt(3)
    assert (iv.lo, iv.hi, iv.sd) == pytest.approx((12 - 2.4843, 12 + 2.4843, 1.0), abs=1e-3)
    assert interval([1.0, 2.0, 3.0]).lo == 0.0  # a goodput or a latency is never below 0
    rng = np.random.default_rng(7)
    draws = rng.normal(10, 2, (4000, 3))
    covered = sum(1 for xs in draws if (iv := interval(list(xs))).lo <= 10 <= iv.hi)
    assert 0.94 <= covered / len(draws) <= 0.96


def test_holm_rejects_step_down_and_the_comparisons_share_one_error_budget():
    from kvtune.search.stats import holm

    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}, 0.05) == {"a"}  # 0.03 > 0.05 / 2 stops the steps
    assert holm({"a": 0.01, "b": 0.02}, 0.05) == {"a", "b"}  # 0.01 < 0.025, then 0.02 < 0.05
    assert holm({}, 0.05) == set()


def test_a_and_a_searches_say_better_at_most_at_the_error_budget_and_a_clear_gain_is_found():
    """Stage 2 as a search runs it (3 candidates and the default, 3 to 5 runs, a verdict at each look),
    every config drawn from one distribution at a 10 % spread: false "better" within 5 %; a 20 %
    gain at a 5 % spread is found in most searches."""
    import numpy as np

    from benchscript import load_benchmark

    bench = load_benchmark("verdict_calibration")
    false_better, power = bench.rates(bench.normal_draws(0.10, np.random.default_rng(3)), 60, 0.2, 3, 5)
    assert false_better <= 0.05
    _, power = bench.rates(bench.normal_draws(0.05, np.random.default_rng(4)), 60, 0.2, 3, 5)
    assert power >= 0.8


def test_the_headline_names_the_flags_to_set_and_the_reasons_the_test():
    live = runs(B, 7, [8.0, 8.3, 8.1]) + runs(DEFAULT, -1, [5.0, 5.4, 4.9])
    verdict, _, _ = choose([], live, [SLO], DEFAULT)
    assert verdict.kind == BETTER
    assert "`--block-size 32 --max-num-seqs 64 --kv-cache-dtype fp8`" in describe(verdict)
    p = float(re.search(r"p = ([\d.e-]+);", verdict.reasons[0]).group(1))
    assert p < ALPHA and int(re.search(r"Holm over (\d+) comparison", verdict.reasons[0]).group(1)) == 1


def test_the_closest_and_the_doubted_leader_are_named_by_their_flags_too():
    missed = runs(B, 7, [8.0, 8.3, 8.1], ttft=0.9) + runs(DEFAULT, -1, [5.0, 5.4, 4.9], ttft=2.0)
    verdict, _, _ = choose([], missed, [SLO], DEFAULT)
    assert verdict.kind == INFEASIBLE and verdict.closest.params == B
    assert "the closest is `--block-size 32 --max-num-seqs 64 --kv-cache-dtype fp8` (trial 7)." in describe(verdict)
    doubted = runs(A, 3, [8.0, 8.3, 8.1], doubts=["the host was saturated"]) + runs(DEFAULT, -1, [5.0, 5.4, 4.9])
    verdict, _, _ = choose([], doubted, [SLO], DEFAULT)
    assert verdict.kind == INCONCLUSIVE and "inconclusive (`--block-size 32` (trial 3) measured best)" in describe(verdict)
    only_default = runs(DEFAULT, -1, [5.0, 5.4, 4.9], ttft=2.0)
    assert "the closest is the default." in describe(choose([], only_default, [SLO], DEFAULT)[0])


def test_a_config_meeting_the_slos_in_some_runs_is_named_fragile():
    live = runs(A, 3, [4.0, 4.1, 4.05]) + [run(DEFAULT, -1, 1, 4.1, ttft=0.3), run(DEFAULT, -1, 2, 4.0, ttft=0.9),
                                           run(DEFAULT, -1, 3, 4.05, ttft=0.4)]
    verdict, _, default = choose([], live, [SLO], DEFAULT)
    assert meets_in(default) == (2, 3)
    assert [2, 3] in [numbers(r) for r in verdict.reasons]  # a reason names the default's 2 of 3 runs


def test_a_configs_figure_is_one_number_wherever_it_is_shown():
    """The report's tables and the UI read Candidate.figure: a live SLO figure is the mean of its runs'
    client-side observations (the interval's), not another summary of the same runs."""
    live = runs(A, 3, [4.0, 4.4, 3.9], ttft=0.3) + runs(DEFAULT, -1, [4.1, 4.2, 4.0], ttft=0.45)
    _, candidates, default = choose([], live, [SLO], DEFAULT)
    a = next(c for c in candidates if c.params == A)
    assert a.figure("ttft_p95", "live") == pytest.approx(0.3) == a.spread["ttft_p95"].mean
    assert a.figure("goodput_rps", "live") == pytest.approx(4.1)
    assert a.figure("ttft_p95", "sim") is None  # never simulated here


def test_a_stage1_trials_score_reads_the_same_from_a_study_written_before_it_was_one_attribute():
    sim = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    objective = Objective("goodput", (SLO,))
    light = Workload([TraceRequest(i / 4.0, 200, 20) for i in range(12)])
    values, sc, _ = objective.evaluate(sim.run, EngineConfig(), light)
    new = optuna.trial.create_trial(values=values, user_attrs=stage1_attrs(7, sc))
    flat = {"run_id": 7, **{k: v for k, v in sc.as_dict().items() if isinstance(v, (int, float))},
            **{f"observed_{k}": v for k, v in sc.observed.items()}}  # each figure an attribute of its own
    old = optuna.trial.create_trial(values=values, user_attrs=flat)
    assert trial_score(old) == trial_score(new) and trial_score(new)["observed"][SLO.name] > 0
    assert trial_score(new)["goodput_rps"] == sc.goodput_rps
    assert trial_score(optuna.trial.create_trial(values=values)) == {}  # nothing measured
