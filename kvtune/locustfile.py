"""Locust users that replay a kvtune workload open-loop over streaming /v1/completions.

Run by `kvtune run` as a subprocess, or by hand with the plain locust CLI:

    locust -f kvtune/locustfile.py --headless -u 256 -r 256 --run-time 10m \\
        --host http://127.0.0.1:8000 --kvtune-workload traces.jsonl --kvtune-samples out/samples

Distributed: start the master with `--master --expect-workers N` and each worker
with `--worker --kvtune-shards N` (and the same --kvtune-* flags); worker k
replays the requests whose index % N == k. The test ends by itself when every
request has finished (or at --run-time).

Every request is sent at its arrival time from the trace (t=0 is the test
start); a free user picks up the next request and sleeps until it is due. With
--kvtune-max-concurrency N the replay is a closed loop (`vllm bench serve
--max-concurrency N`): a user first takes one of N slots, then the next request
in trace order, and frees the slot when its answer ends; so at most N are in
flight and a request waiting for a slot goes out when one finishes (each worker
of a distributed run keeps its share of N). Per
request it records TTFT, every inter-token gap, TPOT, E2E, token counts,
status and lateness into `<samples>.<shard>.jsonl`, and fires `ttft`, `tpot`
and `e2e` entries into Locust's own statistics.
"""
from locust import HttpUser, constant, events, task  # first: locust monkey-patches at import
from locust.runners import MasterRunner, WorkerRunner

import json  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
from gevent.lock import BoundedSemaphore  # noqa: E402

from kvtune.loadgen import load_plan, sse_payload  # noqa: E402


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--kvtune-workload", default="", help="the trace to replay (any kvtune format)")
    parser.add_argument("--kvtune-samples", default="kvtune-samples", help="prefix of the raw samples files")
    parser.add_argument("--kvtune-model", default="", help="model name to send (default: GET /v1/models)")
    parser.add_argument("--kvtune-shards", type=int, default=1, help="number of workers sharing the trace")
    parser.add_argument("--kvtune-text", action="store_true", help="send the trace's text prompts when it has them")
    parser.add_argument("--kvtune-max-concurrency", type=int, default=0,
                        help="a closed loop: at most N requests in flight (0: open loop)")


class Replay:
    """This process's share of the trace and its progress."""

    def __init__(self, environment, plan, samples_path: str, model: str, shard: int, slots: int = 0):
        self.environment = environment
        self.slots = BoundedSemaphore(slots) if slots else None  # a closed loop's requests in flight
        self.shard = shard
        self.plan = plan
        self.next = 0
        self.done = 0
        self.model = model
        self.t0 = time.monotonic()
        self.out = open(samples_path, "w")

    def take(self):
        if self.next >= len(self.plan):
            return None
        item = self.plan[self.next]
        self.next += 1
        return item

    def finish(self, sample: dict) -> None:
        self.out.write(json.dumps(sample) + "\n")
        self.out.flush()
        self.done += 1
        if self.done == len(self.plan):
            self.out.close()
            runner = self.environment.runner
            if isinstance(runner, WorkerRunner):
                runner.send_message("kvtune_done", {"requests": self.done})
            else:
                gevent.spawn_later(0.1, runner.quit)


REPLAY: Replay | None = None
DONE_WORKERS = set()


@events.test_start.add_listener
def _on_test_start(environment, **_):
    global REPLAY
    runner, opts = environment.runner, environment.parsed_options
    if isinstance(runner, MasterRunner):
        runner.register_message("kvtune_done", _worker_done)
        return
    if not opts.kvtune_workload:
        raise SystemExit("kvtune locustfile: --kvtune-workload FILE is required")
    shard = runner.worker_index if isinstance(runner, WorkerRunner) else 0
    plan = load_plan(opts.kvtune_workload, shard, opts.kvtune_shards, opts.kvtune_text)
    model = opts.kvtune_model or _served_model(environment.host)
    REPLAY = Replay(environment, plan, f"{opts.kvtune_samples}.{shard}.jsonl", model, shard,
                    shard_share(opts.kvtune_max_concurrency, shard, opts.kvtune_shards))
    if not plan:  # more workers than requests: this one is done before it starts
        REPLAY.out.close()
        if isinstance(runner, WorkerRunner):
            runner.send_message("kvtune_done", {"requests": 0})
        else:
            gevent.spawn_later(0.1, runner.quit)


def _worker_done(environment, msg, **_):
    DONE_WORKERS.add(msg.node_id)
    if len(DONE_WORKERS) >= environment.runner.worker_count:
        gevent.spawn_later(0.1, environment.runner.quit)


def _served_model(host: str) -> str:
    import requests

    return requests.get(host.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]


def shard_share(max_concurrency: int, shard: int, shards: int) -> int:
    """This shard's slots of a closed loop's `max_concurrency` (0: open loop), the rest to the first shards."""
    if not max_concurrency:
        return 0
    return max(1, max_concurrency // shards + (shard < max_concurrency % shards))


class TraceReplayUser(HttpUser):
    wait_time = constant(0)

    @task
    def replay(self):
        if REPLAY is None:
            gevent.sleep(0.5)
            return
        if REPLAY.slots is None:
            self._replay_next(0.0)
            return
        with REPLAY.slots:  # a closed loop: a slot first, then the next request in trace order
            self._replay_next(time.monotonic() - REPLAY.t0)

    def _replay_next(self, free_s: float) -> None:
        """Send the next request at its arrival, or at `free_s` (when its slot came free) if later."""
        item = REPLAY.take()
        if item is None:
            gevent.sleep(0.5)  # nothing left for this user; the test ends when all finish
            return
        due = max(item.arrival_s, free_s)
        delay = REPLAY.t0 + due - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        REPLAY.finish(self._send(item, due))

    def _send(self, item, due: float) -> dict:
        body = {"model": REPLAY.model, "prompt": item.prompt, "max_tokens": item.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.monotonic()
        sample = {"index": item.index, "shard": REPLAY.shard, "scheduled_s": due, "sent_s": sent - REPLAY.t0,
                  "lateness_s": max(0.0, sent - REPLAY.t0 - due), "ttft_s": None, "itl_s": [],
                  "tpot_s": None, "e2e_s": None, "output_tokens": 0, "prompt_tokens": None,
                  "finish_reason": None, "status": None, "error": None}
        try:
            with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                                  name="/v1/completions (headers)") as resp:
                sample["status"] = resp.status_code
                if resp.status_code != 200:
                    sample["error"] = f"HTTP {resp.status_code}: {resp.text[:300]}"
                    resp.failure(sample["error"])
                else:
                    self._read_stream(resp, sent, sample)
                    resp.success()
        except Exception as err:  # a refused or broken connection is a failed request, not a crash
            sample["error"] = f"{type(err).__name__}: {err}"
        self._fire(sample)
        return sample

    @staticmethod
    def _read_stream(resp, sent: float, sample: dict) -> None:
        last = None
        chunks = 0
        for line in resp.iter_lines(decode_unicode=True):
            payload = sse_payload(line)
            if payload is None:
                continue
            if payload == "DONE":
                break
            if "error" in payload:
                sample["error"] = payload["error"].get("message", "error chunk")
                continue
            now = time.monotonic()
            if payload.get("choices"):
                chunks += 1
                if last is None:
                    sample["ttft_s"] = now - sent
                else:
                    sample["itl_s"].append(now - last)
                last = now
                sample["finish_reason"] = payload["choices"][0].get("finish_reason") or sample["finish_reason"]
            if payload.get("usage"):
                sample["output_tokens"] = payload["usage"]["completion_tokens"]
                sample["prompt_tokens"] = payload["usage"]["prompt_tokens"]
        if last is not None:
            sample["e2e_s"] = last - sent
            sample["output_tokens"] = sample["output_tokens"] or chunks
            n = sample["output_tokens"]
            sample["tpot_s"] = (sample["e2e_s"] - sample["ttft_s"]) / (n - 1) if n > 1 else 0.0

    def _fire(self, sample: dict) -> None:
        fire = self.environment.events.request.fire
        error = RuntimeError(sample["error"]) if sample["error"] else None
        for name in ("ttft", "tpot", "e2e"):
            value = sample[f"{name}_s"]
            fire(request_type="SSE", name=name, response_time=None if value is None else value * 1000,
                 response_length=sample["output_tokens"], exception=error, context={})
