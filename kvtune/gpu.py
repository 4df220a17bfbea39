"""GPU memory and utilisation from NVML, where there is a GPU; a clear 'no GPU' where there is not.

Uses `import pynvml` from the nvidia-ml-py distribution (never the `pynvml`
package: its import hook warns on every `import torch`). Nothing here raises
for a machine without a GPU, a driver or nvidia-ml-py. Indices are NVML's,
which ignore CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Self

# NVML return codes (nvml.h) that mean "no usable GPU here" rather than a fault.
_NO_GPU_REASONS = {
    12: "NVML library not found (no NVIDIA driver installed)",  # NVML_ERROR_LIBRARY_NOT_FOUND
    9: "NVIDIA driver not loaded",  # NVML_ERROR_DRIVER_NOT_LOADED
    4: "no permission to use NVML",  # NVML_ERROR_NO_PERMISSION
    13: "NVML function not found (driver too old)",  # NVML_ERROR_FUNCTION_NOT_FOUND
}


@dataclass
class GpuSample:
    index: int
    name: str
    memory_used: int  # bytes
    memory_total: int  # bytes
    utilization_gpu: float | None  # percent of the driver's last sample period a kernel ran; None if unsupported (MIG)
    utilization_memory: float | None  # percent of that period device memory was read or written
    t: float = 0.0  # time.time() of the sample


def _load():
    """(pynvml module, None) or (None, reason there is no GPU)."""
    try:
        import pynvml
    except ImportError:
        return None, "no GPU: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"no GPU: {_NO_GPU_REASONS.get(getattr(e, 'value', None), f'NVML error: {e}')}"
    except OSError as e:  # a broken libnvidia-ml.so
        return None, f"no GPU: cannot load NVML: {e}"
    return pynvml, None


def _read(nvml, t: float) -> list[GpuSample]:
    samples = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            gpu_util, mem_util = float(util.gpu), float(util.memory)
        except nvml.NVMLError:  # not supported on MIG instances and some vGPUs
            gpu_util = mem_util = None
        samples.append(GpuSample(i, name.decode() if isinstance(name, bytes) else name,
                                 int(memory.used), int(memory.total), gpu_util, mem_util, t))
    return samples


def probe() -> tuple[list[GpuSample], str]:
    """The GPUs' samples now and a one-line status; ([], "no GPU: ...") where there are none."""
    nvml, reason = _load()
    if nvml is None:
        return [], reason
    try:
        samples = _read(nvml, time.time())
        driver = nvml.nvmlSystemGetDriverVersion()
    except nvml.NVMLError as e:
        return [], f"no GPU: NVML error: {e}"
    finally:
        nvml.nvmlShutdown()
    if not samples:
        return [], "no GPU: NVML found no devices"
    names = ", ".join(f"{s.index}: {s.name}" for s in samples)
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return samples, f"{len(samples)} GPU{'s' if len(samples) > 1 else ''} ({names}), driver {driver}"


def gpu_samples() -> list[GpuSample]:
    return probe()[0]


def gpu_status() -> str:
    return probe()[1]


@dataclass
class GpuLog:
    status: str
    samples: list[GpuSample] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None

    def series(self, start: float | None = None) -> dict[str, list]:
        """Per sampling time, all GPUs together: memory in bytes (summed), utilisation (mean).

        `start` is the time.time() that "time" counts from (ScrapeLog.start to line up with a scrape).
        """
        by_time: dict[float, list[GpuSample]] = {}
        for s in self.samples:
            by_time.setdefault(s.t, []).append(s)
        times = sorted(by_time)
        start = times[0] if start is None and times else start
        out = {"time": [t - start for t in times], "gpu_memory_used": [], "gpu_memory_total": [],
               "gpu_utilization": []}
        for t in times:
            group = by_time[t]
            util = [s.utilization_gpu for s in group if s.utilization_gpu is not None]
            out["gpu_memory_used"].append(sum(s.memory_used for s in group))
            out["gpu_memory_total"].append(sum(s.memory_total for s in group))
            out["gpu_utilization"].append(sum(util) / len(util) if util else None)
        return out


class GpuSampler:
    """Samples every GPU every `interval_s` on a plain thread; without a GPU it does nothing."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._log = GpuLog(status="not started")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def start(self) -> GpuSampler:
        if self._thread is not None:
            raise RuntimeError("this GpuSampler was already started")
        samples, status = probe()
        self._log.status = status
        if samples:
            self._nvml, _ = _load()  # held until stop(): one nvmlInit for the whole run
        self._thread = threading.Thread(target=self._run, name="kvtune-gpu", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> GpuLog:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5.0)
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
        return self.log

    @property
    def log(self) -> GpuLog:
        with self._lock:
            return GpuLog(self._log.status, list(self._log.samples), self._log.errors, self._log.last_error)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while self._nvml is not None and not self._stop.is_set():
            try:
                samples = _read(self._nvml, time.time())
            except Exception as e:  # a GPU that falls off the bus must not kill the run
                with self._lock:
                    self._log.errors += 1
                    self._log.last_error = str(e)
            else:
                with self._lock:
                    self._log.samples.extend(samples)
            self._stop.wait(self.interval_s)
