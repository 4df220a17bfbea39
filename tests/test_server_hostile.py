"""`kvengine serve` (torch executor, tiny model) against clients that mean it harm or just give up.

No request may end the engine core, a dead core ends the server (so a supervisor restarts it),
limits answer 4xx/503 with a JSON error, half-sent requests are cut off, and every request a
client abandons, streaming or not, is aborted in the engine.
"""
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.httpclient import loopback_ssl

from serverproc import ServerProcess, free_port, scrape

TORCH = ("--executor", "torch", "--preset", "tiny", "--device", "cpu", "--device-memory", "1GiB",
         "--served-model-name", "tiny")
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 32000
# Every request here goes to http://127.0.0.1 on a connection of its own, as httpx.get/post/stream
# open one. Those build a client per call, and with it a certificate-verifying SSL context (~40 ms
# of CPU, most of what the fuzz spent per example); one context, made once, serves every call.
TLS = loopback_ssl()


def http_get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, verify=TLS, **kwargs)


def http_post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, verify=TLS, **kwargs)


def http_stream(method: str, url: str, **kwargs):
    return httpx.stream(method, url, verify=TLS, **kwargs)


def start(*flags: str, **env: str) -> ServerProcess:
    """A server whose output a thread drains (a full pipe would stall it) into `proc.log`."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        proc = ServerProcess(*TORCH, *flags, timeout=120)
    proc.log = []
    proc.drain = threading.Thread(target=lambda: proc.log.extend(proc.proc.stdout), daemon=True)
    proc.drain.start()
    return proc


def stop(proc: ServerProcess) -> str:
    proc.end()
    proc.drain.join(5)
    return "".join(proc.log)


def engine_core_pid(proc: ServerProcess) -> int:
    pid = proc.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return next(int(c) for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read())


def wait_idle(url: str, timeout_s: float = 30.0) -> bool:
    """True once the server holds no unfinished request (GET /load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_get(url + "/load", timeout=5).json()["server_load"] == 0:
            return True
        time.sleep(0.05)
    return False


def still_serving(url: str) -> None:
    assert http_get(url + "/health", timeout=10).status_code == 200
    ok = http_post(url + "/v1/completions", headers=AUTH, timeout=30, json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def server():
    proc = start("--max-model-len", "1024", "--api-key", KEY, "--max-n-sequences", "8",
                 "--max-num-queued-reqs", "8", "--max-request-body-size", "1MiB",
                 "--request-read-timeout", "1", VLLM_SERVER_DEV_MODE="1")
    yield proc
    stop(proc)


def post(url: str, raw: bytes, path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    return http_post(url + path, content=raw, timeout=timeout,
                      headers={**AUTH, "content-type": "application/json"})


BIG = "1" + "0" * 400  # a JSON integer no float holds
HOSTILE = [  # (raw body, path, the param the 400 names)
    (b'{"prompt":"hi","max_tokens":4,"top_k":9223372036854775808}', "cmpl", "top_k"),
    (b'{"prompt":"hi","max_tokens":4,"seed":18446744073709551616}', "cmpl", "seed"),
    (b'{"prompt":"hi","max_tokens":4,"seed":-9223372036854775809}', "cmpl", "seed"),
    (b'{"prompt":"hi","max_tokens":4,"temperature":NaN}', "cmpl", "temperature"),
    (b'{"prompt":"hi","max_tokens":4,"temperature":Infinity}', "cmpl", "temperature"),
    (b'{"prompt":"hi","max_tokens":4,"temperature":' + BIG.encode() + b'}', "cmpl", "temperature"),
    (b'{"prompt":"hi","max_tokens":4,"top_p":' + BIG.encode() + b'}', "cmpl", "top_p"),
    (b'{"prompt":"hi","max_tokens":4,"top_p":-Infinity}', "cmpl", "top_p"),
    (b'{"prompt":"\\ud800","max_tokens":4}', "cmpl", "prompt"),
    (b'{"prompt":"hi","max_tokens":4,"stop":["a\\udfff"]}', "cmpl", "stop"),
    (b'{"prompt":"hi","max_tokens":4,"model":"\\udc00"}', "cmpl", "model"),
    (b'{"messages":[{"role":"user","content":"\\ud83d"}],"max_tokens":4}', "chat", "messages"),
    (b"[" * 100000 + b"]" * 100000, "cmpl", None),
    (b'{"prompt":"hi","max_tokens":1' + b"0" * 5000 + b"}", "cmpl", None),
    (b'{"prompt":"\xff\xfe","max_tokens":4}', "cmpl", None),
    (b'{"prompt":[5, 32000],"max_tokens":4}', "cmpl", "prompt"),
    (b'{"prompt":"hi","max_tokens":4,"stop_token_ids":[32000]}', "cmpl", "stop_token_ids"),
    (b'{"prompt":"hi","max_tokens":4,"n":9}', "cmpl", "n"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "stop": ["s"] * 200}).encode(), "cmpl", "stop"),
]


@pytest.mark.parametrize("raw, route, param", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_field_is_a_400_naming_it_and_the_engine_lives_on(server, raw, route, param):
    resp = post(server.url, raw, "/v1/completions" if route == "cmpl" else "/v1/chat/completions")
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    still_serving(server.url)


def test_the_extremes_of_the_valid_ranges_are_served(server):
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "seed": -(1 << 63), "top_k": (1 << 63) - 1,
            "temperature": 1e300, "top_p": 5e-324, "stop_token_ids": [VOCAB - 1]}
    resp = http_post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 6
    body["seed"] = (1 << 63) - 1  # and its last choice's seed, one more, still seeds torch
    assert http_post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=30).status_code == 200
    still_serving(server.url)


def test_n_and_the_requests_in_flight_are_bounded(server):
    url = server.url
    resp = http_post(url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"  # 9 > 8: never fits
    body = {"prompt": "x", "n": 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with http_stream("POST", url + "/v1/completions", headers=AUTH, json=body, timeout=30) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the stream, which aborts it
        next(line for line in lines if line.startswith("data: {"))  # all 8 are in
        full = http_post(url + "/v1/completions", headers=AUTH, json={"prompt": "y", "max_tokens": 2}, timeout=30)
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == 503 and "--max-num-queued-reqs" in full.json()["error"]["message"]
    assert wait_idle(url, 10)  # the closed stream aborted all 8
    still_serving(url)


def test_a_body_over_the_limit_is_a_413(server):
    big = json.dumps({"prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    resp = post(server.url, big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: refused once the count passes the limit
        for _ in range(64):
            yield b" " * 65536

    resp = http_post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    still_serving(server.url)


@pytest.mark.parametrize("first, rest", [
    (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),  # half a head
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /v1/comp"),  # after a keep-alive answer
    (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"),  # half a body
    (b"", b""),  # nothing at all
])
def test_a_request_that_never_arrives_in_full_is_cut_off(server, first, rest):
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        if first:
            sock.sendall(first)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(rest)
        t0 = time.monotonic()
        while sock.recv(4096):  # until the server closes it (the half body's may answer first)
            pass
        assert time.monotonic() - t0 < 10  # --request-read-timeout 1
    still_serving(server.url)


def test_abandoned_non_streaming_requests_are_aborted(server):
    url = server.url
    before = scrape(url)

    async def give_up(http, i):
        body = {"prompt": f"give up {i}", "max_tokens": 1000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # seconds of decoding: it cannot be done yet
            await http.post("/v1/completions", json=body, timeout=0.5)

    async def main():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, verify=TLS) as http:
            await asyncio.gather(*(give_up(http, i) for i in range(4)))

    asyncio.run(main())
    assert wait_idle(url, 10)
    after = scrape(url)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert delta("vllm:request_success_total{finished_reason=abort}") == 4
    assert delta("vllm:request_success_total{finished_reason=length}") == 0
    assert delta("vllm:generation_tokens_total") < 4 * 1000


def test_reset_prefix_cache_needs_dev_mode_and_the_api_key(server):
    assert http_post(server.url + "/reset_prefix_cache", timeout=10).status_code == 401
    assert http_post(server.url + "/reset_prefix_cache", headers=AUTH, timeout=10).status_code == 200
    assert http_get(server.url + "/metrics", timeout=10).status_code == 200  # reads stay open


@pytest.fixture(scope="module")
def tight_pool():
    """A server of a tight pool (24 blocks of 16, 8 sequences; no API key, no dev mode): the
    abandon test's, then the one whose engine core the dead-core test kills. `tight_pool()` gives
    it, or a new one where it has ended (the dead-core test ran first)."""
    started: list[ServerProcess] = []

    def get() -> ServerProcess:
        if not started or started[-1].proc.poll() is not None:
            started.append(start("--max-model-len", "256", "--block-size", "16", "--num-gpu-blocks-override", "24",
                                 "--max-num-seqs", "8"))
        return started[-1]
    yield get
    for proc in started:
        stop(proc)


def test_every_abandoned_request_is_aborted_under_a_tight_pool(tight_pool):
    """Clients hang up at every stage (queued, preempted, decoding, before the server read
    the request): each request the engine got ends as an abort, and the pool comes back."""
    proc = tight_pool()
    url = proc.url
    rng = random.Random(0)
    before = scrape(url)

    async def stream_quit(http, i, after_chunks):
        body = {"prompt": [rng.randrange(1000, VOCAB) for _ in range(48)], "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            if after_chunks == 0:  # gone before the first token
                return
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= after_chunks:
                    return

    async def collect_quit(http, i):
        body = {"prompt": [rng.randrange(1000, VOCAB) for _ in range(48)], "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):  # 200 tokens take far longer
            await http.post("/v1/completions", json=body, timeout=rng.uniform(0.1, 0.3))

    async def raw_quit(i):
        payload = json.dumps({"prompt": "raw " * 12, "max_tokens": 200, "ignore_eos": True, "stream": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode())
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.05))
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, verify=TLS) as http:
            jobs = []
            for i in range(60):
                kind = i % 5
                jobs.append(collect_quit(http, i) if kind == 3 else raw_quit(i) if kind == 4
                            else stream_quit(http, i, kind))
            await asyncio.wait_for(asyncio.gather(*jobs), 60)

    asyncio.run(main())
    assert wait_idle(url, 30)
    after = scrape(url)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    aborted = delta("vllm:request_success_total{finished_reason=abort}")
    finished = sum(delta(f"vllm:request_success_total{{finished_reason={r}}}") for r in ("stop", "length", "abort"))
    assert finished == aborted >= 36  # every stream surely arrived; the others may not have
    assert after["kvengine:num_free_blocks"] == after["kvengine:num_gpu_blocks"] - 1
    assert after["vllm:kv_cache_usage_perc"] == 0


def test_a_dead_engine_core_ends_the_server_with_a_nonzero_exit(tight_pool):
    """On the tight pool's server (no dev mode), the last test to use it."""
    proc = tight_pool()
    try:
        assert http_post(proc.url + "/reset_prefix_cache", timeout=10).status_code == 404  # no dev mode
        body = {"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}  # max_model_len 256
        with http_stream("POST", proc.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(engine_core_pid(proc), signal.SIGKILL)  # the OOM killer, a segfault in a kernel
            rest = [line for line in lines if line.startswith("data: ")]
        assert "exit code -9" in rest[-2] and rest[-1] == "data: [DONE]"  # the stream still ends cleanly
        assert proc.proc.wait(10) != 0
    finally:
        log = stop(proc)
    assert "engine core died" in log


def _checkpoint(folder, weights: bytes):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def serve_fails(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvengine", "serve", "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("weights", [b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", b"\x01\x02"])
def test_a_corrupt_safetensors_file_is_a_one_line_error(tmp_path, weights):
    folder = _checkpoint(tmp_path / "ckpt", weights)
    out = serve_fails("--model", str(folder), "--device", "cpu", "--device-memory", "1GiB")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model ") and "model.safetensors" in lines[0]


@pytest.mark.parametrize("profile, field", [({"memory_efficiency": 1e-300}, "memory_efficiency"),
                                            ({"step_overhead_s": 1e12}, "step_overhead_s")])
def test_a_cost_profile_out_of_range_is_refused_at_start(tmp_path, profile, field):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    out = serve_fails("--executor", "sim", "--cost-profile", str(path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and field in lines[0]


# -- fuzzing -----------------------------------------------------------------------------------

STRINGS = st.sampled_from(["", "x", "hi there", "é", "\ud800", "a\udfffb", "\x00", "€" * 50, "tiny", "\n"])
SCALARS = (st.none() | st.booleans() | st.integers(-3, 10) | st.integers()
           | st.sampled_from([1 << 63, -(1 << 63) - 1, 1 << 64, 10 ** 400])
           | st.floats(allow_nan=True, allow_infinity=True) | STRINGS)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                   max_leaves=6)
# A valid max_tokens stays small (the fuzz must be quick); any other value is one the server refuses.
MAX_TOKENS = st.integers(1, 4) | st.sampled_from([0, -1, 1 << 40, 10 ** 400, 2.0, "4", True, [4], float("nan")])
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
PLAUSIBLE = {  # in range or at its edges, so requests reach the sampler
    "n": st.integers(1, 4), "temperature": st.floats(0, 2) | st.sampled_from([1e-6, 1e300, 5e-324]),
    "top_p": st.floats(1e-9, 1) | st.just(5e-324), "seed": st.integers(-(1 << 63), (1 << 63) - 1),
    "top_k": st.integers(-1, 50) | st.sampled_from([VOCAB - 1, VOCAB, 1 << 62, (1 << 63) - 1]),
    "stop": st.lists(TEXT, max_size=3), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "model": st.just("tiny"),
}
HOSTILE_FIELDS = {  # any JSON value, or a plausible one
    **{name: values | ANY for name, values in PLAUSIBLE.items() if name != "stream"},
    "n": st.integers(-1, 10) | ANY, "stream": st.booleans(), "logprobs": ANY, "echo": ANY,
    "repetition_penalty": ANY, "extra": ANY, "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}) | ANY,
}
PROMPT = TEXT | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8) | st.lists(TEXT, min_size=1, max_size=3)
HOSTILE_PROMPT = PROMPT | STRINGS | st.lists(st.integers(-1, VOCAB), max_size=4) | ANY
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
                    min_size=1, max_size=3)
HOSTILE_MESSAGES = MESSAGES | st.lists(st.fixed_dictionaries({"role": STRINGS | ANY, "content": STRINGS | ANY}),
                                       max_size=3) | ANY


def bodies():
    """(path, body): half of them plausible throughout, half with hostile values anywhere."""
    def endpoint(fields, prompt, messages):
        completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": MAX_TOKENS}, optional=fields)
        chat = st.fixed_dictionaries({"messages": messages, "max_tokens": MAX_TOKENS},
                                     optional={**fields, "max_completion_tokens": MAX_TOKENS})
        return st.tuples(st.just("/v1/completions"), completion) | st.tuples(st.just("/v1/chat/completions"), chat)
    return endpoint(PLAUSIBLE, PROMPT, MESSAGES) | endpoint(HOSTILE_FIELDS, HOSTILE_PROMPT, HOSTILE_MESSAGES)


def encode(body, how: int) -> bytes:
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity as raw words; surrogates as \\ud800
    if how == 1:
        return text.encode("utf-8", "surrogatepass")[: max(1, len(text) // 2)]  # cut short
    if how == 2:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")  # raw surrogate bytes
    return text.encode()


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=bodies(), how=st.sampled_from([0, 0, 0, 0, 0, 0, 1, 2]))
def test_fuzzed_bodies_get_2xx_or_a_json_4xx_and_the_server_lives_on(server, case, how):
    path, body = case
    if body.get("stream") is True:
        with http_stream("POST", server.url + path, content=encode(body, how), timeout=30,
                          headers={**AUTH, "content-type": "application/json"}) as resp:
            text = resp.read().decode()
        status = resp.status_code
        if status == 200:
            assert text.endswith("data: [DONE]\n\n")
    else:
        resp = post(server.url, encode(body, how), path)
        status, text = resp.status_code, resp.text
    assert 200 <= status < 500, text
    if status >= 400:
        err = json.loads(text)["error"]
        assert err["code"] == status and err["message"]
    assert wait_idle(server.url, 10)
    still_serving(server.url)
