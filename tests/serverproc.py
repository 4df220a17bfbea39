"""Start a real `kvengine serve` subprocess on a free loopback port, for tests."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from kvtune.httpclient import http_get
from kvtune.targets.process import free_port


class ServerProcess:
    def __init__(self, *flags: str, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvengine", "serve", "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvengine serve exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if http_get(self.url + "/health", timeout=1.0).status_code == 200:  # one SSL context for every poll
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvengine serve did not become healthy in {timeout} s")

    def end(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def stop(self) -> str:
        self.end()
        if not self.proc.stdout:
            return ""
        with self.proc.stdout:
            return self.proc.stdout.read()


def scrape(url: str) -> dict[str, float]:
    """One /metrics scrape as {sample name{labels}: value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "engine"))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
