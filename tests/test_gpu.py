"""kvtune.gpu: NVML samples where a GPU exists, a clear 'no GPU' where it does not, never an exception."""
import os
import sys
import threading
import types

import pytest

from kvtune import gpu

HAS_DRIVER = os.path.exists("/proc/driver/nvidia/version")


def test_samples_and_status_agree():
    samples, status = gpu.probe()
    assert status.startswith("no GPU") == (samples == [])
    for s in samples:
        assert 0 < s.memory_used <= s.memory_total and s.name and s.t > 0


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
def test_no_gpu_here():
    assert gpu.gpu_samples() == []
    assert gpu.gpu_status().startswith("no GPU: ")
    sampler = gpu.GpuSampler(interval_s=0.01).start()
    log = sampler.stop()
    assert not sampler.available and log.samples == [] and log.status.startswith("no GPU")
    assert log.series() == {"time": [], "gpu_memory_used": [], "gpu_memory_total": [], "gpu_utilization": []}


def test_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what `import pynvml` meets when it is not installed
    assert gpu.probe() == ([], "no GPU: nvidia-ml-py is not installed (pip install nvidia-ml-py)")


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(devices, init_error=None):
    """A stand-in for the pynvml module of nvidia-ml-py: the calls kvtune.gpu makes, nothing else."""
    state = {"inits": 0}

    def init():
        if init_error is not None:
            raise FakeNVMLError(init_error)
        state["inits"] += 1

    def shutdown():
        state["inits"] -= 1

    def utilization(i):
        if devices[i].get("mig"):
            raise FakeNVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        return types.SimpleNamespace(gpu=devices[i]["util"], memory=devices[i]["mem_util"])

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError, state=state, nvmlInit=init, nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(devices), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda i: devices[i]["name"],
        nvmlDeviceGetMemoryInfo=lambda i: types.SimpleNamespace(used=devices[i]["used"], total=devices[i]["total"]),
        nvmlDeviceGetUtilizationRates=utilization, nvmlSystemGetDriverVersion=lambda: "550.54.15")


DEVICES = [
    {"name": "NVIDIA H100 80GB HBM3", "used": 70 << 30, "total": 80 << 30, "util": 93, "mem_util": 41},
    {"name": b"NVIDIA A100-SXM4-80GB MIG 3g.40gb", "used": 1 << 30, "total": 40 << 30, "mig": True},
]


def test_gpu_path_with_a_fake_nvml(monkeypatch):
    nvml = fake_nvml(DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    samples, status = gpu.probe()
    assert status == ("2 GPUs (0: NVIDIA H100 80GB HBM3, 1: NVIDIA A100-SXM4-80GB MIG 3g.40gb), "
                      "driver 550.54.15")
    h100, mig = samples
    assert (h100.memory_used, h100.memory_total, h100.utilization_gpu, h100.utilization_memory) == (
        70 << 30, 80 << 30, 93.0, 41.0)
    assert mig.utilization_gpu is None and mig.utilization_memory is None and mig.index == 1
    assert nvml.state["inits"] == 0  # every init is shut down

    sampler = gpu.GpuSampler(interval_s=0.01).start()
    threading.Event().wait(0.1)
    log = sampler.stop()
    assert sampler.available is False and nvml.state["inits"] == 0
    series = log.series(start=log.samples[0].t - 1.0)
    assert len(series["time"]) >= 2 and series["time"][0] == pytest.approx(1.0)
    assert series["gpu_memory_used"][0] == 71 << 30 and series["gpu_memory_total"][0] == 120 << 30
    assert series["gpu_utilization"][0] == 93.0  # the MIG slice has no utilisation: left out of the mean


@pytest.mark.parametrize("code, reason", [(12, "NVML library not found"), (9, "driver not loaded"),
                                          (999, "NVML error")])
def test_nvml_init_failures_read_as_no_gpu(monkeypatch, code, reason):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(DEVICES, init_error=code))
    samples, status = gpu.probe()
    assert samples == [] and status.startswith("no GPU: ") and reason in status


def test_zero_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([]))
    assert gpu.probe() == ([], "no GPU: NVML found no devices")
