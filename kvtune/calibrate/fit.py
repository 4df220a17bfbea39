"""Fit kvengine.executor.cost's coefficients to the probes' timings by least squares.

Each observed timing is a weighted sum of engine steps: a TTFT is the steps from
the request's arrival to its first token (for a loaded probe, half the step it
lands in, then its own) plus the client overhead (one value for an idle server,
one for a busy one); the server's own prefill time (where it exports one) is the
same steps without the client overhead; an ITL is the mean of the steps in its
window. Which steps,
and their shapes (tokens, sequences, context, attention pairs), come from
replaying the probe's own prompts through kvengine's scheduler and KV cache
manager with the server's config; the replay follows the live run's order of
events (an arrival after so many background tokens), not its timing, so the
schedule does not depend on the coefficients. A prediction is then
`sum_j w_j * StepCost.step_time(shape_j)` and the fit moves the coefficients
(in log space, so all stay positive) to make the predictions' relative errors
small. The residuals are reported per probe class, next to the roofline's, and
`degenerate_reasons` says where the fit is not usable as a profile (calibrate_url then
refuses it).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np
from kvengine.engine.clock import VirtualClock
from kvengine.config import DeviceSpec, EngineConfig, ModelSpec
from kvengine.executor.cost import TIED_TO, CostCoefficients, StepCost
from kvengine.engine.llm_engine import LLMEngine
from kvengine.executor.cost import SHAPE_FIELDS, STEP_SHAPE_FIELDS, StepShape
from kvengine.executor.abstract import SimExecutor
from kvengine.core.request import SamplingParams

from .design import ITL, PREFILL_TIME, TTFT
from .errors import CalibrationError
from .timings import ProbeRun, merge_repeated

FITTED = ("memory_efficiency", "compute_efficiency", "attention_efficiency", "step_overhead_s",
          "per_seq_overhead_s", "per_prefill_overhead_s", "busy_arrival_overhead_s")
KV = "kv_memory_efficiency"  # fitted apart only where the data ask for it (see `fit_coefficients`)
DECODE_ATTN = "decode_attention_efficiency"  # the same
CONTEXT_ATTN = "context_attention_efficiency"  # the same
SPLITS = (KV, DECODE_ATTN, CONTEXT_ATTN)
F_SCALE = 0.1  # the robust loss's soft margin, in scaled residuals (see fit_coefficients)
SPLIT_MIN_RMS = 0.002  # a split must remove more misfit than this where it prices
CLIENT = "client_overhead_s"  # on a request reaching an idle server
CLIENT_BUSY = "client_overhead_busy_s"  # on one reaching a server busy with others
BUSY_ARRIVAL = "busy_arrival_overhead_s"  # fitted where the server reports its prefill times
# Bounds of each fitted value (the efficiencies are shares of the device preset's
# peak; a CPU preset is a rough guess, so they may land far from 1).
BOUNDS = {"memory_efficiency": (1e-5, 1e3), "compute_efficiency": (1e-5, 1e3),
          "attention_efficiency": (1e-5, 1e3), KV: (1e-5, 1e3), DECODE_ATTN: (1e-5, 1e3),
          CONTEXT_ATTN: (1e-5, 1e3),
          "step_overhead_s": (1e-7, 10.0),
          "per_seq_overhead_s": (1e-10, 1.0), "per_prefill_overhead_s": (1e-10, 1.0),
          "busy_arrival_overhead_s": (1e-10, 1.0),
          CLIENT: (1e-7, 10.0), CLIENT_BUSY: (1e-7, 10.0)}
# A fit is refused (`degenerate_reasons`) where its relative residuals' RMS, in any probe
# class or over all, exceeds this. Usable fits are under it: the exact-timing fits 0-1%, a
# sim server's 1-5%, kvengine's torch executor on a quiet 2-CPU machine 6-15% per class; on
# one shared with other work, kvengine's --quick fit 23% overall (its worst class 30%) and a
# vLLM CPU server's 21% (29%). Refused: the fit that made this rule (95%), and one whose
# server's speed moved so much mid-probe that a B=16 decode at 2k context read 2x slower
# than at 4k (that class 36%).
RMS_LIMIT = 0.35
# The step's main terms: the weights' reads, the compute, the fixed cost of a step. A fit
# may leave some of them unseen (a host-bound GPU's efficiencies, a CPU's weight reads),
# but a step all three price at about zero is a step cost the probes never showed.
MAIN_TERMS = ("memory_efficiency", "compute_efficiency", "step_overhead_s")


# ---------------------------------------------------------------- step shapes

class _RecordingExecutor(SimExecutor):
    """SimExecutor that notes each step's cost-model inputs."""

    def __init__(self, cost: StepCost):
        super().__init__(cost)
        self.shapes: list[StepShape] = []  # cost.step_shape of each step

    def step_time(self, shape: tuple[int, ...]) -> float:
        self.shapes.append(shape)
        return super().step_time(shape)


@dataclass
class Observation:
    """One measured timing and the engine steps that make it up."""

    kind: str
    label: str
    measure: str  # ttft | itl
    measured_s: float
    steps: np.ndarray  # indices into the shape table
    weights: np.ndarray
    client: str | None = None  # the client overhead in the timing: "idle" or "busy" (TTFTs)
    se_s: float = 0.0  # its standard error, from the spread of the samples it is the median of
    predicted_s: float = math.nan

    @property
    def rel_error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def sim_config(server_config: EngineConfig, model: ModelSpec, runs: list[ProbeRun]) -> EngineConfig:
    """The server's config for replaying the probes: a pool big enough for them all
    (the plan's memory arithmetic is no business of a probe replay)."""
    bs = server_config.block_size
    max_len = min(server_config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    need = max_len // bs + 2
    for run in runs:  # each probe replays on a fresh engine
        trial = run.trials[0]
        prompts = trial.prompts + trial.background
        tokens = sum(len(p) + run.probe.max_tokens + 128 + bs for p in prompts) + len(trial.warmup or ()) + bs
        need = max(need, tokens // bs + 2)
    return dataclasses.replace(server_config, num_gpu_blocks_override=2 * need + 16, max_model_len=max_len)


def step_shapes(runs: list[ProbeRun], model: ModelSpec, device: DeviceSpec,
                config: EngineConfig, kernel: CostCoefficients | None = None) -> tuple[np.ndarray, list[Observation]]:
    """Replay each probe's first trial through the engine core: the table of distinct
    step shapes (cost.step_shape, its attention pairs counted as `kernel`'s
    attention_key_block and context_chunk_all_keys say) and one Observation per timing, a
    probe's repeated runs (the drift checks) as one."""
    runs = merge_repeated(runs)
    table: dict[tuple, int] = {}
    observations = []
    cfg = sim_config(config, model, runs)
    for run in runs:
        replay = _replay_loaded if run.probe.background else _replay
        steps, windows = replay(run, model, device, cfg, kernel or CostCoefficients())
        index = np.array([table.setdefault(s, len(table)) for s in steps], dtype=int)
        for measure in run.measures:
            chosen, weights = windows[TTFT if measure == PREFILL_TIME else measure]
            if not len(chosen):
                raise CalibrationError(f"probe {run.probe.label!r}: no steps to measure its {measure} "
                                       "(too few output tokens)")
            client = ("busy" if run.probe.background else "idle") if measure == TTFT else None
            observations.append(Observation(run.probe.kind, run.probe.label, measure, run.measured(measure),
                                            index[chosen], weights, client, run.spread(measure)))
    shapes = np.array(sorted(table, key=table.get), dtype=float).reshape(-1, SHAPE_FIELDS)
    return shapes, observations


def _engine(model, device, cfg, kernel: CostCoefficients) -> tuple[LLMEngine, _RecordingExecutor]:
    executor = _RecordingExecutor(StepCost.build(model, device, cfg.kv_cache_dtype, cfg.block_size, kernel))
    return LLMEngine(cfg, model, device, executor=executor, clock=VirtualClock(), record_steps=False), executor


def _warm_up(engine: LLMEngine, trial) -> None:
    """A prefix probe's warm-up request, alone, before what is measured: it fills the cache."""
    if trial.warmup is not None:
        engine.add_request("warmup", trial.warmup, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()


def _replay(run: ProbeRun, model, device, cfg, kernel: CostCoefficients):
    """An isolated probe: warm-up alone, then the batch at once. The TTFT spans the
    first request's steps up to its first token; the steady ITL averages the steps
    after the last first token and before the first last token (the window of
    `timings.steady_itl`, which measures its mean gap)."""
    trial = run.trials[0]
    engine, executor = _engine(model, device, cfg, kernel)
    _warm_up(engine, trial)
    first = len(executor.shapes)
    token_steps: dict[str, list[int]] = {str(i): [] for i in range(len(trial.prompts))}
    for i, prompt in enumerate(trial.prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=run.probe.max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        result = engine.step()
        for req, _ in result.new_tokens:
            token_steps[req.request_id].append(len(executor.shapes) - 1 - first)
    per_request = [token_steps[str(i)] for i in range(len(trial.prompts))]
    ttft = np.arange(per_request[0][0] + 1)
    itl = np.arange(max(s[0] for s in per_request) + 1, min(s[-1] for s in per_request))
    windows = {TTFT: (ttft, np.ones(len(ttft))), ITL: (itl, np.full(len(itl), 1.0 / max(len(itl), 1)))}
    return executor.shapes[first:], windows


def _replay_loaded(run: ProbeRun, model, device, cfg, kernel: CostCoefficients):
    """A loaded probe: the background decodes; arrival k comes during the step that gives
    the background's first request its (sent_at_tokens[k] + 1)-th token, so it waits for
    half that step (on average: it lands anywhere in it), then its own steps. The
    background's mean gap while the arrivals come is the mean of those steps, mixed
    ones included."""
    trial = run.trials[0]
    engine, executor = _engine(model, device, cfg, kernel)
    _warm_up(engine, trial)
    total = max(trial.sent_at_tokens) + 64  # more than the window needs: the live run cut it off
    reqs = [engine.add_request(f"b{i}", p, SamplingParams(max_tokens=total, ignore_eos=True))
            for i, p in enumerate(trial.background)]
    rows = []
    for k, (count, prompt) in enumerate(zip(trial.sent_at_tokens, trial.prompts)):
        while reqs[0].num_output_tokens < count + 1:
            engine.step()
        landed = len(executor.shapes) - 1
        arrival = engine.add_request(f"a{k}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while not arrival.num_output_tokens:
            engine.step()
        rows.append((landed, len(executor.shapes) - 1))
    shapes = executor.shapes
    selected = [rows[k] for k in run.loaded_selection()]
    ttft_steps: dict[int, float] = {}
    for landed, answered in selected:
        ttft_steps[landed] = ttft_steps.get(landed, 0.0) + 0.5 / len(selected)
        for j in range(landed + 1, answered + 1):
            ttft_steps[j] = ttft_steps.get(j, 0.0) + 1.0 / len(selected)
    window = list(range(rows[0][0] + 1, rows[-1][1] + 1))  # the gaps after the first send, to the last answer
    windows = {TTFT: (np.array(sorted(ttft_steps), dtype=int), np.array([ttft_steps[j] for j in sorted(ttft_steps)])),
               ITL: (np.array(window, dtype=int), np.full(len(window), 1.0 / max(len(window), 1)))}
    return shapes, windows


# ---------------------------------------------------------------- the model

def coefficients_from(values: dict, base: CostCoefficients | None = None) -> CostCoefficients:
    base = base or CostCoefficients()
    return dataclasses.replace(base, **{k: float(v) for k, v in values.items()
                                        if k in FITTED or k in SPLITS})


def step_times(shapes: np.ndarray, model: ModelSpec, device: DeviceSpec, kv_cache_dtype: str, block_size: int,
               coeffs: CostCoefficients) -> np.ndarray:
    cost = StepCost.build(model, device, kv_cache_dtype, block_size, coeffs)
    return cost.step_times(shapes)


@dataclass
class Design:
    """The observations' weights over the steps (one sparse row each) and which carry a client
    overhead: `predict` gives each timing as the model does (its steps' weighted times plus its
    client overhead), and a fit, which predicts thousands of times, builds it once."""
    weights: object  # scipy.sparse.csr_matrix [observations, steps]
    idle: np.ndarray  # 1.0 where the timing carries the idle client's overhead
    busy: np.ndarray

    @classmethod
    def of(cls, observations: list[Observation], num_steps: int) -> "Design":
        from scipy.sparse import csr_matrix  # here: only calibration pays scipy's import

        rows = np.repeat(np.arange(len(observations)), [len(o.steps) for o in observations])
        columns = np.concatenate([np.asarray(o.steps, dtype=int) for o in observations] or [np.zeros(0, int)])
        values = np.concatenate([np.asarray(o.weights, dtype=float) for o in observations] or [np.zeros(0)])
        weights = csr_matrix((values, (rows, columns)), shape=(len(observations), num_steps))  # repeats summed
        clients = np.array([o.client for o in observations], dtype=object)
        return cls(weights, (clients == "idle").astype(float), (clients == "busy").astype(float))

    def predict(self, times: np.ndarray, client_overhead_s: float,
                client_overhead_busy_s: float | None = None) -> np.ndarray:
        busy = client_overhead_s if client_overhead_busy_s is None else client_overhead_busy_s
        return self.weights @ times + self.idle * client_overhead_s + self.busy * busy


@dataclass
class FitResult:
    coefficients: CostCoefficients
    client_overhead_s: float
    client_overhead_busy_s: float
    observations: list[Observation]
    cost: float  # 0.5 * sum of squared (robust) relative residuals
    nfev: int
    message: str
    initial: dict = field(default_factory=dict)  # the roofline's (uncalibrated) residual summary
    split_costs: dict = field(default_factory=dict)  # the shared fit's cost, and each split's from it
    dropped: list[Observation] = field(default_factory=list)  # timings not fitted: nan, inf or <= 0

    def residuals(self) -> dict:
        return residual_summary(self.observations)

    def refusal(self, rms_limit: float = RMS_LIMIT) -> list[str]:
        """Why this fit is not usable (`degenerate_reasons`); empty where it is."""
        return degenerate_reasons(self, rms_limit)


class FitRefusedError(CalibrationError):
    """The probes ran, but their fit is not usable (`degenerate_reasons`): nothing is saved.
    `reasons`: one line each; `profile`: the refused fit, for a look (never to be stored)."""

    def __init__(self, message: str, reasons: list[str], profile=None):
        super().__init__(message)
        self.reasons, self.profile = reasons, profile


def bound_side(name: str, value: float | None) -> str | None:
    """"upper" or "lower" where the fit left the coefficient at that bound of BOUNDS; else None
    (and for a coefficient never fitted: None, or exactly 0)."""
    if value is None or name not in BOUNDS or not math.isfinite(value) or value == 0:
        return None
    lo, hi = BOUNDS[name]
    return "upper" if value >= hi / 1.01 else "lower" if value <= lo * 1.01 else None


def unseen(name: str, value: float | None) -> bool:
    """At the bound that prices its term at about zero (an efficiency at its top, an overhead
    at its floor): the probes' timings did not show it."""
    side = bound_side(name, value)
    return side == ("upper" if name.endswith("efficiency") else "lower")


def squeezed(name: str, value: float | None) -> bool:
    """At the other bound (an efficiency at its floor, an overhead at its top): the timings
    asked for more of the term than the bounds allow, so the fit is clipped."""
    return bound_side(name, value) is not None and not unseen(name, value)


def degenerate_reasons(result: FitResult, rms_limit: float = RMS_LIMIT) -> list[str]:
    """Why a fit is not usable as a profile, one line each with its numbers; empty where it is.

    * A timing that is not a positive finite number (an ITL whose window held fewer than
      two of a stream's chunks is nan): the fit dropped it, so a probe class went unmeasured.
    * Anything fitted or predicted that is not finite.
    * A probe class's residual RMS, or the overall one, above `rms_limit`.
    * All of MAIN_TERMS unseen (a step priced at about zero), or any coefficient squeezed
      against the bound that makes its term dearest (an overhead of 10 s, an efficiency of
      1e-5 of peak): the timings are not the cost model's shape."""
    reasons = []
    for o in result.dropped:
        what = ("nan: too few stream chunks in the window it is measured over (a server whose frontend falls "
                "behind its engine merges tokens into one chunk, or sends a whole stream in one burst)"
                if math.isnan(o.measured_s)
                else f"{o.measured_s * 1e3:.3g} ms, not a positive finite time")
        reasons.append(f"probe {o.label!r}: its {o.measure} is {what}")
    values = {**result.coefficients.to_dict(), CLIENT: result.client_overhead_s,
              CLIENT_BUSY: result.client_overhead_busy_s}
    fitted = {k: v for k, v in values.items() if k in BOUNDS and v is not None}
    bad = [k for k, v in fitted.items() if not math.isfinite(v)]
    if bad:
        reasons.append(f"not finite: {', '.join(f'{k} = {fitted[k]}' for k in bad)}")
    unpredicted = [o for o in result.observations if not math.isfinite(o.predicted_s)]
    if unpredicted:
        reasons.append(f"{len(unpredicted)} of {len(result.observations)} timings have no finite prediction "
                       f"(first: {unpredicted[0].label!r} {unpredicted[0].measure})")
    if not math.isfinite(result.cost):
        reasons.append(f"the fit's cost is {result.cost}")
    for kind, r in result.residuals().items():
        where = "over all timings" if kind == "all" else f"of the {kind} probes"
        if not math.isfinite(r["rms"]):
            reasons.append(f"residual rms {where} is {r['rms']} (n={r['n']})")
        elif r["rms"] > rms_limit:
            reasons.append(f"residual rms {where} is {r['rms']:.1%} (n={r['n']}, worst {r['max']:.1%}), "
                           f"over the {rms_limit:.0%} limit")
    if all(unseen(name, fitted.get(name)) for name in MAIN_TERMS):
        reasons.append("all the step's main terms are at the bounds that price them at about zero ("
                       + ", ".join(f"{n} {fitted[n]:.3g}" for n in MAIN_TERMS)
                       + "): the probes did not show what a step costs")
    tight = [k for k, v in fitted.items() if math.isfinite(v) and squeezed(k, v)]
    if tight:
        reasons.append("at the bound that makes their term dearest, so the fit is clipped there: "
                       + ", ".join(f"{k} {fitted[k]:.3g} (bounds {BOUNDS[k][0]:g}..{BOUNDS[k][1]:g})"
                                   for k in tight))
    return reasons


def residual_summary(observations: list[Observation], predicted: np.ndarray | None = None) -> dict:
    """Per probe class and overall: count, RMS and worst relative error, median bias."""
    rel = np.array([(p / o.measured_s - 1.0) if predicted is not None else o.rel_error
                    for o, p in zip(observations, predicted if predicted is not None else [0] * len(observations))])
    kinds = sorted({o.kind for o in observations}, key=_kind_order)
    out = {}
    for kind in [*kinds, "all"]:
        mask = np.array([kind in ("all", o.kind) for o in observations])
        r = rel[mask]
        out[kind] = {"n": int(mask.sum()), "rms": float(np.sqrt(np.mean(r ** 2))),
                     "max": float(np.max(np.abs(r))), "bias": float(np.median(r))}
    return out


def _kind_order(kind: str) -> int:
    from .design import PROBE_KINDS
    return PROBE_KINDS.index(kind) if kind in PROBE_KINDS else len(PROBE_KINDS)


@dataclass
class QuantizedProbes:
    """The step shapes and timings of the same server started with a quantized KV cache
    (`calibrate --quantized-kv`), as step_shapes gives them: fit_coefficients weighs its splits
    by how well these fit too, with their dequantization terms (fit_dequant)."""

    shapes: np.ndarray
    observations: list[Observation]
    kv_cache_dtype: str
    block_size: int


def fit_coefficients(shapes: np.ndarray, observations: list[Observation], model: ModelSpec, device: DeviceSpec,
                     kv_cache_dtype: str, block_size: int, base: CostCoefficients | None = None,
                     fit_client_overhead: bool = True, loss: str = "soft_l1", noise_floor: float = 0.01,
                     split_gain: float = 0.85, quantized: QuantizedProbes | None = None) -> FitResult:
    """Least squares (scipy.optimize.least_squares, log-parameters, a few starts) of the
    relative errors of the predicted timings; `base` supplies the fixed coefficients
    (block_overhead_tokens, and the attention kernel's pair counting, which must be the one
    `step_shapes` counted the shapes with) and the first start.

    Each relative error is divided by its observation's relative standard error, floored
    at `noise_floor` (and scaled so the floor weighs 1): a jittery TTFT weighs less than
    a steady ITL, while the cost model's own misfit (beyond the floor) weighs the same
    everywhere.

    Three coefficients first share another's value and are fitted apart only where that
    cuts the cost of the timings they price (those whose steps have their pairs; all, for
    the K/V reads) below `split_gain` of the fit without them, one at a time, the best
    first (forward selection): the K/V reads' bandwidth share (kv_memory_efficiency; a
    CPU's gathers are much slower than its weight reads, a GPU's are not, and a free extra
    coefficient would only trade the weights' read time against the step overhead, so the
    split fit keeps the weights' bandwidth of the fit it starts from), the decodes'
    attention share (decode_attention_efficiency: a paged decode kernel beside a
    flash-attention prefill) and that of chunks after earlier context
    (context_attention_efficiency: gathered context and an explicit mask).

    With `quantized`, a split is chosen on the cost of those timings as well (each candidate's
    coefficients held, its dequantization terms fitted to them), though fitted on `observations`
    alone. On the server's own dtype a slow K/V read and a slow decode kernel are the same
    term (both grow with each decode's context), so noise picked between them; a quantized
    cache reads fewer bytes through the same kernel and tells them apart. Chosen on the
    server's own dtype alone, the decode-kernel split priced a faster fp8 cache as slow as the
    unquantized one, which no dequantization term (>= 0) undoes, and the fp8 pass was refused."""
    base = base or CostCoefficients()
    obs, dropped = _usable(observations)
    if len(obs) < len(FITTED) + 1:
        raise CalibrationError(f"{len(obs)} usable timings: too few to fit {len(FITTED)} coefficients")
    clients = []
    if fit_client_overhead:
        clients = [CLIENT] + ([CLIENT_BUSY] if any(o.client == "busy" for o in obs) else [])
    problem = _Problem(shapes, obs, *_weighed(obs, noise_floor), model, device, kv_cache_dtype, block_size, loss)
    tied = dataclasses.replace(base, **dict.fromkeys(TIED_TO))
    # Without the server's own prefill times, an isolated TTFT only gives per-prefill +
    # client overhead, and a busy arrival's overhead would slide along that line with them.
    timed = any(o.measure == PREFILL_TIME for o in obs)
    names = [n for n in (*FITTED, *clients) if timed or n != BUSY_ARRIVAL]
    shared = problem.solve(names, _starts(base, obs), tied)
    extra = _QuantizedCost(quantized, model, device, loss, noise_floor)
    fit, costs = _chosen_splits(problem, shared, split_gain, extra)
    times = step_times(shapes, model, device, kv_cache_dtype, block_size, fit.coeffs)
    for o, p in zip(obs, problem.design.predict(times, fit.client, fit.busy)):
        o.predicted_s = float(p)
    roofline = step_times(shapes, model, device, kv_cache_dtype, block_size, base)
    initial = residual_summary(obs, problem.design.predict(roofline, 0.0))
    if quantized is not None:
        costs["quantized_cost"] = extra(fit)
    return FitResult(fit.coeffs, float(fit.client), float(fit.busy), obs, fit.cost, int(fit.sol.nfev),
                     str(fit.sol.message), initial, costs, dropped)


@dataclass
class _Solved:
    """One least-squares solve: the coefficients it freed, those it held, and where it landed."""
    free: list[str]
    fixed: CostCoefficients
    sol: object  # scipy's OptimizeResult: cost, fun (the weighed residuals), nfev, message
    coeffs: CostCoefficients
    client: float
    busy: float

    @property
    def cost(self) -> float:
        return float(self.sol.cost)

    def values(self) -> dict:
        return {**self.coeffs.to_dict(), CLIENT: self.client, CLIENT_BUSY: self.busy}


@dataclass
class _Problem:
    """What every solve of one fit shares: the timings and their steps, their weights, the server."""
    shapes: np.ndarray
    obs: list[Observation]
    measured: np.ndarray
    scale: np.ndarray
    model: ModelSpec
    device: DeviceSpec
    kv_cache_dtype: str
    block_size: int
    loss: str
    design: Design = field(init=False)

    def __post_init__(self):
        self.design = Design.of(self.obs, len(self.shapes))

    def solve(self, names: list[str], starts, fixed: CostCoefficients) -> _Solved:
        """The best of least_squares from each start, over the log of `names`, `fixed` holding the rest."""
        from scipy.optimize import least_squares  # here: only calibration pays scipy's import

        lo, hi = np.log([BOUNDS[n][0] for n in names]), np.log([BOUNDS[n][1] for n in names])

        def unpack(x):
            values = dict(zip(names, np.exp(x)))
            client = values.get(CLIENT, 0.0)
            return coefficients_from(values, fixed), client, values.get(CLIENT_BUSY, client)

        def residuals(x):
            coeffs, client, busy = unpack(x)
            times = step_times(self.shapes, self.model, self.device, self.kv_cache_dtype, self.block_size, coeffs)
            return (self.design.predict(times, client, busy) / self.measured - 1.0) / self.scale

        best = None
        for start in starts:
            x0 = np.clip(np.log([start[n] for n in names]), lo + 1e-9, hi - 1e-9)
            try:
                sol = least_squares(residuals, x0, bounds=(lo, hi), loss=self.loss, f_scale=F_SCALE, x_scale=1.0,
                                    diff_step=1e-4, max_nfev=400)
            except ValueError as err:
                raise CalibrationError(f"the fit failed: {err}") from None
            if best is None or sol.cost < best.cost:
                best = sol
        return _Solved(list(names), fixed, best, *unpack(best.x))

    def split_kv(self, fit: _Solved) -> _Solved:
        """`fit` with the K/V reads' bandwidth share freed. It keeps the weights' bandwidth share of
        `fit`: on memory-bound steps the weights' read time and the step overhead are one constant,
        and freed together they slide along that valley wherever the timings are noisy."""
        fixed = dataclasses.replace(fit.fixed, memory_efficiency=fit.coeffs.memory_efficiency)
        free = [n for n in fit.free if n != "memory_efficiency"] + [KV]
        starts = [{**fit.values(), KV: fit.coeffs.memory_efficiency * f} for f in (1.0, 0.3, 0.1, 0.03)]
        return self.solve(free, starts, fixed)

    def split_attention(self, name: str, fit: _Solved) -> _Solved:
        """`fit` with another kernel than the fresh prefill's flash attention at its own share of
        peak: on a CPU the paged decode kernel, or sdpa with a gathered context and a mask."""
        starts = [{**fit.values(), name: fit.coeffs.attention_efficiency * f} for f in (1.0, 0.3, 3.0, 0.1)]
        return self.solve([*fit.free, name], starts, fit.fixed)

    def priced_by(self, name: str) -> np.ndarray:
        """The timings whose steps a split prices: all for the K/V reads, those with its pairs for
        an attention split (a kernel a few probes show would never cut the whole cost)."""
        if name == KV:
            return np.ones(len(self.obs), dtype=bool)
        column = STEP_SHAPE_FIELDS.index(SPLIT_PAIRS[name])
        return np.array([self.shapes[o.steps, column].any() for o in self.obs])


SPLIT_PAIRS = {DECODE_ATTN: "decode_token_pairs", CONTEXT_ATTN: "context_chunk_pairs"}  # the pairs each prices


def _chosen_splits(problem: _Problem, shared: _Solved, split_gain: float, extra) -> tuple[_Solved, dict]:
    """fit_coefficients' forward selection from the shared fit: each round tries every split left,
    judges each on the timings it prices (and the quantized ones, `extra`), and keeps the best one
    that cuts their cost below `split_gain` and by more than SPLIT_MIN_RMS where it prices. The fit
    chosen, and each candidate's cost."""
    first = {KV: problem.split_kv(shared)}
    if first[KV].cost < split_gain * shared.cost:
        # Before splitting, give the shared fit the split's solution to start from, at either
        # of its two bandwidths: it may only have missed that basin.
        found = first[KV].values()
        retry = problem.solve(shared.free, [{**found, "memory_efficiency": found[KV]}, found], shared.fixed)
        if retry.cost < shared.cost:
            shared, first = retry, {}
    left = {KV: problem.split_kv}
    for name in SPLIT_PAIRS:
        if problem.priced_by(name).any():
            left[name] = functools.partial(problem.split_attention, name)
    judged = {name: problem.priced_by(name) for name in left}
    counted = {name: judged[name].sum() + extra.judged(name).sum() for name in left}
    fit, costs, loss = shared, {"shared_cost": shared.cost}, problem.loss
    while left:
        tried = {name: first.pop(name, None) or split(fit) for name, split in left.items()}
        for name, candidate in tried.items():
            costs.setdefault(f"{name}_split_cost", candidate.cost)  # each from the shared fit
        before = {name: _cost(fit.sol, judged[name], loss) + extra(fit, name) for name in tried}
        after = {name: _cost(c.sol, judged[name], loss) + extra(c, name) for name, c in tried.items()}
        # Not for a misfit under SPLIT_MIN_RMS (a relative error) where it prices: nothing to split.
        worth = [name for name in tried if after[name] < split_gain * before[name]
                 and before[name] - after[name] > 0.5 * counted[name] * SPLIT_MIN_RMS ** 2]
        if not worth:
            break
        name = min(worth, key=lambda n: after[n] / before[n])
        fit = tried[name]
        del left[name]
    return fit, costs


DEQUANT = ("quantized_step_overhead_s", "kv_dequant_per_element_s")  # the terms a quantized cache adds
DEQUANT_MAX = {"quantized_step_overhead_s": 1.0, "kv_dequant_per_element_s": 1e-6}  # s; s per element


@dataclass
class DequantFit:
    """The dequantization terms fitted to probes of a server running a quantized KV cache, the
    rest of the cost model held at the main fit's values."""

    coefficients: CostCoefficients  # the main fit's, with DEQUANT set
    observations: list[Observation]  # predicted with the terms
    without: dict  # residual_summary of the same timings with the terms at 0
    dropped: list[Observation] = field(default_factory=list)

    def residuals(self) -> dict:
        return residual_summary(self.observations)


def fit_dequant(shapes: np.ndarray, observations: list[Observation], model: ModelSpec, device: DeviceSpec,
                kv_cache_dtype: str, block_size: int, coeffs: CostCoefficients, client_overhead_s: float,
                client_overhead_busy_s: float, noise_floor: float = 0.01) -> DequantFit:
    """DEQUANT's two terms by non-negative least squares of the relative errors (weighed as in
    fit_coefficients): a prediction is linear in both (a step adds the one, and the other per
    token it gathers), so the fit is one linear solve, each value then capped at DEQUANT_MAX
    (a cache that reads faster than its bytes say is none of these terms: they stay >= 0)."""
    from scipy.optimize import nnls

    if kv_cache_dtype == "auto":
        raise CalibrationError("the dequantization terms need probes of a server with a quantized KV cache")
    obs, dropped = _usable(observations)
    if len(obs) < len(DEQUANT) + 1:
        raise CalibrationError(f"{len(obs)} usable timings of the {kv_cache_dtype} probes: too few to fit "
                               f"{len(DEQUANT)} terms")
    zero = dataclasses.replace(coeffs, **dict.fromkeys(DEQUANT, 0.0))
    design = Design.of(obs, len(shapes))
    base = design.predict(step_times(shapes, model, device, kv_cache_dtype, block_size, zero),
                          client_overhead_s, client_overhead_busy_s)
    per_token = StepCost.build(model, device, kv_cache_dtype, block_size,
                               dataclasses.replace(zero, kv_dequant_per_element_s=1.0)).kv_dequant_s_per_token
    gathered = shapes[:, STEP_SHAPE_FIELDS.index("gathered_tokens")] * per_token
    # Seconds each observation gains per unit of each term: its weighted count of steps, of elements.
    slopes = np.stack([design.predict(np.ones(len(shapes)), 0.0, 0.0), design.predict(gathered, 0.0, 0.0)], axis=1)
    measured, scale = _weighed(obs, noise_floor)
    a = slopes / (measured * scale)[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    values, _ = nnls(a / norms, (1.0 - base / measured) / scale)
    values = np.minimum(values / norms, [DEQUANT_MAX[name] for name in DEQUANT])
    without = residual_summary(obs, base)
    for o, p in zip(obs, base + slopes @ values):
        o.predicted_s = float(p)
    fitted = dataclasses.replace(coeffs, **{name: float(v) for name, v in zip(DEQUANT, values)})
    return DequantFit(fitted, obs, without, dropped)


def _usable(observations: list[Observation]) -> tuple[list[Observation], list[Observation]]:
    """The timings a fit can use (positive and finite), and those it drops."""
    usable = [o.measured_s > 0 and math.isfinite(o.measured_s) for o in observations]
    return ([o for o, u in zip(observations, usable) if u], [o for o, u in zip(observations, usable) if not u])


def _weighed(obs: list[Observation], noise_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """The measured times, and each relative error's divisor: its observation's relative standard
    error, floored at `noise_floor` and scaled so that the floor weighs 1."""
    measured = np.array([o.measured_s for o in obs])
    return measured, np.maximum(np.array([o.se_s for o in obs]) / measured, noise_floor) / noise_floor


class _QuantizedCost:
    """fit_coefficients' cost of the quantized server's timings under a candidate fit: its
    dequantization terms fitted (fit_dequant) with the candidate's coefficients held, then the
    robust cost of the relative residuals (weighed as the fit weighs its own) of the timings
    whose steps a split prices, as for the server's own timings. 0 without such timings."""

    def __init__(self, quantized: QuantizedProbes | None, model, device, loss: str, noise_floor: float):
        self.quantized, self.model, self.device = quantized, model, device
        self.loss, self.noise_floor = loss, noise_floor
        self.masks = {}
        if quantized is not None:
            obs, _ = _usable(quantized.observations)
            self.masks[KV] = np.ones(len(obs), dtype=bool)
            for name, pairs in SPLIT_PAIRS.items():
                column = STEP_SHAPE_FIELDS.index(pairs)
                self.masks[name] = np.array([quantized.shapes[o.steps, column].any() for o in obs], dtype=bool)

    def judged(self, name: str) -> np.ndarray:
        return self.masks.get(name, np.zeros(0, dtype=bool))

    def __call__(self, fitted: _Solved, name: str | None = None) -> float:
        if self.quantized is None:
            return 0.0
        q = self.quantized
        fit = fit_dequant(q.shapes, q.observations, self.model, self.device, q.kv_cache_dtype, q.block_size,
                          fitted.coeffs, fitted.client, fitted.busy, self.noise_floor)
        measured, scale = _weighed(fit.observations, self.noise_floor)
        residuals = (np.array([o.predicted_s for o in fit.observations]) / measured - 1.0) / scale
        return _robust_cost(residuals if name is None else residuals[self.masks[name]], self.loss)


def _cost(sol, part: np.ndarray, loss: str) -> float:
    """least_squares' cost over a part of the residuals."""
    return _robust_cost(sol.fun[part], loss)


def _robust_cost(residuals: np.ndarray, loss: str) -> float:
    """least_squares' cost of these residuals: 0.5 * sum of F_SCALE^2 * loss(r^2 / F_SCALE^2)."""
    z = (np.asarray(residuals) / F_SCALE) ** 2
    rho = {"linear": z, "soft_l1": 2.0 * (np.sqrt(1.0 + z) - 1.0), "cauchy": np.log1p(z),
           "huber": np.where(z <= 1.0, z, 2.0 * np.sqrt(z) - 1.0), "arctan": np.arctan(z)}[loss]
    return float(0.5 * F_SCALE ** 2 * rho.sum())


def _starts(base: CostCoefficients, obs: list[Observation]):
    """The base coefficients, then the efficiencies scaled over decades with the fixed
    overheads guessed from the data (a kinked model: one start can stall in a corner)."""
    itl = [o.measured_s for o in obs if o.measure == ITL] or [o.measured_s for o in obs]
    shortest = min(itl)
    client = 0.1 * min(o.measured_s for o in obs)
    first = {**base.to_dict(), CLIENT: client, CLIENT_BUSY: client,  # log-space: not 0
             "per_prefill_overhead_s": base.per_prefill_overhead_s or 1e-3 * shortest,
             "busy_arrival_overhead_s": base.busy_arrival_overhead_s or 1e-3 * shortest}
    yield first
    for scale in (10.0, 1.0, 0.1, 0.01, 0.001):
        yield {**first, "memory_efficiency": base.memory_efficiency * scale,
               "compute_efficiency": base.compute_efficiency * scale,
               "attention_efficiency": base.attention_efficiency * scale,
               "step_overhead_s": 0.3 * shortest, "per_seq_overhead_s": 0.01 * shortest,
               "per_prefill_overhead_s": 0.01 * shortest, "busy_arrival_overhead_s": 0.01 * shortest}
