"""kvtune's one HTTP client: httpx, for scrapes, health checks, the Prometheus API and probes.

Loopback servers (the ones kvtune starts) are never reached through a proxy from the
environment; another machine is reached as the environment says. Not named `http.py`: Locust
puts the locustfile's folder (kvtune/) on sys.path, where that would shadow the standard
library's `http` for everything Locust imports.
"""
from __future__ import annotations

import functools
import ssl
import urllib.parse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Whatever a request through httpx can fail with: its transport and status errors, and a URL it cannot send to.
HTTP_ERRORS = (httpx.HTTPError, httpx.InvalidURL)


def is_loopback(url: str) -> bool:
    return urllib.parse.urlsplit(url).hostname in LOOPBACK


def http_client(url: str, timeout: float | httpx.Timeout, **kwargs) -> httpx.Client:
    """An httpx.Client for the server at `url`. Redirects are followed (as urllib and requests
    did). A proxy from the environment must not carry requests to this machine's own servers:
    for a loopback `url` the environment is not read (trust_env=False); another machine is
    reached as the environment says (HTTP(S)_PROXY, NO_PROXY, SSL_CERT_FILE). A loopback client
    shares one SSL context: building one loads the CA bundle, a core's work of tens of
    milliseconds, and a health check polls several times a second."""
    if not is_loopback(url):
        return httpx.Client(timeout=timeout, follow_redirects=True, **kwargs)
    return httpx.Client(timeout=timeout, follow_redirects=True, trust_env=False, verify=loopback_ssl(), **kwargs)


@functools.cache
def loopback_ssl() -> ssl.SSLContext:
    """httpx's default context (certifi's CAs, no environment read), made once per process."""
    return httpx.create_ssl_context(trust_env=False)


def http_get(url: str, timeout: float | httpx.Timeout, **kwargs) -> httpx.Response:
    """One GET of `url` on a client of its own (no connection kept); httpx's errors are raised."""
    with http_client(url, timeout) as client:
        return client.get(url, **kwargs)
