"""The report's "What was measured, where, when": a real `kvtune search` study, its report, and the host facts."""
import json
import os
import re
import subprocess
import sys
from importlib import metadata

import optuna
import pytest

from kvtune.environment import host_environment
from kvtune.report import write_report
from kvtune.report.context import ENVIRONMENT_ATTR
from kvtune.search.report_data import load_report_data
from kvtune.store import Store
from kvtune.workload import (
    TraceRequest,
    Workload,
    read_workload,
    workload_stats,
    write_workload,
)

REQUESTS, GAP_S, BLOCK = 21, 0.1, 16
PROMPT_P50 = 96 + BLOCK * (REQUESTS // 2)  # lengths 96, 112, ... : the middle one
SHARED = (1, 2, 3, 4)  # a 64-token system prompt every request starts with
SPACE = ["block_size=16,32", "kv_cache_dtype=auto", "max_num_seqs=4:32:log", "gpu_memory_utilization=0.9"]
SECTION = "## What was measured, where, when"


def trace() -> Workload:
    requests = []
    for i in range(REQUESTS):
        length = 96 + BLOCK * i
        own = tuple(1000 + 100 * i + j for j in range(length // BLOCK - len(SHARED)))
        requests.append(TraceRequest(arrival_s=i * GAP_S, input_length=length, output_length=8 + i,
                                     hash_ids=SHARED + own))
    return Workload(requests, hash_block_size=BLOCK, source="context")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("context")
    path = tmp / "trace.jsonl"
    write_workload(trace(), str(path))
    db = f"sqlite:///{tmp}/s.db"
    p = subprocess.run([sys.executable, "-m", "kvtune", "search", "--workload", str(path), "--target", "none",
                        "--trials", "6", "--preset", "tiny", "--device", "cpu", "--max-model-len", "2048",
                        "--study", "ctx", "--db", db, "--no-report", *(a for s in SPACE for a in ("--space", s))],
                       check=False, capture_output=True, text=True, timeout=120,
                       env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    return tmp, path, db


def section(text: str) -> str:
    start = text.index(SECTION)
    return text[start:text.index("\n## ", start + len(SECTION))]


def row(text: str, label: str) -> str:
    m = re.search(rf"^\| {re.escape(label)} \| (.*?) \|$", text, re.MULTILINE)
    assert m, f"no row {label!r} in\n{text}"
    return m.group(1)


def versions(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("- **Versions**"))


def stored_run_named(text: str, db: str) -> int:
    """The stored run whose workload figures the section says it shows (the trace file is not usable)."""
    data = load_report_data(db, "ctx")
    named = [int(n) for n in re.findall(r"\bsim run (\d+) ", text)]
    assert len(named) == 1 and named[0] in {r.run_id for r in (data.best_run, data.default_run) if r}, text
    return named[0]


def test_workload_figures_match_the_trace_with_their_units(study):
    tmp, path, db = study
    md, html = write_report(db, "ctx", str(tmp / "plain"))
    text = section(md.read_text())
    assert f"`{path}`" in text and not re.search(r"\bsim run \d+ ", text)  # the file, read again; no stored run
    assert row(text, "requests") == str(REQUESTS)
    assert row(text, "prompt length p50") == f"{PROMPT_P50} tokens"
    assert row(text, "prompt length max") == f"{96 + BLOCK * (REQUESTS - 1)} tokens"
    assert row(text, "output length max") == f"{8 + REQUESTS - 1} tokens"
    assert row(text, "mean arrival rate") == f"{1 / GAP_S:.2f} req/s"
    assert row(text, "duration (first to last arrival)") == f"{(REQUESTS - 1) * GAP_S:.3g} s"
    block = int(re.search(r"ideal prefix-cache hit rate \((\d+)-token blocks", text).group(1))
    ideal = workload_stats(read_workload(str(path)), block_size=block)["ideal_prefix_hit_rate"]
    assert 0 < ideal < 1
    shown = row(text, f"ideal prefix-cache hit rate ({block}-token blocks, unbounded cache)")
    assert float(shown.split(" %")[0]) == pytest.approx(ideal * 100, abs=0.05)
    assert versions(text).count(f"kvtune {metadata.version('kvtune')}") == 2  # wrote the report, ran the search
    assert re.search(r"\*\*Report written\*\* \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", text)
    assert re.search(r"\*\*Stage 1 ran\*\* from .* UTC to .* UTC \([\d.,]+ (s|min|h)\b.*, 6 trials\)", text)
    assert "`cpu` (16.00 GiB" in text and load_report_data(db, "ctx").live == []  # stage 1 only
    assert "**Search host**" in text and "not recorded" not in text  # the search stored where it ran
    m = re.search(r"peak KV usage ([\d.]+) % of the pool \(([\d.]+) % headroom\), measured on the simulator", text)
    assert m and float(m.group(1)) + float(m.group(2)) == pytest.approx(100, abs=0.11)
    pool = re.search(r"holds ([\d,]+) tokens \(([\d,]+) blocks × (\d+) tokens, [^)]*\): about ([\d,]+) tokens\D*"
                     r"([\d,]+) tokens free", text)
    assert pool, text
    tokens, blocks, block_size, used, free = (int(g.replace(",", "")) for g in pool.groups())
    assert tokens == blocks * block_size and used + free == (blocks - 1) * block_size  # less vLLM's null block
    data = load_report_data(db, "ctx")
    peak = data.headline.measured.summary.get("kv_usage_peak") or data.best_run.result.summary["kv_usage_peak"]
    assert used == round(peak * (blocks - 1)) * block_size  # the headline config's measured peak
    assert SECTION.removeprefix("## ") in html.read_text()
    assert md.read_text().index(SECTION) < md.read_text().index("## 2.")  # right after the summary


def test_hardware_from_the_studys_environment(study):
    tmp, _, db = study
    env = host_environment()
    storage = optuna.storages.RDBStorage(db)
    stored = optuna.load_study(study_name="ctx", storage=storage).user_attrs[ENVIRONMENT_ATTR]
    optuna.load_study(study_name="ctx", storage=storage).set_user_attr(ENVIRONMENT_ATTR, None)
    try:
        bare, _ = write_report(db, "ctx", str(tmp / "bare"))
    finally:
        optuna.load_study(study_name="ctx", storage=storage).set_user_attr(ENVIRONMENT_ATTR, stored)
    assert "**Search host**: not recorded" in section(bare.read_text())  # a study from before kvtune stored it
    md, _ = write_report(db, "ctx", str(tmp / "env"))
    text = section(md.read_text())
    host = next(line for line in text.splitlines() if line.startswith("- **Search host**"))
    assert "not recorded" not in host
    assert f"{env['cpu_count']} logical cores" in host and " GiB memory" in host and "no GPU" in host
    assert versions(text).count(f"kvtune {env['kvtune']}") == 2 and f"Python {env['python']}" in versions(text)
    assert versions(section(bare.read_text())).count("kvtune ") == 1  # no search version without the environment
    # the host's UTC offset was recorded: Stage 1's times need no caveat after them
    assert isinstance(stored["utc_offset_s"], int)
    assert next(line for line in text.splitlines() if "**Stage 1 ran**" in line).endswith(" trials).")


def test_workload_from_the_stored_run_when_the_trace_is_gone(study):
    tmp, path, db = study
    moved = tmp / "elsewhere.jsonl"
    os.replace(path, moved)
    try:
        md, _ = write_report(db, "ctx", str(tmp / "moved"))
    finally:
        os.replace(moved, path)
    text = section(md.read_text())
    stored_run_named(text, db)  # figures as a stored run measured them
    assert f"`{path}`" in text  # the file that is not here, named
    assert row(text, "requests") == str(REQUESTS)
    assert row(text, "prompt length p50") == f"{PROMPT_P50} tokens"


def test_a_trace_changed_since_the_search_is_not_passed_off_as_the_one_measured(study):
    tmp, path, db = study
    kept = path.read_bytes()
    changed = trace()
    write_workload(changed.with_requests(changed.requests[:5]), str(path))
    try:
        md, _ = write_report(db, "ctx", str(tmp / "changed"))
    finally:
        path.write_bytes(kept)
    text = section(md.read_text())
    # the stored run's figures, not the changed file's; the file named, with what it holds now
    run_id = stored_run_named(text, db)
    assert f"`{path}`" in text and "5 requests" in text
    assert row(text, "requests") == str(REQUESTS)
    with Store(db) as store:
        assert store.load_run(run_id).workload["requests"] == REQUESTS


def test_host_environment_has_sane_facts():
    env = host_environment()
    assert env["kvtune"] == metadata.version("kvtune")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", env["python"])
    assert isinstance(env["cpu_count"], int) and env["cpu_count"] >= 1
    assert env["cpu_affinity"] is None or 1 <= env["cpu_affinity"] <= env["cpu_count"]
    assert isinstance(env["memory_total_bytes"], int) and env["memory_total_bytes"] > 0
    assert isinstance(env["cpu_model"], str) and env["cpu_model"]
    assert env["os"] and env["kernel"]
    assert env["packages"].get("torch") == metadata.version("torch")
    assert isinstance(env["utc_offset_s"], int)
    assert isinstance(env["gpus"], list) and env["gpu_status"]
    if env["gpu_status"].startswith("no GPU"):
        assert env["gpus"] == []
    else:
        assert all(g["memory_total_bytes"] > 0 and g["name"] for g in env["gpus"])
    assert json.loads(json.dumps(env)) == env  # what the study stores as a user attr
