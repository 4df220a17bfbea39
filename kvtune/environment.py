"""`host_environment()`: the facts of the machine a search ran on, as plain JSON.

The report's "where" comes from here: `kvtune search` stores the dict as its
Optuna study's user attr "environment". Everything is read cheaply: package
versions from their distributions' metadata (torch and vLLM are never
imported), CPU and memory from /proc where it exists, GPUs through NVML
(`kvtune.gpu`), which gives an empty list on a machine without one. Nothing
here raises: a fact that cannot be read is None.
"""
from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib import metadata

DISTRIBUTION = "kvtune"  # pyproject.toml's [project] name; it ships both kvtune and kvengine
PACKAGES = ("torch", "optuna", "vllm", "sglang")  # versions worth knowing, where installed


def host_environment() -> dict:
    """kvtune's version (kvengine's where it differs), Python, packages, OS, CPU, memory and GPUs."""
    now = datetime.now().astimezone()
    kvtune = package_version(DISTRIBUTION)
    env = {
        "collected_at": now.astimezone(UTC).isoformat(timespec="seconds"),
        "utc_offset_s": int(now.utcoffset().total_seconds()),  # Optuna's trial times are this clock's, naive
        "hostname": platform.node() or None,
        "kvtune": kvtune,
        "python": platform.python_version(),
        "packages": {name: v for name in PACKAGES if (v := package_version(name)) is not None},
        "os": platform.system() or None,
        "kernel": platform.release() or None,
        "distro": _os_release(),
        "machine": platform.machine() or None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": _affinity(),
        "memory_total_bytes": _memory_total(),
        "memory_limit_bytes": _cgroup_memory_limit(),
    }
    engine = _kvengine_version()
    if engine is not None and engine != kvtune:
        env["kvengine"] = engine
    env["gpus"], env["gpu_status"] = _gpus()
    return env


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution, None where it is not installed (never imports it)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _kvengine_version() -> str | None:
    try:
        from kvengine import __version__  # a one-line package init: no torch
    except ImportError:
        return None
    return __version__


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _os_release() -> str | None:
    for line in (_read("/etc/os-release") or "").splitlines():
        key, _, value = line.partition("=")
        if key == "PRETTY_NAME":
            return value.strip().strip('"') or None
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("avx512f", "amx_tile"); empty where unread."""
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _cpu_model() -> str | None:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or None


def _affinity() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS or Windows
        return None


def _memory_total() -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024  # kB
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_memory_limit() -> int | None:
    """A container's memory limit (cgroup v2, else v1), where it is below the machine's memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(path) or "").strip()
        if text.isdigit():
            limit, total = int(text), _memory_total()
            return limit if total is None or limit < total else None
    return None


def _gpus() -> tuple[list[dict], str]:
    try:
        from .gpu import probe
        samples, status = probe()
    except Exception as err:  # noqa: BLE001 -- a broken driver must never stop a search
        return [], f"no GPU: cannot query NVML: {err}"
    return [{"index": s.index, "name": s.name, "memory_total_bytes": s.memory_total} for s in samples], status
