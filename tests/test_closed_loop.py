"""Closed-loop load (`--max-concurrency N`, vLLM's `vllm bench serve --max-concurrency`): at most N
requests in flight, the next in trace order sent when one finishes, in the simulator and live."""
import json

import pytest

from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.core.request import SamplingParams
from kvengine.engine.llm_engine import LLMEngine
from kvtune.targets import SimTarget
from kvtune.workload import SynthSpec, parse_dist, read_workload, synthesize, write_workload
from kvtune_cli import kvtune_main


def engine():
    return LLMEngine(EngineConfig(), model_preset("llama-3-8b"), device_preset("h100-80gb"))


def at_once(n, prompt=300, output=20):
    return [(0.0, str(i), [i * 7 + 1] * prompt, SamplingParams(max_tokens=output + i, ignore_eos=True))
            for i in range(n)]


def in_flight_at(t, spans):
    return sum(1 for start, end in spans if start <= t < end)


def check_closed_loop(sent: dict, ends: dict, n: int, exact: bool, slack_s: float = 0.0):
    """At most n in flight at any send; the first n go at once; each later one goes, in trace order,
    when an earlier one has finished (at that finish, within slack_s live)."""
    order = sorted(sent, key=int)
    spans = [(sent[r], ends[r]) for r in order]
    assert max(in_flight_at(sent[r] + 1e-9, spans) for r in order) == n
    assert [sent[r] for r in order] == sorted(sent[r] for r in order)  # in trace order
    assert all(sent[r] - sent[order[0]] <= slack_s for r in order[:n])
    finished = sorted(ends.values())
    for k, r in enumerate(order[n:]):
        freed = finished[k]  # the (k+1)-th finish frees the slot request n+k takes
        if exact:
            assert sent[r] == pytest.approx(freed, abs=1e-12)
        else:
            assert freed - 1e-3 <= sent[r] <= freed + slack_s, (r, sent[r], freed)


def test_the_engine_replay_keeps_n_in_flight_and_sends_the_next_when_one_finishes():
    e = engine()
    sent = e.replay(at_once(12), max_concurrency=3)
    ends = {r.request_id: r.finish_time for r in e.finished}
    check_closed_loop(sent, ends, 3, exact=True)
    assert max(run + wait for run, wait in zip(e.steps.num_running, e.steps.num_waiting)) == 3
    # each request is timed from its send: its arrival is when the client sent it
    assert {r.request_id: r.arrival_time for r in e.finished} == sent


def test_a_request_due_after_a_slot_frees_goes_at_its_arrival_and_open_loop_is_unchanged():
    e = engine()
    late = [(0.0, "0", [1] * 100, SamplingParams(max_tokens=4)), (0.0, "1", [2] * 100, SamplingParams(max_tokens=400)),
            (5.0, "2", [3] * 100, SamplingParams(max_tokens=4))]
    sent = e.replay(late, max_concurrency=1)
    first_end = next(r.finish_time for r in e.finished if r.request_id == "0")
    assert sent["1"] == first_end and sent["2"] == max(5.0, next(r.finish_time for r in e.finished
                                                                  if r.request_id == "1"))
    open_loop = engine()
    assert open_loop.replay(at_once(6)) == {str(i): 0.0 for i in range(6)}
    with pytest.raises(ValueError, match="at least 1"):
        engine().replay(at_once(2), max_concurrency=0)


def test_rejected_prompts_free_their_slot_at_once():
    e = LLMEngine(EngineConfig(max_model_len=512), model_preset("llama-3-8b"), device_preset("h100-80gb"))
    arrivals = at_once(6)
    arrivals[1] = (0.0, "1", [5] * 600, SamplingParams(max_tokens=8))  # longer than max_model_len
    rejected = []
    sent = e.replay(arrivals, on_reject=lambda rid, err: rejected.append(rid), max_concurrency=2)
    assert rejected == ["1"] and sent["2"] == 0.0 and len(e.finished) == 5


def test_sim_target_takes_the_workloads_limit():
    workload = synthesize(SynthSpec(num_requests=10, rate=float("inf"), input_len=parse_dist("200"),
                                    output_len=parse_dist("10-40"), seed=1)).closed_loop(2)
    result = SimTarget(model_preset("llama-3-8b"), device_preset("h100-80gb")).run(EngineConfig(), workload)
    sent = {r.request_id: r.arrival_s for r in result.requests}
    ends = {r.request_id: r.arrival_s + r.e2e_s for r in result.requests}
    check_closed_loop(sent, ends, 2, exact=False, slack_s=1e-9)
    assert max(result.series["num_running"]) + 0 <= 2


@pytest.mark.slow
def test_live_and_simulated_closed_loops_keep_the_same_number_in_flight(tmp_path, capsys):
    """`kvtune run --max-concurrency` through Locust against kvengine (sim executor, real time) and on
    the simulator: the same n in flight, the next request sent as one finishes, in trace order.
    Twice as many Locust users as slots, so that the slots, not the users, hold the requests back."""
    trace = tmp_path / "w.jsonl"
    assert kvtune_main("trace", "synth", "-o", trace, "--num-requests", "10", "--rate", "inf",
                       "--input-len", "256", "--output-len", "4-16", "--seed", "2") == 0
    assert {r.arrival_s for r in read_workload(str(trace)).requests} == {0.0}
    n, runs = 4, {}
    for target in ("sim", "engine"):
        out = tmp_path / f"{target}.json"
        capsys.readouterr()
        code = kvtune_main("run", "--target", target, "--executor", "sim", "--preset", "llama-3-8b", "--device",
                           "a10-24gb", "--workload", trace, "--max-concurrency", n, "--users", 2 * n,
                           "--db", f"sqlite:///{tmp_path}/r.db", "--out", out, "--json")
        printed = capsys.readouterr()
        assert code == 0, printed.err + printed.out
        summary = json.loads(printed.out.strip().splitlines()[-1])
        assert summary["completed"] == 10 and summary["ttft_mean"] > 0 and summary["tpot_mean"] > 0
        runs[target] = json.loads(out.read_text())["requests"]
    for target, records in runs.items():
        sent = {r["request_id"]: r["arrival_s"] for r in records}
        ends = {r["request_id"]: r["arrival_s"] + r["e2e_s"] for r in records}
        # live, a slot's next request leaves within the client's own turnaround of the finish
        check_closed_loop(sent, ends, n, exact=False, slack_s=1e-9 if target == "sim" else 0.25)


@pytest.mark.parametrize("preset,device,tp", [("llama-3.1-8b", "h100-80gb", 1), ("llama-3.1-70b", "h200-141gb", 8),
                                              ("qwen3-32b", "h100-80gb", 2)])
def test_kvtune_run_on_the_simulator_prints_ttft_and_tpot_for_real_deployments(tmp_path, capsys, preset, device, tp):
    """The issue's command shape: a config.json, a GPU, tensor parallelism, fp8 weights, a closed loop."""
    from kvengine.model.hf_config import PRESET_DIR

    trace = tmp_path / "w.jsonl"
    write_workload(synthesize(SynthSpec(num_requests=64, rate=float("inf"), input_len=parse_dist("1024"),
                                        output_len=parse_dist("128"))), str(trace))
    code = kvtune_main("run", "--target", "sim", "--hf-config", PRESET_DIR / f"{preset}.json", "--device", device,
                       "--tensor-parallel-size", tp, "--quantization", "fp8", "--max-concurrency", "32",
                       "--workload", trace, "--db", f"sqlite:///{tmp_path}/r.db", "--json")
    printed = capsys.readouterr()
    assert code == 0, printed.err + printed.out
    s = json.loads(printed.out.strip().splitlines()[-1])
    assert s["completed"] == 64 and 0 < s["ttft_p50"] <= s["ttft_p99"] and 0 < s["tpot_mean"] < s["ttft_mean"] * 10
