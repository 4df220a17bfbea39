"""dashboards/prometheus/alerts.yml: the fault card as Prometheus alerts, checked by promtool."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parent.parent / "dashboards" / "prometheus"
RULES, RULE_TESTS = PROMETHEUS / "alerts.yml", PROMETHEUS / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: `apt-get install -y --no-install-recommends "
                             "prometheus` (Debian/Ubuntu) or a release from https://prometheus.io/download/")


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_card_faults_are_alerts():
    faults = {rule["labels"]["fault"] for rule in alerts()}
    assert {"F1", "F2", "F3", "F4", "F6", "F8"} <= faults
    assert {"F5", "F7"} <= faults  # as far as the metrics allow (see the file's header)


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook_with_the_fix():
    for rule in alerts():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        notes = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(notes), rule["alert"]
        assert notes["runbook"].startswith(rule["labels"]["fault"]), rule["alert"]
        assert re.search(r"--[a-z-]+", notes["runbook"]) or "prompt" in notes["runbook"], rule["alert"]


def test_alerts_use_vllm_metric_names():
    text = RULES.read_text()
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in text
    for gone in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"):  # removed from vLLM
        assert gone not in text


def test_every_alert_has_a_promtool_unit_test():
    tested = set(re.findall(r'alertname="([A-Za-z0-9]+)"', RULE_TESTS.read_text()))
    untested = {rule["alert"] for rule in alerts()} - tested
    assert untested <= {"GPUMemoryNearFull"}  # DCGM's metric, not vLLM's


@needs_promtool
def test_promtool_check_rules():
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_fire_each_fault_on_synthetic_series():
    done = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                          timeout=120, cwd=PROMETHEUS, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
