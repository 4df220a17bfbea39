"""--server-log-dir keeps one log per server start, and a config the target's rules refuse starts nothing.

The starts are real `kvengine serve` processes started by `kvtune run`; the refusal is checked
against the CPU vLLM venv's own command (it must refuse before that vLLM is ever run).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtune.environment import cpu_flags
from kvtune.store import Store
from kvtune.targets.process import new_log
from kvtune.targets.rules import vllm_rules
from kvtune.workload import TraceRequest, Workload, write_workload
from kvtune_cli import kvtune
from test_live_targets import small_workload
from vllmserver import vllm_command

# The sim executor's llama-3-8b on an L4: it serves at 0.9 of its memory; at 0.5 the weights do not fit
# and the server exits at start-up.
SIM_L4 = ("--target", "engine", "--executor", "sim", "--preset", "llama-3-8b", "--device", "l4-24gb")


def logs_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def full_log(error: str) -> str:
    return re.search(r"^full log: (.+)$", error, re.M).group(1)


@pytest.mark.slow
def test_each_start_keeps_its_own_log_in_a_folder_made_for_it(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(0.05 * i, 40, 4) for i in range(3)]), str(trace))
    folder = tmp_path / "logs" / "engine"  # neither exists: made, as an output folder is
    db = f"sqlite:///{tmp_path}/runs.db"
    common = ("--workload", str(trace), "--server-log-dir", "logs/engine", "--db", db)  # relative to cwd
    failed = kvtune("run", *SIM_L4, "--gpu-memory-utilization", "0.5", *common, cwd=tmp_path)
    assert failed.returncode == 1 and "do not fit" in failed.stderr, failed.stderr
    ok = kvtune("run", *SIM_L4, "--gpu-memory-utilization", "0.9", "--max-num-seqs", "8", "--block-size", "32",
                "--kv-cache-dtype", "fp8", "--max-model-len", "2048", "--users", "4", "--drain-timeout", "30",
                *common, "--json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert json.loads(ok.stdout.strip().splitlines()[-1])["completed"] == 3
    # in start order, each named by its server and config
    assert logs_in(folder) == ["server-0001-engine-mem0.5.log", "server-0002-engine-block32-mem0.9-seqs8-fp8.log"]
    first, second = (folder / name for name in logs_in(folder))
    assert "do not fit" in first.read_text() and "do not fit" not in second.read_text()
    assert second.read_text().strip(), "the second start's log is empty"
    # the failed run's stored error names its own log, by an absolute path (readable from anywhere)
    failed_run = next(r for r in Store(db).list_runs() if r.status == "failed")
    assert full_log(failed_run.error) == str(first) == full_log(failed.stderr)


def test_a_server_log_dir_that_cannot_be_made_is_refused_before_anything_starts(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(small_workload(n=3), str(trace))
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "logs"  # under a file: no folder can be made there
    db = tmp_path / "runs.db"
    p = kvtune("run", *SIM_L4, "--workload", str(trace), "--server-log-dir", str(folder), "--db", f"sqlite:///{db}")
    assert p.returncode == 2, p.stderr + p.stdout
    assert p.stderr.strip() == f"error: --server-log-dir {folder}: cannot make the folder: Not a directory"
    assert not db.exists()  # refused before the store was opened, so before any server could start


# Each claimant is a process of its own, started fresh (a fork of this pytest-xdist worker could
# inherit a lock one of its threads held at the fork and hang on it), and all claim from one moment on.
CLAIM = ("import sys, time; from kvtune.targets.process import new_log; "
         "time.sleep(max(0.0, float(sys.argv[3]) - time.time())); "
         "print('\\n'.join(new_log(sys.argv[1], f'{sys.argv[2]}-{i}') for i in range(8)))")


def test_processes_sharing_a_log_folder_never_share_a_log(tmp_path):
    at = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path), f"p{k}", at], stdout=subprocess.PIPE,
                              text=True) for k in range(4)]
    claimed = [proc.communicate(timeout=60)[0].split() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4
    every = [path for paths in claimed for path in paths]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in every)
    assert sorted(int(os.path.basename(p)[7:11]) for p in every) == list(range(1, 33))  # one number each
    for paths in claimed:  # each process's starts sort in the order it made them
        assert paths == sorted(paths)
    assert os.path.basename(new_log(str(tmp_path), "")) == "server-0033.log"  # after every number taken


BLOCK_16 = "vLLM (CPU build) does not take --block-size 16; it takes 32, 64, 128, 256 (default 128)"
# the dtypes this host's CPU vLLM takes: fp8 only with AVX-512 or AMX (test_fix_validity checks which)
INT8 = ("--quantized-kv int8: " + vllm_rules("cpu", None, cpu_flags()).refuses("--kv-cache-dtype", "int8"))


@pytest.mark.parametrize("command,flags,message", [
    ("run", ("--block-size", "16"), BLOCK_16),
    ("calibrate", ("--block-size", "16"), BLOCK_16),
    ("calibrate", ("--block-size", "32", "--quantized-kv", "int8"), INT8),  # its second start's dtype
], ids=["run", "calibrate", "calibrate-quantized-kv"])
def test_a_config_cpu_vllm_refuses_is_refused_before_vllm_starts(tmp_path, command, flags, message):
    trace = tmp_path / "t.jsonl"
    write_workload(small_workload(n=3), str(trace))
    folder, db = tmp_path / "logs", tmp_path / "runs.db"
    workload = ("--workload", str(trace)) if command == "run" else ()
    # No checkpoint: nothing may start, so the model is never read.
    p = kvtune(command, "--target", "vllm", "--model", str(tmp_path / "no-model"), "--vllm-command", vllm_command(),
               *flags, *workload, "--server-log-dir", str(folder), "--db", f"sqlite:///{db}")
    assert p.returncode == 2, p.stderr + p.stdout
    assert p.stderr.strip() == f"error: {message}; nothing was started"
    assert logs_in(folder) == [] and not db.exists()  # no server start made a log, nothing was stored
