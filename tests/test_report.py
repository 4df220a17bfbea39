"""`kvtune report`: real studies (Stage1 on the sim target, stage 2 re-runs) turned into Markdown + HTML."""
import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import optuna
import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.entrypoints.flags import add_engine_flags, add_model_flags, config_from_args

from kvtune.plan import plan_capacity
from kvtune.cli.report import add_report_command
from kvtune.report import ReportError, write_report
from kvtune.report.capacity import capacity_for
from kvtune.report.diagnoses import run_diagnoses
from kvtune.report.importance import MIN_TRIALS, param_importance
from kvtune.search.report_data import RunView, load_report_data
from kvtune.results import engine_config
from kvtune.results import RunResult
from kvtune.search import (
    Objective,
    Stage1,
    load_space,
    open_storage,
    open_study,
    parse_slo,
    ranked_trials,
)
from kvtune.search.ranking import FAILED, INFEASIBLE
from kvtune.search.stage2 import LiveConfig, default_params, representable, run_stage2
from kvtune.store import Store
from kvtune.targets import SimTarget
from kvtune.workload import IntDist, SynthSpec, synthesize, write_workload

PRESET, DEVICE = "llama-3-8b", "h100-80gb"
SPACE = ["block_size=16,32", "kv_cache_dtype=auto,fp8", "max_num_seqs=4:64:log", "gpu_memory_utilization=0.85:0.95:0.05"]
BASE = EngineConfig(max_model_len=4096)


def workload():
    """Shared system prompts (so prefix caching shows) at a rate where few running seqs means queueing."""
    return synthesize(SynthSpec(num_requests=80, rate=30.0, input_len=IntDist.uniform(200, 1200),
                                output_len=IntDist.uniform(32, 128), system_prompts=2, system_prompt_len=1024,
                                seed=1))


def build_study(tmp_path, name, slos=("ttft_p95=500ms",), trials=8, objective="goodput", space=SPACE,
                stage2=True, top_k=2, preset=PRESET, device=DEVICE, base=BASE, live=None):
    """What `kvtune search` does, through the same functions, with the sim target playing the live one too
    (`live`, when given, turns each stage-2 result into what a live server would have stored)."""
    db = f"sqlite:///{tmp_path}/{name}.db"
    parsed = tuple(parse_slo(s) for s in slos)
    obj = Objective(objective, parsed)
    sp = load_space(None, list(space))
    store = Store(db)
    attrs = {"workload": str(tmp_path / "absent.jsonl"), "preset": preset, "device": device,
             "slos": [str(s) for s in parsed], "space": {k.name: "" for k in sp.knobs}, "latency": "ttft_p95"}
    study = open_study(open_storage(db), name, obj, "tpe", 0, attrs)
    target = SimTarget(model_preset(preset), device_preset(device))
    stage1 = Stage1(study, sp, base, obj, target.run, workload(), store, trials)
    dflt = default_params(sp, base.resolve(model_preset(preset), device_preset(device)))
    if representable(sp, dflt):
        stage1.enqueue(dflt)
    stage1.optimize()
    if stage2:
        ranked = ranked_trials(study, obj)
        candidates = [LiveConfig(f"trial {t.number}", t.number, dict(t.params)) for t in ranked[:top_k]]
        candidates.append(LiveConfig("default", -1, dflt))
        run = target.run if live is None else (lambda config, w: live(config, target.run(config, w)))
        run_stage2(run, candidates, sp, base, workload(), obj, store, name)
    store.close()
    return db, study


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_stage")
    db, study = build_study(tmp, "two", trials=12)
    md, html = write_report(db, "two", str(tmp / "out"))
    return db, study, md, html


@pytest.fixture(scope="module")
def hopeless(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hopeless")
    db, study = build_study(tmp, "hopeless", slos=("ttft_p95=1ms",), trials=5, stage2=False)
    md, html = write_report(db, "hopeless", str(tmp / "out"))
    return db, study, md, html


def code_blocks(md_text: str) -> list[list[str]]:
    """Each ```bash block as argv (continuation lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)\n```", md_text, re.DOTALL)
    return [shlex.split(b.replace("\\\n", " ")) for b in blocks if not b.startswith("export")]


def command(md_text: str, first_word: str) -> list[str]:
    return next(argv for argv in code_blocks(md_text) if argv[0] == first_word)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def best_live(db, name):
    rows = [r for r in Store(db).list_trials(name, stage="live") if r.state == "COMPLETE"
            and all(v <= 0 for v in (r.constraints or {}).values())]
    return max(rows, key=lambda r: r.values[0])


def section(md_text: str, title: str) -> str:
    start = md_text.index(title)
    nxt = md_text.find("\n## ", start + len(title))
    return md_text[start:] if nxt < 0 else md_text[start:nxt]


def test_writes_markdown_with_its_figures_and_a_self_contained_html(two_stage):
    _, _, md, html = two_stage
    text = md.read_text()
    for png in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (md.parent / png).read_bytes().startswith(b"\x89PNG")
    assert {"history.png", "tradeoff.png", "importance.png", "kv_over_time.png"} <= {
        p.name for p in md.parent.glob("*.png")}
    page = html.read_text()
    links = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]+)""", page, re.IGNORECASE)
    assert links and all(link.startswith("data:") for link in links)
    assert "<link" not in page and page.count("data:image/png;base64,") == text.count("](")
    assert 'class="sortable"' in page and "<script>" in page
    for heading in ("1. Summary", "2. Stage 1", "3. The search", "4. The KV cache", "5. Diagnoses",
                    "6. Capacity plan", "7. Quality note", "Every trial"):
        assert heading in text and heading in page


def test_stage_2_tabulates_each_configs_test_against_the_default_as_the_verdict_judged_it(two_stage):
    db, _, md, _ = two_stage
    verdict = load_report_data(db, "two").verdict
    assert verdict.comparisons and verdict.alpha is not None
    table = section(md.read_text(), "2. Stage 1")
    header = "| config | flags changed | p (one-sided) | beats the default | the test |"
    assert header in table
    rows = [line.split(" | ") for line in table[table.index(header):].splitlines()[2:] if line.startswith("| trial")]
    assert [r[0].strip("| ") for r in rows] == [c.label for c in verdict.comparisons]
    for row, c in zip(rows, verdict.comparisons):
        assert row[2] == (f"{c.p:.2g}" if c.p is not None else "no test (fewer than 2 completed runs, or no gain)")
        assert row[3] == ("yes" if c.beats else "no")


def test_recommends_the_best_live_config_and_its_commands_reproduce_it(two_stage):
    db, _, md, _ = two_stage
    text = md.read_text()
    best = best_live(db, "two")
    assert "✅ **Verdict (measured on" in text
    rec = load_report_data(db, "two").verdict.recommended
    # the best live config, or one tied with it (within 2 %) that changes fewer flags from the default
    rec_row = next(r for r in Store(db).list_trials("two", stage="live") if r.params == rec.params)
    assert rec_row.values[0] >= best.values[0] / 1.02
    p = rec.params
    vllm = command(text, "vllm")
    assert vllm[:3] == ["vllm", "serve", "$MODEL"]
    assert int(flag(vllm, "--block-size")) == p["block_size"]
    assert float(flag(vllm, "--gpu-memory-utilization")) == pytest.approx(p["gpu_memory_utilization"])
    assert int(flag(vllm, "--max-num-seqs")) == p["max_num_seqs"]
    assert flag(vllm, "--kv-cache-dtype") == p["kv_cache_dtype"]
    assert int(flag(vllm, "--max-model-len")) == 4096  # the search's fixed limit travels with it
    sglang = command(text, "python")
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"] and "--host" not in sglang
    assert int(flag(sglang, "--page-size")) == p["block_size"]
    assert int(flag(sglang, "--max-running-requests")) == p["max_num_seqs"]
    assert float(flag(sglang, "--mem-fraction-static")) == pytest.approx(p["gpu_memory_utilization"])
    assert flag(sglang, "--kv-cache-dtype") == {"auto": "auto", "fp8": "fp8_e4m3"}[p["kv_cache_dtype"]]
    engine = command(text, "kvengine")
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    add_engine_flags(parser)
    parser.add_argument("--executor")
    args = parser.parse_args(engine[2:])
    config = config_from_args(args)
    assert (args.preset, args.device) == (PRESET, DEVICE)
    assert {k: getattr(config, k) for k in p} == pytest.approx(p)


def test_stage_comparison_and_default_are_shown(two_stage):
    db, _, md, _ = two_stage
    text = md.read_text()
    stages = section(text, "## 2. Stage 1").split("Each live config against")[0]  # the table of both stages
    live = Store(db).list_trials("two", stage="live")
    assert stages.count("\n| trial ") + stages.count("\n| the default ") == len(live)
    # the summary's table of the recommended config against the default, with both one's live figures
    data = load_report_data(db, "two")
    head, dflt = data.headline, data.default
    assert not head.is_default and f"|  | {head.label} | default | change |" in section(text, "## 1. Summary")
    for row, key in (("goodput", "goodput_rps"), ("throughput", "throughput_rps")):
        shown = [float(cell.split()[0]) for cell in table_row(text, row)[:2]]
        assert shown == pytest.approx([head.figure(key, "live"), dflt.figure(key, "live")], abs=0.006)
    assert "max_num_seqs` 1024" in text  # the default (not in the searched range) ran in stage 2 only
    assert "Diagnoses" in text and "### the default" in section(text, "## 5. Diagnoses")
    capacity = section(text, "## 6. Capacity plan")
    assert "128 KiB" in capacity and "64 KiB" in capacity and "(p99)" in capacity
    assert "reserved max_model_len (4,096)" in capacity


def test_trials_table_lists_every_trial(two_stage):
    db, study, md, _ = two_stage
    table = section(md.read_text(), "### Every trial")
    numbers = {int(m) for m in re.findall(r"^\| sim \| (\d+) \|", table, re.MULTILINE)}
    assert numbers == {t.number for t in study.trials}
    live_runs = [r for r in Store(db).list_runs(study="two") if (r.label or "").startswith("live ")]
    assert len(live_runs) == 3 * len(Store(db).list_trials("two", stage="live"))  # 3 runs of each live config
    assert len(re.findall(r"^\| live \|", table, re.MULTILINE)) == len(live_runs)
    assert "](importance.png)" in md.read_text()  # 12 trials: importance is computed and drawn


def test_no_feasible_config_says_so_first_with_the_closest_and_why(hopeless):
    db, study, md, html = hopeless
    text = md.read_text()
    top = section(text, "## 1. Summary")
    data = load_report_data(db, "hopeless")
    assert data.verdict.kind == INFEASIBLE and data.verdict.stage == "sim" and data.verdict.recommended is None
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    closest = min(done, key=lambda t: (t.user_attrs["score"]["observed"]["ttft_p95"], t.number))
    assert data.verdict.closest.label == f"trial {closest.number}" and f"**trial {closest.number}**" in top
    assert [m.slo for m in data.verdict.misses] == ["ttft_p95"]
    observed_ms = closest.user_attrs["score"]["observed"]["ttft_p95"] * 1000
    shown = f"{observed_ms:,.0f} ms" if observed_ms >= 100 else f"{observed_ms:.1f} ms"
    assert f"TTFT p95 {shown} vs the 1.0 ms limit" in top
    # light traffic: no critical or warning fault explains a 1 ms TTFT, and the top names none
    faults = run_diagnoses(db, data.best_run, data.info.slos)
    assert not [d for d in faults if d.severity in ("critical", "warning")]
    assert not re.search(r"\*\*F\d+\*\*", top)
    assert "Recommended" not in top and "Launch commands (closest config)" in top
    importance = param_importance(study, "goodput")  # 5 trials: too few to rank the knobs, and said so
    assert importance.values is None and importance.note in text and "](importance.png)" not in text
    assert MIN_TRIALS == 10 and str(len(done)) in importance.note
    assert f"<strong>trial {closest.number}</strong>" in html.read_text()  # the HTML has the same top


def test_every_trial_failing_is_reported_with_the_reasons(tmp_path):
    db, _ = build_study(tmp_path, "oom", trials=3, stage2=False,
                        space=[*SPACE[:3], "gpu_memory_utilization=0.10:0.15:0.05"])
    md, _ = write_report(db, "oom", str(tmp_path / "out"))
    text = md.read_text()
    data = load_report_data(db, "oom")
    assert data.verdict.kind == FAILED and data.verdict.stage is None and data.headline is None
    reasons = {t.reason for t in data.trials}
    assert None not in reasons and all(r in section(text, "## 1. Summary") for r in reasons)  # each trial's reason
    assert len(re.findall(r"^\| sim \| \d+ \| failed \|", text, re.MULTILINE)) == 3


def test_multi_objective_draws_the_pareto_front(tmp_path):
    db, _ = build_study(tmp_path, "multi", objective="multi", trials=6, stage2=False)
    md, _ = write_report(db, "multi", str(tmp_path / "out"))
    text = md.read_text()
    assert "Pareto front" in text and (md.parent / "tradeoff.png").exists()


def report_cli(*argv):
    parser = argparse.ArgumentParser()
    add_report_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_cli_unknown_or_empty_study_exits_2_and_lists_the_studies(two_stage, tmp_path, capsys):
    db = two_stage[0]
    assert report_cli("nope", "--db", db, "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "no study 'nope'" in err and "studies: two" in err
    optuna.create_study(study_name="empty", storage=db)
    assert report_cli("empty", "--db", db, "--out", str(tmp_path)) == 2
    assert "has no trials yet" in capsys.readouterr().err
    assert report_cli("two", "--db", f"sqlite:///{tmp_path}/missing.db") == 2
    assert "no database at" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    assert report_cli("two", "--db", db, "--out", str(tmp_path / "r")) == 0
    assert str(tmp_path / "r" / "report.md") in capsys.readouterr().out
    with pytest.raises(ReportError):
        write_report(db, "nope", str(tmp_path))


def test_kvtune_search_ends_with_the_report(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(workload(), str(trace))
    out = tmp_path / "rep"
    p = subprocess.run([sys.executable, "-m", "kvtune", "search", "--workload", str(trace), "--slo", "ttft_p95=500ms",
                        "--max-model-len", "4096", "--target", "none", "--trials", "6", "--study", "cli",
                        "--db", f"sqlite:///{tmp_path}/s.db", "--report-dir", str(out), "--json",
                        *(a for s in SPACE for a in ("--space", s))],
                       check=False, capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    text = (out / "report.md").read_text()
    assert result["report"] == str(out / "report.md") and (out / "report.html").exists()
    assert "(p50)" in text  # the workload file was found: contexts from the trace itself
    if result["feasible"]:
        vllm = command(text, "vllm")
        best = result["recommended"]
        assert int(flag(vllm, "--max-num-seqs")) == best["max_num_seqs"]
        assert int(flag(vllm, "--block-size")) == best["block_size"]
        assert flag(vllm, "--kv-cache-dtype") == best["kv_cache_dtype"]


# ---------------------------------------------------------------- the capacity plan of a live pool

CPU_POOL = 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1
TINY_ELEMENTS = 2 * 4 * 2 * 32  # `tiny`: 2 × layers × kv_heads × head_dim per token


def cpu_vllm_serving_bf16(config, result):
    """What CPU vLLM stores for a bf16 checkpoint with VLLM_CPU_KVCACHE_SPACE=1: its own block size (128),
    its pool of 1 GiB and cache_config_info's figures, whatever the sim (float32 `tiny`) planned."""
    element = 1 if config.kv_cache_dtype.startswith("fp8") else 2
    blocks = CPU_POOL // (TINY_ELEMENTS * element * 128)
    result.target, result.model = "vllm", "/models/tinyllama-bf16"
    result.config |= {"block_size": 128, "num_gpu_blocks": blocks, "kv_cache_size_tokens": blocks * 128,
                      "kv_cache_memory_bytes": CPU_POOL, "launch_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    return result


@pytest.fixture(scope="module")
def live_pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_pool")
    db, _ = build_study(tmp, "cpu", slos=("ttft_p95=5000ms",), trials=4, preset="tiny", device="cpu",
                        space=["block_size=16,32", "kv_cache_dtype=auto,fp8", "max_num_seqs=4:64:log"],
                        live=cpu_vllm_serving_bf16)
    md, _ = write_report(db, "cpu", str(tmp / "out"))
    return db, md.read_text()


def table_row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if re.match(rf"\| {re.escape(label)}( \(p\d+\))? \|", line))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_capacity_plan_of_a_live_run_is_the_servers_pool(live_pool):
    db, text = live_pool
    best = load_report_data(db, "cpu").best_run
    assert best is not None and best.stage == "live"
    cfg = best.result.config
    capacity = section(text, "## 6. Capacity plan")
    auto, fp8 = table_row(capacity, "tokens that fit")
    own = fp8 if cfg["kv_cache_dtype"] == "fp8" else auto
    assert own == f"{cfg['num_gpu_blocks'] * cfg['block_size']:,}"  # the server's tokens, not the planner's
    assert (auto, fp8) == ("1,048,576", "2,097,152")  # bf16 served, though the preset says float32
    assert table_row(capacity, "KV bytes per token") == ["1 KiB", "0.5 KiB"]
    assert table_row(capacity, "KV pool") == ["1.00 GiB", "1.00 GiB"]
    assert "auto (16-bit)" in capacity
    blocks = cfg["num_gpu_blocks"]
    assert f"{blocks:,} blocks of 128 tokens, 1.00 GiB (set by VLLM_CPU_KVCACHE_SPACE=1)" in capacity
    assert "vllm:cache_config_info" in capacity
    # vLLM's concurrency: blocks / ceil(context / block_size), for each context shown
    auto_blocks = CPU_POOL // (TINY_ELEMENTS * 2 * 128)
    contexts = re.findall(r"^\| requests at once, ([\d,]+) tokens", capacity, re.MULTILINE)
    assert contexts
    for context in contexts:
        n = int(context.replace(",", ""))
        assert table_row(capacity, f"requests at once, {context} tokens") == [
            f"{auto_blocks / -(-n // 128):,.1f}", f"{2 * auto_blocks / -(-n // 128):,.1f}"]
    # none of the planner's device-memory arithmetic, and no second pool size
    assert "device memory" not in capacity and "× 0.92" not in capacity and "minus weights" not in capacity
    assert "gpu_memory_utilization" not in capacity
    assert set(re.findall(r"\d+\.\d\d GiB", capacity)) == {"1.00 GiB"}


def test_capacity_plan_of_a_sim_only_study_is_the_planners(hopeless):
    db, _, md, _ = hopeless
    capacity = section(md.read_text(), "## 6. Capacity plan")
    head = load_report_data(db, "hopeless")
    config = engine_config(head.best_run.result.config, head.headline.params)
    model, device = model_preset(PRESET), device_preset(DEVICE)
    plan = plan_capacity(model, device, dataclasses.replace(config, kv_cache_dtype="auto"),
                         [config.resolve(model, device).max_model_len])
    assert f"device memory 80.00 GiB × {config.gpu_memory_utilization:.2f}" in capacity
    assert "minus weights" in capacity and "live server" not in capacity
    assert table_row(capacity, "tokens that fit") == [f"{c.pool_tokens:,}" for c in plan.by_dtype]


def test_capacity_plan_with_a_fixed_pool_says_so_instead_of_utilisation(tmp_path):
    db, _ = build_study(tmp_path, "fixed", trials=3, stage2=False,
                        base=EngineConfig(max_model_len=4096, kv_cache_memory_bytes=8 << 30))
    md, _ = write_report(db, "fixed", str(tmp_path / "out"))
    capacity = section(md.read_text(), "## 6. Capacity plan")
    assert "8.00 GiB (--kv-cache-memory-bytes" in capacity
    assert "device memory" not in capacity and "minus weights" not in capacity
    assert table_row(capacity, "KV pool") == ["8.00 GiB", "8.00 GiB"]
    assert table_row(capacity, "tokens that fit") == [f"{(8 << 30) // (128 << 10) // 16 * 16:,}",
                                                      f"{(8 << 30) // (64 << 10) // 16 * 16:,}"]


def test_capacity_plan_of_an_fp8_live_run_takes_autos_bytes_from_the_studys_auto_run(tmp_path):
    """An fp8 pool says nothing of `auto`'s element size: another live run of the same server, under `auto`, does."""
    db = f"sqlite:///{tmp_path}/runs.db"

    def live_result(dtype: str) -> RunResult:
        return cpu_vllm_serving_bf16(EngineConfig(kv_cache_dtype=dtype), RunResult(
            "sim", "tiny", "cpu", {"kv_cache_dtype": dtype, "max_model_len": 1024}, {}, [], {}, 1.0))

    with Store(db) as store:
        fp8_id, auto_id = store.save_run(live_result("fp8")), store.save_run(live_result("auto"))
        fp8_run = RunView("recommended", "live", fp8_id, store.load_run(fp8_id))
    alone = capacity_for(EngineConfig(block_size=256, kv_cache_dtype="fp8"), "tiny", "cpu", None, None,
                         run=fp8_run).plan
    helped = capacity_for(EngineConfig(block_size=256, kv_cache_dtype="fp8"), "tiny", "cpu", None, None,
                          run=fp8_run, db_url=db, live_run_ids=[fp8_id, auto_id]).plan
    for plan in (alone, helped):
        assert plan.server_pool is not None and plan.by_dtype[1].pool_tokens == 8192 * 128 * 2  # the server's own
        assert plan.config.block_size == 128 and plan.contexts == [1024]
    assert alone.auto_element_bytes == 4 and "assumed" in alone.auto_dtype_source  # the preset's float32
    assert helped.auto_element_bytes == 2 and helped.primary.pool_tokens == 8192 * 128
    assert f"live run {auto_id}" in helped.auto_dtype_source


@pytest.mark.parametrize("auto_bytes, says", [(4, "1 byte per value instead of the model's 4: about four times"),
                                              (2, "instead of the model's 2: about twice"),
                                              (None, "instead of the model's 2 (16-bit, assumed): about twice")])
def test_the_quality_note_counts_fp8s_gain_from_the_models_own_bytes(auto_bytes, says):
    """A float32 model's fp8 cache holds four times the tokens (the demo's tiny model), a 16-bit one's twice."""
    from kvtune.report.sections import quality_section
    lead = quality_section({"auto", "fp8"}, "fp8", auto_bytes)[1].text
    assert says in lead


def test_launch_lines_carry_the_measured_servers_flags_and_label_the_others_untested():
    """A CPU vLLM whose pool came from VLLM_CPU_KVCACHE_SPACE reported its bytes: that is no flag it was
    given (pasted on a GPU host it would pin the pool); SGLang and kvengine were not run; a torch-executor
    engine run's kvengine line says --executor torch."""
    from kvengine.config import EngineConfig
    from kvtune.report.launch import launch_commands

    config = EngineConfig(block_size=16, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 30)
    measured = {"launch_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "launch_server": "vllm", "launch_args": ""}
    vllm, sglang, engine = launch_commands(config, "tiny", "cpu", "/models/tiny", measured)
    assert "--kv-cache-memory-bytes" not in vllm.text and vllm.text.startswith("VLLM_CPU_KVCACHE_SPACE=1 ")
    assert "--kv-cache-dtype fp8" in vllm.text and "untested" not in vllm.note
    assert "vllm serve /models/tiny" in vllm.text  # a console script ran it: the same form
    module = launch_commands(config, "tiny", "cpu", "/models/tiny",
                             measured | {"launch_module": "vllm.entrypoints.openai.api_server"})[0]
    assert module.text.startswith("VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \\\n"
                                  "    --model /models/tiny"), module.text
    assert "untested translation" in sglang.note and "untested translation" in engine.note
    assert "--executor sim" in engine.text
    *_, engine = launch_commands(config, "tiny", "cpu", None, {"launch_server": "engine", "executor": "torch"})
    assert "--executor torch" in engine.text and "untested" not in engine.note and "torch" in engine.note
    assert "--kv-cache-memory-bytes 1073741824" in engine.text  # asked of that server: kept
    *_, engine = launch_commands(config, "tiny", "cpu", None, {})  # a study of the simulator alone
    assert "untested" not in engine.note and "--executor sim" in engine.note  # the simulator measured it


def test_parameter_importance_is_not_drawn_from_differences_within_the_simulators_tie(tmp_path):
    import optuna

    from kvtune.report.importance import param_importance

    study = optuna.create_study(direction="maximize")
    for i in range(12):  # 10.000 to 10.011: within 2 % of each other
        study.enqueue_trial({"block_size": [16, 32][i % 2], "max_num_seqs": 64 + i})
        study.optimize(lambda t: 10.0 + 0.001 * t.suggest_int("max_num_seqs", 64, 128)
                       - 0.064 + 0 * t.suggest_categorical("block_size", [16, 32]), n_trials=1)
    flat = param_importance(study, "goodput")
    assert flat.values is None and "within 2%" in flat.note
    steep = optuna.create_study(direction="maximize")
    for i in range(12):
        steep.enqueue_trial({"block_size": [16, 32][i % 2], "max_num_seqs": 64 + i})
        steep.optimize(lambda t: t.suggest_categorical("block_size", [16, 32]) / 16.0
                       + 0 * t.suggest_int("max_num_seqs", 64, 128), n_trials=1)
    assert param_importance(steep, "goodput").values is not None
