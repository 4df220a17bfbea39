"""The real Prometheus server (the `prometheus` binary) on a free loopback port, for tests.

Its configuration is the project's dashboards/prometheus/prometheus.yml with every job's
targets swapped for the test's servers (a job the test has no server for is dropped), the
scrape and rule-evaluation intervals at 1 s, and dashboards/prometheus/alerts.yml (or a copy
of it) as its rule file. Everything else in the file (labels, relabelling, external labels)
is kept, so the tests judge the configuration the stack runs.

    with running_prometheus(tmp_path, {"engine": ["127.0.0.1:8000"]}) as prom:
        prom.wait_for_scrapes()
        prom.query('vllm:num_requests_running')
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import yaml

from serverproc import free_port

ROOT = Path(__file__).resolve().parent.parent
PROJECT_CONFIG = ROOT / "dashboards" / "prometheus" / "prometheus.yml"
PROJECT_RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"
INTERVAL = "1s"
READY_TIMEOUT_S = 30.0
# A loopback request must never go through a proxy from the environment.
_HTTP = requests.Session()
_HTTP.trust_env = False


def prometheus_binary() -> str:
    """The `prometheus` server binary; skips the test, saying how to get it, when there is none."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the Prometheus server is not installed: `apt-get install -y --no-install-recommends "
                    "prometheus` (Debian/Ubuntu; `make setup` does it) or a release from "
                    "https://prometheus.io/download/")
    return binary


def stack_config(targets: dict[str, list[str]], self_target: str, rule_files: list[str]) -> dict:
    """The project's prometheus.yml scraping `targets` ({job: ["127.0.0.1:PORT", ...]}) every second."""
    config = yaml.safe_load(PROJECT_CONFIG.read_text())
    config["global"].update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL, evaluation_interval=INTERVAL)
    config["rule_files"] = rule_files
    jobs = []
    for job in config["scrape_configs"]:
        name = job["job_name"]
        hosts = [self_target] if name == "prometheus" else targets.get(name)
        if hosts:
            labels = job["static_configs"][0].get("labels", {})
            jobs.append(job | {"static_configs": [{"targets": list(hosts), "labels": labels}]})
    unknown = set(targets) - {job["job_name"] for job in config["scrape_configs"]}
    assert not unknown, f"{PROJECT_CONFIG} has no job {sorted(unknown)}"
    config["scrape_configs"] = jobs
    return config


def rules_copy(dest: Path, for_: str | None = None, source: Path = PROJECT_RULES,
               look_back: dict[str, str] | None = None) -> Path:
    """alerts.yml written to `dest`, with every alert's `for:` set to `for_` when given, and each
    text of `look_back` ({"offset 30m": "offset 18s", "[5m]": "[3s]"}) replaced in every expression.

    Only hold times and look-back distances change; the rest of every expression is the file's.
    Each key of `look_back` must be a range or an offset that some expression holds."""
    rules = yaml.safe_load(source.read_text())
    look_back = look_back or {}
    for old, new in look_back.items():
        assert re.fullmatch(r"\[\w+\]|offset \w+", old) and re.fullmatch(r"\[\w+\]|offset \w+", new), (old, new)
        assert old in source.read_text(), f"no expression of {source} holds {old!r}"
    for group in rules["groups"]:
        for rule in group["rules"]:
            if for_ is not None and "alert" in rule:
                rule["for"] = for_
            for old, new in look_back.items():
                rule["expr"] = rule["expr"].replace(old, new)
    dest.write_text(yaml.safe_dump(rules, sort_keys=False, width=10_000))
    return dest


def wait_for(check: Callable[[], object], timeout_s: float, what: str,
             context: Callable[[], object] | None = None) -> object:
    """Polls `check` until it returns something true; fails saying `what` it waited for (and `context()`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}" + (f"; {context()}" if context else ""))
        time.sleep(0.2)


class PromServer:
    """One Prometheus process; `stop()` ends its whole process group."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]], rules: Path = PROJECT_RULES):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rules = Path(rules)
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self._write_config(targets)

    def _write_config(self, targets: dict[str, list[str]]) -> None:
        self.targets = {job: list(hosts) for job, hosts in targets.items()}
        config = stack_config(self.targets, f"127.0.0.1:{self.port}", [str(self.rules)])
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self) -> PromServer:
        command = [prometheus_binary(), f"--config.file={self.config_path}",
                   f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                   "--web.enable-lifecycle"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # its own group: stop() ends it all
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if _HTTP.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"prometheus was not ready at {self.url}/-/ready in {READY_TIMEOUT_S:g} s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    # -- configuration -------------------------------------------------------
    def set_targets(self, targets: dict[str, list[str]]) -> None:
        """Scrape `targets` from now on (the config file rewritten, then POST /-/reload)."""
        self._write_config(targets)
        resp = _HTTP.post(self.url + "/-/reload", timeout=10)
        assert resp.status_code == 200, f"reload: HTTP {resp.status_code} {resp.text}\n{self.log_tail()}"

    # -- HTTP API -------------------------------------------------------------
    def api(self, path: str, **params) -> dict | list:
        """`data` of a /api/v1 answer; an error says what Prometheus said."""
        resp = _HTTP.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        assert resp.status_code == 200 and body.get("status") == "success", (
            f"{path} {params}: HTTP {resp.status_code}: {body.get('errorType')}: {body.get('error') or resp.text}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({} if at is None else {"time": at})
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def active_targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    # -- waiting --------------------------------------------------------------
    def wait_until(self, check: Callable[[], object], timeout_s: float, what: str,
                   context: Callable[[], object] | None = None) -> object:
        """wait_for, failing with `context()` (default: the end of Prometheus' log)."""
        return wait_for(check, timeout_s, what, context or (lambda: f"prometheus log:\n{self.log_tail()}"))

    def wait_for_scrapes(self, jobs: tuple[str, ...] | None = None, timeout_s: float = 15.0) -> None:
        """Until every target of `jobs` (default: all the test's jobs) has been scraped successfully."""
        wanted = {(job, host) for job, hosts in self.targets.items() for host in hosts
                  if jobs is None or job in jobs}

        def all_up():
            up = {(t["labels"]["job"], t["labels"]["instance"]) for t in self.active_targets()
                  if t["health"] == "up"}
            return wanted <= up

        self.wait_until(all_up, timeout_s, f"scrapes of {sorted(wanted)}")


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: dict[str, list[str]],
                       rules: Path = PROJECT_RULES) -> Iterator[PromServer]:
    """A started PromServer, stopped on the way out whatever happened."""
    prom = PromServer(workdir, targets, rules)
    try:
        yield prom.start()
    finally:
        prom.stop()
