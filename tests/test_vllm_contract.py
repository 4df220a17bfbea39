"""kvengine as vLLM's stand-in: the contract vLLM's CPU build (0.32) keeps, held by `kvengine serve`.

The expected numbers and messages are what a real vLLM 0.32 CPU server answered on the
same tiny checkpoint (tests/checkpoint.py) with --max-model-len 512: its platform defaults
(block_size 128, max_num_seqs 128), its 404 and 400 bodies, the chat template's token
count, and `vllm:iteration_tokens_total` counting computed tokens only.
"""
import asyncio
import json
import re
import shutil
import time

import httpx
import pytest

from checkpoint import write_tiny_llama
from kvengine.entrypoints.cli import build_parser
from kvengine.entrypoints.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from kvengine.config import DEVICE_PRESETS, EngineConfig, model_preset
from kvengine.entrypoints.flags import config_from_args, launch_flags
from kvengine.entrypoints.protocol import render_chat
from kvengine.executor.torch_executor import torch_device_spec
from serverproc import ServerProcess, scrape

MAX_LEN = 512
NAME = "tiny-llama"


# -- defaults, without a server ---------------------------------------------------------

def _knobs(config):
    return config.block_size, config.max_num_seqs, config.max_num_batched_tokens


def test_cpu_torch_device_takes_vllm_cpu_defaults():
    tiny = model_preset("tiny")
    assert _knobs(EngineConfig(block_size=None).resolve(tiny, torch_device_spec("cpu"))) == (128, 128, 2048)
    given = EngineConfig(block_size=32, max_num_seqs=8).resolve(tiny, torch_device_spec("cpu"))
    assert _knobs(given) == (32, 8, 2048)


def test_gpu_presets_and_the_sim_keep_the_gpu_defaults():
    tiny = model_preset("tiny")
    for device, knobs in (("cpu", (16, 256, 2048)), ("l4-24gb", (16, 256, 2048)), ("h100-80gb", (16, 1024, 8192))):
        assert _knobs(EngineConfig(block_size=None).resolve(tiny, DEVICE_PRESETS[device])) == knobs, device
        assert _knobs(EngineConfig().resolve(tiny, DEVICE_PRESETS[device])) == knobs, device


def test_only_serve_leaves_block_size_to_the_platform():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).block_size is None
    assert config_from_args(parser.parse_args(["serve", "--block-size", "64"])).block_size == 64
    assert config_from_args(parser.parse_args(["plan"])).block_size == 16
    assert "--block-size" not in launch_flags(EngineConfig(block_size=None))
    assert launch_flags(EngineConfig())[:2] == ["--block-size", "16"]


def test_chat_template_renders_like_transformers():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}", {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s>user: hi\n"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    with pytest.raises(ChatTemplateError, match="not a valid Jinja2"):
        ChatTemplate("{% for %}")


# -- over HTTP, against a real `kvengine serve` -----------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama", dtype="float32")


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServerProcess("--model", str(checkpoint), "--device", "cpu", "--device-memory", "1GiB",
                         "--served-model-name", NAME, "--max-model-len", str(MAX_LEN), timeout=180)
    yield proc
    proc.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=120, **kw)


def wait_idle(server, timeout_s: float = 30.0) -> None:
    """Until nothing runs or waits (hung-up streams are aborted a moment later)."""
    for _ in range(int(timeout_s / 0.1)):
        m = scrape(server.url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not go idle")


def cache_config(metrics: dict) -> dict:
    key = next(k for k in metrics if k.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r"([a-z_]+)=([^,}]*)", key))


@pytest.mark.slow
def test_cpu_defaults_show_in_metrics(server):
    info = cache_config(scrape(server.url))
    assert info["block_size"] == "128" and info["user_specified_block_size"] == "False"
    assert info["enable_prefix_caching"] == "True" and info["gpu_memory_utilization"] == "0.92"
    text = httpx.get(server.url + "/metrics").text
    assert 'block_size="128"' in text and f'model_name="{NAME}"' in text
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == MAX_LEN


@pytest.mark.slow
def test_max_num_seqs_defaults_to_128(server):
    """140 requests at once: 128 run, 12 wait (vLLM CPU's max_num_seqs)."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=200)) as http:
            async def one(i):
                body = {"model": NAME, "prompt": [100 + i, 7, 8, 9], "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            tasks = [asyncio.create_task(one(i)) for i in range(140)]
            seen = (0, 0)
            for _ in range(200):
                await asyncio.sleep(0.05)
                m = await asyncio.to_thread(scrape, server.url)
                seen = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"])
                if sum(seen) == 140:
                    break
            for t in tasks:
                t.cancel()  # hang up: the server aborts the rest
            await asyncio.gather(*tasks, return_exceptions=True)
            return seen
    assert asyncio.run(main()) == (128, 12)
    wait_idle(server)


@pytest.mark.slow
def test_unknown_model_is_vllms_404(server):
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]})):
        resp = post(server, path, {**body, "model": "gpt-7"})
        assert resp.status_code == 404
        assert resp.json() == {"error": {"message": f"The model `gpt-7` does not exist. Valid aliases: {NAME}.",
                                         "type": "NotFoundError", "param": "model", "code": 404}}


@pytest.mark.slow
def test_over_long_requests_are_400_and_the_server_keeps_serving(server):
    resp = post(server, "/v1/completions", {"prompt": [5] * 600, "max_tokens": 5})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", "input_tokens", 400)
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, your "
                                     "prompt contains 600 input tokens")
    resp = post(server, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 600})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert resp.json()["error"]["message"].startswith(
        f"max_tokens=600 cannot be greater than max_model_len={MAX_LEN}.")
    resp = post(server, "/v1/completions", {"prompt": [5] * MAX_LEN})  # no room for one token
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("max_tokens must be at least 1")
    resp = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t5 " * 600}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input_tokens"
    ok = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_max_tokens_is_clamped_to_the_room_left_and_defaults_like_vllm(server):
    out = post(server, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 505, "ignore_eos": True}).json()
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 502, "total_tokens": MAX_LEN}
    assert out["choices"][0]["finish_reason"] == "length"
    out = post(server, "/v1/completions", {"prompt": [5, 6, 7], "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 16  # a completion's default max_tokens
    chat = post(server, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "t5 t6"}], "ignore_eos": True}).json()
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": MAX_LEN - 4, "total_tokens": MAX_LEN}


@pytest.mark.slow
def test_chat_uses_the_checkpoints_template(server, checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    for messages, vllm_count in (([{"role": "user", "content": "t5 t6"}], 4),
                                 ([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "t5 t6"}], 7)):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = len(tok(text, add_special_tokens=False)["input_ids"])
        out = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
        assert out["usage"]["prompt_tokens"] == expected == vllm_count
        assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"


@pytest.mark.slow
def test_iteration_tokens_count_what_was_computed(server):
    """A repeated 300-token prompt hits 2 blocks of 128: that step computes 300 - 256 + 1 tokens."""
    prompt = list(range(1000, 1300))

    def run_once():
        wait_idle(server)
        before = scrape(server.url)
        out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
        assert out.status_code == 200
        after = scrape(server.url)
        return {k: after[k] - before.get(k, 0) for k in ("vllm:iteration_tokens_total_sum",
                                                         "vllm:iteration_tokens_total_count",
                                                         "vllm:prefix_cache_hits_total",
                                                         "vllm:prompt_tokens_total")}

    first, second = run_once(), run_once()
    assert first == {"vllm:iteration_tokens_total_sum": 303, "vllm:iteration_tokens_total_count": 3,
                     "vllm:prefix_cache_hits_total": 0, "vllm:prompt_tokens_total": 300}
    assert second == {"vllm:iteration_tokens_total_sum": 47, "vllm:iteration_tokens_total_count": 3,
                      "vllm:prefix_cache_hits_total": 256, "vllm:prompt_tokens_total": 300}


@pytest.mark.slow
def test_without_a_chat_template_the_plain_one_stays(tmp_path, checkpoint):
    plain = tmp_path / "no-template"
    shutil.copytree(checkpoint, plain)
    config = plain / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    assert load_chat_template(plain) is None
    proc = ServerProcess("--model", str(plain), "--device-memory", "1GiB", "--max-model-len", str(MAX_LEN),
                         timeout=180)
    try:
        from transformers import AutoTokenizer

        messages = [{"role": "user", "content": "t5 t6"}]
        expected = len(AutoTokenizer.from_pretrained(str(plain))(render_chat(messages),
                                                                 add_special_tokens=False)["input_ids"])
        out = httpx.post(proc.url + "/v1/chat/completions", timeout=60,
                         json={"messages": messages, "max_tokens": 1}).json()
        assert out["usage"]["prompt_tokens"] == expected
    finally:
        proc.stop()
