"""Every proposed flag change is tried in the simulator before it is printed as a fix.

`try_fixes` replays the run's own workload in the simulator as the run was configured (the
baseline) and once per proposed change. A change is printed as a fix only where the baseline
shows the same fault and the change removes it, without missing an SLO the baseline met,
without rejecting more requests, and without making TTFT or e2e p95 worse than the baseline's
by more than MARGIN (plus MARGIN_S). Fixes that helped come first, the best first; the others
stay in `Diagnosis.trials` with their numbers. Where the simulator cannot try a change (more
GPUs, an action on the prompts) or does not show the fault at all, the fix says so.

A live server's pool is mirrored: the simulator gets the server's own block count
(`num_gpu_blocks`), scaled by what each change does to it, so the trial holds what the
server would hold whatever the simulator's device preset plans.

Before anything is tried, every change is made one the run's server takes (fixes.admitted: the
rules of kvtune.targets.rules), and a lowered limit a request can hit (--max-model-len, a batch
budget without chunked prefill) is judged against the trace: one that would refuse requests the
trace sends did not help, whatever the simulator says of the rest.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from kvengine.config import ConfigError, EngineConfig

from ..results import RunResult, config_dict, engine_config
from ..targets.base import TargetStartError
from ..targets.sim import SimTarget
from ..workload import Workload
from .fixes import CPU_KV_SPACE, admitted, refusal, rules_of
from .model import (HELPED, INSUFFICIENT_DATA, NO_HELP, UNTESTED, Diagnosis, FixTrial, FlagChange, Thresholds,
                    join_fixes)
from .pool import fp8_gain, replan, specs
from .run import diagnose

MARGIN = 0.10  # TTFT or e2e p95 may grow by this share of the baseline's ...
MARGIN_S = 0.02  # ... plus this many seconds, before a fix counts as making latency worse
WORSE_IF_HIGHER = ("ttft_p95", "e2e_p95")
FIELDS = {"--kv-cache-dtype": "kv_cache_dtype", "--max-num-seqs": "max_num_seqs",
          "--max-model-len": "max_model_len", "--max-num-batched-tokens": "max_num_batched_tokens",
          "--block-size": "block_size", "--enable-prefix-caching": "enable_prefix_caching",
          "--enable-chunked-prefill": "enable_chunked_prefill",
          "--gpu-memory-utilization": "gpu_memory_utilization",
          "--kv-cache-memory-bytes": "kv_cache_memory_bytes", "--num-gpu-blocks-override": "num_gpu_blocks_override",
          "--tensor-parallel-size": "tensor_parallel_size", CPU_KV_SPACE: CPU_KV_SPACE}
SIZE_KNOBS = ("--num-gpu-blocks-override", "--kv-cache-memory-bytes", CPU_KV_SPACE)
GROWTHS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
POOL_FAULTS = ("F1", "F6", "F8")  # a pool too small: fixed only with room to spare


@dataclass
class Simulator:
    """The simulator the trials run on, the workload they replay, and what to call it. Without a
    target (no simulator for the run's server) the workload still judges the limits a fix lowers,
    and `label` says why nothing else is tried."""

    target: SimTarget | None
    workload: Workload
    label: str
    runs: dict = field(default_factory=dict)  # config -> RunResult, or why it did not start
    found: dict = field(default_factory=dict)  # (id of a run in `runs`, thresholds) -> its faults' ids

    @classmethod
    def of(cls, target: SimTarget, workload: Workload, profile: str | None = None) -> "Simulator":
        how = f"calibrated profile {profile!r}" if profile else "uncalibrated presets"
        return cls(target, workload, f"the simulator ({target.model.name} on {target.device.name}, {how})")

    @property
    def lengths(self) -> list[tuple[int, int]]:
        """Each request's prompt and output tokens, as the trace sends them."""
        return [(r.input_length, r.output_length) for r in self.workload.requests]

    def knows(self, result: RunResult) -> "Simulator":
        """A run this simulator already made of its workload: the baseline it would replay again."""
        self.runs[_key(mirrored_config(result))] = result
        return self

    def run(self, config: EngineConfig) -> RunResult | str:
        key = _key(config)
        if key not in self.runs:
            try:
                self.runs[key] = self.target.run(config, self.workload)
            except (TargetStartError, ConfigError, ValueError) as err:
                self.runs[key] = str(err).splitlines()[0] if str(err) else type(err).__name__
        return self.runs[key]

    def faults(self, run: RunResult, th: Thresholds) -> list[str]:
        """The ids of what `diagnose` finds in one of its runs: worked out once, for every fault
        whose fixes share a run (F1, F6 and F8 often try the same pool)."""
        key = (id(run), th)
        if key not in self.found:
            self.found[key] = [x.id for x in diagnose(run, th)]
        return self.found[key]


def _key(config: EngineConfig) -> str:
    return json.dumps(config_dict(config), sort_keys=True, default=str)


def simulator_for(result: RunResult, workload: Workload) -> tuple[Simulator | None, str]:
    """The simulator of the presets the run names; where there is none (a served checkpoint), the
    workload alone, which still judges the limits a fix lowers, and why nothing else is tried."""
    found = specs(result)
    if found is None:
        why = (f"no simulator for this {result.target} server: pass --profile NAME (from `kvtune "
               "calibrate`) to `kvtune diagnose --run` to try the fixes")
        return Simulator(None, workload, why), why
    return Simulator.of(SimTarget(*found), workload), ""


def diagnosed(result: RunResult, th: Thresholds, sim: Simulator | None, slos=(), error: str | None = None,
              why_none: str = "no simulator for this server") -> list[Diagnosis]:
    """The run's diagnoses with their fixes tried: what every command stores with a run."""
    return try_fixes(diagnose(result, th, error=error), result, sim, th, slos, why_none)


def try_fixes(diagnoses: list[Diagnosis], result: RunResult, sim: Simulator | None, th: Thresholds,
              slos=(), why_none: str = "no simulator for this server") -> list[Diagnosis]:
    """The diagnoses with every flag change tried; `slos` are objects with metric, percentile,
    threshold_s and request_value(record) (search.slo.SLO), TTFT p95 from `th` when none."""
    lengths = sim.lengths if sim is not None else None
    for d in diagnoses:
        if d.changes and d.id != INSUFFICIENT_DATA:
            _admit(d, result, lengths)
        if d.changes and d.id != INSUFFICIENT_DATA:
            _try(d, result, sim, th, slos, why_none)
    return diagnoses


def _admit(d: Diagnosis, result: RunResult, lengths: list[tuple[int, int]] | None) -> None:
    """The diagnosis's options as its server takes them (fixes.admitted), each knob once."""
    options, seen = [], set()
    for option in d.options:
        if isinstance(option, FlagChange):
            option = admitted(result, option, lengths)
            if option is None or (option.flag, str(option.new)) in seen:
                continue
            seen.add((option.flag, str(option.new)))
        options.append(option)
    d.options = options
    d.fix = join_fixes(*options) or f"no flag change for {d.id} that {rules_of(result).server} takes"


def _try(d: Diagnosis, result: RunResult, sim: Simulator | None, th: Thresholds, slos, why_none: str) -> None:
    if sim is None or sim.target is None:
        return _untested(d, why_none if sim is None else sim.label, result, sim.lengths if sim is not None else None)
    try:
        base_config = mirrored_config(result)
    except (TypeError, ValueError) as err:
        return _untested(d, f"the run's config is not one the simulator takes ({err})", result, sim.lengths)
    base = sim.run(base_config)
    shown = _shows(d.id, base, th, sim)
    if shown is not None:
        return _untested(d, f"{sim.label} does not show {d.id} on this workload ({shown})", result, sim.lengths)
    for change in d.changes:
        d.trials.append(sized_trial(d.id, change, result, base_config, base, sim, th, slos))
    _rewrite(d, sim.label)


def sized_trial(fault: str, change: FlagChange, result: RunResult, base_config: EngineConfig,
                base: RunResult | str, sim: Simulator, th: Thresholds, slos) -> FixTrial:
    """A pool-size knob that did not help at the size proposed is tried larger, up to GROWTHS[-1]
    times the current size, each size one the server takes (whole GiB for VLLM_CPU_KVCACHE_SPACE):
    the fix then names the smallest size that helped."""
    first = trial(fault, change, result, base_config, base, sim, th, slos)
    if first.verdict != NO_HELP or change.flag not in SIZE_KNOBS or not first.after:
        return first
    old, rules, tried = float(change.old), rules_of(result), {float(change.new)}
    for growth in GROWTHS:
        new = rules.taken(change.flag, old * growth, up=True)
        if new is None or float(new) <= float(change.new) or float(new) in tried:
            continue
        tried.add(float(new))
        bigger = FlagChange(change.flag, change.old, new,
                            f"{float(new) / old:g}× the pool: the smallest of {', '.join(f'{g:g}×' for g in GROWTHS)} "
                            f"that removed {fault} in the simulator")
        attempt = trial(fault, bigger, result, base_config, base, sim, th, slos)
        if attempt.verdict == HELPED:
            return attempt
    return first


def trial(fault: str, change: FlagChange, result: RunResult, base_config: EngineConfig,
          base: RunResult | str, sim: Simulator, th: Thresholds, slos) -> FixTrial:
    def made(verdict: str, note: str, after: dict | None = None) -> FixTrial:
        return FixTrial(str(change), verdict, note, before, after or {}, change.flag, change.new)

    before = figures(base)
    refused = refused_trial(result, change, sim.lengths)
    if refused is not None:
        return dataclasses.replace(refused, before=before)
    config = changed_config(result, base_config, change)
    if isinstance(config, str):
        return made(UNTESTED, config)
    fixed = sim.run(config)
    if isinstance(fixed, str):
        return made(NO_HELP, f"the simulator would not start it: {fixed[:200]}")
    after = figures(fixed)
    found = problems(fault, base, fixed, th, slos, sim, base_config.max_model_len)
    note = "; ".join(found) if found else f"{fault} is gone"
    return made(NO_HELP if found else HELPED, f"{note} ({effect_text(before, after)})", after)


def refused_trial(result: RunResult, change: FlagChange, lengths: list[tuple[int, int]] | None) -> FixTrial | None:
    """A lowered limit (fixes.refusal) that refuses requests the trace sends: it did not help, whatever
    the simulator would say of the rest; None for any other change, or without a trace."""
    refused = refusal(result.config, change, lengths) if lengths is not None else None
    if refused is None or not refused.over:
        return None
    return FixTrial(str(change), NO_HELP, refused.text, flag=change.flag, value=change.new)


def problems(fault: str, base: RunResult | str, fixed: RunResult, th: Thresholds, slos,
             sim: Simulator | None = None, base_limit: int | None = None) -> list[str]:
    """What keeps `fixed` from counting as a fix of `fault` against `base` (none: it helped); `sim`
    caches the diagnoses of its own runs; `base_limit` is the max_model_len of a baseline that did
    not start, whose refusals the fix is not blamed for."""
    out = []
    if _shows(fault, fixed, th, sim) is None:
        out.append(f"{fault} still shows")
    before, after = figures(base), figures(fixed)
    peak = after.get("kv_usage_peak")
    if fault in POOL_FAULTS and peak is not None and peak >= th.usage_saturated:
        # Gone in the simulator at a full pool is gone by luck: a live server a little slower
        # holds more requests at once and preempts again.
        out.append(f"the pool still fills (usage peak {peak:.1%}): no headroom")
    if after["rejected"] > before.get("rejected", too_long(fixed, base_limit)):
        out.append(f"rejects {after['rejected']} of {after['requests']} requests")
    if isinstance(base, RunResult):
        out += [f"misses {slo_text(s)} that the run met" for s in _slos(slos, th)
                if meets(s, base) and not meets(s, fixed)]
        for name in WORSE_IF_HIGHER:
            b, a = before.get(name), after.get(name)
            if b is not None and a is not None and a > b * (1 + MARGIN) + MARGIN_S:
                out.append(f"{name.replace('_', ' ')} worse by more than {MARGIN:.0%} + {MARGIN_S * 1000:g} ms")
    return out


def _shows(fault: str, run: RunResult | str, th: Thresholds, sim: Simulator | None = None) -> str | None:
    """None where the run shows `fault`; else what it shows instead, in a few words."""
    if isinstance(run, str):
        return None if fault in ("F5", "START") else f"it would not start: {run[:120]}"
    if fault in ("F5", "START"):
        return "it starts"
    found = sim.faults(run, th) if sim is not None else [x.id for x in diagnose(run, th)]
    return None if fault in found else ("it finds " + ", ".join(found) if found else "it finds no fault")


def mirrored_config(result: RunResult) -> EngineConfig:
    """The run's config for the simulator: with the pool of blocks the server reported, if it did."""
    config = engine_config(result.config)
    served = result.config.get("num_gpu_blocks")
    if served and not result.config.get("num_gpu_blocks_override"):
        config = dataclasses.replace(config, num_gpu_blocks_override=int(served))
    return config


def changed_config(result: RunResult, base: EngineConfig, change: FlagChange) -> EngineConfig | str:
    """The config with `change` applied, or why the simulator cannot try it."""
    mirrored = bool(result.config.get("num_gpu_blocks")) and not result.config.get("num_gpu_blocks_override")
    rules = rules_of(result)
    if change.flag in SIZE_KNOBS and not rules.moves_pool(change.flag):
        return f"{change.flag} does not size this server's pool: {rules.pool_knob} does"
    if change.flag == CPU_KV_SPACE:
        if base.num_gpu_blocks_override is None:
            return ("the server reported no block count (vllm:cache_config_info num_gpu_blocks) for the "
                    "simulator to scale by VLLM_CPU_KVCACHE_SPACE")
        return _scaled(base, float(change.new) / float(change.old))
    config = apply_change(base, change)
    if isinstance(config, str) or not mirrored:
        return config
    name, value = FIELDS[change.flag], getattr(config, FIELDS[change.flag])
    if name == "kv_cache_dtype":
        return _scaled(config, fp8_gain(result))
    if name == "block_size":
        return _scaled(config, base.block_size / value)
    if name in ("gpu_memory_utilization", "kv_cache_memory_bytes", "tensor_parallel_size"):
        ratio = _pool_ratio(result, name, change)
        return _scaled(config, ratio) if ratio else "the pool this gives on the server is not known to the simulator"
    return config


def apply_change(config: EngineConfig, change: FlagChange) -> EngineConfig | str:
    """The engine config with the flag set as the change asks, or why no engine flag does that."""
    name = FIELDS.get(change.flag)
    if name is None or name == CPU_KV_SPACE:
        return f"{change.flag} is not a knob of the simulator"
    value = {"on": True, "off": False}.get(change.new, change.new) if isinstance(change.new, str) else change.new
    return dataclasses.replace(config, **{name: value})


def _scaled(config: EngineConfig, ratio: float) -> EngineConfig:
    return dataclasses.replace(config, num_gpu_blocks_override=max(int(config.num_gpu_blocks_override * ratio), 1))


def _pool_ratio(result: RunResult, name: str, change: FlagChange) -> float | None:
    if name == "kv_cache_memory_bytes":
        return change.new / change.old if change.old else None
    old, new = replan(result), replan(result, **{name: change.new})
    return new.num_gpu_blocks / old.num_gpu_blocks if old and new and old.num_gpu_blocks else None


def figures(run: RunResult | str) -> dict:
    if isinstance(run, str):
        return {}
    s = run.summary
    keys = ("requests", "completed", "rejected", "throughput_rps", "ttft_p95", "e2e_p95", "tpot_p95",
            "itl_p95", "preemptions", "prefix_hit_rate", "kv_usage_peak")
    return {k: s.get(k) for k in keys}


def too_long(fixed: RunResult, limit: int | None) -> int:
    """Where the baseline did not start, the requests its own max_model_len (`limit`) would have refused
    too: never those a lowered limit refuses, which are the fix's doing."""
    return sum(r.finish_reason == "rejected" and r.prompt_tokens >= (limit or math.inf) for r in fixed.requests)


def _slos(slos, th: Thresholds):
    return list(slos) or [_TtftSlo(th.ttft_p95_slo_s)]


@dataclass(frozen=True)
class _TtftSlo:
    threshold_s: float
    metric: str = "ttft"
    percentile: int = 95

    def request_value(self, rec):
        return rec.ttft_s


def meets(slo, run: RunResult) -> bool:
    values = [v for r in run.requests if r.ok and (v := slo.request_value(r)) is not None]
    return bool(values) and float(np.percentile(values, slo.percentile)) <= slo.threshold_s


def slo_text(slo) -> str:
    return f"{slo.metric}_p{slo.percentile} <= {slo.threshold_s * 1000:g} ms"


def effect_text(before: dict, after: dict) -> str:
    parts = []
    for key, name in (("ttft_p95", "TTFT p95"), ("e2e_p95", "e2e p95"), ("preemptions", "preemptions"),
                      ("rejected", "rejected")):
        b, a = before.get(key), after.get(key)
        if a is None or (key in ("preemptions", "rejected") and not b and not a):
            continue
        shown = _seconds if key.endswith("p95") else str
        parts.append(f"{name} {shown(b) if b is not None else '?'} → {shown(a)}")
    b, a = before.get("prefix_hit_rate"), after.get("prefix_hit_rate")
    if a is not None and b is not None and abs(a - b) >= 0.01:
        parts.append(f"prefix hits {b:.0%} → {a:.0%}")
    b, a = before.get("throughput_rps"), after.get("throughput_rps")
    if a is not None and b:
        parts.append("same throughput" if abs(a / b - 1) < 0.02 else f"throughput {b:.2f} → {a:.2f} req/s")
    return ", ".join(parts)


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _rank_key(t: FixTrial) -> float:
    """Lower is better: the fix's TTFT and e2e p95 over the baseline's."""
    ratios = [t.after[k] / t.before[k] for k in WORSE_IF_HIGHER if t.before.get(k) and t.after.get(k) is not None]
    return sum(ratios) / len(ratios) if ratios else 1.0


def _rewrite(d: Diagnosis, label: str) -> None:
    helped = sorted((t for t in d.trials if t.verdict == HELPED), key=_rank_key)
    untested = [t for t in d.trials if t.verdict == UNTESTED]
    actions = [o for o in d.options if isinstance(o, str)]
    parts = [f"{t.change} [in {label}: {effect_text(t.before, t.after)}]" for t in helped]
    parts += [f"{t.change} [not simulated: {t.note}]" for t in untested]
    if not helped:
        tried = [t for t in d.trials if t.verdict == NO_HELP]
        lead = f"no proposed flag change removed {d.id} in {label}" if tried else ""
        d.fix = "; ".join(p for p in (lead, "; or ".join(parts + actions)) if p) or lead
        return
    d.fix = "; or ".join(parts + actions)


def _untested(d: Diagnosis, why: str, result: RunResult | None = None,
              lengths: list[tuple[int, int]] | None = None) -> None:
    """Nothing simulated: a lowered limit that refuses requests of the trace (`lengths`) did not help;
    the other changes are printed untested, saying why."""
    d.trials, kept = [], []
    for c in d.changes:
        refused = refused_trial(result, c, lengths) if result is not None else None
        d.trials.append(refused or FixTrial(str(c), UNTESTED, why, flag=c.flag, value=c.new))
        if refused is None:
            kept.append(c)
    if len(kept) == len(d.changes):
        d.fix = f"{d.fix} [untested: {why}]"
        return
    shown = join_fixes(*kept, *(o for o in d.options if isinstance(o, str)))
    lead = f"no flag change of {d.id} fits the trace" if not shown else ""
    d.fix = "; ".join(t for t in (lead, shown) if t) + f" [untested: {why}]"
