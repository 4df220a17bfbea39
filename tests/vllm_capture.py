"""Capture the real-vLLM data of tests/test_vllm_series.py (run by hand; the tests only read its files).

    .venv/bin/python tests/vllm_capture.py [--vllm .venv-vllm/bin/python] [--model /tmp/tinyllama]

Starts vLLM's CPU build with a pool of 64 blocks of 32 tokens (2,048 tokens; --max-model-len 1024, as
vLLM refuses 2048 with this pool: "the estimated maximum model length is 2016"), replays 24 requests
of 512 prompt tokens (the first 256 shared, so the prefix cache serves some) + 256 output tokens
(ignore_eos) arriving together through kvtune's live target (Locust, /v1/completions with token id
lists, /metrics scraped every 0.5 s), and writes into tests/data/:

- vllm-preempt-before.txt, vllm-preempt-after.txt: /metrics just before and just after the run;
- vllm-preempt-run.json: kvtune's RunResult of the run (client records, scraped series, summary).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtune.scrape import fetch
from kvtune.targets import LiveOptions, UrlTarget
from kvtune.targets.process import ManagedServer, free_port
from kvtune.workload import TraceRequest, Workload
from kvtune.workload.tokens import unique_tokens

DATA = ROOT / "tests" / "data"
REQUESTS, PROMPT, SHARED, OUTPUT = 24, 512, 256, 256


def workload() -> Workload:
    shared = unique_tokens(10_000, SHARED).tolist()
    reqs = [TraceRequest(0.02 * i, PROMPT, OUTPUT,
                         prompt_token_ids=tuple(shared + unique_tokens(i, PROMPT - SHARED).tolist()))
            for i in range(REQUESTS)]
    return Workload(reqs, source="vllm_capture")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model", default="/tmp/tinyllama")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)  # 64 blocks hold 2016 tokens: 2048 is refused
    args = ap.parse_args()
    port = free_port()
    cmd = [args.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
           "--block-size", "32", "--num-gpu-blocks-override", str(args.blocks)]
    server = ManagedServer(cmd, port, 400, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                               "VLLM_CPU_KVCACHE_SPACE": "1"})
    print(f"vLLM's log: {server.log_path}", flush=True)
    with server:
        url = server.url
        # one small request so the server has served something, as the reference scrape had
        model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        requests.post(url + "/v1/completions", json={"model": model, "prompt": [1000, 1001, 1002, 1003],
                                                     "max_tokens": 4}, timeout=60).raise_for_status()
        time.sleep(1.0)
        before = fetch(url + "/metrics")
        result = UrlTarget(url, LiveOptions(users=REQUESTS, scrape_interval_s=0.5, drain_timeout_s=600,
                                            device="cpu")).run(None, workload())
        time.sleep(1.0)
        after = fetch(url + "/metrics")
        (DATA / "vllm-preempt-before.txt").write_text(before)
        (DATA / "vllm-preempt-after.txt").write_text(after)
        result.write_json(str(DATA / "vllm-preempt-run.json"))
        s = result.summary
        print(f"completed {s['completed']}/{s['requests']}, preemptions {s.get('server_preemptions')}, "
              f"duration {result.duration_s:.1f} s, wall {result.wall_s:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
