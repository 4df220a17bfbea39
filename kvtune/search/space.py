"""The search space: which KV-cache knobs vary, over which values.

Defaults follow what `vllm serve` accepts: block sizes that every attention
backend takes (multiples of 16), utilisation up to 0.95, fp8 as the KV dtype
vLLM offers besides the model's own. From flags (`--space
max_num_seqs=32:512:log`) or a YAML file:

    block_size: [16, 32, 64]
    gpu_memory_utilization: {low: 0.85, high: 0.95, step: 0.01}
    max_num_seqs: {low: 32, high: 512, log: true}
    kv_cache_dtype: [auto, fp8]
    max_num_batched_tokens: [4096, 8192]     # optional knob
    enable_prefix_caching: [true, false]     # optional knob
    tensor_parallel_size: [1, 2, 4, 8]       # what `kvtune search --gpus N` adds: divisors of N
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import yaml

from kvengine.config import BLOCK_SIZES, KV_CACHE_DTYPES, ConfigError, EngineConfig

KNOBS = ("block_size", "gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype",
         "max_num_batched_tokens", "enable_prefix_caching", "tensor_parallel_size")


class SpaceError(ValueError):
    """A search-space definition that cannot be used; the message names the knob."""


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple | None = None  # categorical
    low: float | None = None  # numeric range
    high: float | None = None
    step: float | None = None
    log: bool = False

    @property
    def is_int(self) -> bool:
        return self.name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size")

    def suggest(self, trial):
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.is_int:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log,
                                     step=1 if self.log else int(self.step or 1))
        return trial.suggest_float(self.name, self.low, self.high, log=self.log,
                                   step=None if self.log else self.step)

    def grid(self, levels: int = 8) -> list:
        """Every value of a categorical knob; `levels` evenly (or log-) spaced values of a range."""
        if self.choices is not None:
            return list(self.choices)
        if self.step and not self.log:
            n = int(round((self.high - self.low) / self.step)) + 1
            values = [self.low + i * self.step for i in range(n)]
        elif self.log:
            ratio = (self.high / self.low) ** (1 / max(levels - 1, 1))
            values = [self.low * ratio ** i for i in range(levels)]
        else:
            values = [self.low + (self.high - self.low) * i / max(levels - 1, 1) for i in range(levels)]
        return sorted({int(round(v)) if self.is_int else round(v, 6) for v in values})


DEFAULT_KNOBS = {
    "block_size": Knob("block_size", choices=(16, 32, 64, 128)),
    "gpu_memory_utilization": Knob("gpu_memory_utilization", low=0.80, high=0.95, step=0.01),
    "max_num_seqs": Knob("max_num_seqs", low=16, high=1024, log=True),
    "kv_cache_dtype": Knob("kv_cache_dtype", choices=("auto", "fp8")),
}
OPTIONAL_KNOBS = {
    "max_num_batched_tokens": Knob("max_num_batched_tokens", choices=(2048, 4096, 8192, 16384)),
    "enable_prefix_caching": Knob("enable_prefix_caching", choices=(True, False)),
}


@dataclass(frozen=True)
class SearchSpace:
    knobs: tuple[Knob, ...]

    @classmethod
    def default(cls, optional: tuple[str, ...] = ()) -> "SearchSpace":
        return cls(tuple(DEFAULT_KNOBS.values()) + tuple(OPTIONAL_KNOBS[name] for name in optional))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def suggest(self, trial) -> dict:
        return {k.name: k.suggest(trial) for k in self.knobs}

    def grid(self, levels: int = 8) -> list[dict]:
        names = self.names
        return [dict(zip(names, combo)) for combo in itertools.product(*(k.grid(levels) for k in self.knobs))]

    def with_knobs(self, knobs: dict[str, Knob]) -> "SearchSpace":
        current = {k.name: k for k in self.knobs} | knobs
        return SearchSpace(tuple(current[name] for name in KNOBS if name in current))

    def for_target(self, rules, explicit: set[str] = frozenset()) -> tuple["SearchSpace", list[str]]:
        """The space a target can run (`rules`: kvtune.targets.rules.TargetRules), and a line for each
        change. Values the operator named (`explicit` knobs) that the target refuses are an error."""
        space, notes = self, []
        if not rules.utilization_sizes_pool:
            space, notes = self.pool_fixed_by(rules.pool_knob, explicit, rules.server)
        knobs = []
        for knob in space.knobs:
            allowed = {"block_size": rules.block_sizes, "kv_cache_dtype": rules.kv_cache_dtypes}.get(knob.name)
            if allowed is None or knob.choices is None:
                knobs.append(knob)
                continue
            kept = tuple(v for v in knob.choices if v in allowed)
            refused = [v for v in knob.choices if v not in allowed]
            if refused and knob.name in explicit:
                raise SpaceError(f"{knob.name}: {rules.server} refuses {', '.join(map(str, refused))}; it takes "
                                 f"{', '.join(map(str, allowed))}")
            if knob.name == "block_size" and not explicit & {"block_size"}:
                kept = tuple(v for v in allowed if v >= min(knob.choices)) or tuple(allowed)
            if kept != knob.choices:
                notes.append(f"{knob.name} searched over {', '.join(map(str, kept))}: what {rules.server} takes")
            knobs.append(dataclasses.replace(knob, choices=kept))
        return SearchSpace(tuple(knobs)), notes

    def pool_fixed_by(self, pool_knob: str, explicit: set[str] = frozenset(),
                      server: str = "the server") -> tuple["SearchSpace", list[str]]:
        """The space without gpu_memory_utilization where `pool_knob` sizes the KV pool: a utilisation
        would change nothing, and a config that differs only there is no advice. Named in `explicit`
        it is an error."""
        if "gpu_memory_utilization" not in self.names:
            return self, []
        if "gpu_memory_utilization" in explicit:
            raise SpaceError(f"gpu_memory_utilization: {server} ignores it ({pool_knob} sizes the pool); leave it "
                             "out of --space")
        kept = tuple(k for k in self.knobs if k.name != "gpu_memory_utilization")
        return SearchSpace(kept), [f"gpu_memory_utilization is not searched: {server} ignores it ({pool_knob} "
                                   "sizes the pool)"]

    def steps_toward(self, params: dict, default: dict) -> list[dict]:
        """`params` with one knob of discrete numeric values moved part of the way back to the
        default's value (each value strictly between the two), the cheapest change first
        (`change_cost`): what stage 2's descent tries live after a win, since random sampling
        overshoots a knob that matters little (block 16 where 64 serves as well)."""
        steps = []
        for knob in self.knobs:
            new, old = params.get(knob.name), default.get(knob.name)
            if knob.choices is None or not (_positive_number(new) and _positive_number(old)):
                continue
            low, high = sorted((new, old))
            steps += [params | {knob.name: v} for v in knob.choices if _positive_number(v) and low < v < high]
        return sorted(steps, key=lambda p: change_cost(p, default))

    def config(self, params: dict, base: EngineConfig) -> EngineConfig:
        """The engine config a trial's parameters describe (the rest from `base`)."""
        return dataclasses.replace(base, **params)


def change_cost(params: dict, default: dict) -> tuple[int, int, float]:
    """What turning `default` into `params` asks of an operator, least first: how many changes alter
    the model's numerics (a quantized KV cache: answers may differ, which only the operator's own
    evaluation can clear; report section 7 says so), then how many flags change, then how far the
    numbers move (the sum of |log2(new / default)| over the numeric flags: block 64 is a smaller
    step from 128 than block 16). Among configs the live test cannot tell apart, or the simulator
    scores alike, the cheapest is recommended: the same choice on every rerun, where the
    simulator's order between two equal results moves with each calibration."""
    changed = [k for k, v in default.items() if params.get(k) != v]
    lossy = sum(1 for k in changed if k == "kv_cache_dtype" and params.get(k) != "auto")
    return lossy, len(changed), round(sum(_step(params.get(k), default[k]) for k in changed), 9)


def _step(new, old) -> float:
    """How far a flag moves: |log2(new / old)| between positive numbers, 1 for any other change."""
    return abs(math.log2(new / old)) if _positive_number(new) and _positive_number(old) else 1.0


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def tensor_parallel_knob(model, gpus: int) -> Knob:
    """TP sizes for `gpus` GPUs: the divisors of `gpus` the model's heads allow (vLLM's rules), each
    serving gpus / TP replicas."""
    from kvengine.config import check_tensor_parallel

    sizes = []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        try:
            check_tensor_parallel(model, tp)
            sizes.append(tp)
        except ConfigError:
            continue
    return Knob("tensor_parallel_size", choices=tuple(sizes))


def parse_knob(name: str, spec) -> Knob:
    """A knob from YAML (a list, or {low, high, step, log}) or a flag value ('16,32' or 'lo:hi[:step|log]')."""
    if name not in KNOBS:
        raise SpaceError(f"unknown knob {name!r}; the space can vary {', '.join(KNOBS)}")
    if isinstance(spec, str):
        spec = _spec_from_text(name, spec)
    if isinstance(spec, list):
        choices = tuple(_coerce(name, v) for v in spec)
        if not choices:
            raise SpaceError(f"{name}: no values given")
        _check_values(name, choices)
        return Knob(name, choices=choices)
    if isinstance(spec, dict):
        unknown = set(spec) - {"low", "high", "step", "log"}
        if unknown or "low" not in spec or "high" not in spec:
            raise SpaceError(f"{name}: a range needs low and high (and optionally step, log); got {spec}")
        knob = Knob(name, low=float(spec["low"]), high=float(spec["high"]),
                    step=None if spec.get("step") is None else float(spec["step"]), log=bool(spec.get("log")))
        if not knob.low < knob.high or (knob.log and knob.low <= 0):
            raise SpaceError(f"{name}: need 0 < low < high for a range, got low={knob.low}, high={knob.high}")
        _check_values(name, (knob.low, knob.high))
        return knob
    raise SpaceError(f"{name}: expected a list of values or a range {{low, high}}, got {spec!r}")


def _spec_from_text(name: str, text: str):
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise SpaceError(f"--space {name}={text}: a range is low:high[:step|log]")
        spec = {"low": parts[0], "high": parts[1]}
        if len(parts) == 3:
            spec.update({"log": True} if parts[2] == "log" else {"step": parts[2]})
        try:
            return {k: (v if k == "log" else float(v)) for k, v in spec.items()}
        except ValueError:
            raise SpaceError(f"--space {name}={text}: low, high and step must be numbers") from None
    return [v.strip() for v in text.split(",") if v.strip()]


def _coerce(name: str, value):
    if name == "kv_cache_dtype":
        return str(value)
    if name == "enable_prefix_caching":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "on", "1", "yes"):
            return True
        if str(value).lower() in ("false", "off", "0", "no"):
            return False
        raise SpaceError(f"enable_prefix_caching: expected true or false, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpaceError(f"{name}: expected a number, got {value!r}") from None
    if name == "gpu_memory_utilization":
        return number
    if number != int(number):
        raise SpaceError(f"{name}: expected an integer, got {value!r}")
    return int(number)


def _check_values(name: str, values) -> None:
    if name == "block_size" and any(v not in BLOCK_SIZES for v in values):
        raise SpaceError(f"block_size: values must be among {', '.join(map(str, BLOCK_SIZES))}, got {list(values)}")
    if name == "kv_cache_dtype" and any(v not in KV_CACHE_DTYPES for v in values):
        raise SpaceError(f"kv_cache_dtype: values must be among {', '.join(KV_CACHE_DTYPES)}, got {list(values)}")
    if name == "gpu_memory_utilization" and any(not 0 < v <= 1 for v in values):
        raise SpaceError(f"gpu_memory_utilization: values must be in (0, 1], got {list(values)}")
    if name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size") and any(
            v < 1 or math.isinf(v) for v in values):
        raise SpaceError(f"{name}: values must be positive integers, got {list(values)}")


def load_space(path: str | None, flags: list[str], optional: tuple[str, ...] = ()) -> SearchSpace:
    """The default space, then a YAML file's knobs, then --space flags (later wins)."""
    space = SearchSpace.default(optional)
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as err:
            raise SpaceError(f"--space-file {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise SpaceError(f"--space-file {path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise SpaceError(f"--space-file {path}: expected a mapping of knob: values")
        try:
            space = space.with_knobs({name: parse_knob(name, spec) for name, spec in data.items()})
        except SpaceError as err:
            raise SpaceError(f"--space-file {path}: {err}") from None
    for flag in flags:
        name, sep, spec = flag.partition("=")
        if not sep or not spec:
            raise SpaceError(f"--space {flag}: expected knob=values, e.g. block_size=16,32 or max_num_seqs=32:512:log")
        space = space.with_knobs({name.strip(): parse_knob(name.strip(), spec)})
    return space


def check_config(config: EngineConfig) -> str | None:
    """Why a point of the space is not a valid config (e.g. batched tokens < seqs), or None."""
    try:
        config.validate()
    except ConfigError as err:
        return str(err)
    return None
