"""Fixes tried in the simulator before they are printed (issue #24).

Each run is a real sim run of a workload built to cause its fault; the trials replay that
same workload. Expected figures are recomputed here by running the simulator with the fix
applied, never copied from the trial.
"""
import dataclasses
import json
import re
import subprocess
import sys
from functools import cache

from kvengine.config import EngineConfig, device_preset, model_preset
from kvtune.diagnose import FlagChange, Thresholds, diagnose
from kvtune.diagnose.model import HELPED, NO_HELP, UNTESTED, Diagnosis
from kvtune.diagnose.render import format_diagnoses
from kvtune.diagnose.trial import Simulator, changed_config, mirrored_config, try_fixes
from kvtune.results import RunResult
from kvtune.store import Store
from kvtune.targets import SimTarget
from kvtune.workload import IntDist, SynthSpec, synthesize, write_workload

TARGET = SimTarget(model_preset("llama-3-8b"), device_preset("h100-80gb"))
POOL_BLOCKS = 300


@cache
def thrash_workload():
    """12 shared 1,024-token system prompts at 8 req/s: a 4,800-token pool preempts and thrashes."""
    spec = SynthSpec(num_requests=120, rate=8, system_prompts=12, system_prompt_len=1024,
                     input_len=IntDist.fixed(128), output_len=IntDist.fixed(64))
    return synthesize(spec)


def served(result: RunResult) -> RunResult:
    """The run as a server sized in bytes reports it: its pool as num_gpu_blocks, no override."""
    config = dict(result.config)
    config["num_gpu_blocks"] = config.pop("num_gpu_blocks_override")
    return dataclasses.replace(result, config=config)


@cache
def tight_run() -> RunResult:
    config = EngineConfig(num_gpu_blocks_override=POOL_BLOCKS, max_model_len=2048, max_num_seqs=256)
    return served(TARGET.run(config, thrash_workload()))


def simulator() -> Simulator:
    return Simulator.of(TARGET, thrash_workload())


def tried(fault: str, options: list | None = None, result: RunResult | None = None) -> Diagnosis:
    result = result or tight_run()
    found = {d.id: d for d in diagnose(result)}[fault]
    if options is not None:
        found = Diagnosis(found.id, found.severity, found.symptom, found.evidence, found.cause, options)
    return try_fixes([found], result, simulator(), Thresholds())[0]


def test_the_run_has_the_faults_the_trials_work_on():
    assert {"F1", "F6"} <= {d.id for d in diagnose(tight_run())}


def test_a_fix_that_removes_the_fault_is_printed_with_what_it_did_in_the_simulator():
    f6 = tried("F6")
    fp8 = next(t for t in f6.trials if "--kv-cache-dtype" in t.change)
    assert fp8.verdict == HELPED
    # The same simulator on the server's pool with fp8: twice the blocks of the same bytes.
    fixed = TARGET.run(EngineConfig(num_gpu_blocks_override=2 * POOL_BLOCKS, max_model_len=2048,
                                    max_num_seqs=256, kv_cache_dtype="fp8"), thrash_workload())
    assert fp8.after["preemptions"] == fixed.summary["preemptions"] < fp8.before["preemptions"]
    assert fp8.before["preemptions"] == tight_run().summary["preemptions"]
    assert "F6" not in {d.id for d in diagnose(fixed)}
    assert f6.fix.startswith(f"{fp8.change} [in {simulator().label}: ")  # the helped fix first, where it was tried
    assert f"preemptions {fp8.before['preemptions']} → {fp8.after['preemptions']}" in f6.fix


def test_a_concurrency_cap_that_starves_the_queue_is_not_printed():
    starve = FlagChange("--max-num-seqs", 256, 1, "one at a time")
    f6 = tried("F6", [starve, FlagChange("--kv-cache-dtype", "auto", "fp8")])
    cap = f6.trials[0]
    assert cap.verdict == NO_HELP
    assert "ttft" in cap.note and "10% + 20 ms" in cap.note  # the figure it worsened, past the margin
    assert cap.after["ttft_p95"] > 1.1 * cap.before["ttft_p95"]
    assert "--max-num-seqs" not in f6.fix and f6.fix.startswith("`--kv-cache-dtype auto → fp8`")
    assert cap.change.startswith("`--max-num-seqs 256 → 1`")
    assert f"{NO_HELP}: {cap.change}: {cap.note}" in format_diagnoses([f6])  # shown as tried, with why


def test_a_shorter_max_model_len_that_refuses_requests_is_not_printed():
    refuse = FlagChange("--max-model-len", 2048, 512)  # the prompts are 1,152 tokens
    f1 = tried("F1", [refuse])
    assert f1.trials[0].verdict == NO_HELP
    n = len(thrash_workload())
    assert [int(x) for x in re.findall(r"\d+", f1.trials[0].note)] == [n, n, 512]  # rejects all n, over 512 tokens
    assert f1.trials[0].after == {} and not any(t.verdict == HELPED for t in f1.trials)  # refused: not simulated
    assert "--max-model-len" not in f1.fix and "F1" in f1.fix  # the refusing change is not printed as a fix


def test_a_pool_that_does_not_help_at_the_size_proposed_is_grown_until_one_does():
    result = served(TARGET.run(EngineConfig(num_gpu_blocks_override=POOL_BLOCKS, max_model_len=2048),
                               thrash_workload()))
    small = FlagChange("--num-gpu-blocks-override", POOL_BLOCKS, POOL_BLOCKS + 10)
    f1 = tried("F1", [small], result)
    assert f1.trials[0].verdict == HELPED
    assert (f1.trials[0].flag, f1.trials[0].value) == ("--num-gpu-blocks-override", 2 * POOL_BLOCKS)
    assert f1.fix.startswith("`--num-gpu-blocks-override 300 → 600` (2× the pool")
    assert f1.trials[0].after["preemptions"] < f1.trials[0].before["preemptions"]
    assert f1.trials[0].after["kv_usage_peak"] < 0.95
    # At 1.5× F1 is gone from the simulator too, but with the pool still full at its peak: a live
    # server a little slower than the simulator preempts again, so that size is not the fix.
    at_450 = TARGET.run(EngineConfig(num_gpu_blocks_override=450, max_model_len=2048), thrash_workload())
    assert "F1" not in {d.id for d in diagnose(at_450)} and at_450.summary["kv_usage_peak"] >= 0.95


def test_the_server_pool_is_mirrored_and_scaled_by_each_change():
    result = tight_run()
    base = mirrored_config(result)
    assert base.num_gpu_blocks_override == POOL_BLOCKS
    assert changed_config(result, base, FlagChange("--kv-cache-dtype", "auto", "fp8")).num_gpu_blocks_override == 600
    assert changed_config(result, base, FlagChange("--block-size", 16, 32)).num_gpu_blocks_override == 150
    assert changed_config(result, base, FlagChange("--max-num-seqs", 256, 8)).num_gpu_blocks_override == 300


def test_under_a_block_override_fp8_holds_no_more_and_is_not_offered_for_room():
    overridden = TARGET.run(EngineConfig(num_gpu_blocks_override=POOL_BLOCKS, max_model_len=2048,
                                         max_num_seqs=256), thrash_workload())
    f6 = {d.id: d for d in diagnose(overridden)}["F6"]
    assert "--kv-cache-dtype" not in f6.fix and "--num-gpu-blocks-override 300 → 450" in f6.fix
    base = mirrored_config(overridden)
    fp8 = changed_config(overridden, base, FlagChange("--kv-cache-dtype", "auto", "fp8"))
    assert fp8.num_gpu_blocks_override == POOL_BLOCKS  # the override fixes the block count


def test_a_simulator_that_does_not_show_the_fault_leaves_the_fix_untested():
    roomy = dataclasses.replace(tight_run(), config=dict(tight_run().config, num_gpu_blocks=100_000))
    f6 = {d.id: d for d in diagnose(tight_run())}["F6"]
    [f6] = try_fixes([f6], roomy, simulator(), Thresholds())
    assert {t.verdict for t in f6.trials} == {UNTESTED}
    assert not f6.tried and len({t.note for t in f6.trials}) == 1  # one reason for all: the simulator's
    why = f6.trials[0].note
    assert why.startswith(simulator().label) and "F6" in why and f6.fix.endswith(f"[untested: {why}]")


def test_more_gpus_are_tried_on_the_simulator_with_the_pool_they_give():
    """The simulator runs one GPU of T: TP 2 halves the weights and the K/V heads each GPU holds, so the
    server's mirrored pool grows by what kvengine's memory plan says (more than twice), and the fix is
    tried. With an override in force the pool stays: only the faster steps (each GPU reads half the
    weights, then the two all-reduces a layer) are tried."""
    mirrored = tight_run()  # a pool the server sized from memory: 300 blocks reported
    two = changed_config(mirrored, mirrored_config(mirrored), FlagChange("--tensor-parallel-size", 1, 2))
    assert two.tensor_parallel_size == 2 and two.num_gpu_blocks_override > 2 * POOL_BLOCKS
    f6 = tried("F6", [FlagChange("--tensor-parallel-size", 1, 2)], result=mirrored)
    assert f6.trials[0].verdict == HELPED, f6.fix
    pinned = dataclasses.replace(mirrored, config=dict(mirrored.config, num_gpu_blocks_override=POOL_BLOCKS))
    overridden = changed_config(pinned, mirrored_config(pinned), FlagChange("--tensor-parallel-size", 1, 2))
    assert overridden.num_gpu_blocks_override == POOL_BLOCKS and overridden.tensor_parallel_size == 2


def test_no_simulator_says_why_the_fixes_are_untested():
    plain = {d.id: d for d in diagnose(tight_run())}["F6"]
    why = "no trace at hand"
    [plain] = try_fixes([plain], tight_run(), None, Thresholds(), why_none=why)
    assert plain.fix.endswith(f"[untested: {why}]") and {t.verdict for t in plain.trials} == {UNTESTED}


def test_trials_are_stored_with_the_diagnosis(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/t.db")
    run_id = store.save_run(tight_run())
    f6 = tried("F6")
    store.save_diagnoses(run_id, [f6])
    [back] = [Diagnosis.from_stored(row) for row in store.load_diagnoses(run_id)]
    assert back.trials == f6.trials and back.fix == f6.fix


def test_diagnose_run_tries_the_fixes_on_the_runs_own_trace(tmp_path):
    trace, db = tmp_path / "thrash.jsonl", f"sqlite:///{tmp_path}/k.db"
    write_workload(thrash_workload(), str(trace))
    kvtune = [sys.executable, "-m", "kvtune"]
    subprocess.run(kvtune + ["run", "--target", "sim", "--workload", str(trace), "--num-gpu-blocks-override", "300",
                             "--max-model-len", "2048", "--db", db], check=True, capture_output=True, timeout=120)
    out = subprocess.run(kvtune + ["diagnose", "--run", "1", "--db", db, "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "tried: helped: `--num-gpu-blocks-override 300 → 450`" in out
    diagnoses = json.loads(out.strip().splitlines()[-1])["diagnoses"]
    helped = [(d, t) for d in diagnoses for t in d["trials"] if t["verdict"] == HELPED]
    assert ("--num-gpu-blocks-override", 450) in [(t["flag"], t["value"]) for _, t in helped]
    for d, t in helped:  # each run in the simulator on the run's own trace, its figures in the fix line
        assert t["after"]["requests"] == len(thrash_workload())
        assert f"{t['change']} [in {simulator().label}: TTFT p95" in d["fix"]
    other = tmp_path / "other.jsonl"
    write_workload(synthesize(SynthSpec(num_requests=120, rate=2)), str(other))
    out = subprocess.run(kvtune + ["diagnose", "--run", "1", "--db", db, "--workload", str(other), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    diagnoses = json.loads(out.strip().splitlines()[-1])["diagnoses"]
    trials = [t for d in diagnoses for t in d["trials"]]
    assert trials and {t["verdict"] for t in trials} == {UNTESTED}  # another trace: nothing simulated
    assert all(t["note"].startswith(f"{other} ") for t in trials)  # and the note names the file
