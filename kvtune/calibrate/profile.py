"""Named cost profiles: what a calibration fitted, for whom, and how well; kept in the store.

A profile holds the fitted `CostCoefficients`, the model and device presets the
roofline was evaluated for (a sim run with the profile must use the same
ones), what it was fitted against (target, URL, executor, served model, the
server's cache config), the client overhead, and the residuals per probe class.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvengine.config import DeviceSpec, EngineConfig, ModelSpec, device_preset, model_preset
from kvengine.model.spec import spec_from_dict
from kvengine.executor.cost import TIED_TO, CostCoefficients

from ..store import Store, StoreError, missing_database, resolve_db_url
from ..targets.sim import SimTarget

PROFILE_VERSION = 1


class ProfileNotFoundError(StoreError):
    """No profile by that name; the message lists the ones there are."""


@dataclass
class CalibrationProfile:
    name: str
    model: str  # the model preset the coefficients were fitted for
    device: str  # the device preset
    coefficients: CostCoefficients
    client_overhead_s: float = 0.0  # HTTP and frontend time a client sees on top of the steps (idle server)
    client_overhead_busy_s: float = 0.0  # the same for a request reaching a server busy with others
    target: str = ""  # engine | vllm | sglang | url
    url: str = ""
    executor: str | None = None  # the engine target's executor
    served_model: str = ""
    server: dict = field(default_factory=dict)  # ServerInfo.to_dict() and the config it ran
    residuals: dict = field(default_factory=dict)  # per probe class: n, rms, max, bias
    roofline_residuals: dict = field(default_factory=dict)  # the same for the uncalibrated roofline
    observations: list[dict] = field(default_factory=list)  # label, kind, measure, measured_s, predicted_s
    probe_wall_s: float = 0.0
    drift: dict = field(default_factory=dict)  # timings.speed_drift: the server's speed, first probe to last
    fit: dict = field(default_factory=dict)  # cost, nfev, message
    dtype: str = ""  # the dtype the server ran the model in, where that is not the preset's (plan.served_dtype)
    notes: list[str] = field(default_factory=list)  # what the probes could not cover (ProbePlan.notes)
    model_spec: dict = field(default_factory=dict)  # the served model's shape (a config.json's, not only presets')
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    version: int = PROFILE_VERSION

    def specs(self) -> tuple[ModelSpec, DeviceSpec]:
        """The model (in the dtype it was served in) and device presets the sim must run with this profile."""
        model = spec_from_dict(self.model_spec) if self.model_spec else model_preset(self.model)
        if self.dtype and self.dtype != model.dtype:
            model = dataclasses.replace(model, dtype=self.dtype)
        return model, device_preset(self.device)

    def sim_target(self) -> SimTarget:
        """The simulator this profile calibrates: its presets, coefficients and client overhead."""
        model, device = self.specs()
        return SimTarget(model, device, self.coefficients, self.client_overhead_s, self.client_overhead_busy_s)

    def server_defaults(self, config: EngineConfig) -> EngineConfig:
        """`config` with what it leaves unset taken from the server the profile was fitted on: its block
        size, max_num_seqs, batch budget, max_model_len and its pool (the blocks it reported), so a sim
        run with the profile simulates that server rather than the presets' defaults."""
        ran, info = self.server.get("config") or {}, self.server
        pool_set = config.num_gpu_blocks_override is not None or config.kv_cache_memory_bytes is not None
        filled = {name: ran.get(name) for name in ("block_size", "max_num_seqs", "max_num_batched_tokens")
                  if getattr(config, name) is None and isinstance(ran.get(name), int)}
        if config.block_size is None and isinstance(info.get("block_size"), int):
            filled["block_size"] = info["block_size"]
        if config.max_model_len is None and isinstance(info.get("max_model_len"), int):
            filled["max_model_len"] = info["max_model_len"]
        if not pool_set and isinstance(info.get("num_gpu_blocks"), int):
            filled["num_gpu_blocks_override"] = info["num_gpu_blocks"]
        return dataclasses.replace(config, **filled)

    def untimed_kv_dtypes(self, kv_cache_dtypes) -> list[str]:
        """The quantized KV cache dtypes among `kv_cache_dtypes` where the profile timed none (one
        timed, fp8 say, prices them all: they read through the same path): the sim prices them at
        their bytes alone, which a CPU's software dequantization far exceeds."""
        if self.fit.get("dequant"):
            return []
        return [d for d in kv_cache_dtypes if d != "auto"]

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["coefficients"] = self.coefficients.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CalibrationProfile:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(CostCoefficients)}
        data["coefficients"] = CostCoefficients(**{k: v for k, v in data["coefficients"].items() if k in known})
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def describe(self) -> str:
        c = self.coefficients
        served = f" in {self.dtype}" if self.dtype else ""
        return (f"{self.name}: {self.model}{served} on {self.device} (fitted on {self.target}"
                f"{' ' + self.executor if self.executor else ''} at {self.created_at}); "
                f"memory_efficiency {c.memory_efficiency:.4g}, compute_efficiency {c.compute_efficiency:.4g}, "
                f"attention_efficiency {c.attention_efficiency:.4g}, "
                + "".join(f"{name} {getattr(c, name):.4g}, " for name in TIED_TO if getattr(c, name) is not None)
                + f"step_overhead {c.step_overhead_s * 1e3:.3g} ms, "
                f"per_seq_overhead {c.per_seq_overhead_s * 1e6:.3g} us, "
                f"per_prefill_overhead {c.per_prefill_overhead_s * 1e6:.3g} us, "
                f"busy_arrival_overhead {c.busy_arrival_overhead_s * 1e6:.3g} us")


@contextmanager
def _opened(db: str | Store | None):
    """The store `db` is, or opens (closed after)."""
    if isinstance(db, Store):
        yield db
        return
    store = Store(resolve_db_url(db))
    try:
        yield store
    finally:
        store.close()


def save_profile(db: str | Store | None, profile: CalibrationProfile) -> None:
    """Store (or replace) the profile under its name."""
    with _opened(db) as store:
        store.save_profile(profile.name, profile.to_dict())


def get_profile(db: str | Store | None, name: str) -> CalibrationProfile:
    """The named profile; ProfileNotFoundError names it and lists those there are."""
    path = None if isinstance(db, Store) else missing_database(resolve_db_url(db))
    if path is not None:  # reading must not leave an empty database behind
        raise ProfileNotFoundError(f"no cost profile {name!r}: there is no database at {path} "
                                   "(make one with `kvtune calibrate --name NAME`, or pass --db URL)")
    with _opened(db) as store:
        data = store.load_profile(name)
        if data is None:
            names = store.list_profiles()
            there = ", ".join(names) if names else "none yet; make one with `kvtune calibrate --name NAME`"
            raise ProfileNotFoundError(f"no cost profile {name!r} in {store.display_url} (profiles: {there})")
        return CalibrationProfile.from_dict(data)


def list_profiles(db: str | Store | None) -> list[CalibrationProfile]:
    with _opened(db) as store:
        return [CalibrationProfile.from_dict(store.load_profile(n)) for n in store.list_profiles()]


def load_cost_profile(db_url: str | None, name: str) -> CostCoefficients:
    """The named profile's coefficients, for `--target sim --profile NAME` (pair them
    with `get_profile(...).specs()`: they hold for that model and device only)."""
    return get_profile(db_url, name).coefficients
