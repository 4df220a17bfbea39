"""`kvengine` on the command line, as an operator runs it."""
import json
import re
import subprocess
import sys


def kvengine(*args):
    return subprocess.run([sys.executable, "-m", "kvengine", *args], capture_output=True, text=True)


def test_help_on_every_command():
    for cmd in ([], ["plan"], ["presets"]):
        p = kvengine(*cmd, "--help")
        assert p.returncode == 0 and "usage: kvengine" in p.stdout


def test_plan_prints_vllm_startup_lines_and_json():
    p = kvengine("plan", "--preset", "llama-3-8b", "--device", "h100-80gb", "--context", "4096", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["kv_bytes_per_token"] == 131072
    assert result["pool_tokens"] == result["num_gpu_blocks"] * 16
    # vLLM's start-up lines, as operators grep them, with the plan's own figures in them
    size = re.search(r"^GPU KV cache size: ([\d,]+) tokens$", p.stdout, re.MULTILINE)
    concurrency = re.search(r"^Maximum concurrency for 8,192 tokens per request: ([\d.]+)x$", p.stdout, re.MULTILINE)
    assert size and int(size.group(1).replace(",", "")) == result["pool_tokens"]  # 8,192 divides into blocks of 16
    assert concurrency and float(concurrency.group(1)) == round(result["num_gpu_blocks"] / (8192 // 16), 2)
    assert set(result["max_concurrency"]) == {"4096"}


def test_bad_flags_name_the_flag_and_exit_nonzero():
    p = kvengine("plan", "--block-size", "24")
    assert p.returncode == 2 and "--block-size" in p.stderr and "Traceback" not in p.stderr
    p = kvengine("plan", "--preset", "gpt-5")
    assert p.returncode == 2 and "--preset" in p.stderr and "llama-3-8b" in p.stderr
    p = kvengine("plan", "--kv-cache-dtype", "fp4")
    assert p.returncode == 2 and "--kv-cache-dtype" in p.stderr
    p = kvengine("plan", "--preset", "llama-3-70b", "--device", "l4-24gb")
    assert p.returncode == 1 and "engine cannot start" in p.stderr


def test_presets_lists_models_and_devices():
    p = kvengine("presets", "--json")
    data = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "tiny"} <= set(data["models"])
    assert {"h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "a10-24gb", "l4-24gb", "cpu"} <= set(data["devices"])


def test_serve_start_errors_from_the_engine_core_process_are_one_clear_line(tmp_path):
    """The engine is built in its own process; what fails there reaches the operator as before."""
    p = kvengine("serve", "--executor", "torch", "--model", str(tmp_path / "missing"), "--port", "1")
    assert p.returncode == 2 and f"--model {tmp_path / 'missing'}: not a local folder" in p.stderr
    assert "Traceback" not in p.stderr
    p = kvengine("serve", "--executor", "torch", "--device-memory", "1MiB", "--port", "1")
    assert p.returncode == 1 and "engine cannot start" in p.stderr and "Traceback" not in p.stderr
