"""What a diagnosis is: a fault, the evidence that shows it, its cause and the fix.

Plain dataclasses that the store (`Store.save_diagnoses`), the report and the
JSON output take as they are. `Thresholds` holds every number a rule compares
against, with defaults from the fault card; pass your own to tighten or loosen.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

SEVERITIES = ("critical", "warning", "info")
INSUFFICIENT_DATA = "insufficient_data"


@dataclass
class Evidence:
    metric: str  # the series or figure, in vLLM's / the fault card's words
    window: str  # where in the run it was measured
    value: float | int | str | None
    threshold: str  # what it was compared against, e.g. ">= 0.9"


@dataclass
class FixTrial:
    """One proposed fix replayed in the simulator against the run's own workload."""

    change: str  # the fix as printed
    verdict: str  # one of TRIAL_VERDICTS
    note: str  # why: what it did to the symptom and the SLOs, or why it could not be simulated
    before: dict = field(default_factory=dict)  # the simulator's figures without the fix
    after: dict = field(default_factory=dict)  # ... and with it
    flag: str = ""  # the change as a flag and the value it sets, for a caller to apply
    value: object = None


HELPED, NO_HELP, UNTESTED = "helped", "did not help", "untested"
TRIAL_VERDICTS = (HELPED, NO_HELP, UNTESTED)


@dataclass
class Diagnosis:
    """`fix` is the text an operator reads. A rule may pass a list of options instead (FlagChanges
    the simulator can try, and plain-text actions), kept in `options` for `trial.try_fixes`, which
    rewrites `fix` from what the trials showed and keeps them in `trials`."""

    id: str  # F1..F8, START (the server refused the config), or INSUFFICIENT_DATA
    severity: str  # one of SEVERITIES
    symptom: str
    evidence: list[Evidence]
    cause: str
    fix: str | list  # flag changes (`--max-num-seqs 256 → 8`) or an action on the workload
    trials: list[FixTrial] = field(default_factory=list)
    options: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if isinstance(self.fix, list):
            self.options = [o for o in self.fix if o]
            self.fix = join_fixes(*self.options)

    @property
    def tried(self) -> list[FixTrial]:
        """The trials to show: all of them where the simulator ran any (none where it could try
        nothing: the fix line says why)."""
        return self.trials if any(t.verdict != UNTESTED for t in self.trials) else []

    @property
    def changes(self) -> list["FlagChange"]:
        return [o for o in self.options if isinstance(o, FlagChange)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stored(cls, row) -> "Diagnosis":
        """A diagnosis as the store keeps it (store.DiagnosisRow): evidence and trials as plain dicts."""
        evidence = [Evidence(e.get("metric", ""), e.get("window", ""), e.get("value"), str(e.get("threshold", "")))
                    if isinstance(e, dict) else Evidence(str(e), "", None, "") for e in row.evidence]
        trials = [FixTrial(**t) for t in getattr(row, "trials", None) or []]
        return cls(row.fault_id, row.severity, row.symptom, evidence, row.cause, row.fix, trials)


@dataclass(frozen=True)
class Thresholds:
    """Every limit the rules use. Fractions are 0–1, times in seconds, lengths in tokens."""

    # Enough data to judge at all
    min_requests: int = 20
    min_duration_s: float = 2.0
    min_samples: int = 5
    bins: int = 20  # time windows a run is cut into for trends
    min_bins: int = 4
    # "Sustained": the share of run time a condition must hold
    sustained_fraction: float = 0.1
    # KV usage levels
    usage_high: float = 0.9  # F1, F6: blocks near the limit
    usage_saturated: float = 0.95  # a fix whose simulated pool still peaks here has no headroom
    usage_busy: float = 0.5  # F2: contexts fill a good part of the pool
    # Latency SLOs (client percentiles, else the server's histograms)
    ttft_p95_slo_s: float = 1.0
    # F1: the waiting queue grew by at least this many requests inside the blocked window
    queue_growth: int = 2
    # F2: ITL p95 of the longest-context quartile over the shortest
    itl_growth: float = 1.5
    min_itl_samples: int = 200
    # F2, F3: generation tokens/s counts as flat below this gain
    flat_throughput_gain: float = 1.1
    # F3: running requests grow by this factor while tokens/s grows with at most this elasticity
    running_growth: float = 1.5
    max_throughput_elasticity: float = 0.5  # 0.5: doubling running adds under 41% tokens/s
    decode_window_prefill_ratio: float = 4.0  # F3 skips windows with more prompt than this × generated tokens
    gpu_busy_percent: float = 80.0
    # F4: prefix cache
    low_hit_rate: float = 0.2
    ideal_high: float = 0.3  # below: the prompts themselves share little (a template problem)
    thrash_ratio: float = 0.5  # observed under this share of the ideal: the cache loses what it could reuse
    # F6, F8: preemptions
    min_preemptions: int = 5
    preempting_fraction: float = 0.25  # F6: share of the run's windows with preemptions
    preempted_share_critical: float = 0.1  # share of requests preempted at least once
    # F5: start failures
    utilization_near_full: float = 0.95
    large_batched_tokens: int = 8192
    # F7: multi-call sessions
    min_calls_per_session: float = 2.0
    long_prompt_tokens: int = 1024
    session_ttft_s: float = 1.0  # TTFT paid over one session's calls
    # Fix suggestions: never suggest a utilisation above this
    max_suggested_utilization: float = 0.95

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class FlagChange:
    """One suggested change to a `vllm serve` flag, with what it buys."""

    flag: str
    old: object
    new: object
    effect: str = ""

    def __str__(self) -> str:
        text = f"`{self.flag} {_show(self.old)} → {_show(self.new)}`"
        return f"{text} ({self.effect})" if self.effect else text


def _show(value) -> str:
    if value is None:
        return "current"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def join_fixes(*parts) -> str:
    """Alternatives in order of preference, as one line: 'A; or B; or C'."""
    return "; or ".join(str(p) for p in parts if p)


def fixes(*parts) -> list:
    """The options a rule proposes, in order of preference (None for one that does not apply)."""
    return [p for p in parts if p]

