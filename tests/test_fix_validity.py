"""Every fix `kvtune diagnose` prints is one its server takes, and a fix that only starts a server by
refusing the workload's requests is not printed as one (issue #39).

The runs are real sim runs; a CPU vLLM's run is the sim run as that server's target stores it (its
VLLM_CPU_KVCACHE_SPACE, its block sizes, the block count it reported). The failed start is the
simulator's own, and the real CPU vLLM log of tests/data/start-failures. The last tests start the
real CPU vLLM (.venv-vllm) with each fix printed for that log, and send the pool the fix sized more
than it holds.
"""
import contextlib
import dataclasses
import math
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from kvengine.config import EngineConfig, device_preset, model_preset

from kvtune.diagnose import FlagChange, Thresholds, diagnose
from kvtune.diagnose.model import HELPED, NO_HELP, UNTESTED, Diagnosis
from kvtune.diagnose.render import format_diagnoses
from kvtune.diagnose.trial import Simulator, diagnosed, simulator_for, try_fixes
from kvtune.results import RunResult
from kvtune.targets import SimTarget, TargetStartError
from kvtune.targets.rules import CPU_KV_SPACE_ENV, run_rules, vllm_rules
from kvtune.results import config_dict
from kvtune.workload import (
    IntDist,
    SynthSpec,
    TraceRequest,
    Workload,
    synthesize,
    workload_stats,
)

TARGET = SimTarget(model_preset("llama-3-8b"), device_preset("h100-80gb"))
CPU_BLOCK_SIZES = [32, 64, 128, 256]
OVERRIDE_BLOCKS = 36  # the issue's --num-gpu-blocks-override, in CPU vLLM's default blocks of 128


def thrash_workload() -> Workload:
    """12 shared 1,024-token system prompts at 8 req/s: a pool of ~4,600 tokens fills and queues."""
    return synthesize(SynthSpec(num_requests=120, rate=8, system_prompts=12, system_prompt_len=1024,
                                input_len=IntDist.fixed(128), output_len=IntDist.fixed(64)))


def cpu_vllm_run(override: bool) -> RunResult:
    """A sim run as a CPU vLLM started with VLLM_CPU_KVCACHE_SPACE=1 stores it: the variable, CPU vLLM's
    block sizes and the 36 blocks it reported; with `override`, --num-gpu-blocks-override 36 too."""
    run = TARGET.run(EngineConfig(num_gpu_blocks_override=OVERRIDE_BLOCKS, block_size=128, max_model_len=2048,
                                  max_num_seqs=128), thrash_workload())
    config = dict(run.config, launch_env={CPU_KV_SPACE_ENV: "1"}, launch_server="vllm",
                  server_block_sizes=CPU_BLOCK_SIZES, num_gpu_blocks=OVERRIDE_BLOCKS)
    if not override:
        config.pop("num_gpu_blocks_override")
    return dataclasses.replace(run, target="vllm", config=config)


def counts(note: str) -> list[int]:
    """The whole numbers a note states, in its order (1,024 read as 1024)."""
    return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?<!,)", note)]


def printed(diagnoses: list[Diagnosis]) -> list:
    """The trials whose change the fix line prints: those that helped and those never simulated."""
    return [t for d in diagnoses for t in d.trials if t.verdict in (HELPED, UNTESTED)]


def assert_the_server_takes(result: RunResult, diagnoses: list[Diagnosis]) -> None:
    """CPU vLLM 0.32 reads VLLM_CPU_KVCACHE_SPACE with int() (`invalid literal for int() with base 10:
    '1.5'`) and takes block sizes in multiples of 32; under an override nothing else sizes the pool."""
    for t in printed(diagnoses):
        if t.flag == CPU_KV_SPACE_ENV:
            assert str(t.value).isdigit() and int(t.value) >= 1, t.change
        if t.flag == "--block-size":
            assert t.value in CPU_BLOCK_SIZES, t.change
        if result.config.get("num_gpu_blocks_override"):
            assert t.flag not in (CPU_KV_SPACE_ENV, "--gpu-memory-utilization", "--kv-cache-memory-bytes"), t.change


# -- the rules ----------------------------------------------------------------------------------------

def test_the_rules_say_what_cpu_vllm_takes_and_what_sizes_its_pool():
    rules = vllm_rules("cpu", {CPU_KV_SPACE_ENV: "1"})
    assert rules.refuses(CPU_KV_SPACE_ENV, "1.5") and rules.refuses(CPU_KV_SPACE_ENV, 0)
    assert rules.refuses(CPU_KV_SPACE_ENV, 2) is None
    assert rules.taken(CPU_KV_SPACE_ENV, 1.5) == 2 and rules.taken(CPU_KV_SPACE_ENV, 1.5, up=False) == 1
    assert rules.taken("--block-size", 16) == 32 and rules.taken("--block-size", 16, up=False) is None
    assert rules.pool_knob == CPU_KV_SPACE_ENV and not rules.moves_pool("--gpu-memory-utilization")
    overridden = rules.with_server_args("--num-gpu-blocks-override 36 --kv-cache-memory-bytes 1GiB")
    assert overridden.pool_knob == "--num-gpu-blocks-override"
    assert not any(overridden.moves_pool(k) for k in (CPU_KV_SPACE_ENV, "--kv-cache-memory-bytes",
                                                      "--gpu-memory-utilization", "--kv-cache-dtype"))
    # what a stored run says of its server: the override it ran with beats the variable
    stored = run_rules({"num_gpu_blocks_override": 36, "launch_env": {CPU_KV_SPACE_ENV: "1"},
                        "server_block_sizes": CPU_BLOCK_SIZES, "kv_cache_memory_bytes": 1 << 30}, "vllm")
    assert stored.pool_knob == "--num-gpu-blocks-override" and stored.pool_size == 36
    assert stored.block_sizes == tuple(CPU_BLOCK_SIZES)


@pytest.mark.parametrize("flags, fp8", [({"avx2"}, False), ({"avx2", "avx512f"}, True), ({"amx_tile"}, True),
                                        (None, True)])
def test_cpu_vllm_takes_fp8_kv_only_on_a_host_with_avx512_or_amx(flags, fp8):
    """vLLM's CPU attention stops a start with fp8 K/V on a host with neither (cpu_attn._get_attn_isa):
    the search must not propose it there, and a baseline asking for it is refused before any start."""
    rules = vllm_rules("cpu", None, flags)
    assert ("fp8" in rules.kv_cache_dtypes) == fp8 and "auto" in rules.kv_cache_dtypes
    refusal = rules.refuses("--kv-cache-dtype", "fp8")
    assert (refusal is None) == fp8
    if not fp8:
        assert refusal.startswith("vLLM (CPU build) has no --kv-cache-dtype fp8; it takes auto (") and "AVX-512 or AMX" in refusal


# -- defect 2: a printed fix that stops vLLM from starting ---------------------------------------------

def test_under_an_override_the_pool_fix_is_the_override_and_it_is_tried():
    """The issue's run: VLLM_CPU_KVCACHE_SPACE=1 and --num-gpu-blocks-override 36 printed
    `VLLM_CPU_KVCACHE_SPACE 1 → 1.5` (refused by vLLM, and the pool was the override's anyway), never tried."""
    result = cpu_vllm_run(override=True)
    found = try_fixes(diagnose(result), result, Simulator.of(TARGET, thrash_workload()), Thresholds())
    text = format_diagnoses(found)
    assert "F1" in {d.id for d in found}
    assert f"`{CPU_KV_SPACE_ENV} " not in text, text  # no change of the variable
    assert_the_server_takes(result, found)
    pool = [t for t in printed(found) if t.flag == "--num-gpu-blocks-override"]
    assert pool and all(t.verdict == HELPED and t.value > OVERRIDE_BLOCKS for t in pool), text


def test_a_pool_sized_by_the_variable_grows_in_whole_gib_and_is_simulated():
    result = cpu_vllm_run(override=False)
    found = try_fixes(diagnose(result), result, Simulator.of(TARGET, thrash_workload()), Thresholds())
    assert_the_server_takes(result, found)
    space = [t for d in found for t in d.trials if t.flag == CPU_KV_SPACE_ENV]
    assert space and all(t.verdict != UNTESTED for t in space), format_diagnoses(found)
    assert any(t.verdict == HELPED for t in space)


# -- defect 3: a fix that starts the server by refusing the workload's requests -------------------------

def long_and_short_trace() -> Workload:
    """60 short requests and 5 of 6,000 prompt + 400 output tokens."""
    rng = np.random.default_rng(1)
    requests = [TraceRequest(float(t), 700, 100) for t in np.cumsum(rng.exponential(0.1, 60))]
    requests += [TraceRequest(1.0 + k, 6000, 400) for k in range(5)]
    return Workload(sorted(requests, key=lambda r: r.arrival_s), 16)


def failed_start() -> tuple[RunResult, str]:
    """llama-3-8b at --max-model-len 8192 with 23% of an H100: the pool holds 4,720 tokens, and the
    start fails with the hint the issue's `--max-model-len 8192 → 4720` came from."""
    config = EngineConfig(gpu_memory_utilization=0.23, max_model_len=8192)
    with pytest.raises(TargetStartError) as info:
        TARGET.run(config, long_and_short_trace())
    assert "estimated maximum model length is 4720" in str(info.value)
    result = RunResult("sim", "llama-3-8b", "h100-80gb", config_dict(config), workload_stats(long_and_short_trace()),
                       [], {}, 0.0)
    return result, str(info.value)


def test_a_max_model_len_that_refuses_the_traces_requests_did_not_help():
    result, error = failed_start()
    [f5] = try_fixes(diagnose(result, error=error), result, Simulator.of(TARGET, long_and_short_trace()), Thresholds())
    shorter = next(t for t in f5.trials if t.flag == "--max-model-len")
    assert shorter.verdict == NO_HELP and shorter.value == 4720
    over = sum(r.input_length + r.output_length > 4720 for r in long_and_short_trace().requests)
    assert counts(shorter.note) == [over, len(long_and_short_trace()), 4720] and "reject" in shorter.note
    assert "--max-model-len" not in f5.fix and any(t.verdict == HELPED for t in f5.trials)
    assert f"{NO_HELP}: {shorter.change}: {shorter.note}" in format_diagnoses([f5])  # shown as tried, with why


def test_without_a_simulator_the_trace_still_judges_the_limit_and_without_a_trace_the_fix_says_it():
    result, error = failed_start()
    served = dataclasses.replace(result, target="vllm", model="/models/llama-3-8b")  # no presets: no simulator
    sim, why = simulator_for(served, long_and_short_trace())
    [f5] = diagnosed(served, Thresholds(), sim, error=error, why_none=why)
    shorter = next(t for t in f5.trials if t.flag == "--max-model-len")
    assert shorter.verdict == NO_HELP and shorter.note.startswith("would reject 5 of 65 requests")
    assert "--max-model-len" not in f5.fix and f5.fix.endswith(f"[untested: {why}]")
    [alone] = diagnosed(served, Thresholds(), None, error=error, why_none="no trace at hand")
    assert "`--max-model-len 8192 → 4720`" in alone.fix
    assert "rejects requests (prompt + output) longer than 4,720 tokens" in alone.fix


def test_a_batch_budget_without_chunked_prefill_is_judged_on_the_prompts():
    """With chunked prefill off a prompt must fit max_num_batched_tokens in one step: a smaller budget refuses
    the longer prompts; with chunked prefill on it bounds no request."""
    workload = thrash_workload()
    off = TARGET.run(EngineConfig(num_gpu_blocks_override=300, max_model_len=2048, max_num_seqs=256,
                                  enable_chunked_prefill=False, max_num_batched_tokens=4096), workload)
    on = dataclasses.replace(off, config=dict(off.config, enable_chunked_prefill=True))
    f1 = {d.id: d for d in diagnose(off)}["F1"]

    def budget_trial(run: RunResult):
        options = [FlagChange("--max-num-batched-tokens", 4096, 1024)]
        d = Diagnosis(f1.id, f1.severity, f1.symptom, f1.evidence, f1.cause, options)
        return try_fixes([d], run, Simulator.of(TARGET, workload), Thresholds())[0].trials[0]

    n = len(workload)
    refused = budget_trial(off)
    assert refused.verdict == NO_HELP
    assert counts(refused.note) == [n, n, 1024] and "reject" in refused.note and "prompts" in refused.note
    assert "would reject" not in budget_trial(on).note


def test_a_max_tokens_cap_that_cuts_the_traces_outputs_short_did_not_help():
    """The requests' max_tokens is no server flag, but capping it truncates every longer answer."""
    run = TARGET.run(EngineConfig(num_gpu_blocks_override=300, max_model_len=2048, max_num_seqs=256), thrash_workload())
    f1 = {d.id: d for d in diagnose(run)}["F1"]
    caps = [FlagChange("max_tokens", None, 32), FlagChange("max_tokens", None, 64)]  # the outputs are 64 tokens
    [d] = try_fixes([Diagnosis(f1.id, f1.severity, f1.symptom, f1.evidence, f1.cause, caps)], run,
                    Simulator.of(TARGET, thrash_workload()), Thresholds())
    n = len(thrash_workload())
    assert d.trials[0].verdict == NO_HELP
    assert counts(d.trials[0].note) == [n, n, 32] and "truncate" in d.trials[0].note
    assert d.trials[1].verdict == UNTESTED and counts(d.trials[1].change) == [64, n] and "none" in d.trials[1].change


# -- 6: fp8's gain as it is --------------------------------------------------------------------------

def test_the_f2_fix_states_fp8s_gain_on_a_float32_model():
    """kvengine's tiny preset keeps K/V in float32: fp8 takes a quarter of the bytes, not half."""
    requests = [TraceRequest(i * 0.005, 1000, 3000) for i in range(256)]
    run = SimTarget(model_preset("tiny"), device_preset("l4-24gb")).run(
        EngineConfig(kv_cache_memory_bytes=2200 << 20, max_num_seqs=256), Workload(requests, 16))
    f2 = {d.id: d for d in diagnose(run)}["F2"]
    fp8 = next(c for c in f2.changes if c.flag == "--kv-cache-dtype")
    assert "halves" not in f2.fix and "1/4" in fp8.effect, f2.fix
    before, after = (int(x.replace(",", "")) for x in fp8.effect.split(" tokens")[0].removeprefix("pool ").split(" → "))
    assert after == 4 * before  # the pool's own growth, the same gain


# -- a real CPU vLLM start failure: each printed fix starts the server -----------------------------------

MAX_MODEL_LEN_LOG = "vllm-max-model-len"  # --max-model-len 2048 --block-size 32 --num-gpu-blocks-override 4
LOG_CONFIG = {"block_size": 32, "max_model_len": 2048, "num_gpu_blocks_override": 4}


def diagnosed_log(tmp_path) -> Diagnosis:
    from test_start_failures import kept_copy

    from kvtune.targets.process import start_error

    err = start_error("the server exited with status 1 before it was healthy", kept_copy(MAX_MODEL_LEN_LOG, tmp_path))
    result = RunResult("vllm", "tiny-llama", "unknown", dict(LOG_CONFIG), {}, [], {}, 0.0)
    [f5] = diagnosed(result, Thresholds(), None, error=str(err), why_none="no trace at hand")
    return f5


def test_a_pool_fixed_by_an_override_is_grown_to_hold_one_request(tmp_path):
    """vLLM's hint (96 tokens from 4 blocks of 32) leaves out the null block: 2,048 tokens need 64 blocks
    and that one. fp8 and utilisation hold no more tokens in an override's 4 blocks: not printed."""
    f5 = diagnosed_log(tmp_path)
    blocks = math.ceil(LOG_CONFIG["max_model_len"] / LOG_CONFIG["block_size"]) + 1
    assert [t.change.split(" (")[0] for t in printed([f5])] == ["`--max-model-len 2048 → 96`",
                                                                f"`--num-gpu-blocks-override 4 → {blocks}`"]
    assert "rejects requests (prompt + output) longer than 96 tokens" in f5.fix
    assert "--kv-cache-dtype" not in f5.fix and "--gpu-memory-utilization" not in f5.fix


@dataclasses.dataclass
class FixedServer:
    fix: object  # the printed trial whose change this server was started with
    server: object  # kvtune.targets.process.ManagedServer


@pytest.fixture(scope="module")
def fixed_servers(tmp_path_factory):
    """The log's own flags and pool (VLLM_CPU_KVCACHE_SPACE=1), with one printed fix applied to each
    server, all started side by side (a vLLM start is one busy core). A start error, with vLLM's root
    cause, fails the test that asked; every server ends with the module."""
    from checkpoint import write_tiny_llama
    from vllmserver import ENV, START_TIMEOUT_S, TEST_ARGS, vllm_command

    from kvtune.targets.process import ManagedServer, free_port

    command = vllm_command()  # skips, saying how to get vLLM, when there is none
    folder = tmp_path_factory.mktemp("fixed")
    fixes = printed([diagnosed_log(folder)])
    assert 0 < len(fixes) <= 2  # each is one start of vLLM
    model = str(write_tiny_llama(folder / "tiny-llama"))
    servers = []
    for t in fixes:
        flags = {"--" + k.replace("_", "-"): str(v) for k, v in LOG_CONFIG.items()}
        env = dict(ENV)
        (env if t.flag == CPU_KV_SPACE_ENV else flags)[t.flag] = str(t.value)
        port = free_port()
        argv = [*command.split(), "--model", model, "--host", "127.0.0.1", "--port", str(port),
                *[w for kv in flags.items() for w in kv], *TEST_ARGS.split()]
        servers.append(FixedServer(t, ManagedServer(argv, port, START_TIMEOUT_S, env=env, log_dir=str(folder / "logs"))))
    with contextlib.ExitStack() as stack:
        for each in servers:
            stack.callback(each.server.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda each: each.server.start(), servers))
        yield servers


@pytest.mark.slow
def test_cpu_vllm_starts_with_each_printed_fix(fixed_servers):
    """Each start must come up (fp8, once printed here, holds no more than 96 tokens in 4 blocks)."""
    assert all(each.server.alive for each in fixed_servers), [each.fix.change for each in fixed_servers]


def tight_workload() -> Workload:
    """20 requests at once (the fewest a diagnosis judges), 64-token prompts growing by 128 tokens each:
    2,880 tokens at their longest against the 2,048 of the fixed pool's usable blocks."""
    return synthesize(SynthSpec(num_requests=20, rate=200.0, input_len=IntDist.fixed(64),
                                output_len=IntDist.fixed(128), seed=2))


@pytest.mark.slow
def test_the_pool_the_fix_sized_preempts_under_more_than_it_holds_and_is_diagnosed_f6(fixed_servers, tmp_path):
    """The override fix sizes the pool for one 2,048-token request; 20 requests that outgrow it as they
    decode are preempted (vLLM's own counters say how many), and `kvtune diagnose` finds F6."""
    import json

    from kvtune_cli import kvtune
    from kvtune.store import Store
    from kvtune.workload import write_workload

    [served] = [each.server for each in fixed_servers if each.fix.flag == "--num-gpu-blocks-override"]
    workload, trace, db = tight_workload(), tmp_path / "tight.jsonl", f"sqlite:///{tmp_path}/tight.db"
    write_workload(workload, str(trace))
    p = kvtune("run", "--target", served.url, "--workload", trace, "--db", db, "--json")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["completed"] == 20
    assert s["server_preemptions"] > 0
    assert 0 < s["server_requests_preempted"] <= 20  # from vllm:request_num_preemptions, not the clients
    assert s["server_prompt_tokens"] >= sum(r.input_length for r in workload.requests)
    assert Store(db).load_run(s["run_id"]).config["num_gpu_blocks"] == 65  # read back: cache_config_info
    d = kvtune("diagnose", "--run", s["run_id"], "--db", db, "--json")
    found = {x["id"]: x for x in json.loads(d.stdout.strip().splitlines()[-1])["diagnoses"]}
    assert "F6" in found and found["F6"]["severity"] in ("warning", "critical"), found
