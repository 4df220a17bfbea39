"""The bundled Grafana dashboard as the tests read it: its panels and queries, and its template
variables replaced as Grafana would replace them (tests/test_ops_stack.py checks the queries parse,
tests/test_prometheus_real.py runs them on a real Prometheus)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "grafana" / "kvtune.json"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(board: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    return [p for top in board["panels"] for p in (top, *top.get("panels", []))]


def panel_queries(board: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of every panel."""
    return [(p, t) for p in dashboard_panels(board) for t in p.get("targets", [])]


def grafana_to_promql(expr: str, job: str = ".*", model: str = ".*", range_s: float = 3600,
                      interval_s: float = 15, rate_interval: str = "1m") -> str:
    """Grafana's template variables replaced as Grafana would for one job and one model (every one
    by default), a dashboard range of `range_s` and a scrape interval of `interval_s`."""
    assert job == ".*" or re.fullmatch(r"[\w.-]+", job), "a name Grafana would have to regex-escape"
    assert model == ".*" or re.fullmatch(r"[\w.-]+", model), "a name Grafana would have to regex-escape"
    values = {"$__rate_interval": rate_interval, "$__interval": f"{interval_s:g}s",
              "$__range": f"{math.ceil(range_s)}s", "$job": job, "$model_name": model}
    for var in sorted(values, key=len, reverse=True):  # $__range before a shorter name it starts with
        expr = expr.replace(var, values[var])
    assert "$" not in expr, f"a template variable the test does not know: {expr}"
    return expr
