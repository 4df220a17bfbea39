"""The one ranking: which config wins, by how much, and whether the evidence says so.

`search --json`, the report and the UI all take their verdict from `choose`; what it judges (a
config's runs, their means and intervals, how it met the SLOs) is measurement.py's.

Stage 2 (the live target) decides whenever it completed a run. Configs are ranked by how
they met the SLOs (`tier`: in every run, on average only, not at all), then by the
objective's mean: a config that met them in every run is preferred to one with a higher
mean that missed them in some run. The leader's tie is every config of its tier that the
leader does not beat by a test. A config beats the reference (the default, or the
operator's baseline) only when a test says so at a stated error rate: Welch's t-test
(one-sided, unequal variances: the configs' run-to-run noise differs) of its objective's
mean, and of each SLO's observed value where it meets the SLO in every run and the
reference misses it on average. The tests of one comparison are Bonferroni-combined, the
comparisons of all the tied configs with the reference Holm-corrected, and the repeats
added while undecided are paid for by dividing the error budget over the looks
(`choose`'s `looks`): the chance of a false "better" stays within ALPHA. Intervals are
Student-t 95 % intervals of the mean. Of the tied configs shown to beat the reference,
the cheapest change is recommended (`space.change_cost`: a quantized KV cache last, then
the fewest flags; the simulator's order breaks a tie, the live means within a tie are
noise). The reference in the tie: keep it. The reference outside the tie (it misses an
SLO) and nothing shown to beat it: the smallest change in the tie. Runs whose own evidence
is doubtful (client and server disagree, the load generator fell behind, the host was
saturated, requests failed) make the verdict inconclusive. Stage 1 alone (no live stage)
is deterministic: configs within SIM_TIE of the best are tied, and the same rule applies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .measurement import (
    EVERY_RUN,
    MISSED,
    ON_AVERAGE,
    Candidate,
    Measurement,
    Miss,
    combine,
    meets_in,
    misses,
    rank_key,
    tier,
)
from .slo import SLO
from .space import change_cost
from .stats import holm, welch

TOP_SIM_CANDIDATES = 5  # configs compared when no stage 2 ran
SIM_TIE = 0.02  # stage-1 values this close to the best are one result: the model is not that exact
MIN_GAIN = 0.02  # a live gain smaller than this is no reason to change flags, however significant
ALPHA = 0.05  # the chance of a false "better" a verdict allows, over all its comparisons and looks


def within_tie(a: float, b: float) -> bool:
    """Whether two stage-1 values are one result at the simulator's precision (SIM_TIE apart at most)."""
    return abs(a - b) <= SIM_TIE * max(abs(a), abs(b))


# what a verdict can be
BETTER = "better"  # the recommended config beats the default by a test at the error budget
KEEP_DEFAULT = "keep_default"  # no config is shown to beat the default
SMALLEST_CHANGE = "smallest_change"  # the default misses the SLOs; several configs tie: the least change
INCONCLUSIVE = "inconclusive"  # the evidence cannot be trusted (reasons say why)
INFEASIBLE = "infeasible"  # nothing met the SLOs
FAILED = "failed"  # nothing completed (on the stage that was to decide)


@dataclass(frozen=True)
class Comparison:
    """One live config against the reference, as the verdict judged it: `compare`'s p-value (None
    without 2 completed runs of each, or no gain to test), whether the test counts it as beating the
    reference (the Holm step over the configs tied at the top, at `Verdict.alpha`; an inconclusive
    verdict's doubts then trust none), and why."""
    label: str
    params: dict
    p: float | None
    beats: bool
    why: str | None


@dataclass
class Verdict:
    stage: str | None  # the stage whose numbers decided: live, sim, or None when nothing completed
    recommended: Candidate | None  # what to run (the default itself when nothing beats it)
    closest: Candidate | None  # only when nothing met the SLOs
    misses: list[Miss] = field(default_factory=list)  # the closest one's
    feasible_elsewhere: list[int] = field(default_factory=list)  # sim trials that met the SLOs when live did not
    kind: str = FAILED  # BETTER, KEEP_DEFAULT, SMALLEST_CHANGE, INCONCLUSIVE, INFEASIBLE, FAILED
    reasons: list[str] = field(default_factory=list)  # the evidence for the verdict, or against trusting it
    leader: Candidate | None = None  # the best by the objective's mean (before the tie rule)
    tied: list[Candidate] = field(default_factory=list)  # configs indistinguishable from the leader
    fragile: list[Candidate] = field(default_factory=list)  # higher means than the leader's, SLOs missed in some run
    default_params: dict | None = None  # what the recommendation's flags are changed from
    reference: str = "the default"  # what that config is called: the default, or the operator's baseline
    beat: list[Candidate] = field(default_factory=list)  # the tied configs a test showed to beat the reference
    comparisons: list[Comparison] = field(default_factory=list)  # live: each config against the reference
    alpha: float | None = None  # live: the level each look tested at (ALPHA split over the looks)

    @property
    def measured(self) -> bool:
        """Whether the deciding stage measured anything."""
        return self.kind != FAILED


@dataclass(frozen=True)
class Test:
    """Whether `a` beats `b`: its tests' smallest p-value, Bonferroni-combined over them, and why."""
    p: float
    why: str

    def reason(self, correction: str = "") -> str:
        return f"{self.why} (Welch t, one-sided p = {self.p:.2g}{correction})"


def compare(a: Candidate, b: Candidate, slos: list[SLO]) -> Test | None:
    """The test of `a` beating `b`: Welch on the objective's mean (where a's mean gains more than
    MIN_GAIN: a smaller gain is no reason to change flags), and on each SLO's observed value that `a`
    meets in every run while b's mean misses it; None without 2 runs of each."""
    va, vb = a.spread.get("value"), b.spread.get("value")
    if va is None or vb is None or va.n < 2 or vb.n < 2:
        return None
    tests = []
    d = welch(va, vb)
    if d is not None and va.mean > vb.mean * (1 + MIN_GAIN):
        tests.append((d.p, f"its mean {va.mean:.3g} [{va.lo:.3g}, {va.hi:.3g}] against {vb.mean:.3g} "
                           f"[{vb.lo:.3g}, {vb.hi:.3g}], a difference of {d.diff:+.3g} [{d.lo:+.3g}, {d.hi:+.3g}]"))
    for slo in slos:
        sa, sb = a.spread.get(slo.name), b.spread.get(slo.name)
        meets = all(m.observed.get(slo.name) is not None and m.observed[slo.name] <= slo.threshold_s
                    for m in a.runs if m.ok)
        if sa is None or sb is None or not meets or sb.mean <= slo.threshold_s:
            continue
        d = welch(sa, sb, higher_is_better=False)
        if d is not None:
            ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
            tests.append((d.p, f"it meets {slo.name} <= {slo.threshold_s * 1000:g} ms in every run "
                               f"({ms(sa.mean)} ms [{ms(sa.lo)}, {ms(sa.hi)}]) and the other misses it on average "
                               f"({ms(sb.mean)} ms [{ms(sb.lo)}, {ms(sb.hi)}])"))
    if not tests:
        return None
    p, why = min(tests)
    return Test(min(1.0, p * (1 + len(slos))), why)  # Bonferroni over the objective and every SLO


def separated(a: Candidate, b: Candidate, slos: list[SLO], alpha: float = ALPHA) -> str | None:
    """Why `a` beats `b` at level `alpha` (compare's test), or None."""
    test = compare(a, b, slos)
    return None if test is None or test.p >= alpha else test.reason()


# ---------------------------------------------------------------- the verdict

def choose(trials: list[Measurement], live: list[Measurement], slos: list[SLO],
           default_params: dict | None, looks: int = 1,
           default_label: str = "the default") -> tuple[Verdict, list[Candidate], Candidate]:
    """The verdict, the configs to compare across stages (best first, the default last), and the default.
    `looks`: how many times stage 2 may look at its runs before stopping (one per repeat count from
    --repeats to --max-repeats): each look spends ALPHA / looks. `default_label`: what the reference
    config is called ("the baseline" for an operator's --baseline-args)."""
    sim_done = [t for t in trials if t.ok and t.duplicate_of is None]
    pair = _pairing(trials, live, default_params, slos, default_label)
    default = pair(default_params) if default_params is not None else Candidate(default_label, {}, is_default=True)
    if live:
        verdict, shown = _live_verdict(live, pair, default, slos, sim_done, ALPHA / max(looks, 1))
    else:
        verdict, shown = _sim_verdict(sim_done, pair, default, slos)
    verdict.default_params, verdict.reference = default_params, default_label
    return verdict, _unique([c for c in shown if not c.is_default]) + [default], default


def _live_verdict(live, pair, default, slos, sim_done, alpha: float):
    configs = _unique([pair(m.params) for m in live])
    done = [c for c in configs if c.live is not None and c.live.ok]
    shown = sorted(configs, key=lambda c: (0, tier(c, "live"), rank_key(c.live, slos)) if c in done else (1,))
    if not done:
        reasons = list(dict.fromkeys(f"{c.label}: {m.reason}" for c in configs for m in c.runs if m.reason))
        return Verdict("live", None, None, kind=FAILED, reasons=reasons or ["no live run completed"]), shown
    verdict = _decide("live", [c for c in shown if c in done], default, slos,
                      lambda a, b: separated(a, b, slos, alpha), _holm_beating(slos, alpha))
    verdict.reasons += _robustness(verdict, default, slos)
    verdict.alpha, verdict.comparisons = alpha, _comparisons(done, default, verdict.beat, slos)
    if verdict.kind == INFEASIBLE:
        verdict.feasible_elsewhere = [t.number for t in sim_done if t.feasible]
    doubts = _doubts(verdict, default)
    if doubts:
        # the evidence can carry neither a change of flags nor "nothing meets the SLOs" (a busy host
        # alone can miss them): nothing is recommended, the leader is shown
        verdict.kind, verdict.reasons, verdict.recommended = INCONCLUSIVE, doubts, None
        verdict.leader = verdict.leader or verdict.closest
        verdict.closest, verdict.misses = None, []
    return verdict, shown


def _sim_verdict(sim_done, pair, default, slos):
    ranked = sorted(sim_done, key=lambda m: rank_key(m, slos))
    if not ranked:
        return Verdict(None, None, None, kind=FAILED, reasons=["no stage-1 trial completed"]), []

    def beyond_tie(a: Candidate, b: Candidate) -> str | None:  # both completed stage 1 (`ordered`)
        if a.sim.feasible and not b.sim.feasible:
            return "the other misses the SLOs on the simulator"
        va, vb = a.sim.value, b.sim.value
        if va is not None and vb is not None and va > vb * (1 + SIM_TIE) + 1e-12:
            return f"{va:.3g} vs {vb:.3g} on the simulator, more than {SIM_TIE:.0%} apart"
        return None

    ordered = [pair(m.params) for m in ranked]
    verdict = _decide("sim", ordered, default, slos, beyond_tie)
    shown = ordered[:TOP_SIM_CANDIDATES]
    rec = verdict.recommended  # the smallest change within the tie may rank below the top few: shown too
    return verdict, shown + [rec] if rec is not None and all(c is not rec for c in shown) else shown


def _comparisons(done: list[Candidate], default: Candidate, beat: list[Candidate],
                 slos: list[SLO]) -> list[Comparison]:
    """Each completed config's test against the reference, best first."""
    out = []
    for c in (c for c in done if not c.is_default):
        test = compare(c, default, slos)
        out.append(Comparison(c.label, dict(c.params), test.p if test else None, any(b is c for b in beat),
                              test.why if test else None))
    return out


def _holm_beating(slos: list[SLO], alpha: float):
    """Of the configs tied at the top, those shown to beat the default, Holm-corrected over all of
    them, with each one's reason."""
    def beating(tied: list[Candidate], default: Candidate) -> dict:
        tests = {id(c): compare(c, default, slos) for c in tied}
        ps = {key: t.p for key, t in tests.items() if t is not None}
        n = len(tied)
        holm_said = (f"; Holm over {n} comparison{'s' if n != 1 else ''} with {default.label} at α = {alpha:.2g}, "
                     f"{ALPHA:.0%} split over stage 2's looks")
        rejected = holm(ps, alpha)
        return {id(c): tests[id(c)].reason(holm_said) for c in tied if id(c) in rejected}
    return beating


def _robustness(verdict: Verdict, default: Candidate, slos: list[SLO]) -> list[str]:
    """A config that meets the SLOs in some runs and misses them in others is fragile: say so, and
    say so of a fragile config with a higher mean than the recommended one, which was preferred."""
    lines = []
    rec = verdict.recommended
    for c in [default] + ([rec] if rec is not None and rec is not default and not rec.is_default else []):
        met, done = meets_in(c)
        if slos and 0 < met < done:
            lines.append(f"{c.label} met the SLOs in {met} of {done} runs")
        elif slos and met == 0 and done and c.is_default:
            lines.append(f"{c.label} missed the SLOs in {done} of {done} runs")
    if rec is not None and tier(rec, "live") == EVERY_RUN:
        for c in verdict.fragile:
            met, done = meets_in(c)
            lines.append(f"{c.label} had a higher mean ({c.live.value:.3g} against {rec.live.value:.3g}) but met the "
                         f"SLOs in only {met} of {done} runs: {rec.label}, which met them in every run, is preferred")
    return lines


def _decide(stage: str, ordered: list[Candidate], default: Candidate, slos: list[SLO], beats,
            beating=None) -> Verdict:
    """The tie rule, on configs best first (by `tier`, then their measurement on `stage`). `beats(a, b)`
    says why a beats b or None; `beating(tied, default)`, where given, which tied configs beat the
    default ({id: why}) when they are tested together (live: Holm over them)."""
    leader = ordered[0]
    if tier(leader, stage) == MISSED:
        return Verdict(stage, None, leader, misses(leader.on(stage), slos), kind=INFEASIBLE, leader=leader,
                       reasons=["no config met every SLO"])
    tied = [c for c in ordered if tier(c, stage) == tier(leader, stage) and beats(leader, c) is None]
    fragile = [c for c in ordered if tier(c, stage) == ON_AVERAGE and c.on(stage).value > leader.on(stage).value]
    verdict = Verdict(stage, None, None, kind=BETTER, leader=leader, tied=tied, fragile=fragile)
    default_in = next((c for c in ordered if c.is_default), None)
    if default_in is not None and default_in in tied:
        verdict.recommended, verdict.kind = default_in, KEEP_DEFAULT
        verdict.reasons = [f"no config beats {default.label} by a Welch t-test at the error budget" if stage == "live"
                           else f"no config beats {default.label} by more than {SIM_TIE:.0%} on the simulator"]
        return verdict
    if default_in is None:  # every config in `ordered` completed on `stage`: the default did not
        verdict.recommended = _simplest(tied, default, slos)
        verdict.reasons = [f"{default.label} did not complete a run" if stage == "live" else
                           f"{default.label} was not measured"]
        return verdict
    # Of the tied, only one shown to beat the default is a change worth making: a smaller change
    # that ties with the leader but not beyond the default's spread is not shown to gain anything.
    why = beating(tied, default_in) if beating else {id(c): beats(c, default_in) for c in tied}
    shown = verdict.beat = [c for c in tied if why.get(id(c)) is not None]
    if shown:
        rec = verdict.recommended = _simplest(shown, default, slos)
        verdict.reasons = [f"{rec.label} beats {default.label}: {why[id(rec)]}"]
        others = [c.label for c in shown if c is not rec]
        if others:
            verdict.reasons.append(f"{', '.join(others)} also beat{'s' if len(others) == 1 else ''} {default.label} "
                                   f"and tie{'s' if len(others) == 1 else ''} with {rec.label}, the smaller change")
        return verdict
    # the default is outside the tie yet nothing that ties beats it: the default misses an SLO
    verdict.recommended, verdict.kind = _simplest(tied, default, slos), SMALLEST_CHANGE
    verdict.reasons = [f"{default.label} misses the SLOs on average, but no config is shown to beat it by a test; "
                       f"{verdict.recommended.label} is the smallest change among the {len(tied)} tied at the top"]
    return verdict


def _simplest(configs: list[Candidate], default: Candidate, slos: list[SLO]) -> Candidate:
    """The cheapest change (`space.change_cost`: no quantized KV before one, then the fewest flags);
    among equals, the simulator's best (the live means, within the tie, are noise)."""
    def sim_rank(c):
        return rank_key(c.sim, slos) if c.sim is not None and c.sim.ok else (2, 0.0, 0)
    return min(configs, key=lambda c: (change_cost(c.params, default.params), sim_rank(c)))


def _doubts(verdict: Verdict, default: Candidate) -> list[str]:
    """Doubts of the runs that decided: the recommended config's, the leader's and the default's."""
    return list(dict.fromkeys(f"{c.label}, run {m.repeat}: {d}" for c in (verdict.recommended, verdict.leader, default)
                              if c is not None for m in c.runs for d in m.doubts))


def _pairing(trials: list[Measurement], live: list[Measurement], default_params: dict | None, slos: list[SLO],
             default_label: str = "the default"):
    """`pair(params)`: the config's candidate, with its stage-1 trial (the completed one, else the one that
    failed, so that a config that ran and failed reads failed with its reason) and its live runs."""
    tried = sorted((t for t in trials if t.duplicate_of is None and not t.surplus), key=lambda t: not t.ok)

    def pair(params: dict) -> Candidate:
        sim = next((t for t in tried if t.params == params), None)
        runs = sorted((m for m in live if m.params == params), key=lambda m: m.repeat)
        is_default = default_params is not None and params == default_params
        number = sim.number if sim is not None else runs[0].number if runs else None
        label = default_label if is_default else f"trial {number}"
        merged, spread = combine(runs, slos) if runs else (None, {})
        return Candidate(label, dict(params), sim, merged, is_default, runs, spread)
    return pair


def _unique(candidates: list[Candidate]) -> list[Candidate]:
    """The first candidate of each config (params), in order."""
    return [c for i, c in enumerate(candidates) if all(c.params != d.params for d in candidates[:i])]
