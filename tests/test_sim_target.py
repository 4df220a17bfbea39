"""The sim target and `kvtune run`: replays whose numbers can be checked by hand."""
import json

import pytest

from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.executor.cost import StepShape, StepCost
from kvtune.results import RunResult
from kvtune.targets import SimTarget, TargetStartError
from kvtune.workload import TraceRequest, Workload, write_workload
from kvtune_cli import kvtune

MODEL, DEVICE = model_preset("llama-3-8b"), device_preset("h100-80gb")


def run(requests, config=None, hash_block_size=512):
    return SimTarget(MODEL, DEVICE).run(config or EngineConfig(), Workload(requests, hash_block_size))


def test_one_request_alone_ttft_is_one_prefill_step():
    result = run([TraceRequest(0.0, 1000, 3)])
    rec = result.requests[0]
    cost = StepCost.build(MODEL, DEVICE, "auto", 16)
    assert rec.ttft_s == pytest.approx(cost.step_time(StepShape(1000, 1, 1000, 1000 * 1001 // 2, 1, 1)))
    assert rec.output_tokens == 3 and len(rec.itl_s) == 2 and rec.queue_s == 0
    assert result.summary["completed"] == 1 and result.summary["prefix_hit_rate"] == 0.0


def test_two_identical_prompts_the_second_is_cached():
    same = (1, 2)
    result = run([TraceRequest(0.0, 1000, 2, hash_ids=same), TraceRequest(5.0, 1000, 2, hash_ids=same)])
    first, second = result.requests
    assert first.cached_tokens == 0
    assert second.cached_tokens == 992  # 62 full blocks of 16; the last token is recomputed
    assert second.ttft_s < first.ttft_s
    assert result.summary["prefix_hit_rate"] == pytest.approx(992 / 2000)
    assert result.summary["ideal_prefix_hit_rate"] == pytest.approx(992 / 2000)


def test_mooncake_style_shared_hash_ids_give_prefix_hits():
    # 40 requests share a 2-block (1024-token) system prefix, each with its own tail.
    reqs = [TraceRequest(i * 0.5, 1024 + 300, 50, hash_ids=(7, 8, 100 + i)) for i in range(40)]
    result = run(reqs)
    s = result.summary
    assert s["prefix_hit_rate"] > 0.7
    assert s["prefix_hit_rate"] == pytest.approx(s["ideal_prefix_hit_rate"], abs=0.01)
    assert sum(r.cached_tokens for r in result.requests) == 39 * 1024


def test_rejected_prompts_are_counted_not_dropped():
    result = run([TraceRequest(0.0, 100, 5), TraceRequest(0.1, 5000, 5)],
                 EngineConfig(max_model_len=4096))
    assert [r.finish_reason for r in result.requests] == ["length", "rejected"]
    assert "longer than the maximum model length" in result.requests[1].error
    assert result.summary["rejected"] == 1 and result.summary["completed"] == 1


def test_start_failure_is_a_target_error():
    with pytest.raises(TargetStartError, match="gpu_memory_utilization"):
        SimTarget(MODEL, device_preset("l4-24gb")).run(
            EngineConfig(gpu_memory_utilization=0.5), Workload([TraceRequest(0.0, 10, 1)]))


def test_run_result_round_trips_through_json(tmp_path):
    result = run([TraceRequest(0.0, 200, 4), TraceRequest(0.2, 300, 6)])
    path = tmp_path / "run.json"
    result.write_json(str(path))
    back = RunResult.read_json(str(path))
    assert back.summary == result.summary
    assert back.requests[1].itl_s == result.requests[1].itl_s
    assert set(back.series) >= {"time", "num_running", "num_waiting", "kv_usage", "num_preemptions",
                                "prefix_queries", "prefix_hits"}


def test_kvtune_run_cli(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(i * 0.1, 600, 20, hash_ids=(1, 2 + i)) for i in range(30)]), str(trace))
    out = tmp_path / "run.json"
    p = kvtune("run", "--target", "sim", "--workload", str(trace), "--preset", "llama-3-8b",
               "--device", "h100-80gb", "--block-size", "32", "--max-num-seqs", "64",
               "--kv-cache-dtype", "fp8", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("throughput_rps", "output_tok_s", "ttft_p95", "tpot_p95", "prefix_hit_rate",
                "ideal_prefix_hit_rate", "preemptions", "kv_usage_peak"):
        assert key in summary
    assert summary["completed"] == 30 and summary["prefix_hit_rate"] > 0.4
    saved = json.loads(out.read_text())
    assert saved["config"]["block_size"] == 32 and saved["config"]["kv_cache_dtype"] == "fp8"
    assert "TTFT".lower() in p.stdout and "prefix hits" in p.stdout


def test_kvtune_run_bad_input_writes_nothing(tmp_path):
    out = tmp_path / "run.json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 1, "input_length": -3}\n')
    p = kvtune("run", "--workload", str(bad), "--out", str(out))
    assert p.returncode == 2 and "bad.jsonl:2" in p.stderr and not out.exists()
    p = kvtune("run", "--workload", str(tmp_path / "missing.jsonl"), "--out", str(out))
    assert p.returncode == 2 and "missing.jsonl" in p.stderr and not out.exists()
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n')
    p = kvtune("run", "--workload", str(good), "--device", "l4-24gb", "--gpu-memory-utilization", "0.5",
               "--out", str(out))
    assert p.returncode == 1 and "cannot start" in p.stderr and not out.exists()
    p = kvtune("run", "--workload", str(good), "--max-num-seqs", "0")
    assert p.returncode == 2 and "--max-num-seqs" in p.stderr


def test_help_on_every_command(capsys):
    p = kvtune("--help")  # the real entry point once; the parser it builds for the rest
    assert p.returncode == 0 and "usage: kvtune" in p.stdout
    from kvtune.cli import build_parser
    from kvtune.cli.commands import COMMANDS
    commands = [[name] for name in COMMANDS] + [["trace", sub] for sub in ("stats", "convert", "synth")]
    assert len(commands) >= 11
    for cmd in commands:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([*cmd, "--help"])
        assert done.value.code == 0 and f"usage: kvtune {' '.join(cmd)}" in capsys.readouterr().out, cmd


def test_a_frontend_overhead_on_an_idle_server_moves_ttft_and_e2e_only():
    requests = [TraceRequest(float(i), 64, 8) for i in range(4)]  # a second apart: each alone
    bare = run(requests)
    fronted = SimTarget(MODEL, DEVICE, None, 0.005, 0.002).run(EngineConfig(), Workload(requests, 512))
    for a, b in zip(bare.requests, fronted.requests):
        assert b.arrival_s == a.arrival_s
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.005) and b.e2e_s == pytest.approx(a.e2e_s + 0.005)
        assert b.itl_s == pytest.approx(a.itl_s)


def test_a_burst_enters_the_engine_one_request_at_a_time():
    requests = [TraceRequest(0.0, 64, 8) for _ in range(4)]
    bare = run(requests)
    assert bare.series["num_seqs"][0] == 4  # all four in the first step
    fronted = SimTarget(MODEL, DEVICE, None, 0.002, 0.003).run(EngineConfig(), Workload(requests, 512))
    # Taken in at 2, 5, 8, 11 ms (the first finds the server idle, the rest others in flight):
    # the first step (2 ms in) runs the first request alone.
    assert fronted.series["num_seqs"][0] == 1
    ttfts = [r.ttft_s for r in fronted.requests]
    alone = StepCost.build(MODEL, DEVICE, "auto", 16).step_time(StepShape(64, 1, 64, 64 * 65 // 2, 1, 1))
    assert ttfts == sorted(ttfts) and ttfts[0] == pytest.approx(0.002 + alone)
    assert all(r.arrival_s == 0.0 for r in fronted.requests)
    assert ttfts[-1] > 0.011  # at least its wait to be taken in


def test_a_rejected_request_is_not_left_in_flight_at_the_frontend():
    requests = [TraceRequest(0.0, 20_000, 4), TraceRequest(1.0, 64, 8)]  # the first is over max_model_len
    config = EngineConfig(max_model_len=4096)
    bare = run(requests, config)
    fronted = SimTarget(MODEL, DEVICE, None, 0.005, 0.002).run(config, Workload(requests, 512))
    assert fronted.requests[0].finish_reason == "rejected"
    assert fronted.requests[1].ttft_s == pytest.approx(bare.requests[1].ttft_s + 0.005)  # found it idle
