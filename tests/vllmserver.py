"""A real vLLM (the CPU build in .venv-vllm, which `make test` installs) for the tests.

Started by kvtune's own ManagedServer on a free loopback port, serving the tiny
random Llama of tests/checkpoint.py. `-O0` skips torch.compile's warm-up, which
only makes the start slower; the tests measure decisions and counters, not speed.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import requests

from kvtune.targets.servers import VLLM_MODULE, default_vllm_command

POOL_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: a fixed pool, whatever else the machine holds
TEST_ARGS = "--dtype bfloat16 -O0"
# VLLM_ENABLE_V1_MULTIPROCESSING=0: `vllm serve` still runs its engine core in a spawned process
# (vllm/v1/engine/async_llm.py), but the CPU platform then keeps the uni executor
# (vllm/platforms/cpu.py), so the model runs in the core instead of a third spawned worker: one vLLM
# import less at each start. OMP_NUM_THREADS=1 leaves the OpenMP binding the mp executor sets up moot.
ENV = {"VLLM_CPU_KVCACHE_SPACE": POOL_GIB, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
START_TIMEOUT_S = 420.0


def vllm_command() -> str:
    """The module form in the vLLM venv; skips the test (saying how to get it) when there is none."""
    command = default_vllm_command()
    python = shlex.split(command)[0]
    if VLLM_MODULE not in command or not Path(python).is_file():
        pytest.skip("no vLLM venv: `make vllm` (or `make test`) installs vllm-cpu into .venv-vllm")
    return command


def metrics(url: str) -> dict[str, float]:
    """One /metrics scrape: {sample name with labels: value}, read without kvtune's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def counter(scrape: dict, name: str, **labels) -> float:
    """A vLLM counter summed over the labels not given."""
    want = [f"{k}={v}" for k, v in labels.items()]
    total = 0.0
    for key, value in scrape.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in want):
            total += value
    return total

