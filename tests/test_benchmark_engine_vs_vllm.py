"""benchmarks/engine_vs_vllm.py without servers: the gating's block arithmetic, its lock-step test,
the /metrics parser and the greedy agreement."""
from pathlib import Path

import httpx
import pytest
from benchscript import load_benchmark
from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("engine_vs_vllm")


@pytest.mark.parametrize("name", ["tight", "shared"])
def test_the_gates_hold_the_pool_and_never_outgrow_it(bench, name):
    g = bench.gate_blocks(bench.SETS[name])
    assert g["usable"] - g["gates_prefilled"] < g["first_request"]  # the set cannot be admitted
    assert g["gates_done"] <= g["usable"]  # the gates never preempt
    assert g["gates_max_len"] <= bench.DECISION_MAX_LEN
    assert 512 < g["p_step_tokens"] <= 1024 < g["gate_step_tokens"] <= 2048  # the buckets the test reads


def test_only_the_tight_set_overflows_the_pool(bench):
    assert bench.gate_blocks(bench.SETS["tight"])["workload_alone"] > 63
    assert bench.gate_blocks(bench.SETS["shared"])["workload_alone"] <= 63


def _state(bench, steps_since_p, waiting, running, tokens_extra=0, ones=0):
    """A scrape's samples after P's step, the gates' common prefill and steps_since_p - 2 decodes."""
    spec = bench.SETS["shared"]
    buckets = {1.0: ones, 8.0: steps_since_p - 2 - ones, 512.0: 0, 1024.0: 1, 2048.0: 1}
    cum, m = 0, {}
    for le in sorted(buckets):
        cum += buckets[le]
        m[("vllm:iteration_tokens_total_bucket", (("le", str(le)),))] = float(cum)
    m[("vllm:iteration_tokens_total_count", ())] = float(steps_since_p)
    m[("vllm:iteration_tokens_total_sum", ())] = float(
        1024 + sum(spec["gate_lens"]) + 2 + 2 * (steps_since_p - 2) + tokens_extra)
    m[("vllm:num_requests_waiting", ())] = float(waiting)
    m[("vllm:num_requests_running", ())] = float(running)
    return spec, m


def test_gate_state_accepts_lock_step_and_rejects_the_rest(bench):
    empty = {}
    spec, m = _state(bench, 40, 24, 2)
    assert bench._gate_state(m, empty, spec)
    spec, m = _state(bench, 1 + spec["gate_out"], 24, 0)  # the gates' last step: still before the set's
    assert bench._gate_state(m, empty, spec)
    assert not bench._gate_state(_state(bench, 40, 23, 2)[1], empty, spec)  # one request not queued yet
    assert not bench._gate_state(_state(bench, 40, 24, 2, tokens_extra=1)[1], empty, spec)  # P shared a step
    assert not bench._gate_state(_state(bench, 40, 24, 2, ones=1)[1], empty, spec)  # a gate decoded alone
    assert not bench._gate_state(_state(bench, 2 + spec["gate_out"], 24, 2)[1], empty, spec)


def test_scrape_reads_what_prometheus_client_reads(bench, monkeypatch):
    text = (DATA / "vllm-preempt-after.txt").read_text()
    url = "http://metrics.test"
    monkeypatch.setitem(bench._CLIENTS, url, httpx.Client(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, text=text))))
    got = bench.scrape(url)
    want = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:"):
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))
                want[key] = want.get(key, 0.0) + s.value
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]) for k in want)
    assert bench.metric(got, "vllm:num_preemptions_total") == bench.metric(want, "vllm:num_preemptions_total")
    only = bench.scrape(url, bench.GATE_METRICS)
    assert {k[0] for k in only} <= {"vllm:num_requests_waiting", "vllm:num_requests_running",
                                    "vllm:iteration_tokens_total_bucket", "vllm:iteration_tokens_total_count",
                                    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_created"}
    assert bench.bucket(only, 2048) == bench.bucket(got, 2048)


def test_agreement_counts_up_to_the_first_difference(bench):
    assert bench.agreement([["a", "b", "c"], ["x", "y"]], [["a", "b", "d"], ["x", "y"]]) == pytest.approx(4 / 5)
