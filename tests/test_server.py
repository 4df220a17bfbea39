"""`kvengine serve` over real HTTP on 127.0.0.1: the OpenAI surface, SSE, errors, /metrics."""
import asyncio
import time
import json
import random

import httpx
import pytest

from serverproc import ServerProcess, scrape

SIM = ("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb",
       "--served-model-name", "sim-llama", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # for /reset_prefix_cache, as vLLM
        proc = ServerProcess(*SIM)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai  # here, not at the top: every pytest-xdist worker collects this file, one runs it

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_completion_and_usage(client):
    out = client.completions.create(model="sim-llama", prompt="Hello, paged attention", max_tokens=7,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == "sim-llama"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_openai_client_streaming_with_usage(client):
    stream = client.completions.create(model="sim-llama", prompt=[1000, 1001, 1002, 1003], max_tokens=5,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 5
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 4


def test_openai_client_chat(client):
    out = client.chat.completions.create(model="sim-llama", max_tokens=4,
                                         messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "What is a KV cache?"}],
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 4
    stream = client.chat.completions.create(model="sim-llama", max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_batched_prompts(client):
    out = client.completions.create(model="sim-llama", prompt=["a b c", "d e f"], n=2, max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12


def test_sse_framing_usage_chunk_and_done(server):
    body = {"model": "sim-llama", "prompt": [1500] * 20, "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join(resp.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert [len(p["choices"]) for p in payloads] == [1, 1, 1, 1, 0]
    assert payloads[0]["id"].startswith("cmpl-") and payloads[0]["object"] == "text_completion"
    assert payloads[-1]["usage"] == {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}


def test_models_health_version_load(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sim-llama"
    assert models["data"][0]["max_model_len"] == 2048 and models["data"][0]["owned_by"] == "vllm"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert "version" in httpx.get(server.url + "/version").json()
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


@pytest.mark.parametrize("body, param", [
    ({"model": "sim-llama", "prompt": [1000] * 3000}, "input_tokens"),
    ({"model": "sim-llama", "prompt": [1000] * 2048}, "max_tokens"),  # no room for one token
    ({"model": "sim-llama", "prompt": "x", "max_tokens": 2049}, "max_tokens"),
    ({"model": "sim-llama", "prompt": "x", "n": 0}, "n"),
    ({"model": "sim-llama", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": "sim-llama", "prompt": 42}, "prompt"),
    ({"model": "sim-llama"}, "prompt"),
    ({"model": "sim-llama", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "sim-llama", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "sim-llama", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "sim-llama", "prompt": [-5, 3]}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, param):
    resp = httpx.post(server.url + "/v1/completions", json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 1})
    assert ok.status_code == 200


def test_an_unknown_route_or_method_is_answered_as_vllms_fastapi_app_answers_it(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("POST", "/health", "GET"),
                                  ("HEAD", "/health", "GET")):  # FastAPI's routes take no HEAD
        wrong = httpx.request(method, server.url + path)
        assert (wrong.status_code, wrong.headers["allow"]) == (405, allowed)
        if method != "HEAD":
            assert wrong.json() == {"detail": "Method Not Allowed"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_is_404_and_an_over_long_max_tokens_is_clamped(server):
    for path, body in (("/v1/completions", {"model": "gpt-7", "prompt": "x"}),
                       ("/v1/chat/completions", {"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(server.url + path, json=body)
        assert resp.status_code == 404
        assert resp.json() == {"error": {"message": "The model `gpt-7` does not exist. Valid aliases: sim-llama.",
                                         "type": "NotFoundError", "param": "model", "code": 404}}
    # vLLM clamps max_tokens to the room the prompt leaves, it does not refuse it
    out = httpx.post(server.url + "/v1/completions", timeout=60,
                     json={"prompt": [1000] * 2040, "max_tokens": 100, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"


def test_invalid_json_and_bad_chat(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_stop_strings_and_stop_token_ids(server):
    # The sim executor's tokens are deterministic: learn them, then stop on them.
    first = httpx.post(server.url + "/v1/completions",
                       json={"prompt": [2000] * 8, "max_tokens": 6, "ignore_eos": True}).json()
    text = first["choices"][0]["text"]
    stop = text[2:4]
    cut = httpx.post(server.url + "/v1/completions",
                     json={"prompt": [2000] * 8, "max_tokens": 6, "ignore_eos": True, "stop": [stop]}).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[:text.index(stop)]


def quiet_scrape(url: str) -> dict:
    """A scrape once the server has nothing running or waiting (an earlier test's request, aborted by
    its client, may still be counting its last tokens) and its counters hold still."""
    previous = None
    for _ in range(100):
        m = scrape(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and m == previous:
            return m
        previous = m
        time.sleep(0.1)
    raise AssertionError(f"{url} never went quiet: {previous}")


def test_metrics_agree_with_what_was_sent(server):
    before = quiet_scrape(server.url)
    prompt = [3000 + i for i in range(200)]  # 12 full blocks of 16
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200
    after = scrape(server.url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == 400
    assert delta("vllm:generation_tokens_total") == 20
    assert delta("vllm:prefix_cache_queries_total") == 400
    assert delta("vllm:prefix_cache_hits_total") == 192  # the second request hits 12 blocks
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_time_per_output_token_seconds"):
        assert delta(hist + "_count") == 2, hist
    assert delta("vllm:inter_token_latency_seconds_count") == 18
    assert delta("vllm:request_prompt_tokens_sum") == 400
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    info = [k for k in after if k.startswith("vllm:cache_config_info")][0]
    for label in ("block_size=16", "cache_dtype=auto", "gpu_memory_utilization=0.92",
                  "enable_prefix_caching=True", "num_gpu_blocks="):
        assert label in info
    assert after["kvengine:num_free_blocks"] == after["kvengine:num_gpu_blocks"] - 1


def test_exposition_names_and_content_type(server):
    resp = httpx.get(server.url + "/metrics")
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = resp.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:iteration_tokens_total_bucket", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", 'le="2560.0"', 'le="7680.0"'):
        assert name in text, name
    assert 'model_name="sim-llama"' in text and 'engine="0"' in text


def test_client_disconnects_abort_and_free_blocks(server):
    """200 streams, a random third hang up after their first chunk: nothing leaks."""
    rng = random.Random(0)
    quitters = set(rng.sample(range(200), 67))
    aborted = scrape(server.url)["vllm:request_success_total{finished_reason=abort}"]

    async def one(http, i):
        # A quitter asks for more tokens than it could get before its hang-up is seen, so only
        # an abort frees its blocks (with 30, a busy frontend sometimes saw it finish first).
        body = {"prompt": [1000 + i] * 64, "max_tokens": 1900 if i in quitters else 30, "stream": True,
                "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and i in quitters:
                    return "quit"
        return "done"

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(200))), 120)

    results = asyncio.run(main())
    assert results.count("quit") == 67
    m = quiet_scrape(server.url)
    assert m["kvengine:num_free_blocks"] == m["kvengine:num_gpu_blocks"] - 1
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] - aborted == 67


def test_reset_prefix_cache(server):
    prompt = {"prompt": [4000 + i for i in range(64)], "max_tokens": 1}
    httpx.post(server.url + "/v1/completions", json=prompt)
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    before = scrape(server.url)["vllm:prefix_cache_hits_total"]
    httpx.post(server.url + "/v1/completions", json=prompt)
    assert scrape(server.url)["vllm:prefix_cache_hits_total"] == before  # nothing left to hit


def test_api_key_on_every_v1_route():
    proc = ServerProcess(*SIM, "--api-key", "s3cret")
    try:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            resp = httpx.request(method, proc.url + path, json={"prompt": "x"})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
        ok = httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(proc.url + "/health").status_code == 200  # health stays open
    finally:
        proc.stop()


def test_preemptions_show_on_a_small_pool():
    proc = ServerProcess(*SIM, "--num-gpu-blocks-override", "160", "--max-num-seqs", "32")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as http:
                bodies = [{"prompt": [1000 + i] * 600, "max_tokens": 300, "ignore_eos": True} for i in range(6)]
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        responses = asyncio.run(main())
        assert all(r.status_code == 200 for r in responses)
        m = scrape(proc.url)
        assert m["vllm:num_preemptions_total"] > 0
        assert m["vllm:request_success_total{finished_reason=length}"] == 6
    finally:
        proc.stop()
