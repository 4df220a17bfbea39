"""kvtune.report.plots, the one chart module: each chart is a Figure that renders to PNG for its data, and None
when there is nothing to draw."""
import dataclasses
import subprocess
import sys

import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from matplotlib.figure import Figure

from kvtune.plan import plan_capacity
from kvtune.report import plots
from kvtune.results import RunResult
from kvtune.search.measurement import Measurement
from kvtune.search.report_data import RunView

SERIES = {"time": [0.0, 0.5, 1.0, 1.5, 2.0], "kv_usage": [0.1, 0.5, None, 0.9, 0.2],
          "num_running": [1, 2, 3, 4, 5], "num_waiting": [0, 0, 1, 0, 0],
          "num_preemptions": [0, 1, 0, 2, 0], "prefix_queries": [10, 0, 10, 10, 0], "prefix_hits": [5, 0, 0, 4, 0]}


def trial(number: int, throughput: float, ttft_s: float, state: str = "COMPLETE") -> Measurement:
    return Measurement("sim", number, {"block_size": 16}, state, values=[throughput] if state == "COMPLETE" else None,
                       constraints={"ttft_p95": ttft_s - 0.5}, throughput_rps=throughput,
                       observed={"ttft_p95": ttft_s}, reason=None if state == "COMPLETE" else "out of memory")


TRIALS = [trial(0, 10.0, 0.3), trial(1, 14.0, 0.9), trial(2, 0.0, 0.0, "FAIL"), trial(3, 12.0, 0.2)]


def run_view(series: dict) -> RunView:
    return RunView("recommended", "sim", 1, RunResult("sim", "llama-3-8b", "h100-80gb", {}, {}, [], series, 2.0))


def capacity_plan():
    return plan_capacity(model_preset("llama-3-8b"), device_preset("h100-80gb"), EngineConfig(), [1024, 4096])


CHARTS = {  # name: (its data, nothing to draw)
    "history": (lambda: plots.history(TRIALS, "goodput (req/s)"), lambda: plots.history([], "goodput (req/s)")),
    "tradeoff": (lambda: plots.tradeoff(TRIALS, "ttft_p95", {0, 3}, 0.5), lambda: plots.tradeoff([], "ttft_p95",
                                                                                                   set(), None)),
    "pareto": (lambda: plots.pareto(plots.tradeoff_points(TRIALS, "ttft_p95"), [1, 3], "TTFT p95", 0.5),
               lambda: plots.pareto([], [], "TTFT p95", None)),
    "importance": (lambda: plots.importance({"max_num_seqs": 0.7, "block_size": 0.3}), lambda: plots.importance({})),
    "kv_over_time": (lambda: plots.kv_over_time([run_view(SERIES)]), lambda: plots.kv_over_time([run_view({})])),
    "timeline": (lambda: plots.timeline(SERIES), lambda: plots.timeline({"time": []})),
    "lengths": (lambda: plots.lengths([100, 800, 1200], [32, 64, 128]), lambda: plots.lengths([], [])),
    "capacity": (lambda: plots.capacity(capacity_plan()),
                 lambda: plots.capacity(dataclasses.replace(capacity_plan(), by_dtype=[]))),
}


@pytest.mark.parametrize("name", list(CHARTS))
def test_each_chart_is_a_figure_for_data_and_none_for_nothing(name):
    drawn, empty = CHARTS[name]
    figure = drawn()
    assert isinstance(figure, Figure)
    assert plots.png(figure).startswith(b"\x89PNG")
    assert empty() is None


def test_tradeoff_points_skip_failed_and_repeated_trials():
    repeat = dataclasses.replace(trial(4, 12.0, 0.2), duplicate_of=3)
    points = plots.tradeoff_points([*TRIALS, repeat], "ttft_p95")
    assert [(t.number, x, y) for t, x, y in points] == [(0, 10.0, 0.3), (1, 14.0, 0.9), (3, 12.0, 0.2)]


def test_binned_keeps_peaks_and_totals():
    s = plots.binned(SERIES, max_points=2)
    assert list(s["time"]) == [1.0, 2.0]
    assert list(s["kv_usage"]) == [0.5, 0.9] and list(s["num_running"]) == [2, 5]  # gaps (None) skipped
    assert list(s["preemptions"]) == [1, 2] and list(s["preemptions_total"]) == [1, 3]
    assert list(s["hit_rate"]) == [0.5, 0.3]  # so far: 5 of 10, then 9 of 30
    sparse = plots.binned({"time": [0.0, 0.1, 10.0], "kv_usage": [0.2, 0.4, 0.6]}, max_points=100)
    assert list(sparse["kv_usage"]) == [0.4, 0.6]  # the empty bins between are skipped, not drawn as gaps
    assert all(len(v) == 0 for v in plots.binned({}).values())


def test_drawing_never_imports_pyplot():
    """pyplot would switch the backend of the process that imports the report."""
    code = ("import sys; from kvtune.report import plots; "
            f"plots.png(plots.timeline({SERIES!r})); print('matplotlib.pyplot' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_history_within_the_simulators_tie_says_so_and_magnifies_nothing():
    level = [trial(i, 10.0 + 0.0003 * i, 0.3) for i in range(5)]
    ax = plots.history(level, "goodput (req/s)").axes[0]
    assert "within 2%, the simulator's tie" in ax.get_title()
    low, high = ax.get_ylim()
    assert low <= 0 and high >= 10.0  # the axis starts at 0: no offset axis blowing up 0.0003 req/s
    spread = plots.history(TRIALS, "goodput (req/s)").axes[0]
    assert "tie" not in spread.get_title()
