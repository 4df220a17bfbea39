"""`kvengine serve` with the torch executor (the tiny model on the CPU), over real HTTP."""
import json
import re

import httpx
import pytest

from serverproc import ServerProcess, scrape


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--executor", "torch", "--preset", "tiny", "--device", "cpu", "--device-memory", "1GiB",
                         "--served-model-name", "tiny", "--max-model-len", "1024", timeout=120)
    yield proc
    proc.stop()


def test_greedy_completion_is_deterministic_and_counted(server):
    import openai  # here, not at the top: every pytest-xdist worker collects this file, one runs it

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = scrape(server.url)
    info = next(k for k in before if k.startswith("vllm:cache_config_info"))
    block = int(re.search(r"[{,]block_size=(\d+)", info).group(1))
    assert block == 128  # vLLM's CPU default when --block-size is not given
    outs = [client.completions.create(model="tiny", prompt="Paged attention stores K/V in blocks. " * 8,
                                      max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            for _ in range(2)]
    assert outs[0].choices[0].text == outs[1].choices[0].text
    assert outs[0].usage.completion_tokens == 12
    after = scrape(server.url)
    prompt = outs[0].usage.prompt_tokens
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 2 * prompt
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 24
    assert after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0) == (prompt - 1) // block * block > 0


def test_streaming_and_chat_on_the_real_model(server):
    body = {"model": "tiny", "prompt": [1000, 1001, 1002], "max_tokens": 5, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = [e for e in "".join(resp.iter_text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 4


def test_seeded_sampling_repeats(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    b = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert a == b


def test_the_pool_leaves_the_process_within_its_memory_budget():
    """On the CPU the engine core's own footprint (interpreter, torch, what loading left) shares the
    --device-memory budget with the pool, as a CUDA context shares a GPU: what a fresh server's core
    holds, plus its pool once written, plus the activation peak, stays within utilisation x budget."""
    import psutil

    from kvengine.config import EngineConfig, model_preset
    from kvengine.core.memory import activation_peak_bytes, kv_bytes_per_block
    from kvengine.executor.torch_executor import torch_device_spec
    proc = ServerProcess("--executor", "torch", "--preset", "tiny", "--device", "cpu", "--device-memory", "1GiB",
                         "--max-model-len", "1024", timeout=120)
    try:
        core = max(psutil.Process(proc.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
        held = core.memory_info().rss  # no request yet: none of the pool's pages is written
        info = next(k for k in scrape(proc.url) if k.startswith("vllm:cache_config_info"))
    finally:
        proc.stop()
    blocks = int(re.search(r"num_gpu_blocks=(\d+)", info).group(1))
    block_size = int(re.search(r"[{,]block_size=(\d+)", info).group(1))
    tiny = model_preset("tiny")
    pool = blocks * kv_bytes_per_block(tiny, "auto", block_size)
    config = EngineConfig(max_model_len=1024, block_size=block_size).resolve(tiny, torch_device_spec("cpu", 1 << 30))
    activation = activation_peak_bytes(tiny, config.max_num_batched_tokens, config.max_num_seqs)
    assert held + pool + activation <= 1.02 * 0.92 * (1 << 30), (held, pool, activation)


MEASURE = """
import json, math
from kvengine.config import EngineConfig
from kvengine.engine.torch_engine import build_torch_engine
e = build_torch_engine(EngineConfig(max_model_len=1024), preset="tiny", device="cpu",
                       device_memory=1 << 30, own_process=True)
m = e.memory
print(json.dumps(dict(measured=m.activation_measured, activation=m.activation_bytes, line=m.log_lines(1024)[0],
                      available=m.kv_cache_bytes, blocks=m.num_gpu_blocks, block=m.block_bytes,
                      rest=math.ceil((1 << 30) * e.config.gpu_memory_utilization) - m.weights_bytes
                      - m.activation_bytes - m.overhead_bytes)))
"""


def test_the_cpu_activation_peak_is_measured_before_the_pool_is_sized():
    """In a process serving one CPU engine (the server's core), as on CUDA, a profile run at
    max_num_batched_tokens measures the activation peak (the rise of peak RSS), and the pool is
    sized with it by the same formula. Its own process: the allocator settings it makes stay there."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["measured"] and plan["activation"] > 0, plan
    how = re.search(r"activation peak memory takes [\d.]+ GiB \(([^)]+)\)", plan["line"]).group(1)
    assert how != "estimated" and "measured" in how  # the start-up line says the peak was measured
    assert plan["available"] == plan["rest"] and plan["blocks"] == plan["available"] // plan["block"]
