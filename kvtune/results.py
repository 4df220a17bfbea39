"""RunResult: what one run of a workload on a target produced, whatever the target.

Per-request records (what the clients saw), per-step or per-scrape series
(what the server said), the config and the workload's profile, and a summary
of plain figures. Every target returns this shape, so scoring, diagnosis and
the store never need to know which target ran.
"""
from __future__ import annotations

import json
import os
import tempfile
import dataclasses
from dataclasses import asdict, dataclass, field

import numpy as np
from kvengine.config import EngineConfig

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")
QUANTILES = (50, 95, 99)



# The summary figures every run row carries as columns (kvtune.store): what a list of runs, the
# ranking's means over repeats and the report's tables read without loading a run's records.
SUMMARY_FIGURES = ("requests", "completed", "throughput_rps", "output_tok_s", "ttft_p95", "tpot_p95",
                   "e2e_p95", "prefix_hit_rate", "kv_usage_peak", "preemptions")

@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None  # stop | length | abort | rejected | error
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


@dataclass(frozen=True)
class Launch:
    """How the measured server was started, kept with a run beside its knobs: the launch line a
    report prints repeats it, and a diagnosis proposes only what that server takes. A run stores it
    flat in its config (`stored`; `of` reads it back), so rows written before it read the same."""
    server: str  # engine | vllm | sglang ("" in a run stored without it)
    args: str = ""  # the extra server flags it was given (--server-args)
    env: dict = field(default_factory=dict)  # the server's environment that sizes or shapes it
    module: str | None = None  # vLLM run as `python -m MODULE` rather than `vllm serve`
    executor: str | None = None  # kvengine's executor
    block_sizes: tuple[int, ...] = ()  # the block sizes that server takes
    _STORED = ("launch_server", "launch_args", "launch_env", "launch_module", "server_block_sizes")

    def stored(self) -> dict:
        out = {"launch_server": self.server, "launch_args": self.args, "launch_env": dict(self.env),
               "server_block_sizes": list(self.block_sizes)}
        if self.module:
            out["launch_module"] = self.module
        if self.executor:
            out["executor"] = self.executor
        return out

    @classmethod
    def of(cls, config: dict | None) -> "Launch | None":
        """The launch a run's stored config records; None for a run whose server kvtune did not start."""
        config = config or {}
        if not any(key in config for key in cls._STORED):
            return None
        return cls(config.get("launch_server") or "", config.get("launch_args") or "", dict(config.get("launch_env") or {}),
                   config.get("launch_module"), config.get("executor"),
                   tuple(config.get("server_block_sizes") or ()))


@dataclass
class RunResult:
    target: str
    model: str
    device: str
    config: dict
    workload: dict  # the workload's profile (kvtune.workload.workload_stats)
    requests: list[RequestRecord]
    series: dict[str, list]  # name -> values, aligned with series["time"]
    duration_s: float  # first arrival to last completion
    wall_s: float = 0.0
    summary: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunResult":
        data = dict(data)
        data["requests"] = [RequestRecord(**r) for r in data["requests"]]
        return cls(**data)

    def write_json(self, path: str) -> None:
        """Atomically: a reader never sees half a file."""
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".run-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    @classmethod
    def read_json(cls, path: str) -> "RunResult":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def quantiles(values, prefix: str) -> dict:
    """{prefix_p50: .., prefix_p95: .., prefix_p99: .., prefix_mean: ..}, None when empty."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return {f"{prefix}_p{q}": None for q in QUANTILES} | {f"{prefix}_mean": None}
    out = {f"{prefix}_p{q}": float(v) for q, v in zip(QUANTILES, np.percentile(arr, QUANTILES))}
    out[f"{prefix}_mean"] = float(arr.mean())
    return out


def quantile_bound(summary: dict, key: str) -> tuple[str, float] | None:
    """Where a summary's histogram quantile `key` (e.g. server_queue_p50) is known only as a bound:
    ("<", b) when its rank fell in the first bucket (0, b], (">", b) in the +Inf bucket above b;
    None when it is a value (or missing). See kvtune.targets.live.server_figures."""
    if summary.get(key) is not None:
        return None
    if summary.get(key + "_below") is not None:
        return "<", summary[key + "_below"]
    if summary.get(key + "_above") is not None:
        return ">", summary[key + "_above"]
    return None


def bound_text(sign: str, seconds: float) -> str:
    """'< 300 ms', '< 1 ms', '> 80 s': a bucket bound of a latency histogram, as it reads."""
    if seconds >= 10:
        return f"{sign} {seconds:,g} s"
    return f"{sign} {seconds * 1000:,.4g} ms"


def summarize(result: RunResult) -> dict:
    """The plain figures of a run (seconds, tokens, fractions)."""
    ok = [r for r in result.requests if r.ok]
    duration = result.duration_s or float("nan")
    s = result.series
    summary = {
        "requests": len(result.requests),
        "completed": len(ok),
        "rejected": sum(r.finish_reason == "rejected" for r in result.requests),
        "failed": sum(r.error is not None and r.finish_reason != "rejected" for r in result.requests),
        "duration_s": result.duration_s,
        "throughput_rps": len(ok) / duration,
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / duration,
    }
    summary |= quantiles([r.ttft_s for r in ok], "ttft")
    summary |= quantiles([r.tpot_s for r in ok if r.output_tokens > 1], "tpot")
    summary |= quantiles(np.concatenate([r.itl_s for r in ok]) if ok else [], "itl")
    summary |= quantiles([r.e2e_s for r in ok], "e2e")
    summary |= quantiles([r.queue_s for r in ok if r.queue_s is not None], "queue")
    queries, hits = sum(s.get("prefix_queries", ())), sum(s.get("prefix_hits", ()))
    summary["prefix_hit_rate"] = hits / queries if queries else None
    summary["ideal_prefix_hit_rate"] = result.workload.get("ideal_prefix_hit_rate")
    summary["preemptions"] = int(sum(s.get("num_preemptions", ())))
    usage = s.get("kv_usage", [])
    summary["kv_usage_peak"] = max(usage) if usage else None
    summary["kv_usage_mean"] = _time_weighted_mean(usage, s.get("duration")) if usage else None
    running = s.get("num_running", [])
    summary["running_peak"] = max(running) if running else None
    return summary


def _time_weighted_mean(values: list[float], durations: list[float] | None) -> float:
    if not durations or sum(durations) == 0:
        return float(np.mean(values))
    return float(np.dot(values, durations) / sum(durations))


def config_dict(config: EngineConfig) -> dict:
    """A config as a run stores it; `engine_config` reads it back."""
    return {k: v for k, v in vars(config).items() if k != "extra"}


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "extra"}


def engine_config(stored: dict | None, params: dict | None = None, **changes) -> EngineConfig:
    """The config a run's stored dict describes, `params` (a trial's knobs) and `changes` on top.

    Other keys (launch_env, a URL target's labels) are left out. A knob stored as None (the server
    did not say) takes EngineConfig's default where that is not None: block_size 16, vLLM's on
    GPUs, is the one place that default is assumed."""
    merged = {**(stored or {}), **(params or {}), **changes}
    known = {k: v for k, v in merged.items() if k in _FIELDS}
    return EngineConfig(**{k: v for k, v in known.items() if v is not None or _FIELDS[k].default is None})
