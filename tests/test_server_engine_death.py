"""When the engine core dies the server says so (503), instead of hanging its clients."""
import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from kvengine.engine.clock import WallClock
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.executor.cost import StepCost
from kvengine.engine.llm_engine import LLMEngine
from kvengine.executor.abstract import SimExecutor
from kvengine.engine.core_client import EngineClient
from kvengine.metrics.prometheus import EngineMetrics
from kvengine.entrypoints.server import ServerState, create_app
from kvengine.model.tokenizer import ByteTokenizer
from serverproc import free_port


class FailingExecutor(SimExecutor):
    """A device that faults on a given step (an Xid error, an OOM in a kernel)."""

    def __init__(self, cost: StepCost, fail_at_step: int | None):
        super().__init__(cost)
        self.steps = 0
        self.fail_at_step = fail_at_step

    def execute(self, out):
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().execute(out)


def build_engine(fail_at_step: int | None):
    """Runs in the engine core process (so it is importable there by name)."""
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    config = EngineConfig().resolve(model, device)
    executor = FailingExecutor(StepCost.build(model, device, "auto", 16), fail_at_step)
    engine = LLMEngine(config, model, device, executor=executor, clock=WallClock(), record_steps=False)
    return engine, ByteTokenizer(), model.name


@contextmanager
def serving(fail_at_step: int | None):
    client = EngineClient(build_engine, fail_at_step)
    client.metrics = EngineMetrics("m", client.info)
    client.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(client, "m", "m")),
                                           host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield client, url
    finally:
        server.should_exit = True
        thread.join(10)
        client.shutdown()


def test_dead_engine_core_gives_503_and_errors_in_flight_requests():
    with serving(fail_at_step=3) as (_, url):
        resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=30)
        assert resp.status_code == 503 and "engine core died" in resp.json()["error"]["message"]
        assert "illegal memory access" in resp.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        dead = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert dead.status_code == 503 and dead.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(url + "/metrics").status_code == 200  # still scrapeable: the evidence survives


def test_a_killed_engine_core_process_ends_open_streams_with_an_error():
    with serving(fail_at_step=None) as (client, url):
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # streaming
            os.kill(client.process.pid, signal.SIGKILL)  # the OOM killer, a segfault in a kernel
            rest = [line for line in lines if line.startswith("data: ")]
        assert "exit code -9" in rest[-2] and rest[-1] == "data: [DONE]"
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 503
