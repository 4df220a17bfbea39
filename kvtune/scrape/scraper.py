"""Scraper: GET a server's /metrics every few seconds on a plain thread and keep the snapshots.

httpx does the HTTP, as everywhere in kvtune: one `httpx.Client` held for the scrape loop
(keep-alive: one connection, not one a scrape), closed when the scraper stops (kvtune/httpclient.py makes it).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Self

import httpx

from ..httpclient import HTTP_ERRORS, http_client
from .log import ScrapeLog
from .parse import Snapshot, config_from_info, parse_exposition

# Never ask for OpenMetrics: prometheus-client then escapes `vllm:` to `vllm_` in sample names.
ACCEPT = "text/plain; version=0.0.4; charset=utf-8"


class ScrapeError(RuntimeError):
    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch(url: str, timeout_s: float = 5.0, client: httpx.Client | None = None) -> str:
    """The exposition text at `url`, or a ScrapeError that says what went wrong where.

    `client`: the connection to reuse (a Scraper's); None, a client for this one GET.
    A URL httpx cannot send to (no http:// or https://) raises ValueError."""
    if client is None:
        with http_client(url, timeout_s) as own:
            return fetch(url, timeout_s, own)
    try:
        response = client.get(url, headers={"Accept": ACCEPT}, timeout=timeout_s)
    except httpx.UnsupportedProtocol as e:
        raise ValueError(f"cannot scrape {url}: {e}") from e
    except httpx.TimeoutException as e:
        raise ScrapeError(f"{url} did not answer within {timeout_s:g} s") from e
    except HTTP_ERRORS as e:  # refused, reset, a broken answer
        raise _connect_error(url, _reason(e)) from e
    if not response.is_success:
        raise ScrapeError(f"{url} answered HTTP {response.status_code} {response.reason_phrase}",
                          retryable=response.status_code >= 500)
    return response.content.decode("utf-8", errors="replace")


def reported_config(url: str, timeout_s: float = 10.0) -> dict:
    """What one scrape of the server's /metrics says of its config (config_from_info); {} where it
    has no /metrics, or no Prometheus text or cache_config_info there."""
    try:
        return config_from_info(parse_exposition(fetch(metrics_url(url), timeout_s)).info)
    except (ScrapeError, ValueError):
        return {}


def _reason(err: BaseException):
    """The OSError under httpx's error (ConnectionRefusedError, a DNS failure), else the error itself."""
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return err


def _connect_error(url: str, reason) -> ScrapeError:
    if isinstance(reason, ConnectionRefusedError):
        return ScrapeError(f"connection refused by {url}: is the server running and listening there?")
    return ScrapeError(f"cannot scrape {url}: {reason}")


class Scraper:
    """`start()` scrapes at once and then every `interval_s`; `stop()` takes a last one and returns the log.

    Failed scrapes (after `retries` retries) are counted in the log with the
    last error's message; nothing is raised from the thread.
    """

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 5.0,
                 model_name: str | None = None, retries: int = 2, retry_delay_s: float = 0.2,
                 on_samples: Callable[[list[tuple[float, str, float]]], None] | None = None):
        self.url = metrics_url(url)
        self.on_samples = on_samples  # given each snapshot's ScrapeLog.newest_samples, from the thread
        self.sink_errors = 0  # on_samples calls that raised: the scrape goes on regardless
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self._log = ScrapeLog(url=self.url)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: httpx.Client | None = None  # held from start() to stop(): one kept-alive connection

    def scrape_once(self) -> Snapshot:
        """One snapshot now; raises ScrapeError once the retries are spent."""
        error = None
        for attempt in range(self.retries + 1):
            if attempt and self._stop.wait(self.retry_delay_s * attempt):
                break  # stopping: no more retries
            start = time.time()
            try:
                text = fetch(self.url, self.timeout_s, self._client)
            except ScrapeError as e:
                error = e
                if not e.retryable:
                    break
                continue
            try:
                return parse_exposition(text, t=(start + time.time()) / 2, model_name=self.model_name)
            except Exception as e:
                raise ScrapeError(f"{self.url} sent an exposition prometheus_client cannot parse: {e}",
                                  retryable=False) from e
        raise error

    def start(self) -> Scraper:
        if self._thread is not None:
            raise RuntimeError("this Scraper was already started")
        self._client = http_client(self.url, self.timeout_s)
        self._thread = threading.Thread(target=self._run, name="kvtune-scrape", daemon=True)
        self._thread.start()
        return self

    def stop(self, final_scrape: bool = True) -> ScrapeLog:
        """Stop the thread; with `final_scrape`, one more snapshot so the log covers the run's end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s * (self.retries + 1) + self.interval_s + 1.0)
        try:
            if final_scrape:
                self._record()
        finally:
            client, self._client = self._client, None
            if client is not None:
                client.close()
        return self.log

    @property
    def log(self) -> ScrapeLog:
        with self._lock:
            return ScrapeLog(list(self._log.snapshots), self._log.url, self._log.errors, self._log.last_error)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            self._record()
            deadline = max(deadline + self.interval_s, time.monotonic())  # late: skip, don't burst
            if self._stop.wait(deadline - time.monotonic()):
                return

    def _record(self) -> None:
        try:
            snap = self.scrape_once()
        except Exception as e:  # the thread must survive anything a server sends
            with self._lock:
                self._log.errors += 1
                self._log.last_error = str(e)
            return
        with self._lock:
            self._log.snapshots.append(snap)
            rows = self._log.newest_samples() if self.on_samples else []
        if rows:
            try:
                self.on_samples(rows)
            except Exception:  # noqa: BLE001 - a store that hiccups must not stop the scrape
                self.sink_errors += 1
