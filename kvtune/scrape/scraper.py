"""Scraper: GET a server's /metrics every few seconds on a plain thread and keep the snapshots.

The standard library's urllib does the HTTP: no extra dependency, and nothing
that gevent (which `import locust` patches in) would need to cooperate with.
"""
from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Self

from .log import ScrapeLog
from .parse import Snapshot, parse_exposition

# Never ask for OpenMetrics: prometheus-client then escapes `vllm:` to `vllm_` in sample names.
ACCEPT = "text/plain; version=0.0.4; charset=utf-8"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ScrapeError(RuntimeError):
    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The exposition text at `url`, or a ScrapeError that says what went wrong where."""
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    try:
        with _opener(url).open(request, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        e.close()  # it holds the connection open
        raise ScrapeError(f"{url} answered HTTP {e.code} {e.reason}", retryable=e.code >= 500) from e
    except urllib.error.URLError as e:
        raise _connect_error(url, e.reason, timeout_s) from e
    except (OSError, http.client.HTTPException) as e:  # timeouts and resets while reading
        raise _connect_error(url, e, timeout_s) from e


def _connect_error(url: str, reason, timeout_s: float) -> ScrapeError:
    if isinstance(reason, ConnectionRefusedError):
        return ScrapeError(f"connection refused by {url}: is the server running and listening there?")
    if isinstance(reason, TimeoutError):
        return ScrapeError(f"{url} did not answer within {timeout_s:g} s")
    return ScrapeError(f"cannot scrape {url}: {reason}")


def _opener(url: str) -> urllib.request.OpenerDirector:
    # A proxy from the environment must not carry requests to this machine's own servers.
    if urllib.parse.urlsplit(url).hostname in LOOPBACK:
        return _DIRECT
    return _DEFAULT


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_DEFAULT = urllib.request.build_opener()


class Scraper:
    """`start()` scrapes at once and then every `interval_s`; `stop()` takes a last one and returns the log.

    Failed scrapes (after `retries` retries) are counted in the log with the
    last error's message; nothing is raised from the thread.
    """

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 5.0,
                 model_name: str | None = None, retries: int = 2, retry_delay_s: float = 0.2):
        self.url = metrics_url(url)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self._log = ScrapeLog(url=self.url)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape_once(self) -> Snapshot:
        """One snapshot now; raises ScrapeError once the retries are spent."""
        error = None
        for attempt in range(self.retries + 1):
            if attempt and self._stop.wait(self.retry_delay_s * attempt):
                break  # stopping: no more retries
            start = time.time()
            try:
                text = fetch(self.url, self.timeout_s)
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
        self._thread = threading.Thread(target=self._run, name="kvtune-scrape", daemon=True)
        self._thread.start()
        return self

    def stop(self, final_scrape: bool = True) -> ScrapeLog:
        """Stop the thread; with `final_scrape`, one more snapshot so the log covers the run's end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s * (self.retries + 1) + self.interval_s + 1.0)
        if final_scrape:
            self._record()
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
