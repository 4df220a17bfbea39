"""Live page: scrape a running server's /metrics every few seconds, chart it, and keep its diagnosis current.

The one page that reaches outside the database, and only to read /metrics:
nothing is stored (`kvtune diagnose --url` or `kvtune run --target URL` store).
The snapshots live in the browser session's state.
"""
from __future__ import annotations

import streamlit as st

from kvtune.diagnose import diagnose
from kvtune.targets.watch import WatchError, history, result_from_scrape
from kvtune.report import fmt
from kvtune.scrape import ScrapeError, ScrapeLog, Scraper
from kvtune.ui import charts, runs, tables, widgets

MAX_SNAPSHOTS = 3600  # an hour at one a second: older ones are dropped
STATE = "live_watch"
WATCHING = "live_on"


def check_url(text: str) -> str:
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected a server URL such as http://127.0.0.1:8000, got {text!r}")
    return url


def scrape_into(watch: dict) -> None:
    """One scrape appended to the watch; a failure is counted, never raised."""
    try:
        snapshot = Scraper(watch["url"], timeout_s=5.0, retries=0).scrape_once()
    except ScrapeError as err:
        watch["errors"] += 1
        watch["last_error"] = str(err)
        return
    watch["snapshots"] = (watch["snapshots"] + [snapshot])[-MAX_SNAPSHOTS:]


def start_watch(url: str, prometheus_text: str, last_s: float, step_s: float) -> dict:
    """A new watch of `url`: empty, to scrape live, or filled from Prometheus' last `last_s` seconds."""
    watch = {"url": url, "snapshots": [], "errors": 0, "last_error": None, "source": f"{url}/metrics"}
    if prometheus_text.strip():
        prometheus = check_url(prometheus_text)
        watch["snapshots"] = history(prometheus, url, last_s, step_s).snapshots[-MAX_SNAPSHOTS:]
        watch["source"] = f"{url} in Prometheus at {prometheus}, its last {last_s:g} s"
        watch["history"] = True
    return watch


def stop_watch() -> None:
    st.session_state[WATCHING] = False


def render() -> None:
    st.title("Live")
    st.caption("Scrape a running vLLM, SGLang or kvengine server's /metrics, chart it as it updates and "
               "diagnose what it shows. Nothing is stored.")
    state = st.session_state
    cols = st.columns([3, 1, 1, 1], vertical_alignment="bottom")
    url_text = cols[0].text_input("Server URL", placeholder="http://127.0.0.1:8000", key="live_url")
    interval = cols[1].number_input("Every (s)", 0.5, 60.0, 2.0, 0.5, key="live_interval")
    past = st.columns([3, 1], vertical_alignment="bottom")
    prom_text = past[0].text_input("Or read its history from Prometheus (optional)",
                                   placeholder="http://127.0.0.1:9090", key="live_prometheus")
    last = past[1].number_input("Last (s)", 10, 7 * 86400, 3600, 60, key="live_last")
    if cols[2].button("Start", key="live_start", type="primary"):
        try:
            state[STATE] = start_watch(check_url(url_text), prom_text, float(last), float(interval))
            state[WATCHING] = not prom_text.strip()  # a history is read once
        except (ValueError, WatchError) as err:
            st.error(str(err))
    # A callback, not the click's return value: a click's trigger lasts one script run, and the
    # fragment's own timed rerun, which does not draw this button, can be the run that consumes it.
    cols[3].button("Stop", key="live_stop", on_click=stop_watch)
    if STATE not in state:
        st.info("Enter the address of a running server (its /metrics is read) and press Start.")
        return
    st.fragment(run_every=interval if state.get(WATCHING) else None)(watch_view)()


def watch_view() -> None:
    watch = st.session_state[STATE]
    on = st.session_state.get(WATCHING, False)
    if on:
        scrape_into(watch)
    log = ScrapeLog(list(watch["snapshots"]), watch["url"], watch["errors"], watch["last_error"])
    verb = "Read" if watch.get("history") else "Watching" if on else "Stopped watching"
    st.caption(f"{verb} {watch['source']}: {len(log)} scrapes"
               + (f", {log.errors} failed" if log.errors else "") + ".")
    if log.last_error:
        st.warning(f"Last failed scrape: {log.last_error}")
    if not log.snapshots:
        return
    result = result_from_scrape(log, watch["url"])
    series, latest = result.series, log.snapshots[-1]
    cols = st.columns(5)
    cols[0].metric("Running", fmt.count(latest.get("running")))
    cols[1].metric("Waiting", fmt.count(latest.get("waiting")))
    cols[2].metric("KV usage", fmt.pct(latest.get("kv_usage")))
    queries, hits = sum(series.get("prefix_queries") or ()), sum(series.get("prefix_hits") or ())
    cols[3].metric("Prefix hit rate", fmt.pct(hits / queries if queries else None))
    cols[4].metric("Preemptions", fmt.count(sum(series.get("num_preemptions") or ())))
    figure = charts.timeline(series)
    if figure is not None:
        charts.show(figure)
    st.subheader("Latency from the server's histograms")
    frame = runs.latency_frame(result.summary)
    tables.table(frame[["latency", "server p50", "server p95", "server p99"]], key="live_latency")
    st.subheader("Diagnosis")
    widgets.diagnosis_cards(diagnose(result), key="live")


if __name__ == "__main__":
    render()
