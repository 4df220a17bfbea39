"""When the engine loop dies the server says so (503), instead of hanging its clients."""
import threading
import time

import httpx
import uvicorn

from kvengine.clock import WallClock
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.cost import StepCost
from kvengine.engine import LLMEngine
from kvengine.executor import SimExecutor
from kvengine.loop import EngineLoop
from kvengine.metrics import EngineMetrics
from kvengine.server import ServerState, create_app
from kvengine.tokenizer import ByteTokenizer
from serverproc import free_port


class FailingExecutor(SimExecutor):
    """A device that faults on its third step (an Xid error, an OOM in a kernel)."""

    def __init__(self, cost: StepCost):
        super().__init__(cost)
        self.steps = 0

    def execute(self, out):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().execute(out)


def test_dead_engine_loop_gives_503_and_errors_in_flight_requests():
    model, device = model_preset("llama-3-8b"), device_preset("h100-80gb")
    config = EngineConfig().resolve(model, device)
    executor = FailingExecutor(StepCost.build(model, device, "auto", 16))
    engine = LLMEngine(config, model, device, executor=executor, clock=WallClock(), record_steps=False)
    loop = EngineLoop(engine, EngineMetrics("m", engine))
    loop.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(loop, ByteTokenizer(), "m", "m")),
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
        resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=30)
        assert resp.status_code == 503 and "engine loop died" in resp.json()["error"]["message"]
        assert "illegal memory access" in resp.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        dead = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert dead.status_code == 503 and dead.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(url + "/metrics").status_code == 200  # still scrapeable: the evidence survives
    finally:
        server.should_exit = True
        thread.join(10)
